"""Learning-rate schedules with the mindformers (MindSpore) interface.

Each schedule is a small, picklable callable object: ``schedule(global_step)``
takes the 0-based global optimizer step (an ``int``) and returns the learning
rate for that step as a Python ``float``, in the same units as the
``learning_rate`` / ``base_lr`` argument.  The classes, argument names,
defaults and formulas follow ``mindformers.core.lr.lr_schedule``:

===========================================  ====================================
halfadam.schedules                           mindformers.core
===========================================  ====================================
:class:`ConstantWarmUpLR`                    ``ConstantWarmUpLR``
:class:`LinearWithWarmUpLR`                  ``LinearWithWarmUpLR``
:class:`CosineWithWarmUpLR`                  ``CosineWithWarmUpLR``
:class:`CosineWithRestartsAndWarmUpLR`       ``CosineWithRestartsAndWarmUpLR``
:class:`PolynomialWithWarmUpLR`              ``PolynomialWithWarmUpLR``
:class:`CosineAnnealingLR`                   ``CosineAnnealingLR``
:class:`CosineAnnealingWarmRestarts`         ``CosineAnnealingWarmRestarts``
===========================================  ====================================

Unlike mindformers, unknown keyword arguments are rejected (mindformers
silently swallows ``**kwargs``), so a misspelt argument is an error.

Numerics.  mindformers evaluates these formulas as MindSpore graphs on
float32 tensors: the step is cast to float32, Python-float constants are
rounded to float32 when they meet a tensor, and every tensor operation
rounds its result to float32.  To reproduce mindformers bit for bit, the
schedules here replay the same sequence of operations, rounding to float32
after each one (see :func:`_f32`), and return that float32 value as a Python
float.  Products of two Python constants that mindformers computes in double
precision before they reach a tensor (e.g. ``learning_rate - warmup_lr_init``)
are likewise computed in double precision here.

Driving a schedule from PyTorch.  :func:`as_lr_scheduler` wraps any schedule
in a :class:`torch.optim.lr_scheduler.LRScheduler` so that code calling
``scheduler.step()`` after each ``optimizer.step()`` sees
``param_group["lr"] == schedule(n)`` after ``n`` calls to ``step()``.
``as_lr_scheduler(optimizer)`` (no schedule) instead follows a halfadam
optimizer's own schedules, for frameworks that log ``get_last_lr()``.
"""

from __future__ import annotations

import math
import numbers
import operator
import struct
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

__all__ = [
    "ConstantWarmUpLR",
    "LinearWithWarmUpLR",
    "CosineWithWarmUpLR",
    "CosineWithRestartsAndWarmUpLR",
    "PolynomialWithWarmUpLR",
    "CosineAnnealingLR",
    "CosineAnnealingWarmRestarts",
    "ScheduleLR",
    "as_lr_scheduler",
]

# --------------------------------------------------------------------------
# float32 arithmetic
# --------------------------------------------------------------------------

_FLOAT32 = struct.Struct("<f")


def _f32(x: float) -> float:
    """Round a Python float to the nearest float32 (returned as a float).

    A single +, -, *, / of two float32 values computed in double precision
    and then rounded this way is exactly the IEEE float32 result, so chaining
    ``_f32`` after each operation emulates float32 tensor arithmetic.
    """
    try:
        return _FLOAT32.unpack(_FLOAT32.pack(x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _fmax0(x: float) -> float:
    """``ops.Maximum(0.0, x)`` on float32 scalars."""
    return x if x > 0.0 else 0.0


_PI32 = _f32(math.pi)


def _pow32(base: float, exponent: float) -> float:
    """``base ** exponent`` rounded to float32 (NaN for a negative base and a
    non-integer exponent, +-inf on overflow, like C ``powf``)."""
    if base < 0.0 and not exponent.is_integer():
        return math.nan
    try:
        return _f32(base**exponent)
    except OverflowError:
        negative = base < 0.0 and exponent % 2.0 == 1.0
        return -math.inf if negative else math.inf


def _half_cosine(angle: float) -> float:
    """``max(0, 0.5 * (1 + cos(angle)))`` in float32, as mindformers does."""
    return _fmax0(_f32(0.5 * _f32(1.0 + _f32(math.cos(angle)))))


# --------------------------------------------------------------------------
# argument validation
# --------------------------------------------------------------------------


def _check_int(name: str, value: Any, minimum: int = 0) -> int:
    """Return ``value`` as an int, raising TypeError/ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    value = int(value)
    if value < minimum:
        bound = "non-negative" if minimum == 0 else f">= {minimum}"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    return value


def _check_real(
    name: str,
    value: Any,
    minimum: float | None = 0.0,
    maximum: float | None = None,
) -> float:
    """Return ``value`` as a finite float within bounds, naming ``name`` on error."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value!r}")
    return value


def _resolve_warmup_steps(
    warmup_steps: int | None, warmup_ratio: float | None, total_steps: int | None
) -> int:
    """Number of warm-up steps, mindformers ``_get_warmup_steps`` semantics.

    ``warmup_ratio``, when given, takes precedence over ``warmup_steps`` and
    yields ``int(total_steps * warmup_ratio)`` (truncation, not rounding).
    """
    if warmup_ratio is not None:
        ratio = _check_real("warmup_ratio", warmup_ratio, 0.0, 1.0)
        if total_steps is None:
            raise ValueError(
                f"total_steps must be set when warmup_ratio is used, got total_steps=None "
                f"(warmup_ratio={warmup_ratio!r})"
            )
        return int(total_steps * ratio)
    if warmup_steps is None:
        raise TypeError("warmup_steps must be an int when warmup_ratio is None, got None")
    return _check_int("warmup_steps", warmup_steps)


# --------------------------------------------------------------------------
# base classes
# --------------------------------------------------------------------------


class _Schedule:
    """Common ``__call__`` / ``__repr__`` for all schedules.

    Subclasses implement ``_lr(step)`` where ``step`` is the global step
    already rounded to float32, and list their constructor arguments in
    ``_fields`` (for ``repr``).
    """

    _fields: tuple[str, ...] = ()

    def __call__(self, global_step: int) -> float:
        """Learning rate at 0-based ``global_step``.

        Raises:
            TypeError: ``global_step`` is not an integer.
            ValueError: ``global_step`` is negative.
        """
        if isinstance(global_step, bool):
            raise TypeError(f"global_step must be an int, got {global_step!r}")
        try:
            step = operator.index(global_step)
        except TypeError:
            raise TypeError(
                f"global_step must be an int, got {global_step!r} ({type(global_step).__name__})"
            ) from None
        if step < 0:
            raise ValueError(f"global_step must be non-negative, got {step!r}")
        # mindformers casts the step to float32 before using it.
        return self._lr(_f32(float(step)))

    def _lr(self, step: float) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._fields)
        return f"{type(self).__name__}({args})"


class _WarmUpSchedule(_Schedule):
    """Shared linear warm-up of the ``*WarmUpLR`` schedules.

    For ``step < warmup_steps`` the learning rate is

        warmup_lr_init + (learning_rate - warmup_lr_init) * step / warmup_steps

    and subclasses supply the post-warm-up phase in ``_after_warmup``.
    """

    def __init__(
        self,
        learning_rate: float,
        warmup_steps: int | None,
        warmup_lr_init: float,
        warmup_ratio: float | None,
        total_steps: int | None,
        *,
        total_steps_required: bool,
    ) -> None:
        self.learning_rate = _check_real("learning_rate", learning_rate)
        self.warmup_lr_init = _check_real("warmup_lr_init", warmup_lr_init)
        if total_steps is None:
            if total_steps_required:
                raise TypeError(f"{type(self).__name__} requires total_steps (an int), got None")
            self.total_steps = None
        else:
            self.total_steps = _check_int("total_steps", total_steps, minimum=1)
        self.warmup_ratio = warmup_ratio
        # The resolved number of warm-up steps (warmup_ratio wins if given).
        self.warmup_steps = _resolve_warmup_steps(warmup_steps, warmup_ratio, self.total_steps)
        if self.total_steps is not None and self.warmup_steps > self.total_steps:
            raise ValueError(
                f"warmup_steps must be <= total_steps ({self.total_steps}), "
                f"got {self.warmup_steps!r}"
            )
        self._warmup32 = _f32(self.warmup_steps)
        # mindformers computes (learning_rate - warmup_lr_init) on Python floats.
        self._warmup_range32 = _f32(self.learning_rate - self.warmup_lr_init)
        self._warmup_init32 = _f32(self.warmup_lr_init)

    def _lr(self, step: float) -> float:
        if self._warmup32 > step:
            percent = _f32(step / self._warmup32)
            return _f32(self._warmup_init32 + _f32(self._warmup_range32 * percent))
        return self._after_warmup(step)

    def _after_warmup(self, step: float) -> float:  # pragma: no cover - abstract
        raise NotImplementedError


def _resolve_decay_steps(decay_steps: int | None, default: int) -> int:
    """``max(1, decay_steps)`` if given, else ``max(1, default)`` (mindformers)."""
    if decay_steps is None:
        return max(1, default)
    return max(1, _check_int("decay_steps", decay_steps))


# --------------------------------------------------------------------------
# warm-up schedules
# --------------------------------------------------------------------------


class ConstantWarmUpLR(_WarmUpSchedule):
    r"""Linear warm-up, then a constant learning rate.

    Matches ``mindformers.core.ConstantWarmUpLR``.  With ``t`` the 0-based
    global step and ``W`` the number of warm-up steps:

    .. math::
        \eta_t = \begin{cases}
            \eta_\text{init} + (\eta - \eta_\text{init})\, t / W & t < W \\
            \eta & t \ge W
        \end{cases}

    Learning rates are in the units of ``learning_rate``; steps count
    optimizer steps.  Evaluated in float32 like mindformers.

    Args:
        learning_rate: Learning rate after warm-up, ``>= 0``.
        warmup_steps: Warm-up length ``W`` in steps, ``>= 0``; required unless
            ``warmup_ratio`` is given.
        warmup_lr_init: Learning rate at step 0, ``>= 0``.  Default 0.
        warmup_ratio: If given (in ``[0, 1]``), ``W = int(total_steps *
            warmup_ratio)`` and ``warmup_steps`` is ignored.
        total_steps: Total training steps, ``>= 1``; only needed with
            ``warmup_ratio``.

    Raises:
        TypeError: an argument has the wrong type, or neither
            ``warmup_steps`` nor ``warmup_ratio`` is given.
        ValueError: negative or non-finite value, ``warmup_ratio`` outside
            ``[0, 1]``, ``warmup_ratio`` without ``total_steps``, or
            ``warmup_steps > total_steps``.
    """

    _fields = ("learning_rate", "warmup_steps", "warmup_lr_init", "warmup_ratio", "total_steps")

    def __init__(
        self,
        learning_rate: float,
        warmup_steps: int | None = None,
        warmup_lr_init: float = 0.0,
        warmup_ratio: float | None = None,
        total_steps: int | None = None,
    ) -> None:
        super().__init__(
            learning_rate, warmup_steps, warmup_lr_init, warmup_ratio, total_steps,
            total_steps_required=False,
        )
        self._lr32 = _f32(self.learning_rate)

    def _after_warmup(self, step: float) -> float:
        return self._lr32


class LinearWithWarmUpLR(_WarmUpSchedule):
    r"""Linear warm-up, then linear decay to 0 at ``total_steps``.

    Matches ``mindformers.core.LinearWithWarmUpLR``.  With ``t`` the 0-based
    global step, ``W`` warm-up steps and ``T = total_steps``:

    .. math::
        \eta_t = \begin{cases}
            \eta_\text{init} + (\eta - \eta_\text{init})\, t / W & t < W \\
            \eta \cdot \max\!\bigl(0, (T - t) / \max(1, T - W)\bigr) & t \ge W
        \end{cases}

    The decay always ends at 0 (there is no ``lr_end``) and stays at 0 for
    ``t >= T``.  Evaluated in float32 like mindformers.

    Args:
        learning_rate: Peak learning rate, ``>= 0``.
        total_steps: Total training steps ``T``, ``>= 1``.
        warmup_steps: Warm-up length ``W``, ``0 <= W <= T``; required unless
            ``warmup_ratio`` is given.
        warmup_lr_init: Learning rate at step 0, ``>= 0``.  Default 0.
        warmup_ratio: If given (in ``[0, 1]``), ``W = int(T * warmup_ratio)``.

    Raises:
        TypeError: wrong argument type, or neither ``warmup_steps`` nor
            ``warmup_ratio`` given.
        ValueError: negative / non-finite value, ``total_steps < 1``,
            ``warmup_ratio`` outside ``[0, 1]``, ``warmup_steps > total_steps``.
    """

    _fields = ("learning_rate", "total_steps", "warmup_steps", "warmup_lr_init", "warmup_ratio")

    def __init__(
        self,
        learning_rate: float,
        total_steps: int,
        warmup_steps: int | None = None,
        warmup_lr_init: float = 0.0,
        warmup_ratio: float | None = None,
    ) -> None:
        super().__init__(
            learning_rate, warmup_steps, warmup_lr_init, warmup_ratio, total_steps,
            total_steps_required=True,
        )
        self._lr32 = _f32(self.learning_rate)
        self._total32 = _f32(self.total_steps)
        self._linear32 = _f32(max(1, self.total_steps - self.warmup_steps))

    def _after_warmup(self, step: float) -> float:
        percent = _fmax0(_f32(_f32(self._total32 - step) / self._linear32))
        return _f32(self._lr32 * percent)


class _CosineDecay(_WarmUpSchedule):
    """Shared set-up of the two cosine-with-warm-up schedules: ``lr_end`` from ``decay_steps`` on."""

    _fields = (
        "learning_rate", "warmup_steps", "total_steps", "num_cycles", "lr_end",
        "warmup_lr_init", "warmup_ratio", "decay_steps",
    )

    def __init__(self, learning_rate, warmup_steps, total_steps, num_cycles, lr_end, warmup_lr_init,
                 warmup_ratio, decay_steps) -> None:
        super().__init__(
            learning_rate, warmup_steps, warmup_lr_init, warmup_ratio, total_steps,
            total_steps_required=True,
        )
        self.num_cycles = _check_real("num_cycles", num_cycles)
        self.lr_end = _check_real("lr_end", lr_end)
        self.decay_steps = _resolve_decay_steps(decay_steps, self.total_steps)
        self._cosine32 = _f32(max(1, self.total_steps - self.warmup_steps))
        self._decay32 = _f32(self.decay_steps)
        self._lr_end32 = _f32(self.lr_end)
        # lr_end is a float32 tensor in mindformers: the range is a float32 difference.
        self._range32 = _f32(_f32(self.learning_rate) - self._lr_end32)

    def _lr(self, step: float) -> float:
        if step >= self._decay32:
            return self._lr_end32
        return super()._lr(step)


class CosineWithWarmUpLR(_CosineDecay):
    r"""Linear warm-up, then cosine decay from ``learning_rate`` to ``lr_end``.

    Matches ``mindformers.core.CosineWithWarmUpLR``.  With ``t`` the 0-based
    global step, ``W`` warm-up steps, ``C = max(1, total_steps - W)`` and
    ``D = max(1, decay_steps)`` (default ``D = max(1, total_steps)``):

    .. math::
        \eta_t = \begin{cases}
            \eta_\text{end} & t \ge D \\
            \eta_\text{init} + (\eta - \eta_\text{init})\, t / W & t < W \\
            \eta_\text{end} + (\eta - \eta_\text{end})
                \max\!\bigl(0, \tfrac12(1 + \cos(2\pi\, n_\text{cycles}\, (t - W) / C))\bigr)
                & \text{otherwise}
        \end{cases}

    Note the ``t >= D`` test comes first, so a ``decay_steps`` shorter than
    the warm-up cuts the warm-up short; with ``num_cycles > 0.5`` the cosine
    rises again after its minimum (as in mindformers).  Evaluated in float32.

    Args:
        learning_rate: Peak learning rate, ``>= 0``.
        warmup_steps: Warm-up length ``W``, ``>= 0``.  Default 0.
        total_steps: Total training steps, ``>= 1`` (required: it sets the
            cosine period ``C`` even when ``decay_steps`` is given).
        num_cycles: Number of cosine waves over ``C`` steps, ``>= 0``.
            Default 0.5 (a half cosine from ``learning_rate`` to ``lr_end``).
        lr_end: Final learning rate, ``>= 0``.  Default 0.
        warmup_lr_init: Learning rate at step 0, ``>= 0``.  Default 0.
        warmup_ratio: If given (in ``[0, 1]``), ``W = int(total_steps *
            warmup_ratio)``.
        decay_steps: Step from which the rate is held at ``lr_end``
            (``0`` counts as ``1``); default ``total_steps``.

    Raises:
        TypeError: wrong argument type or ``total_steps`` missing.
        ValueError: negative / non-finite value, ``warmup_ratio`` outside
            ``[0, 1]``, ``warmup_steps > total_steps``.
    """

    def __init__(
        self,
        learning_rate: float,
        warmup_steps: int | None = 0,
        total_steps: int | None = None,
        num_cycles: float = 0.5,
        lr_end: float = 0.0,
        warmup_lr_init: float = 0.0,
        warmup_ratio: float | None = None,
        decay_steps: int | None = None,
    ) -> None:
        super().__init__(learning_rate, warmup_steps, total_steps, num_cycles, lr_end, warmup_lr_init,
                         warmup_ratio, decay_steps)
        # math.pi * num_cycles * 2.0 is folded in double, then meets a tensor.
        self._omega32 = _f32(math.pi * self.num_cycles * 2.0)

    def _after_warmup(self, step: float) -> float:
        progress = _f32(_f32(step - self._warmup32) / self._cosine32)
        percent = _half_cosine(_f32(self._omega32 * progress))
        return _f32(self._lr_end32 + _f32(self._range32 * percent))


class CosineWithRestartsAndWarmUpLR(_CosineDecay):
    r"""Linear warm-up, then ``num_cycles`` cosine decays with hard restarts.

    Matches ``mindformers.core.CosineWithRestartsAndWarmUpLR``.  With ``t``
    the 0-based global step, ``W`` warm-up steps, ``C = max(1, total_steps -
    W)``, ``D = max(1, decay_steps)`` (default ``max(1, total_steps)``) and
    ``p = (t - W) / C``:

    .. math::
        \eta_t = \begin{cases}
            \eta_\text{end} & t \ge D \\
            \eta_\text{init} + (\eta - \eta_\text{init})\, t / W & t < W \\
            \eta_\text{end} + (\eta - \eta_\text{end})
                \max\!\bigl(0, \tfrac12(1 + \cos(\pi\, ((n_\text{cycles}\, p) \bmod 1)))\bigr)
                & p < 1 \\
            0 & \text{otherwise}
        \end{cases}

    Each cycle decays from ``learning_rate`` towards ``lr_end`` and jumps back
    to ``learning_rate``.  mindformers quirk kept here: past ``total_steps``
    the value is ``lr_end`` if ``t >= D`` but **0** (not ``lr_end``) when
    ``decay_steps > total_steps``.  Evaluated in float32.

    Args:
        learning_rate: Peak learning rate, ``>= 0``.
        warmup_steps: Warm-up length ``W``, ``>= 0``; required unless
            ``warmup_ratio`` is given.
        total_steps: Total training steps, ``>= 1`` (required).
        num_cycles: Number of restarts-cycles over ``C`` steps, ``>= 0``.
            Default 1.0.
        lr_end: Learning rate at the bottom of each cycle, ``>= 0``.  Default 0.
        warmup_lr_init: Learning rate at step 0, ``>= 0``.  Default 0.
        warmup_ratio: If given (in ``[0, 1]``), ``W = int(total_steps *
            warmup_ratio)``.
        decay_steps: Step from which the rate is held at ``lr_end``
            (``0`` counts as ``1``); default ``total_steps``.

    Raises:
        TypeError: wrong argument type, ``total_steps`` missing, or neither
            ``warmup_steps`` nor ``warmup_ratio`` given.
        ValueError: negative / non-finite value, ``warmup_ratio`` outside
            ``[0, 1]``, ``warmup_steps > total_steps``.
    """

    def __init__(
        self,
        learning_rate: float,
        warmup_steps: int | None = None,
        total_steps: int | None = None,
        num_cycles: float = 1.0,
        lr_end: float = 0.0,
        warmup_lr_init: float = 0.0,
        warmup_ratio: float | None = None,
        decay_steps: int | None = None,
    ) -> None:
        super().__init__(learning_rate, warmup_steps, total_steps, num_cycles, lr_end, warmup_lr_init,
                         warmup_ratio, decay_steps)
        self._cycles32 = _f32(self.num_cycles)

    def _after_warmup(self, step: float) -> float:
        progress = _f32(_f32(step - self._warmup32) / self._cosine32)
        if progress >= 1.0:
            return 0.0
        phase = _f32(self._cycles32 * progress)
        phase = _f32(phase - math.floor(phase))  # floor-mod 1, exact in float32
        percent = _half_cosine(_f32(_PI32 * phase))
        return _f32(self._lr_end32 + _f32(self._range32 * percent))


class PolynomialWithWarmUpLR(_WarmUpSchedule):
    r"""Linear warm-up, then polynomial decay from ``learning_rate`` to ``lr_end``.

    Matches ``mindformers.core.PolynomialWithWarmUpLR``.  With ``t`` the
    0-based global step, ``W`` warm-up steps, ``T = total_steps`` and
    ``D = max(1, decay_steps)`` (default ``max(1, T - W)``):

    .. math::
        \eta_t = \begin{cases}
            \eta_\text{init} + (\eta - \eta_\text{init})\, t / W & t < W \\
            \eta_\text{end} & t > T \\
            \eta_\text{end} + (\eta - \eta_\text{end})\,(1 - (t - W) / D)^{p} & \text{otherwise}
        \end{cases}

    With the default ``D = T - W`` the decay reaches ``lr_end`` exactly at
    ``t = T``.  mindformers quirk kept here: the hold at ``lr_end`` starts
    after ``T``, not after ``W + D``, so with an explicit ``decay_steps <
    T - W`` the base ``1 - (t - W)/D`` goes negative for ``W + D < t <= T``
    (the rate then rises again for even ``power`` and is NaN for
    non-integer ``power``, as in MindSpore's float32 ``Pow``).  Evaluated in
    float32, including mindformers' final ``learning_rate * (decay /
    learning_rate)`` round trip.

    Args:
        learning_rate: Peak learning rate, ``> lr_end``.
        total_steps: Total training steps ``T``, ``>= 1``.
        warmup_steps: Warm-up length ``W``, ``0 <= W <= T``; required unless
            ``warmup_ratio`` is given.
        lr_end: Final learning rate, ``>= 0``.  Default 1e-7.
        power: Polynomial exponent ``p``, ``>= 0``.  Default 1.0.
        warmup_lr_init: Learning rate at step 0, ``>= 0``.  Default 0.
        warmup_ratio: If given (in ``[0, 1]``), ``W = int(T * warmup_ratio)``.
        decay_steps: Decay length ``D`` (``0`` counts as ``1``); default
            ``T - W``.

    Raises:
        TypeError: wrong argument type, or neither ``warmup_steps`` nor
            ``warmup_ratio`` given.
        ValueError: negative / non-finite value, ``learning_rate <= lr_end``,
            ``warmup_ratio`` outside ``[0, 1]``, ``warmup_steps > total_steps``.
    """

    _fields = (
        "learning_rate", "total_steps", "warmup_steps", "lr_end", "power",
        "warmup_lr_init", "warmup_ratio", "decay_steps",
    )

    def __init__(
        self,
        learning_rate: float,
        total_steps: int,
        warmup_steps: int | None = None,
        lr_end: float = 1e-7,
        power: float = 1.0,
        warmup_lr_init: float = 0.0,
        warmup_ratio: float | None = None,
        decay_steps: int | None = None,
    ) -> None:
        super().__init__(
            learning_rate, warmup_steps, warmup_lr_init, warmup_ratio, total_steps,
            total_steps_required=True,
        )
        self.lr_end = _check_real("lr_end", lr_end)
        self.power = _check_real("power", power)
        if not self.learning_rate > self.lr_end:
            raise ValueError(
                f"lr_end must be smaller than learning_rate ({self.learning_rate!r}), "
                f"got {self.lr_end!r}"
            )
        self.decay_steps = _resolve_decay_steps(decay_steps, self.total_steps - self.warmup_steps)
        self._lr32 = _f32(self.learning_rate)
        self._lr_end32 = _f32(self.lr_end)
        self._range32 = _f32(self._lr32 - self._lr_end32)
        self._power32 = _f32(self.power)
        self._decay32 = _f32(self.decay_steps)
        self._total32 = _f32(self.total_steps)

    def _after_warmup(self, step: float) -> float:
        if step > self._total32:
            return self._lr_end32
        remaining = _f32(1.0 - _f32(_f32(step - self._warmup32) / self._decay32))
        # remaining < 0 only with decay_steps < total_steps - warmup_steps (see docstring).
        decay = _f32(_f32(self._range32 * _pow32(remaining, self._power32)) + self._lr_end32)
        percent = _f32(decay / self._lr32)
        return _f32(self._lr32 * percent)


# --------------------------------------------------------------------------
# SGDR-style schedules (no warm-up)
# --------------------------------------------------------------------------


class _CosineAnnealingBase(_Schedule):
    """Shared ``eta_min + (base_lr - eta_min) * percent`` of the SGDR schedules."""

    def __init__(self, base_lr: float, eta_min: float) -> None:
        self.base_lr = _check_real("base_lr", base_lr)
        self.eta_min = _check_real("eta_min", eta_min)
        self._eta_min32 = _f32(self.eta_min)
        # (base_lr - eta_min) is a Python-float difference in mindformers.
        self._range32 = _f32(self.base_lr - self.eta_min)

    def _anneal(self, t_cur: float, period: float) -> float:
        """``eta_min + (base_lr - eta_min) * max(0, (1 + cos(pi t_cur / period)) / 2)``."""
        percent = _half_cosine(_f32(_f32(_PI32 * t_cur) / period))
        return _f32(self._eta_min32 + _f32(self._range32 * percent))


class CosineAnnealingLR(_CosineAnnealingBase):
    r"""Cosine annealing between ``base_lr`` and ``eta_min`` with period ``2 t_max``.

    Matches ``mindformers.core.CosineAnnealingLR`` (the closed form of
    ``torch.optim.lr_scheduler.CosineAnnealingLR``).  With ``t`` the 0-based
    global step:

    .. math::
        \eta_t = \eta_\text{min} + (\eta_\text{base} - \eta_\text{min})
            \tfrac12\bigl(1 + \cos(\pi t / t_\text{max})\bigr)

    The rate reaches ``eta_min`` at ``t = t_max`` and, past it, rises back to
    ``base_lr`` at ``2 t_max`` and keeps oscillating (it is not clamped).
    Evaluated in float32 like mindformers, so ``schedule(0)`` may differ from
    ``base_lr`` by one float32 ulp.

    Args:
        base_lr: Maximum learning rate, ``>= 0``.
        t_max: Half period in steps, ``>= 1``.
        eta_min: Minimum learning rate, ``>= 0``.  Default 0.

    Raises:
        TypeError: wrong argument type.
        ValueError: negative / non-finite value or ``t_max < 1``.
    """

    _fields = ("base_lr", "t_max", "eta_min")

    def __init__(self, base_lr: float, t_max: int, eta_min: float = 0.0) -> None:
        super().__init__(base_lr, eta_min)
        self.t_max = _check_int("t_max", t_max, minimum=1)
        self._t_max32 = _f32(self.t_max)

    def _lr(self, step: float) -> float:
        return self._anneal(step, self._t_max32)


class CosineAnnealingWarmRestarts(_CosineAnnealingBase):
    r"""SGDR: cosine annealing restarted every ``T_i`` steps, ``T_i = t_0 t_mult^i``.

    Matches ``mindformers.core.CosineAnnealingWarmRestarts`` (the closed form
    of ``torch.optim.lr_scheduler.CosineAnnealingWarmRestarts``).  With ``t``
    the 0-based global step, cycle ``i`` starts at ``S_i = t_0 (t_mult^i - 1)
    / (t_mult - 1)`` (``S_i = i t_0`` when ``t_mult == 1``) and

    .. math::
        \eta_t = \eta_\text{min} + (\eta_\text{base} - \eta_\text{min})
            \tfrac12\bigl(1 + \cos(\pi (t - S_i) / T_i)\bigr),
        \qquad S_i \le t < S_{i+1}

    so the rate is ``base_lr`` at each restart.  For ``t_mult > 1`` the cycle
    index is computed as ``floor(log(t / t_0 (t_mult - 1) + 1) / log t_mult)``
    in float32, exactly as mindformers does.

    Args:
        base_lr: Learning rate at each restart, ``>= 0``.
        t_0: Length of the first cycle in steps, ``>= 1``.
        t_mult: Cycle-length growth factor, int ``>= 1``.  Default 1.
        eta_min: Minimum learning rate, ``>= 0``.  Default 0.

    Raises:
        TypeError: wrong argument type.
        ValueError: negative / non-finite value, ``t_0 < 1`` or ``t_mult < 1``.
    """

    _fields = ("base_lr", "t_0", "t_mult", "eta_min")

    def __init__(
        self, base_lr: float, t_0: int, t_mult: int = 1, eta_min: float = 0.0
    ) -> None:
        super().__init__(base_lr, eta_min)
        self.t_0 = _check_int("t_0", t_0, minimum=1)
        self.t_mult = _check_int("t_mult", t_mult, minimum=1)
        self._t0_32 = _f32(self.t_0)
        self._t_mult32 = _f32(self.t_mult)
        if self.t_mult > 1:
            self._log_t_mult32 = _f32(math.log(self.t_mult))

    def _lr(self, step: float) -> float:
        if step < self._t0_32:
            return self._anneal(step, self._t0_32)
        if self.t_mult == 1:
            index = math.floor(_f32(step / self._t0_32))
            t_cur = _f32(step - _f32(index * self._t0_32))
            return self._anneal(t_cur, self._t0_32)
        x = _f32(step / self._t0_32)
        x = _f32(_f32(x * _f32(self.t_mult - 1.0)) + 1.0)
        index = math.floor(_f32(_f32(math.log(x)) / self._log_t_mult32))
        q_n = _f32(self._t_mult32**index)
        t_start = _f32(_f32(self._t0_32 * _f32(1.0 - q_n)) / _f32(1.0 - self.t_mult))
        t_i = _f32(self._t0_32 * q_n)
        return self._anneal(_f32(step - t_start), t_i)


# --------------------------------------------------------------------------
# torch.optim.lr_scheduler adapter
# --------------------------------------------------------------------------


class ScheduleLR(LRScheduler):
    """A ``torch.optim.lr_scheduler.LRScheduler`` that sets absolute learning rates, or follows a
    halfadam optimizer's own schedules.

    With a ``schedule``: like :class:`torch.optim.lr_scheduler.LambdaLR`, but
    ``param_group["lr"]`` is set to ``schedule(last_epoch)`` itself, not
    ``initial_lr`` times it.  After construction (``last_epoch=-1``) the rate is
    ``schedule(0)``; after ``n`` calls to :meth:`step` it is ``schedule(n)``.

    With ``schedule=None`` (follow mode, for a halfadam optimizer): it writes
    nothing.  Each :meth:`step` (and the construction) records, per group, the
    learning rate the optimizer's coming step uses: its ``lr_schedule`` at the
    group's ``global_step``, or the group's fixed ``lr``.  So
    :meth:`get_last_lr`, which frameworks log, reports the optimizer's
    schedule, however often :meth:`step` is called, and the optimizer's
    schedule stays the one source of truth.

    :meth:`state_dict` leaves the schedules out (they are configuration, given
    again at construction), so it loads with ``torch.load(weights_only=True)``.
    Build it with :func:`as_lr_scheduler`.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        schedule: Callable[[int], float] | Sequence[Callable[[int], float]] | None = None,
        last_epoch: int = -1,
    ) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if isinstance(last_epoch, bool) or not isinstance(last_epoch, int) or last_epoch < -1:
            raise ValueError(f"last_epoch must be an int >= -1, got {last_epoch!r}")
        n_groups = len(optimizer.param_groups)
        if schedule is None:
            for i, group in enumerate(optimizer.param_groups):
                if "lr_schedule" not in group or "global_step" not in group:
                    raise TypeError(
                        f"schedule=None follows the learning-rate schedules of a halfadam optimizer, but "
                        f"param_groups[{i}] of {type(optimizer).__name__} has no 'lr_schedule'/'global_step': "
                        f"pass a schedule (a callable of the step) to drive its lr"
                    )
            schedules = None
        else:
            if isinstance(schedule, (list, tuple)):
                if len(schedule) != n_groups:
                    raise ValueError(
                        f"schedule must be one callable or {n_groups} (one per param group), "
                        f"got {len(schedule)}"
                    )
                schedules = list(schedule)
            else:
                schedules = [schedule] * n_groups
            for s in schedules:
                if not callable(s):
                    raise TypeError(f"schedule must be callable, got {s!r}")
        self.schedules = schedules
        # Absolute schedules do not use initial_lr, but LRScheduler requires it
        # when resuming (last_epoch >= 0); provide it so resuming just works.
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        super().__init__(optimizer, last_epoch)

    @property
    def follows_optimizer(self) -> bool:
        """Whether this scheduler follows the optimizer's own schedules (``schedule=None``)."""
        return self.schedules is None

    def get_lr(self) -> list[float]:
        """Learning rate of each param group at step ``last_epoch`` (follow mode: of the optimizer's
        coming step)."""
        if self.schedules is None:
            return self._followed_lr()
        return [float(s(self.last_epoch)) for s in self.schedules]

    def _get_closed_form_lr(self) -> list[float]:
        return self.get_lr()

    def _followed_lr(self) -> list[Any]:
        # A halfadam optimizer keeps each group's "lr" at its coming step's value (its schedule at
        # the group's global_step), so following it is reading it.
        return [g["lr"].clone() if isinstance(g["lr"], Tensor) else g["lr"] for g in self.optimizer.param_groups]

    def step(self, epoch: int | None = None) -> None:
        """Advance ``last_epoch``; set the learning rates from the schedule (follow mode: only record
        the optimizer's, see :meth:`get_last_lr`)."""
        if self.schedules is not None:
            super().step(epoch)
            return
        self._step_count = getattr(self, "_step_count", 0) + 1
        self.last_epoch = self.last_epoch + 1 if epoch is None else epoch
        self._last_lr = self._followed_lr()

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state without the optimizer and the schedules (plain data)."""
        return {k: v for k, v in super().state_dict().items() if k != "schedules"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`; the schedules given at construction stay (a ``schedules`` entry,
        from an older state dict, is ignored)."""
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "schedules"})


def as_lr_scheduler(
    optimizer: Optimizer,
    schedule: Callable[[int], float] | Sequence[Callable[[int], float]] | None = None,
    last_epoch: int = -1,
) -> ScheduleLR:
    """A ``torch.optim.lr_scheduler.LRScheduler`` for ``optimizer``: driving its learning rates from
    ``schedule``, or (``schedule=None``) reporting a halfadam optimizer's own.

    ``as_lr_scheduler(opt)`` is what to hand a framework that wants a scheduler (HF ``Trainer``'s
    ``optimizers=(opt, scheduler)``, Lightning's ``lr_scheduler``, accelerate's ``prepare``) when
    the schedule is the optimizer's ``lr=``/``learning_rate=``: it never writes ``group["lr"]``
    and its ``get_last_lr()`` is, as for a torch scheduler, the learning rate of the optimizer step
    that follows its last ``step()``.

    Args:
        optimizer: The optimizer whose ``param_groups[i]["lr"]`` are set (or followed).
        schedule: A schedule from this module (or any ``step -> lr`` callable
            returning an absolute learning rate), or a list/tuple with one per
            param group; ``None`` (default) to follow the halfadam optimizer's
            groups: each group's ``lr_schedule`` at its ``global_step``, or its
            fixed ``lr``.
        last_epoch: Index of the last step taken; ``-1`` starts fresh (lr is
            ``schedule(0)`` right away).  When resuming at ``k`` the lr becomes
            ``schedule(k + 1)``.  In follow mode only a counter.

    Returns:
        A :class:`ScheduleLR`; with a schedule, after ``n`` calls to ``step()``
        each group's lr is ``schedule(n)``.

    Raises:
        TypeError: ``optimizer`` is not an Optimizer; a schedule is not callable;
            ``schedule=None`` for an optimizer whose groups are not halfadam's
            (no ``lr_schedule``/``global_step``).
        ValueError: wrong number of schedules or ``last_epoch < -1``.
    """
    return ScheduleLR(optimizer, schedule, last_epoch)
