"""Accepted forms of the hyperparameters, their validation, and their value at each step.

The forms follow the documented mindformers ``AdamW`` contract (where its implementation disagrees with
its documentation, the documentation wins):

* learning rate (``lr`` or ``learning_rate``): a float or int >= 0; a 0-d tensor (fixed); a 1-D tensor
  or any other finite sequence of numbers (an iterable with a length: list, tuple, range, array;
  dynamic: global step ``t``, 0-based, uses element ``t``; past the last element the last value
  holds); or a schedule, any callable taking the global step (int) and returning a number (for
  example the classes of :mod:`halfadam.schedules`). A one-shot iterator (a generator,
  ``itertools.repeat``) is a TypeError: it may be endless, and a checkpoint could not store it;
  pass ``list(...)`` of it, or a schedule. A mapping is a TypeError (its keys are not steps).
* weight decay: a float or int >= 0, or a schedule (callable of the global step).
* ``betas``: a pair of floats in (0.0, 1.0); ``eps``: a float > 0 that stays > 0 in float32, the
  dtype the update is computed in (``1e-46`` would be 0 there, and ``0/0`` where a gradient is 0).

Values are checked in the dtype the math runs in (float32): a learning rate or weight decay that is
finite as a Python float but overflows float32 (``1e39``) is a ValueError too.

Each function raises ``TypeError`` for a value of the wrong type and ``ValueError`` for one out of
range, nan or inf, with a message that names the argument (``where``) and the value.
"""

from __future__ import annotations

import math
import numbers
import struct
from collections.abc import Mapping, Sized
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["PerStepValues", "parse_lr", "parse_weight_decay", "parse_betas", "parse_eps", "value_at", "check_value",
           "resolve", "peek", "lr_argument"]

Schedule = Callable[[int], float]


class PerStepValues:
    """A learning rate given per step: ``PerStepValues(values)(t) == values[min(t, len(values) - 1)]``.

    Built from a 1-D tensor or an iterable of numbers passed as a learning rate. Past the last element
    the last value holds (mindformers' dynamic learning rate reads ``values[t]`` and has no defined
    behaviour past the end).
    """

    def __init__(self, values: Sequence[float]):
        self.values = [float(v) for v in values]

    def __call__(self, step: int) -> float:
        return self.values[min(int(step), len(self.values) - 1)]

    def __repr__(self) -> str:
        return f"PerStepValues({len(self.values)} values)"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PerStepValues) and other.values == self.values


def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_float(x: Any) -> bool:
    return _is_number(x) and not isinstance(x, numbers.Integral)


def _is_real_tensor(t: torch.Tensor) -> bool:
    """A tensor of a floating or integer dtype (any width, signed or not), not bool or complex."""
    return t.dtype != torch.bool and not t.is_complex()


def _as_float32(value: float) -> float:
    """``value`` rounded to float32, the dtype the update is computed in (inf if it overflows)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def check_value(value: float, where: str) -> float:
    """``value`` as a float, checked to be finite (also in float32) and >= 0 (ValueError naming ``where``)."""
    value = float(value)
    if not (math.isfinite(value) and math.isfinite(_as_float32(value))):
        raise ValueError(f"{where} must be finite (in float32, the dtype of the update), got {value}")
    if value < 0:
        raise ValueError(f"{where} must be >= 0, got {value}")
    return value


def parse_lr(value: Any, where: str = "lr") -> Tuple[float, Optional[Schedule]]:
    """Validate a learning rate in any accepted form.

    Returns:
        ``(value at global step 0, schedule or None)``; the schedule is ``None`` for a fixed learning
        rate.

    Raises:
        TypeError: not an int, float, tensor, finite sequence of numbers or callable (a one-shot
            iterator, a mapping, a string); a schedule that cannot be called with the global step.
        ValueError: negative, nan or inf (any element of a sequence), a tensor of more than one
            dimension or on the meta device (no value), or an empty sequence.
    """
    if _is_number(value):
        return check_value(value, where), None
    if isinstance(value, torch.Tensor):
        if value.is_meta:
            raise ValueError(f"{where} is a tensor on the meta device, which holds no value")
        if value.dim() > 1:
            raise ValueError(f"{where} as a tensor must have 0 or 1 dimensions, got shape {tuple(value.shape)}")
        if not _is_real_tensor(value):
            raise TypeError(f"{where} as a tensor must be of a floating or integer dtype (not bool or complex), "
                            f"got {value.dtype}")
        if value.dim() == 0:
            return check_value(value.item(), where), None
        return _parse_sequence(value.tolist(), where)
    if callable(value):
        return check_value(_call_schedule(value, 0, where), where), value
    if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__iter__"):
        raise TypeError(
            f"{where} must be a float, an int, a tensor, a sequence of numbers or a schedule "
            f"(a callable of the global step), got {type(value).__name__}: {value!r}"
        )
    if not isinstance(value, Sized):
        raise TypeError(
            f"{where} as per-step values must be a finite sequence (list, tuple, 1-D tensor), got a one-shot "
            f"iterator ({type(value).__name__}), which may be endless and cannot be checkpointed: pass "
            f"list(...) of its first values, or a schedule (a callable of the global step)"
        )
    return _parse_sequence(list(value), where)


def _parse_sequence(values: list, where: str) -> Tuple[float, Schedule]:
    if not values:
        raise ValueError(f"{where} must not be an empty sequence")
    for i, v in enumerate(values):
        if not _is_number(v):
            raise TypeError(f"{where}[{i}] must be a number, got {type(v).__name__}: {v!r}")
        check_value(v, f"{where}[{i}]")
    schedule = PerStepValues(values)
    return schedule(0), schedule


def parse_weight_decay(value: Any, where: str = "weight_decay") -> Tuple[float, Optional[Schedule]]:
    """Validate a weight decay: a float or int >= 0, or a schedule (callable of the global step).

    Returns ``(value at global step 0, schedule or None)``.

    Raises:
        TypeError: not a float, int or callable.
        ValueError: negative, nan or inf.
    """
    if _is_number(value):
        return check_value(value, where), None
    if isinstance(value, torch.Tensor) and value.dim() == 0 and _is_real_tensor(value) and not value.is_meta:
        return check_value(value.item(), where), None
    if callable(value):
        return check_value(_call_schedule(value, 0, where), where), value
    raise TypeError(f"{where} must be a float, an int or a schedule, got {type(value).__name__}: {value!r}")


def parse_betas(betas: Any, where: str = "betas") -> Tuple[float, float]:
    """Validate ``betas``: a pair of floats, each in the open interval (0.0, 1.0).

    Raises:
        TypeError: not a pair, or an element that is not a float.
        ValueError: an element outside (0.0, 1.0), nan or inf.
    """
    if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
        raise TypeError(f"{where} must be a pair of floats (beta1, beta2), got {betas!r}")
    out = []
    for i, beta in enumerate(betas):
        if not _is_float(beta):
            raise TypeError(f"{where}[{i}] must be a float, got {type(beta).__name__}: {beta!r}")
        if not 0.0 < beta < 1.0:
            raise ValueError(f"{where}[{i}] must be in the range (0.0, 1.0), got {beta}")
        out.append(float(beta))
    return out[0], out[1]


def parse_eps(eps: Any, where: str = "eps") -> float:
    """Validate ``eps``: a float > 0 and finite, also once rounded to float32 (the compute dtype).

    Raises:
        TypeError: not a float.
        ValueError: <= 0, nan or inf, or 0 or inf in float32 (e.g. ``1e-46``, ``1e39``).
    """
    if not _is_float(eps):
        raise TypeError(f"{where} must be a float, got {type(eps).__name__}: {eps!r}")
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"{where} must be > 0 and finite, got {eps}")
    as_f32 = _as_float32(eps)
    if not (0 < as_f32 < math.inf):
        raise ValueError(f"{where}={eps} is {as_f32} in float32, the dtype the update is computed in; it must "
                         f"be > 0 and finite there (float32 keeps values from about 1.4e-45 to 3.4e38)")
    return float(eps)


def value_at(schedule: Schedule, step: int, where: str) -> float:
    """The value of ``schedule`` at global step ``step``, validated (a number >= 0, finite)."""
    return check_value(_call_schedule(schedule, step, where), where)


def _call_schedule(schedule: Schedule, step: int, where: str) -> float:
    try:
        value = schedule(step)
    except TypeError as exc:
        raise TypeError(f"{where} schedule could not be called with the global step ({step}): {exc}") from exc
    except ValueError as exc:
        raise ValueError(f"{where} schedule failed at global step {step}: {exc}") from exc
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_meta:
        value = value.item()
    if not _is_number(value):
        raise TypeError(f"{where} schedule returned {type(value).__name__} at step {step}, expected a number")
    return float(value)


def lr_argument(lr: Any, learning_rate: Any) -> Tuple[Any, str]:
    """``(value, name)`` of the learning rate given as ``lr`` or as mindformers' ``learning_rate``
    (the default 1e-3 where neither is); TypeError when both are."""
    if learning_rate is not None:
        if lr is not None:
            raise TypeError("pass the learning rate as either lr or learning_rate, not both")
        return learning_rate, "learning_rate"
    return (1e-3 if lr is None else lr), "lr"


def peek(group: Dict[str, Any], key: str, step: int) -> Optional[float]:
    """The scheduled value of ``key`` at ``step``, or ``None`` if the schedule fails there."""
    try:
        return value_at(group[f"{key}_schedule"], step, key)
    except Exception:
        return None


def resolve(group: Dict[str, Any], key: str, where: str, step: int) -> float:
    """The group's value of ``key`` at global step ``step`` (its schedule's, or the fixed value), validated."""
    schedule = group.get(f"{key}_schedule")
    if schedule is not None:
        return value_at(schedule, step, f"{where}['{key}']")
    value = group[key]  # a number, or a tensor set by the user or a torch lr_scheduler
    if isinstance(value, Tensor) and value.numel() == 1 and not value.is_meta:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where}['{key}'] must be a number (or a 1-element tensor), got "
                        f"{type(value).__name__}: {value!r}")
    return check_value(value, f"{where}['{key}']")


def parse_nonnegative(value: Any, where: str) -> float:
    """Validate a float >= 0 and finite (SGD's ``momentum``, ``dampening``).

    Raises:
        TypeError: not a float or an int (a bool is neither).
        ValueError: negative, nan or inf.
    """
    if not _is_number(value):
        raise TypeError(f"{where} must be a float, got {type(value).__name__}: {value!r}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{where} must be >= 0 and finite, got {value}")
    return float(value)


def parse_bool(value: Any, where: str) -> bool:
    """Validate a bool (SGD's ``nesterov``, ``maximize``). Raises TypeError for anything else."""
    if not isinstance(value, bool):
        raise TypeError(f"{where} must be True or False, got {value!r}")
    return value
