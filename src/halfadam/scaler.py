"""Dynamic loss scaling for float16 training, on CPU and CUDA.

:class:`GradScaler` has the surface of ``torch.amp.GradScaler`` (Micikevicius et al., "Mixed Precision
Training", ICLR 2018, section 3.2: scale the loss so small gradients survive float16, unscale before
the update, skip steps whose gradients overflowed and lower the scale; raise it after
``growth_interval`` clean steps). The difference is the hand-over to halfadam optimizers: gradients
are unscaled into float32 tensors that the optimizer consumes directly (``optimizer.step(grads=...)``),
so a gradient that is 1e-8 after unscaling survives instead of flushing to zero in float16, while
``param.grad`` gets the unscaled values too, so that clipping or rescaling it between ``unscale_``
and ``step`` takes effect. For any other optimizer it unscales ``param.grad`` in place, as torch does.
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from . import handover
from .distributed import AUTO, halfadam_optimizer
from .handover import READY as _READY, STEPPED as _STEPPED, UNSCALED as _UNSCALED

__all__ = ["GradScaler", "Float16GradWarning"]


#: The smallest loss scale there can be, and ``min_scale``'s lower bound: 2**-126, the smallest normal
#: float32, whose inverse is still finite (see :class:`GradScaler`).
_MIN_SCALE = torch.finfo(torch.float32).tiny
_MAX_SCALE = torch.finfo(torch.float32).max
#: :meth:`GradScaler.update` warns after this many consecutive overflowing steps.
_OVERFLOW_WARNING_STEPS = 32
#: ... and after this many consecutive steps whose gradients were all zero.
_ZERO_WARNING_STEPS = 100


def _real(name: str, value: Any) -> float:
    """``value`` as a float; TypeError naming ``name`` unless it is a real number (a bool is not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    return float(value)


def _int(name: str, value: Any) -> int:
    """``value`` as an int; TypeError naming ``name`` unless it is an integer (a bool or 2.0 is not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def _scale_value(name: str, value: Any) -> float:
    """``value`` checked as a loss scale: a real number in [2**-126, float32 max]."""
    value = _real(name, value)
    if not _MIN_SCALE <= value <= _MAX_SCALE:
        raise ValueError(f"{name} must be in [2**-126, {_MAX_SCALE:.6g}] (a positive, normal, finite float32), "
                         f"got {value!r}")
    return value


def _settings(scale: Any, growth_factor: Any, backoff_factor: Any, growth_interval: Any,
              scale_name: str) -> Tuple[float, float, float, int]:
    """The checked ``(scale, growth_factor, backoff_factor, growth_interval)``.

    Raises TypeError (wrong type, bools included) or ValueError (out of range) naming the argument;
    ``scale_name`` is the scale's name (``init_scale``, or ``scale`` in a state_dict).
    """
    scale = _scale_value(scale_name, scale)
    growth_factor = _real("growth_factor", growth_factor)
    if not (growth_factor > 1.0 and math.isfinite(growth_factor)):
        raise ValueError(f"growth_factor must be a finite number > 1, got {growth_factor!r}")
    backoff_factor = _real("backoff_factor", backoff_factor)
    if not 0.0 < backoff_factor < 1.0:
        raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
    growth_interval = _int("growth_interval", growth_interval)
    if growth_interval <= 0:
        raise ValueError(f"growth_interval must be an int > 0, got {growth_interval!r}")
    return scale, growth_factor, backoff_factor, growth_interval


def _checked_state(state_dict: Dict[str, Any]) -> Tuple[Tuple[float, float, float, int], int]:
    """A scaler state_dict's ``((scale, growth_factor, backoff_factor, growth_interval), growth_tracker)``,
    each checked as the constructor checks it. Raises KeyError (a missing key), TypeError, ValueError."""
    missing = [k for k in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
               if k not in state_dict]
    if missing:
        raise KeyError(f"GradScaler state_dict is missing {missing}")
    settings = _settings(state_dict["scale"], state_dict["growth_factor"], state_dict["backoff_factor"],
                         state_dict["growth_interval"], "scale")
    tracker = _int("_growth_tracker", state_dict["_growth_tracker"])
    if tracker < 0:
        raise ValueError(f"_growth_tracker must be >= 0, got {tracker}")
    return settings, tracker


def _update_scale_(scale: Tensor, tracker: Tensor, found_inf: Tensor, growth_factor: float, backoff_factor: float,
                   growth_interval: int, min_scale: float) -> None:
    """The dynamic loss scale's rule, in place on the 1-element ``scale`` (float32) and ``tracker`` (int32,
    clean steps since the last change): after an inf/nan (``found_inf``, a bool tensor) the scale is
    ``max(scale * backoff_factor, min_scale)``; after ``growth_interval`` clean steps it grows by
    ``growth_factor`` unless that overflows float32. As torch.amp's ``_amp_update_scale_``, with the floor."""
    count = torch.where(found_inf, torch.zeros_like(tracker), tracker + 1)
    grow = count >= growth_interval
    grown = scale * growth_factor
    grown = torch.where(torch.isfinite(grown), grown, scale)
    backed_off = torch.clamp(scale * backoff_factor, min=min_scale)
    scale.copy_(torch.where(found_inf, backed_off, torch.where(grow, grown, scale)))
    tracker.copy_(torch.where(grow, torch.zeros_like(count), count))


def _capturable(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a halfadam optimizer with ``capturable=True`` (it takes ``found_inf``)."""
    return halfadam_optimizer(optimizer) is optimizer and getattr(optimizer, "capturable", False)


class _Streaks:
    """Counts consecutive overflowing steps and consecutive steps whose gradients were all zero; warns
    (UserWarning) once per run of either: when the scale reaches its floor ``min_scale`` or the
    overflows reach :data:`_OVERFLOW_WARNING_STEPS` steps, and when the zeros reach
    :data:`_ZERO_WARNING_STEPS` steps."""

    def __init__(self, min_scale: float):
        self.min_scale = min_scale
        self.steps, self.warned = 0, False
        self.zero_steps, self.zero_warned = 0, False

    def record(self, overflow: bool, all_zero: Optional[bool], scale: Tensor) -> None:
        """One step's outcome (``overflow``: its gradients held inf/nan; ``all_zero``: they were all 0,
        ``None`` if not known); ``scale``: the new loss scale. Called by :meth:`_LossScale.update`: the
        warnings point at the caller of :meth:`GradScaler.update`."""
        if all_zero and not overflow:
            self.zero_steps += 1
            if self.zero_steps >= _ZERO_WARNING_STEPS and not self.zero_warned:
                self.zero_warned = True
                warnings.warn(
                    f"GradScaler: every gradient was 0 in {self.zero_steps} consecutive steps (loss scale "
                    f"{scale.item():.3g}, min_scale {self.min_scale:.3g}): nothing is training. A scale far "
                    f"below 1 flushes float16 gradients to 0 in the backward pass: raise min_scale; else "
                    f"look for a loss that does not depend on the parameters.", UserWarning, stacklevel=4)
        elif all_zero is not None or overflow:
            self.zero_steps, self.zero_warned = 0, False
        if not overflow:
            self.steps, self.warned = 0, False
            return
        self.steps += 1
        if self.warned:
            return
        value = scale.item()
        if value <= self.min_scale or self.steps >= _OVERFLOW_WARNING_STEPS:
            self.warned = True
            reason = (f"reached its floor min_scale={self.min_scale:.3g}" if value <= self.min_scale
                      else f"is {value:.3g}")
            warnings.warn(
                f"GradScaler: {self.steps} consecutive steps had inf/nan gradients and were "
                f"skipped; the loss scale {reason}. Lowering the scale does not seem to cure it: look for "
                f"inf/nan in the loss, the data or the model. Training resumes (and the scale grows "
                f"again) at the first step with finite gradients.", UserWarning, stacklevel=4)


class _LossScale:
    """The dynamic loss scale of a :class:`GradScaler`: its settings, its 1-element tensors (created on
    first use), its update rule and its saved state. :class:`GradScaler` runs the protocol around it
    (scale, unscale, check and step each optimizer) and hands this the outcome of each step.

    ``init_scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval`` and ``min_scale`` are
    checked as :class:`GradScaler` documents them (TypeError / ValueError naming the argument).
    """

    def __init__(self, init_scale: Any, growth_factor: Any, backoff_factor: Any, growth_interval: Any,
                 min_scale: Any):
        (self.init_scale, self.growth_factor, self.backoff_factor,
         self.growth_interval) = _settings(init_scale, growth_factor, backoff_factor, growth_interval, "init_scale")
        min_scale = _scale_value("min_scale", min_scale)
        if self.init_scale < min_scale:
            raise ValueError(f"init_scale={init_scale!r} is below min_scale={min_scale!r}, the floor of the scale")
        self.scale: Optional[Tensor] = None  # float32, 1 element; None until create()
        self.tracker: Optional[Tensor] = None  # int32, 1 element: clean steps since the last change
        self.init_tracker = 0
        self.streaks = _Streaks(min_scale)  # consecutive overflows and all-zero steps, for the warnings

    def create(self, device: torch.device) -> None:
        """The scale and growth tracker tensors on ``device``, unless they exist already."""
        if self.scale is None:
            self.scale = torch.full((1,), self.init_scale, dtype=torch.float32, device=device)
            self.tracker = torch.full((1,), self.init_tracker, dtype=torch.int32, device=device)

    def value(self) -> float:
        """The scale as a Python float (``init_scale`` before :meth:`create`)."""
        return self.init_scale if self.scale is None else self.scale.item()

    def set(self, new_scale: Any) -> None:
        """Set the scale to ``new_scale`` (a real number or a 1-element tensor, checked); the tracker stays."""
        value = new_scale.item() if isinstance(new_scale, Tensor) else new_scale
        self.scale.fill_(_scale_value("new_scale", value))

    def update(self, found: List[Tensor], all_zero: Optional[bool]) -> None:
        """Back off or grow (:func:`_update_scale_`) after a step whose optimizers' ``found_inf`` flags are
        ``found`` (any nonzero: an overflow) and whose gradients were ``all_zero`` (``None``: not known);
        records the step in the streaks that warn."""
        found_inf = torch.stack([f.to(self.scale.device) for f in found]).sum() > 0
        _update_scale_(self.scale, self.tracker, found_inf, self.growth_factor, self.backoff_factor,
                       self.growth_interval, self.streaks.min_scale)
        self.streaks.record(bool(found_inf), all_zero, self.scale)  # step() synchronized on found_inf

    def state_dict(self) -> Dict[str, Any]:
        """The keys and values of ``torch.amp.GradScaler.state_dict()`` (see :meth:`GradScaler.state_dict`)."""
        return {
            "scale": self.value(),
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": self.init_tracker if self.tracker is None else int(self.tracker.item()),
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a non-empty ``state_dict`` as :meth:`GradScaler.load_state_dict` documents (all checked
        before anything changes; a scale below ``min_scale`` starts at ``min_scale``, with a warning
        pointing at the caller of :meth:`GradScaler.load_state_dict`)."""
        settings, tracker = _checked_state(state_dict)
        min_scale = self.streaks.min_scale
        if settings[0] < min_scale:
            warnings.warn(f"GradScaler.load_state_dict: the saved loss scale {settings[0]:.3g} is below this "
                          f"scaler's min_scale={min_scale:.3g} (torch.amp.GradScaler has no floor); "
                          f"it starts at min_scale", UserWarning, stacklevel=3)
            settings = (min_scale,) + settings[1:]
        self.init_scale, self.growth_factor, self.backoff_factor, self.growth_interval = settings
        self.init_tracker = tracker
        if self.scale is not None:
            self.scale.fill_(self.init_scale)
            self.tracker.fill_(self.init_tracker)


def _clip_unscaled(scaler: "GradScaler", optimizer: Any, step_kwargs: Dict[str, Any]) -> Tensor:
    """Clipping to ``max_grad_norm`` with scaling off; returns the norm before clipping. A halfadam
    optimizer gets the coefficient as ``step_kwargs["grad_scale"]`` (applied in float32 as the kernel
    reads each gradient); any other optimizer's ``.grad`` is clipped in place."""
    if halfadam_optimizer(optimizer) is optimizer and step_kwargs.get("grad_scale") is None:
        step_kwargs["grad_scale"], norm = handover.clip_scale(optimizer, scaler._max_grad_norm)
        return norm
    return scaler.clip_grad_norm_(optimizer, scaler._max_grad_norm)


class Float16GradWarning(UserWarning):
    """A float16 ``param.grad`` changed after :meth:`GradScaler.unscale_` is used as written, in float16.

    Shown once per :class:`GradScaler`. The step takes the change exactly, but the values are float16:
    an unscaled gradient below about 6e-8 is 0 there and one below 6.1e-5 keeps fewer than 11 bits.
    ``scaler.clip_grad_norm_(optimizer, max_norm)`` or ``GradScaler(max_grad_norm=...)`` clip the float32
    copies instead. Filter it with ``warnings.filterwarnings("ignore", category=Float16GradWarning)``.
    """


class GradScaler:
    """Dynamic loss scaling for float16 (and bfloat16) training, on CPU and CUDA.

    Usage, as ``torch.amp.GradScaler``::

        scaler = halfadam.GradScaler()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)                     # optional, e.g. before clipping
        scaler.clip_grad_norm_(optimizer, 1.0)         # optional, on the unscaled fp32 gradients
        scaler.step(optimizer)                         # skipped if any gradient is inf/nan
        scaler.update()

    Args:
        device: ``"cpu"``, ``"cuda"`` or a ``torch.device`` for the scale tensor; ``None`` (default)
            takes the device of the first tensor passed to :meth:`scale`.
        init_scale: initial loss scale, a real number in [``min_scale``, float32 max]. Default ``2**16``.
        growth_factor: factor (> 1, finite) applied after ``growth_interval`` consecutive clean steps.
        backoff_factor: factor in (0, 1) applied after a step with inf/nan gradients.
        growth_interval: clean steps (an int > 0) between growths.
        enabled: ``False`` turns loss scaling off: ``scale`` returns its input and ``step`` calls
            ``optimizer.step()`` (bfloat16 training), clipping first when ``max_grad_norm`` is given.
        process_group: the ranks that agree on skipping a step (keyword only). ``"auto"`` (default):
            the default process group when ``torch.distributed`` is initialized with world size > 1,
            else none; a ``ProcessGroup``: that group; ``None``: no agreement. With agreement the
            inf/nan flag is all-reduced (MAX) in :meth:`unscale_`, so every rank skips the same step and
            keeps the same scale. Needed under FSDP2 (each rank sees only its gradient shards);
            harmless under DDP (one 4-byte all-reduce per step). A ZeroRedundancyOptimizer always
            agrees over its own process group (its step is a collective; each rank checks only the
            gradients of its shard).
        max_grad_norm: a real number > 0, finite: :meth:`step` clips each optimizer's unscaled
            gradients to this global L2 norm (as ``clip_grad_norm_``), scaling on or off;
            :attr:`last_grad_norm` holds the norm before clipping. ``None`` (default): no clipping.
        min_scale: the floor of the loss scale (keyword only; default 1.0), a real number in
            [2**-126, ``init_scale``]: see the floor below.

    The fused hand-over: when :meth:`step` is called on a halfadam optimizer without a prior
    :meth:`unscale_`, the gradients are not unscaled into new tensors. One pass over the raw
    (scaled) gradients computes their global L2 norm, accumulated so that it cannot overflow
    (float64; float32 for float16 gradients, whose squares cannot overflow it): it is inf/nan
    exactly when a gradient holds inf/nan, as torch.amp.GradScaler's check. If finite,
    ``optimizer.step(grad_scale=inv_scale * clip_coefficient)`` unscales, clips and updates while
    reading each gradient once more (inside the fused kernel). Call :meth:`unscale_` yourself only if
    you need the unscaled gradients (e.g. for your own clipping).

    With a halfadam optimizer (:class:`halfadam.AdamW`, ``Adam``, ``AdamFP16``), :meth:`unscale_`
    writes unscaled float32 gradients into new tensors (float16/bfloat16 gradients) or in place
    (float32 gradients) and :meth:`step` passes them as ``optimizer.step(grads=...)``. It also writes
    the unscaled values into a half ``param.grad`` (rounded), as torch does, so code between
    ``unscale_`` and ``step`` sees real gradients, and whatever it does to ``.grad`` takes effect
    (see :meth:`step`): ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` clips. With
    float16 parameters, :meth:`clip_grad_norm_` (or ``max_grad_norm``) is the precise way: it clips
    the float32 copies, while an edited float16 ``.grad`` is used with float16's precision (unscaled
    gradients below about 6e-8 are 0 there). If any gradient holds inf or nan, :meth:`step` does not
    call the optimizer: parameters, master weights, moments and step counts stay bit-for-bit
    unchanged, and :meth:`update` multiplies the scale by ``backoff_factor``.

    The scale's floor, ``min_scale`` (default 1.0, as DeepSpeed's and Megatron-LM's ``min_loss_scale``;
    2**-126 at the lowest, the smallest with a finite inverse): an overflow never takes the scale
    below it. torch.amp.GradScaler has none: after 100 overflows in a row its scale is 5e-26 and the
    scaled float16 gradients flush to 0. :meth:`update` warns (UserWarning) once per run of consecutive overflows that
    reaches the floor or 32 steps (the cause is then rarely the scale: look for inf/nan in the loss,
    data or model), and once per run of 100 steps whose gradients were all 0 (known where
    :meth:`step` computes the gradients' norm: the fused hand-over, or ``max_grad_norm``).

    Raises:
        TypeError: an argument of the wrong type, e.g. a bool for a number (named in the message).
        ValueError: an argument out of range (named in the message).
        RuntimeError: a broken call sequence (e.g. ``unscale_`` twice, ``step`` twice without ``update``).
    """

    def __init__(
        self,
        device: Any = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        max_grad_norm: Optional[float] = None,
        *,
        process_group: Any = AUTO,
        min_scale: float = 1.0,
    ):
        self._loss = _LossScale(init_scale, growth_factor, backoff_factor, growth_interval, min_scale)
        if max_grad_norm is not None:
            max_grad_norm = _real("max_grad_norm", max_grad_norm)
            if not (math.isfinite(max_grad_norm) and max_grad_norm > 0):
                raise ValueError(f"max_grad_norm must be None or a finite number > 0, got {max_grad_norm!r}")
        self._max_grad_norm = max_grad_norm
        try:
            self._device = None if device is None else torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device must be None, 'cpu', 'cuda' or a torch.device, got {device!r} ({exc})") from None
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be True or False, got {enabled!r}")
        self._enabled = enabled
        self._process_group = process_group
        #: The global gradient norm (unscaled, before clipping) of the last :meth:`step` that clipped
        #: through ``max_grad_norm``, a 0-d float32 tensor; ``None`` before.
        self.last_grad_norm: Optional[Tensor] = None
        self._per_optimizer: Dict[int, Dict[str, Any]] = {}
        self._fp16_edit_warned = False  # the one-time Float16GradWarning (see step)

    # ------------------------------------------------------------------ scale
    def is_enabled(self) -> bool:
        """Whether loss scaling is on (the ``enabled`` argument)."""
        return self._enabled

    @property
    def _scale(self) -> Optional[Tensor]:
        """The loss scale tensor (float32, 1 element); ``None`` before the first :meth:`scale`."""
        return self._loss.scale

    def scale(self, outputs: Any) -> Any:
        """Multiply ``outputs`` (a tensor, or a list/tuple of them, nested) by the loss scale.

        Each product is ``output * scale`` with the scale as a 0-d float32 tensor, exactly as
        torch.amp.GradScaler computes it: the product has the output's shape and dtype (a float16
        loss of shape (3,) gives a float16 product of shape (3,)), except that a 0-d float16/bfloat16
        output gives a 0-d float32 product (torch's promotion of two 0-d tensors; so does torch's
        scaler). Returns ``outputs`` unchanged when disabled.

        Raises:
            TypeError: ``outputs`` is neither a tensor nor a list/tuple of them.
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, Tensor):
            self._loss.create(self._device or outputs.device)
            return outputs * self._scale.to(device=outputs.device).reshape(())
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise TypeError(f"outputs must be a tensor or a list/tuple of tensors, got {type(outputs).__name__}")

    def get_scale(self) -> float:
        """The current loss scale as a Python float (1.0 when disabled; ``init_scale`` before use)."""
        if not self._enabled:
            return 1.0
        return self._loss.value()

    def get_growth_factor(self) -> float:
        """The factor the scale grows by after ``growth_interval`` consecutive clean steps."""
        return self._loss.growth_factor

    def get_backoff_factor(self) -> float:
        """The factor the scale shrinks by after a step with inf/nan gradients."""
        return self._loss.backoff_factor

    def get_growth_interval(self) -> int:
        """The number of consecutive clean steps between growths."""
        return self._loss.growth_interval

    # ------------------------------------------------------------------ unscale / step
    def _opt_state(self, optimizer: Any) -> Dict[str, Any]:
        return self._per_optimizer.setdefault(id(optimizer), handover.new_handover())

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the loss scale and record whether any is inf/nan.

        Afterwards ``param.grad`` holds the unscaled gradient, as with torch.amp.GradScaler, so code
        between ``unscale_`` and :meth:`step` sees real gradients (logging a norm,
        ``torch.nn.utils.clip_grad_norm_``, a custom rescale, zeroing a layer's gradient). Only
        parameters whose ``.grad`` is not ``None`` are unscaled and checked.

        With a halfadam optimizer, a float16/bfloat16 gradient is unscaled into a new float32 tensor
        (of the gradient's shape), which :meth:`step` hands to the optimizer, and the unscaled
        values, rounded to the gradient's dtype, are written into ``param.grad`` in place (in float16
        an unscaled gradient below about 6e-8 is 0, below 6.1e-5 it loses bits; the float32 copy keeps
        them). A float32/float64 gradient is unscaled in place and is itself what the optimizer uses.
        Changes to ``.grad`` made before :meth:`step` take effect: see :meth:`step`. Under a
        ZeroRedundancyOptimizer only this rank's shard gets float32 copies and is checked; the other
        gradients are unscaled in place (so ``.grad`` holds one scale throughout).

        For any other optimizer ``param.grad`` is unscaled in place.

        Raises:
            ValueError: a float16 gradient with an optimizer that is not halfadam's (as torch's
                scaler: it would flush to zero; use a halfadam optimizer).
            RuntimeError: ``unscale_`` already called since the last :meth:`update`, called after
                :meth:`step`, or before any :meth:`scale` (no loss scale yet).
        """
        self._unscale(optimizer, write_back=True)

    def _unscale(self, optimizer: Any, write_back: bool) -> None:
        """:meth:`unscale_`; ``write_back=False`` (from :meth:`step`, with no user code before the
        optimizer runs) leaves a half ``.grad`` scaled and does not watch for changes."""
        if not self._enabled:
            return
        st = self._opt_state(optimizer)
        if st["stage"] is _UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if st["stage"] is _STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        if self._scale is None:
            raise RuntimeError("unscale_() called before scale(): no loss scale exists yet.")
        handover.unscale(st, optimizer, self._scale, self._process_group, write_back)
        st["stage"] = _UNSCALED

    def _warn_fp16_edit(self) -> None:
        """The one-time :class:`Float16GradWarning` (stack level: the caller of the public method)."""
        self._fp16_edit_warned = True
        warnings.warn(
            "param.grad of a float16 parameter was changed after scaler.unscale_() (for example by "
            "torch.nn.utils.clip_grad_norm_ on the model's parameters): the step uses it as written, "
            "in float16, where an unscaled gradient below about 6e-8 is 0 and one below 6.1e-5 loses "
            "precision. scaler.clip_grad_norm_(optimizer, max_norm) or GradScaler(max_grad_norm=...) "
            "clips the float32 gradients instead. (Shown once.)", Float16GradWarning, stacklevel=3)

    def clip_grad_norm_(self, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the unscaled gradients of ``optimizer`` to a total norm of at most ``max_norm``.

        Calls :meth:`unscale_` first if needed. The norm is computed over the gradients the optimizer
        will use: for halfadam optimizers the unscaled float32 ones (changes made to ``.grad`` since
        :meth:`unscale_` included, see :meth:`step`), accumulated in float64 so that large finite
        gradients cannot overflow it. They are multiplied by ``min(1, max_norm / (norm + 1e-6))`` in
        float32, and the clipped values are written into a half ``.grad`` too (rounded), so ``.grad``
        shows what the step uses. Returns the total norm before clipping as a 0-d float32 tensor
        (inf/nan if a gradient overflowed; that step is skipped anyway). For sharded (``DTensor``,
        FSDP2) gradients the norm is that of the whole gradients, reduced across ranks; under a
        ZeroRedundancyOptimizer the norms of the ranks' shards are combined over its process group
        (only this rank's shard is clipped); replicated (DDP) gradients give the global norm locally.

        Raises:
            TypeError: ``max_norm`` or ``norm_type`` is not a real number (a bool is not).
            ValueError: ``max_norm`` is negative or nan.
        """
        max_norm, norm_type = _real("max_norm", max_norm), _real("norm_type", norm_type)
        if not max_norm >= 0.0:
            raise ValueError(f"max_norm must be >= 0, got {max_norm!r}")
        if self._enabled and self._opt_state(optimizer)["stage"] is _READY:
            self.unscale_(optimizer)
        st = self._opt_state(optimizer)
        if handover.adopt_grad_edits(st, not self._fp16_edit_warned):
            self._warn_fp16_edit()
        return handover.clip_(st, optimizer, max_norm, norm_type)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (if not done yet) and call ``optimizer.step`` unless a gradient is inf/nan.

        Whether to skip is decided by the inf/nan check of :meth:`unscale_` (or of this call, which
        unscales itself, or with a halfadam optimizer checks the scaled gradients in one fused norm
        pass, see the class docstring). With ``max_grad_norm`` the gradients are clipped first.

        After an explicit :meth:`unscale_` with a halfadam optimizer, what user code did to
        ``param.grad`` since then takes effect, exactly: a parameter whose ``.grad`` was set to
        ``None`` is skipped (as torch optimizers do); one whose ``.grad`` was replaced, newly set, or
        changed in place anywhere (through any API, ``.data`` included; detected by comparing bits
        with the unscaled values ``unscale_`` wrote) is updated with that ``.grad`` as written (in its
        dtype, so a float16 one has float16 precision; the first such float16 change warns once, with
        :class:`Float16GradWarning`); every other parameter is updated with its exact float32 copy, so
        a call that changes nothing (e.g. ``torch.nn.utils.clip_grad_norm_`` whose coefficient is
        1.0) gives bit-for-bit the step without it. Changes are not re-checked for inf/nan.

        Returns what ``optimizer.step`` returned, or ``None`` if the step was skipped.

        Raises:
            RuntimeError: ``step`` called twice without :meth:`update`; a ``closure`` keyword
                (unsupported, as in torch).
        """
        if not self._enabled:
            if self._max_grad_norm is not None:  # clipping is asked for whether or not scaling is on
                self.last_grad_norm = _clip_unscaled(self, optimizer, kwargs)
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        st = self._opt_state(optimizer)
        if st["stage"] is _STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if st["stage"] is _READY and halfadam_optimizer(optimizer) is optimizer and self._scale is not None:
            return self._fused_step(optimizer, st, *args, **kwargs)
        fp16_edit = False
        if st["stage"] is _READY:
            self._unscale(optimizer, write_back=False)
        else:
            fp16_edit = handover.adopt_grad_edits(st, not self._fp16_edit_warned)
        if self._max_grad_norm is not None:
            self.last_grad_norm = self.clip_grad_norm_(optimizer, self._max_grad_norm)
            st["all_zero"] = self.last_grad_norm == 0
        result = None
        capturable = _capturable(optimizer)  # the skip happens inside the kernel: nothing waits for found_inf
        if capturable or st["found_inf"].item() == 0.0:
            if fp16_edit:  # said when a step uses it (a skipped step's nan from a clip is no news)
                self._warn_fp16_edit()
            if st["grads"] is not None:
                kwargs["grads"] = st["grads"]
            if capturable:
                kwargs["found_inf"] = st["found_inf"]
            result = optimizer.step(*args, **kwargs)
        st["grads"] = st["seen"] = st["watched"] = None
        st["stage"] = _STEPPED
        return result

    def _fused_step(self, optimizer: Any, st: Dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        """Check, (clip) and step reading the scaled gradients, never writing unscaled copies.

        The check and the clipping coefficient come from one pass (:func:`halfadam.handover.fused_check`);
        the optimizer multiplies each gradient by ``grad_scale`` as it reads it.
        """
        st["found_inf"], grad_scale, norm, st["all_zero"] = handover.fused_check(
            optimizer, self._scale, self._max_grad_norm, self._process_group)
        if norm is not None:
            self.last_grad_norm = norm
        # the optimizer skips where found_inf is set: on the host, or inside the kernel when it is capturable
        result = optimizer.step(*args, grad_scale=grad_scale, found_inf=st["found_inf"], **kwargs)
        st["stage"] = _STEPPED
        return result

    def update(self, new_scale: Optional[float] = None) -> None:
        """Set the next loss scale: back off after an inf/nan, grow after ``growth_interval`` clean steps.

        After an overflow the scale is ``max(scale * backoff_factor, min_scale)`` (the floor, see the
        class docstring; torch.amp.GradScaler's has none); a growth that would overflow float32 keeps
        the scale. Warns (UserWarning) once per run of consecutive overflows, when the scale reaches
        the floor or the run reaches 32 steps, and once per run of 100 steps whose gradients were all 0.

        Args:
            new_scale: use this scale instead (a real number or a 1-element tensor, in [2**-126,
                float32 max]); the growth tracker is left as is.

        Raises:
            TypeError / ValueError: a ``new_scale`` of the wrong type / out of range.
            RuntimeError: no scale exists yet (no :meth:`scale` call), or no step's inf check was recorded.
        """
        if not self._enabled:
            return
        if self._scale is None:
            raise RuntimeError("update() called before scale(): no loss scale exists yet.")
        if new_scale is not None:
            self._loss.set(new_scale)
        else:
            found = [st["found_inf"] for st in self._per_optimizer.values() if st["found_inf"] is not None]
            if not found:
                raise RuntimeError("No inf checks were recorded prior to update().")
            zeros = [st.get("all_zero") for st in self._per_optimizer.values()]
            self._loss.update(found, None if any(z is None for z in zeros) else all(bool(z) for z in zeros))
        self._per_optimizer.clear()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        """``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``_growth_tracker``.

        The keys of ``torch.amp.GradScaler.state_dict()``, so either scaler loads the other's.
        Empty when disabled.
        """
        return self._loss.state_dict() if self._enabled else {}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict` (or from ``torch.amp.GradScaler``); checked first.

        Each value is checked as the constructor checks its argument (``scale`` as ``init_scale``;
        ``_growth_tracker``: an int >= 0); nothing is changed unless every check passes. A ``scale``
        below ``min_scale`` (a torch.amp.GradScaler's after many overflows) starts at ``min_scale``,
        with a UserWarning.

        Raises:
            RuntimeError: loading a non-empty state into a disabled scaler, or an empty one.
            KeyError: a missing key.
            TypeError: a value of the wrong type (a bool, a string, 2.5 for an int), naming the key.
            ValueError: a value out of range, naming the key.
        """
        if not self._enabled:
            if state_dict:
                raise RuntimeError("The source state dict is not empty, but this GradScaler is disabled.")
            return
        if not state_dict:
            raise RuntimeError("The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler.")
        self._loss.load_state_dict(state_dict)
