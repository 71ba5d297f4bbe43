"""The Adam update, stated once.

Every execution path of halfadam (the per-tensor reference, the multi-tensor and the fused/compiled
ones) runs :func:`adam_update_` on float32 tensors; there is no second copy of these equations.

Notation (Kingma & Ba, "Adam", ICLR 2015, Algorithm 1; Loshchilov & Hutter, "Decoupled Weight Decay
Regularization", ICLR 2019, Algorithm 2), at step ``t`` (1-based, the step being taken) with
gradient ``g``, parameter ``w`` (the fp32 master weight for fp16/bf16 parameters), learning rate
``lr`` and weight decay ``wd``:

==========================  =====================================================================
decay ``"decoupled"``        ``w <- w * (1 - lr * wd)``   (AdamW; torch.optim.AdamW, mindformers AdamW)
decay ``"absolute"``         ``w <- w * (1 - wd)``        (labml ``WeightDecay(absolute=True)``)
decay ``"l2"``               ``g <- g + wd * w``          (Adam with L2; torch.optim.Adam)
first moment                 ``m <- b1 * m + (1 - b1) * g``
second moment                ``v <- b2 * v + (1 - b2) * g * g``
update                       ``w <- w - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``
update, optimized_update     ``w <- w - lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)``
==========================  =====================================================================

``optimized_update`` (labml's ``AdamFP16`` default) adds ``eps`` before bias-correcting the second
moment; the two forms differ only in where ``eps`` enters.

Master sync (:func:`sync_master_`), before every update of a parameter that has an fp32 master
weight ``w32`` and a float16/bfloat16 value ``w16``:

==========================  =====================================================================
master sync                  ``w32 <- w16   where  w16 != round(w32)``  (element by element)
==========================  =====================================================================

``!=`` there (:func:`written`) also tells the zeros apart: ``+0.0`` and ``-0.0`` differ (a parameter
zeroed by ``p.mul_(0)`` keeps each zero's sign, as it would without a master). After a step
``w16 == round(w32)`` holds everywhere (the step writes ``w16 <- round(w32)``), so an
element where it fails was written by someone else since (``load_state_dict``, ``copy_``, ``.data``,
a framework), and the step starts from that value, as it would without a master.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, List, Tuple, Union

import torch
from torch import Tensor

__all__ = ["DECAY_MODES", "Rule", "ADAM", "adam_update_", "adam_coefficients", "adam_elementwise_", "sync_master_",
           "written", "coefficient_operands", "as_coefficients", "select"]

#: Accepted values of ``decay``: how weight decay enters the update (see the module docstring).
DECAY_MODES = ("decoupled", "absolute", "l2")

Scalar = Union[float, Tensor]


def adam_update_(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    step: Scalar,
    lr: Scalar,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: Scalar,
    decay: str = "decoupled",
    optimized_update: bool = False,
) -> None:
    """Apply one Adam/AdamW step in place.

    Args:
        param: float32 tensor of any shape, updated in place (the master weight, or the parameter
            itself when it is float32).
        grad: float32 tensor of ``param``'s shape; read only.
        exp_avg, exp_avg_sq: float32 tensors of ``param``'s shape (first and second moments),
            updated in place.
        step: the step being taken, 1-based (bias correction uses ``1 - beta^step``); a Python
            number or a 0-d tensor.
        lr: learning rate (Python number or 0-d float32 tensor).
        beta1, beta2: moment decay rates in [0, 1).
        eps: term added to the denominator for numerical stability, > 0.
        weight_decay: decay coefficient >= 0 (number or 0-d tensor); how it enters depends on ``decay``.
        decay: one of :data:`DECAY_MODES`.
        optimized_update: add ``eps`` before bias-correcting the second moment (labml ``AdamFP16``).

    The operations are the same with Python numbers or tensors, in every execution (eager, compiled,
    the C++ kernel): results agree bit for bit across them, and with ``torch.optim.AdamW``/``Adam`` to
    float32 rounding (torch's eager ``lerp_``/``addcdiv_`` round differently by an ulp here and
    there). Numbers or tensors are accepted for ``step``, ``lr`` and ``weight_decay`` so that a
    compiled caller can pass tensors and never recompile when they change.

    It is two halves, also usable apart: :func:`adam_coefficients` (every scalar of the step: decay
    factor, bias corrections, step size, the betas' complements, eps) and :func:`adam_elementwise_`
    (the per-element work). The fused execution computes the first eagerly (a few 0-d float64 ops per
    bucket) and hands only the second, with the scalars as 0-d tensors, to ``torch.compile``: no
    hyperparameter is a constant of the compiled kernel, so changing any of them (a learning-rate
    schedule, ``OneCycleLR`` cycling ``betas``) never recompiles.
    """
    coefficients = adam_coefficients(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                      weight_decay=weight_decay, decay=decay, optimized_update=optimized_update)
    adam_elementwise_(param, grad, exp_avg, exp_avg_sq, *coefficients, decay=decay, optimized_update=optimized_update)


def adam_coefficients(
    *,
    step: Scalar,
    lr: Scalar,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: Scalar,
    decay: str = "decoupled",
    optimized_update: bool = False,
) -> Tuple[Scalar, ...]:
    """Every scalar of one step, in the order :func:`adam_elementwise_` takes them:

    * ``decay_factor``: what ``w`` is multiplied by before the update (``1 - lr*wd``, ``1 - wd`` or 1);
    * ``l2``: the coefficient of ``w`` added to the gradient (``wd`` for ``decay="l2"``, else 0);
    * ``step_size``: ``lr / (1 - b1^t)`` (times ``sqrt(1 - b2^t)`` with ``optimized_update``);
    * ``sqrt_bias_correction2``: ``sqrt(1 - b2^t)`` (1 with ``optimized_update``);
    * ``one_minus_beta1``, ``beta2``, ``one_minus_beta2``, ``eps``.

    With Python numbers the results are Python floats (double precision). With tensors (any of
    ``step``, ``lr``, ``weight_decay``; 0-d, or 1-D for one value per parameter) they are computed in
    float64 on the tensors' device and returned as float32 tensors of their broadcast shape (what a
    Python scalar argument becomes inside a float32 kernel), so both forms agree to float32 rounding.
    The Python numbers among the arguments stay numbers (no host-to-device copy: the computation
    can be captured in a CUDA graph).
    """
    if decay not in DECAY_MODES:
        raise ValueError(f"decay must be one of {DECAY_MODES}, got {decay!r}")
    step, lr, weight_decay, zero = coefficient_operands(step, lr, weight_decay)
    if decay == "l2":
        decay_factor, l2 = zero + 1, zero + weight_decay
    elif decay == "decoupled":
        decay_factor, l2 = 1 - lr * weight_decay, zero
    else:  # "absolute"
        decay_factor, l2 = 1 - weight_decay, zero
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    if optimized_update:
        step_size = lr * _sqrt(bias_correction2) / bias_correction1
        sqrt_bias_correction2 = zero + 1
    else:
        step_size = lr / bias_correction1
        sqrt_bias_correction2 = _sqrt(bias_correction2)
    return as_coefficients((decay_factor, l2, step_size, sqrt_bias_correction2, 1 - beta1, beta2, 1 - beta2, eps),
                           zero)


def coefficient_operands(step: Scalar, lr: Scalar, weight_decay: Scalar) -> Tuple[Scalar, Scalar, Scalar, Scalar]:
    """A rule's coefficients' operands, ``(step, lr, weight_decay, zero)``: with a tensor among them (0-d,
    or 1-D for one value per parameter), the tensors in float64 on the first one's device, the numbers as
    floats, and ``zero`` a float64 zero tensor of their broadcast shape; else they as they are and ``zero``
    0.0. Every rule computes its coefficients from these in float64, then :func:`as_coefficients`."""
    tensors = [x for x in (step, lr, weight_decay) if isinstance(x, Tensor)]
    if not tensors:
        return step, lr, weight_decay, 0.0
    device = tensors[0].device
    step, lr, weight_decay = (x.to(device=device, dtype=torch.float64) if isinstance(x, Tensor) else float(x)
                              for x in (step, lr, weight_decay))
    zero = torch.zeros(torch.broadcast_shapes(*(t.shape for t in tensors)), dtype=torch.float64, device=device)
    return step, lr, weight_decay, zero


def as_coefficients(values: Tuple[Scalar, ...], zero: Scalar) -> Tuple[Scalar, ...]:
    """``values`` as a step's coefficients: float32 tensors of ``zero``'s shape where it is a tensor (what a
    Python scalar becomes inside a float32 kernel: both forms agree to float32 rounding), else Python floats."""
    if isinstance(zero, Tensor):
        return tuple((zero + x).float() for x in values)
    return tuple(float(x) for x in values)


def select(condition: Union[bool, Tensor], yes: float, no: float) -> Scalar:
    """``yes`` where ``condition`` holds, else ``no``: :func:`torch.where` for a tensor condition."""
    if isinstance(condition, Tensor):
        return torch.where(condition, yes, no)
    return yes if condition else no


def adam_elementwise_(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    decay_factor: Scalar,
    l2: Scalar,
    step_size: Scalar,
    sqrt_bias_correction2: Scalar,
    one_minus_beta1: Scalar,
    beta2: Scalar,
    one_minus_beta2: Scalar,
    eps: Scalar,
    *,
    decay: str = "decoupled",
    optimized_update: bool = False,
) -> None:
    """The per-element half of :func:`adam_update_`, given :func:`adam_coefficients`' scalars.

    The scalars are all Python floats or all 0-d float32 tensors (then none of them is a constant of
    a compiled kernel). One spelling, each operation rounded once (no fused multiply-add, a
    correctly rounded square root), so that every execution computes the same bits:
    ``m += (g - m) * (1 - b1)`` (lerp's formula for weights < 0.5), ``v = v * b2 + g * (1 - b2) * g``,
    ``w -= m / d * step_size``.
    """
    if decay == "l2":
        grad = grad + l2 * param
    else:
        param.mul_(decay_factor)
    exp_avg.add_((grad - exp_avg) * one_minus_beta1)
    exp_avg_sq.mul_(beta2).add_(grad * one_minus_beta2 * grad)
    root = _sqrt_rounded(exp_avg_sq)
    denom = root.add_(eps) if optimized_update else (root / sqrt_bias_correction2).add_(eps)
    param.sub_(exp_avg / denom * step_size)


@dataclass(frozen=True)
class Rule:
    """An update rule: what the engine needs of an optimizer's math, and nothing else.

    Everything around the rule is shared by every optimizer (masters and their encodings, moment
    encodings, buckets, executions, the master-sync rule, the GradScaler hand-over, checkpoints,
    FSDP2, the self-check); a rule states only its per-element math on float32 tensors. Adam's is
    :data:`ADAM` (this module); SGD's and Lion's live in :mod:`halfadam.sgd` and :mod:`halfadam.lion`,
    each one module with its optimizer class (docs/engine.md: adding an optimizer).

    Attributes:
        name: the rule's name (``"adam"``, ``"sgd"``, ``"lion"``): messages and the self-check.
        kernel: the hand-written kernels' rule id (0 Adam, 1 SGD, 2 Lion): the rule-specific lines of
            ``kernels/adam_cpu.cpp`` and ``kernels/triton.py``.
        moments: the rule's per-element state, ``(state key, kind)`` each, at most one of each kind:
            ``"signed"`` (encoded as Adam's ``exp_avg``: bfloat16 or sign + 7-bit codes) or
            ``"square"`` (as ``exp_avg_sq``: non-negative 8-bit codes). The kernels take the signed
            one in their ``exp_avg`` slot and the square one in their ``exp_avg_sq`` slot.
        coefficients: ``coefficients(step, lr, weight_decay, **options)``: every scalar of a step, in
            the order ``elementwise`` and the kernels take them; Python floats from numbers, float32
            tensors when ``step``, ``lr`` or ``weight_decay`` is a tensor (as :func:`adam_coefficients`).
        elementwise: ``elementwise(weight, grad, moments, coefficients, flags)``: the per-element
            update, in place, on float32 tensors (``moments`` in the order of ``moments``).
        flags: ``flags(options)``: the two booleans the kernels are compiled for (Adam: decay
            ``"l2"``, ``optimized_update``; SGD: weight decay on, nesterov; Lion: none).
        check_options: hyperparameters the self-check steps the kernels with, given a step's options
            (the same flags).
        flag_names: what each flag means when it is on, for messages (Adam: ``("decay l2",
            "optimized_update")``).
    """

    name: str
    kernel: int
    moments: Tuple[Tuple[str, str], ...]
    coefficients: Callable[..., Tuple[Scalar, ...]]
    elementwise: Callable[[Tensor, Tensor, List[Tensor], Tuple[Scalar, ...], Tuple[bool, bool]], None]
    flags: Callable[[dict], Tuple[bool, bool]]
    check_options: Callable[[dict], dict]
    flag_names: Tuple[str, ...] = ()

    def describe(self, flags: Tuple[bool, bool]) -> str:
        """The rule and its kernel flags that are on, for messages (``"sgd, nesterov"``)."""
        return ", ".join([self.name] + [n for n, f in zip(self.flag_names, flags) if f])


def _adam_coefficients(step: Scalar, lr: Scalar, weight_decay: Scalar, **options: Any) -> Tuple[Scalar, ...]:
    return adam_coefficients(step=step, lr=lr, weight_decay=weight_decay, **options)


def _adam_elementwise(weight: Tensor, grad: Tensor, moments: List[Tensor], coefficients: Tuple[Scalar, ...],
                      flags: Tuple[bool, bool]) -> None:
    adam_elementwise_(weight, grad, moments[0], moments[1], *coefficients, decay="l2" if flags[0] else "decoupled",
                      optimized_update=flags[1])


#: Adam's rule (AdamW, Adam, AdamFP16): options ``beta1``, ``beta2``, ``eps``, ``decay``, ``optimized_update``.
ADAM = Rule(
    name="adam", kernel=0, moments=(("exp_avg", "signed"), ("exp_avg_sq", "square")),
    coefficients=_adam_coefficients, elementwise=_adam_elementwise,
    flags=lambda o: (o["decay"] == "l2", bool(o["optimized_update"])),
    check_options=lambda o: dict(beta1=0.9, beta2=0.999, eps=1e-8, decay=o["decay"],
                                 optimized_update=o["optimized_update"]),
    flag_names=("decay l2", "optimized_update"))


def sync_master_(master: Tensor, param: Tensor) -> None:
    """The master-sync rule: ``master`` takes ``param``'s value wherever ``param != round(master)``.

    Args:
        master: float32 tensor (the fp32 master weight), updated in place.
        param: tensor of ``master``'s shape in the parameter's dtype (float16, bfloat16, or float32),
            read only; ``round`` is the conversion to that dtype (round to nearest even, as the step's
            write-back).

    An element that compares unequal (nan included) was changed outside the optimizer; elements
    still equal to the rounded master keep the master's extra bits. For a float32 ``param`` the rule
    makes ``master`` a copy of ``param``.

    Compiled callers must keep the rounding: Inductor by default elides the float32 -> half cast in
    ``master.to(param.dtype)`` and compares against the unrounded master (every element then looks
    written, and the master loses its extra bits each step). The fused kernel is compiled with
    ``emulate_precision_casts=True`` for this (:mod:`halfadam.executions`); comparing bit patterns
    instead is also exact but made Inductor's CPU kernel 5x slower. Eagerly on the CPU the master
    is rewritten only when some element differs (a GPU would have to synchronise to know).
    """
    stale = written(param, master)
    if not torch.compiler.is_compiling() and master.device.type == "cpu" and not bool(stale.any()):
        return  # eager on the CPU, nothing written (the usual case): skip the rewrite's three passes
    master.copy_(torch.where(stale, param.to(master.dtype), master))


def written(param: Tensor, master: Tensor) -> Tensor:
    """Where ``param`` is not ``round(master)`` (bool, ``param``'s shape): another value, nan on
    either side, or a zero of the other sign (``-0.0 == 0.0`` in IEEE comparisons, but a write of
    ``+0.0`` over a master that rounds to ``-0.0`` is a write)."""
    rounded = master.to(param.dtype)
    return (param != rounded) | (torch.signbit(param) != torch.signbit(rounded))


def _sqrt_rounded(x: Tensor) -> Tensor:
    """``sqrt(x)`` correctly rounded (IEEE), as compiled code and the C++ kernel compute it. Eager
    float32 ``sqrt`` of torch's CPU build is not (about one input in five differs by an ulp), so
    there it is taken in float64 and rounded once to float32 (exact: 53 >= 2 * 24 + 2 bits)."""
    if x.dtype == torch.float32 and x.device.type == "cpu" and not torch.compiler.is_compiling():
        return x.double().sqrt_().float()
    return x.sqrt()


def _sqrt(x: Scalar) -> Scalar:
    return x.sqrt() if isinstance(x, Tensor) else math.sqrt(x)
