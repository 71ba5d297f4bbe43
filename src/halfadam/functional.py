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
"""

from __future__ import annotations

import math
from typing import Union

import torch
from torch import Tensor

__all__ = ["DECAY_MODES", "adam_update_"]

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

    The arithmetic follows ``torch.optim.adamw._single_tensor_adamw`` operation by operation, so
    float32 results agree with ``torch.optim.AdamW``/``Adam`` to rounding. Numbers or tensors are
    accepted for ``step``, ``lr`` and ``weight_decay`` so that a compiled caller can pass tensors
    and never recompile when they change.
    """
    if decay == "l2":
        grad = grad + weight_decay * param
    elif decay == "decoupled":
        param.mul_(1 - lr * weight_decay)
    elif decay == "absolute":
        param.mul_(1 - weight_decay)
    else:
        raise ValueError(f"decay must be one of {DECAY_MODES}, got {decay!r}")

    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)

    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    if optimized_update:
        step_size = lr * _sqrt(bias_correction2) / bias_correction1
        denom = exp_avg_sq.sqrt().add_(eps)
    else:
        step_size = lr / bias_correction1
        denom = (exp_avg_sq.sqrt() / _sqrt(bias_correction2)).add_(eps)
    if isinstance(step_size, Tensor):
        param.sub_(exp_avg / denom * step_size)
    else:
        param.addcdiv_(exp_avg, denom, value=-step_size)


def _sqrt(x: Scalar) -> Scalar:
    return x.sqrt() if isinstance(x, Tensor) else math.sqrt(x)
