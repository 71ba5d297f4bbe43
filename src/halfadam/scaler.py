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
from collections import defaultdict
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .distributed import AUTO, all_reduce_found_inf, halfadam_optimizer, local, total_norm, zero_process_group

__all__ = ["GradScaler", "Float16GradWarning"]

_READY, _UNSCALED, _STEPPED = "ready", "unscaled", "stepped"

#: The loss scale never goes below 2**-126, the smallest normal float32 (see :class:`GradScaler`).
_MIN_SCALE = torch.finfo(torch.float32).tiny
_MAX_SCALE = torch.finfo(torch.float32).max
#: :meth:`GradScaler.update` warns after this many consecutive overflowing steps.
_OVERFLOW_WARNING_STEPS = 32


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


def _global_norm(grads: List[Tensor], norm_type: float = 2.0, shard_group: Any = None) -> Tensor:
    """The ``norm_type``-norm of ``grads`` (see :func:`total_norm`) as a float64 0-d tensor, free of overflow.

    Accumulated in float64: in float32 the sum of squares of finite float32/bfloat16 values overflows
    from about 1.8e19, long before any value does. The 2-norm of float16 gradients alone stays in
    float32 (no overhead): each square is at most 65504**2, so the sum cannot overflow. The result is
    therefore inf/nan exactly when a gradient holds inf/nan, except for float64 gradients beyond
    about 1e154, whose squares overflow float64 (see :meth:`GradScaler._fused_step`).
    """
    exact32 = norm_type == 2.0 and all(g.dtype == torch.float16 for g in grads)
    acc = torch.float32 if exact32 else torch.float64
    return total_norm(grads, norm_type, shard_group=shard_group, dtype=acc).double()


def _capturable(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a halfadam optimizer with ``capturable=True`` (it takes ``found_inf``)."""
    return halfadam_optimizer(optimizer) is optimizer and getattr(optimizer, "capturable", False)


def _unscale_and_check_(tensors: List[Tensor], inv_scale: Tensor, found_inf: Tensor) -> None:
    """Multiply ``tensors`` by ``inv_scale`` in place; set ``found_inf`` to 1.0 if any holds inf/nan.

    ``found_inf`` and ``inv_scale`` are 1-element float32 tensors on one device. Uses torch's fused
    ``_amp_foreach_non_finite_check_and_unscale_`` (the op behind torch.amp.GradScaler) when present,
    per (device, dtype) group; otherwise plain public ops with the same result: the check reads the
    values before unscaling, and the product is computed in float32 (float64 for float64 tensors).
    This is the only private torch op used here.
    """
    groups: Dict[Any, List[Tensor]] = defaultdict(list)
    for t in map(local, tensors):  # DTensor (FSDP2) gradients: their local shards, in place
        groups[(t.device, t.dtype)].append(t)
    fused = getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)
    for (device, _), ts in groups.items():
        local_inf = torch.zeros(1, dtype=torch.float32, device=device)
        local_inv = inv_scale.to(device)
        if fused is not None:
            fused(ts, local_inf, local_inv)
        else:
            for t in ts:
                local_inf = torch.maximum(local_inf, (~torch.isfinite(t)).any().float())
                t.mul_(local_inv.reshape(()))  # a 0-d factor: computed in float32, rounded once
        found_inf.copy_(torch.maximum(found_inf, local_inf.to(found_inf.device)))


_HALF = (torch.float16, torch.bfloat16)
#: :func:`_unchanged` compares CPU tensors in chunks of this many elements (the first one smaller), so
#: a gradient changed near its start (any rescale, a clip) is found without a full pass.
_CHUNK = 1 << 20


class Float16GradWarning(UserWarning):
    """A float16 ``param.grad`` changed after :meth:`GradScaler.unscale_` is used as written, in float16.

    Shown once per :class:`GradScaler`. The step takes the change exactly, but the values are float16:
    an unscaled gradient below about 6e-8 is 0 there and one below 6.1e-5 keeps fewer than 11 bits.
    ``scaler.clip_grad_norm_(optimizer, max_norm)`` or ``GradScaler(max_grad_norm=...)`` clip the float32
    copies instead. Filter it with ``warnings.filterwarnings("ignore", category=Float16GradWarning)``.
    """


def _int_view(t: Tensor) -> Tensor:
    """``t`` (float16/bfloat16) viewed as int16: equal views mean equal bits (nan, -0.0 included)."""
    return t.view(torch.int16)


def _unchanged(pairs: List[Tuple[Tensor, Tensor]]) -> List[bool]:
    """For each ``(grad, copy)``: whether ``grad`` still holds ``copy`` rounded to its dtype, bit for bit.

    ``grad`` is a float16/bfloat16 tensor, ``copy`` the float32 tensor written into it (both local
    shards). A different shape or device counts as changed. On the CPU each pair is compared in
    chunks, stopping at the first difference (a rescaled or clipped gradient usually costs a few
    thousand elements); elsewhere one flag per pair is computed on its device and read back with
    one synchronization per device.
    """
    result: List[Optional[bool]] = [None] * len(pairs)
    pending: Dict[torch.device, List[Tuple[int, Tensor]]] = defaultdict(list)
    for i, (grad, copy) in enumerate(pairs):
        if grad.shape != copy.shape or grad.device != copy.device or grad.dtype not in _HALF:
            result[i] = False
        elif grad.device.type == "cpu" and grad.is_contiguous() and copy.is_contiguous():
            flat_g, flat_c, n = grad.reshape(-1), copy.reshape(-1), grad.numel()
            start, size, same = 0, 4096, True
            while same and start < n:
                stop = min(n, start + size)
                same = torch.equal(_int_view(flat_g[start:stop]), _int_view(flat_c[start:stop].to(grad.dtype)))
                start, size = stop, _CHUNK
            result[i] = same
        else:
            differs = (_int_view(grad) != _int_view(copy.to(grad.dtype))).any()
            pending[grad.device].append((i, differs))
    for items in pending.values():
        for (i, _), flag in zip(items, torch.stack([d for _, d in items]).tolist()):
            result[i] = not flag
    return result  # type: ignore[return-value]


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
        init_scale: initial loss scale, a real number in [2**-126, float32 max ~ 3.4e38] (see the
            floor below). Default ``2**16``.
        growth_factor: factor (> 1, finite) applied after ``growth_interval`` consecutive clean steps.
        backoff_factor: factor in (0, 1) applied after a step with inf/nan gradients.
        growth_interval: clean steps (an int > 0) between growths.
        enabled: ``False`` makes every method a pass-through (``scale`` returns its input, ``step``
            calls ``optimizer.step()``).
        process_group: the ranks that agree on skipping a step (keyword only). ``"auto"`` (default):
            the default process group when ``torch.distributed`` is initialized with world size > 1,
            else none; a ``ProcessGroup``: that group; ``None``: no agreement. With agreement the
            inf/nan flag is all-reduced (MAX) in :meth:`unscale_`, so every rank skips the same step and
            keeps the same scale. Needed under FSDP2 (each rank sees only its gradient shards);
            harmless under DDP (one 4-byte all-reduce per step). A ZeroRedundancyOptimizer always
            agrees over its own process group (its step is a collective; each rank checks only the
            gradients of its shard).
        max_grad_norm: if given (a real number > 0, finite), :meth:`step` clips the gradients to this
            global L2 norm of the unscaled gradients, over each optimizer's gradients (as
            ``clip_grad_norm_`` would, without a separate call). ``None`` (default): no clipping.

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

    The scale's floor: unlike torch.amp.GradScaler, whose scale reaches 0.0 after about 150
    consecutive overflows and never recovers, the scale never goes below 2**-126, the smallest
    normal float32. That is the smallest scale whose inverse, the unscale factor, is a finite float32
    (2**126; exact for powers of two): below it the inverse overflows to inf, unscaling turns every
    zero gradient into nan (0 * inf), and every later step overflows again. At the floor, training
    resumes as soon as the gradients are finite (the scale then grows as usual). Since inf/nan
    that no scale cures (a nan in the loss, the data or the model) is the usual reason for a long
    run of overflows, :meth:`update` warns (UserWarning) when the scale reaches the floor or after
    32 consecutive overflowing steps (with the default factors the scale is then 2**-16: a float16
    gradient would have to exceed 4e9 to overflow), once per run of consecutive overflows.

    Raises:
        TypeError: an argument of the wrong type, e.g. a bool or a string where a number is meant
            (named in the message).
        ValueError: an argument out of range (named in the message).
        RuntimeError: the call sequence is broken (``unscale_`` twice, ``step`` twice without
            ``update``, ``update`` without any step's inf check).
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
    ):
        (self._init_scale, self._growth_factor, self._backoff_factor,
         self._growth_interval) = _settings(init_scale, growth_factor, backoff_factor, growth_interval, "init_scale")
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
        self._scale: Optional[Tensor] = None
        self._growth_tracker: Optional[Tensor] = None
        self._init_growth_tracker = 0
        self._overflow_streak, self._streak_warned = 0, False  # consecutive overflows, for the warning
        self._per_optimizer: Dict[int, Dict[str, Any]] = {}
        self._fp16_edit_warned = False  # the one-time Float16GradWarning (see step)

    # ------------------------------------------------------------------ scale
    def is_enabled(self) -> bool:
        return self._enabled

    def _lazy_init(self, device: torch.device) -> None:
        if self._scale is None:
            device = self._device or device
            self._scale = torch.full((1,), self._init_scale, dtype=torch.float32, device=device)
            self._growth_tracker = torch.full((1,), self._init_growth_tracker, dtype=torch.int32, device=device)

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
            self._lazy_init(outputs.device)
            return outputs * self._scale.to(device=outputs.device).reshape(())
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise TypeError(f"outputs must be a tensor or a list/tuple of tensors, got {type(outputs).__name__}")

    def get_scale(self) -> float:
        """The current loss scale as a Python float (1.0 when disabled; ``init_scale`` before use)."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else self._scale.item()

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def get_growth_interval(self) -> int:
        return self._growth_interval

    # ------------------------------------------------------------------ unscale / step
    def _opt_state(self, optimizer: Any) -> Dict[str, Any]:
        return self._per_optimizer.setdefault(
            id(optimizer), {"stage": _READY, "found_inf": None, "grads": None, "shard_group": None,
                            "seen": None, "watched": None})

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
        inv_scale = self._scale.double().reciprocal().float()
        found_inf = torch.zeros(1, dtype=torch.float32, device=self._scale.device)
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        inner = halfadam_optimizer(optimizer)
        # ZeroRedundancyOptimizer: ranks update disjoint shards, and its step is a collective; they
        # always agree over its process group, and only this rank's shard is unscaled into fp32.
        zero_group = zero_process_group(optimizer)
        if inner is not None:
            watched = [p for g in (optimizer if zero_group is None else inner).param_groups for p in g["params"]]
            if zero_group is not None:
                others = params
                params = [p for p in watched if p.grad is not None]
            grads = {p: p.grad if p.grad.dtype in (torch.float32, torch.float64) else p.grad.float() for p in params}
            _unscale_and_check_(list(grads.values()), inv_scale, found_inf)
            st["grads"] = grads
            st["shard_group"] = zero_group
            if write_back:
                # .grad of a half parameter gets the unscaled values (rounded); step() compares it
                # with them to find the gradients that user code changed (see _adopt_grad_edits).
                st["seen"], st["watched"] = {p: p.grad for p in params}, watched
                self._write_back(st)
                if zero_group is not None:  # other ranks' shards: only so that .grad has one scale
                    rest = [p.grad for p in others if p not in grads]
                    if rest:
                        _unscale_and_check_(rest, inv_scale, torch.zeros_like(found_inf))
        else:
            for p in params:
                if p.grad.dtype == torch.float16:
                    raise ValueError(
                        "Attempting to unscale float16 gradients in place; they would flush to zero. "
                        "Use a halfadam optimizer, which takes unscaled float32 gradients."
                    )
            _unscale_and_check_([p.grad for p in params], inv_scale, found_inf)
        # Every rank skips the same steps.
        all_reduce_found_inf(found_inf, self._process_group if zero_group is None else zero_group)
        st["found_inf"] = found_inf
        st["stage"] = _UNSCALED

    @staticmethod
    def _write_back(st: Dict[str, Any]) -> None:
        """Copy each float32 gradient into the half ``.grad`` it was made from (rounded to its dtype)."""
        seen = st["seen"]
        for p, g in st["grads"].items():
            if g is not seen[p]:
                local(seen[p]).copy_(local(g))

    def _adopt_grad_edits(self, st: Dict[str, Any]) -> bool:
        """Make what user code did to ``.grad`` since :meth:`unscale_` the gradients :meth:`step` uses.

        Per watched parameter: ``.grad`` set to ``None``: skipped; a new tensor, or a gradient where
        there was none: that tensor; the same half tensor whose bits differ anywhere from the float32
        copy rounded to its dtype (an in-place change, through any API: the check is on values, so
        ``torch.nn.utils.clip_grad_norm_`` with a coefficient of exactly 1.0 changes nothing): that
        tensor. An adopted float16/bfloat16 gradient becomes a new float32 copy of its values (exact),
        any other one is used itself. Untouched parameters keep their exact float32 copies. A no-op
        unless the user called :meth:`unscale_` (``st["seen"]`` set).

        Returns whether a float16 gradient holding a nonzero value was adopted (for the one-time
        :class:`Float16GradWarning`; only checked until it was shown).
        """
        seen = st.get("seen")
        if seen is None:
            return False
        grads = st["grads"]
        adopt, compare = [], []
        for p in st["watched"]:
            cur, old = p.grad, seen.get(p)
            if old is None:
                if cur is not None:
                    adopt.append(p)
            elif cur is None:
                del grads[p], seen[p]
            elif cur is not old:
                adopt.append(p)
            elif grads[p] is not cur:  # a half .grad next to its float32 copy
                compare.append(p)
        if compare:
            same = _unchanged([(local(seen[p]), local(grads[p])) for p in compare])
            adopt += [p for p, unchanged in zip(compare, same) if not unchanged]
        fp16_edit = False
        for p in adopt:
            cur = p.grad
            grads[p] = cur.float() if cur.dtype in _HALF else cur
            seen[p] = cur
            if cur.dtype == torch.float16 and not self._fp16_edit_warned and not fp16_edit:
                fp16_edit = bool(local(cur).any())
        return fp16_edit

    def _warn_fp16_edit(self) -> None:
        """The one-time :class:`Float16GradWarning` (stack level: the caller of the public method)."""
        self._fp16_edit_warned = True
        warnings.warn(
            "param.grad of a float16 parameter was changed after scaler.unscale_() (for example by "
            "torch.nn.utils.clip_grad_norm_ on the model's parameters): the step uses it as written, "
            "in float16, where an unscaled gradient below about 6e-8 is 0 and one below 6.1e-5 loses "
            "precision. scaler.clip_grad_norm_(optimizer, max_norm) or GradScaler(max_grad_norm=...) "
            "clips the float32 gradients instead. (Shown once.)", Float16GradWarning, stacklevel=3)

    def _grads(self, optimizer: Any) -> List[Tensor]:
        st = self._opt_state(optimizer)
        if st["grads"] is not None:
            return list(st["grads"].values())
        return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]

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
        if self._adopt_grad_edits(st):
            self._warn_fp16_edit()
        grads = self._grads(optimizer)
        shard_group = st["shard_group"] if st["grads"] is not None else None  # ZeRO: this rank's shard
        if not grads and shard_group is None:
            return torch.zeros(())
        # Across shards: DTensor (FSDP2) gradients over their mesh, ZeRO's shards over its group.
        total = _global_norm(grads, norm_type, shard_group=shard_group)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in map(local, grads):
            g.mul_(coef.to(device=g.device, dtype=g.dtype))
        if st.get("seen") is not None:
            self._write_back(st)
        return total.float()

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
            fp16_edit = self._adopt_grad_edits(st)
        if self._max_grad_norm is not None:
            self.last_grad_norm = self.clip_grad_norm_(optimizer, self._max_grad_norm)
        result = None
        if _capturable(optimizer):  # the skip happens inside the kernel: nothing waits for found_inf
            if fp16_edit:
                self._warn_fp16_edit()
            if st["grads"] is not None:
                kwargs = dict(kwargs, grads=st["grads"])
            result = optimizer.step(*args, found_inf=st["found_inf"], **kwargs)
        elif st["found_inf"].item() == 0.0:
            if fp16_edit:  # said when a step uses it (a skipped step's nan from a clip is no news)
                self._warn_fp16_edit()
            if st["grads"] is not None:
                result = optimizer.step(*args, grads=st["grads"], **kwargs)
            else:
                result = optimizer.step(*args, **kwargs)
        st["grads"] = st["seen"] = st["watched"] = None
        st["stage"] = _STEPPED
        return result

    def _fused_step(self, optimizer: Any, st: Dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        """Check, (clip) and step reading the scaled gradients, never writing unscaled copies.

        The norm of the raw gradients from :func:`_global_norm` cannot overflow, so it is inf/nan
        exactly when a gradient holds inf/nan: one reduction gives both the inf check and the
        clipping norm (across shards and ranks, see :func:`halfadam.distributed.total_norm`). Only
        float64 gradients' squares can overflow it (beyond about 1e154); when such a norm is not
        finite, the max-norm (which cannot overflow) decides instead. The optimizer multiplies each
        gradient by ``grad_scale`` as it reads it.
        """
        inv_scale = self._scale.double().reciprocal().float()
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        raw = _global_norm(grads, 2.0)
        found_inf = ~torch.isfinite(raw)
        if any(g.dtype == torch.float64 for g in grads) and found_inf:
            found_inf = ~torch.isfinite(total_norm(grads, math.inf, dtype=torch.float64))
        st["found_inf"] = all_reduce_found_inf(found_inf.float().reshape(1).to(self._scale.device),
                                               self._process_group)
        grad_scale = inv_scale
        if self._max_grad_norm is not None:
            total = (raw.to(self._scale.device) * inv_scale).reshape(())  # unscaled, float64
            self.last_grad_norm = total.float()
            grad_scale = inv_scale * torch.clamp(self._max_grad_norm / (total + 1e-6), max=1.0).float()
        # the optimizer skips where found_inf is set: on the host, or inside the kernel when it is capturable
        result = optimizer.step(*args, grad_scale=grad_scale, found_inf=st["found_inf"], **kwargs)
        st["stage"] = _STEPPED
        return result

    def update(self, new_scale: Optional[float] = None) -> None:
        """Set the next loss scale: back off after an inf/nan, grow after ``growth_interval`` clean steps.

        After an overflow the scale is ``max(scale * backoff_factor, 2**-126)`` (the floor, see the
        class docstring; torch.amp.GradScaler's has none); a growth that would overflow float32 keeps
        the scale. Warns (UserWarning) once per run of consecutive overflows, when the scale reaches
        the floor or the run reaches 32 steps.

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
            value = new_scale.item() if isinstance(new_scale, Tensor) else new_scale
            self._scale.fill_(_scale_value("new_scale", value))
        else:
            found = [st["found_inf"] for st in self._per_optimizer.values() if st["found_inf"] is not None]
            if not found:
                raise RuntimeError("No inf checks were recorded prior to update().")
            found_inf = torch.stack([f.to(self._scale.device) for f in found]).sum() > 0
            tracker = torch.where(found_inf, torch.zeros_like(self._growth_tracker), self._growth_tracker + 1)
            grow = tracker >= self._growth_interval
            grown = self._scale * self._growth_factor
            grown = torch.where(torch.isfinite(grown), grown, self._scale)
            backed_off = torch.clamp(self._scale * self._backoff_factor, min=_MIN_SCALE)
            self._scale.copy_(torch.where(found_inf, backed_off, torch.where(grow, grown, self._scale)))
            self._growth_tracker.copy_(torch.where(grow, torch.zeros_like(tracker), tracker))
            self._warn_on_overflow_streak(bool(found_inf))  # step() has synchronized on found_inf already
        self._per_optimizer.clear()

    def _warn_on_overflow_streak(self, overflow: bool) -> None:
        """Count consecutive overflows; warn once per run of them, at the floor or at 32 of them."""
        if not overflow:
            self._overflow_streak, self._streak_warned = 0, False
            return
        self._overflow_streak += 1
        if self._streak_warned:
            return
        scale = self._scale.item()
        if scale <= _MIN_SCALE or self._overflow_streak >= _OVERFLOW_WARNING_STEPS:
            self._streak_warned = True
            reason = "reached its floor 2**-126" if scale <= _MIN_SCALE else f"is {scale:.3g}"
            warnings.warn(
                f"GradScaler: {self._overflow_streak} consecutive steps had inf/nan gradients and were "
                f"skipped; the loss scale {reason}. Lowering the scale does not seem to cure it: look for "
                f"inf/nan in the loss, the data or the model. Training resumes (and the scale grows "
                f"again) at the first step with finite gradients.", UserWarning, stacklevel=3)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        """``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``_growth_tracker``.

        The keys of ``torch.amp.GradScaler.state_dict()``, so either scaler loads the other's.
        Empty when disabled.
        """
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._init_growth_tracker if self._growth_tracker is None else int(self._growth_tracker.item()),
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict` (or from ``torch.amp.GradScaler``); checked first.

        Each value is checked as the constructor checks its argument (``scale`` as ``init_scale``;
        ``_growth_tracker``: an int >= 0); nothing is changed unless every check passes.

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
        missing = [k for k in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
                   if k not in state_dict]
        if missing:
            raise KeyError(f"GradScaler state_dict is missing {missing}")
        settings = _settings(state_dict["scale"], state_dict["growth_factor"], state_dict["backoff_factor"],
                             state_dict["growth_interval"], "scale")
        tracker = _int("_growth_tracker", state_dict["_growth_tracker"])
        if tracker < 0:
            raise ValueError(f"_growth_tracker must be >= 0, got {tracker}")
        self._init_scale, self._growth_factor, self._backoff_factor, self._growth_interval = settings
        self._init_growth_tracker = tracker
        if self._scale is not None:
            self._scale.fill_(self._init_scale)
            self._growth_tracker.fill_(self._init_growth_tracker)
