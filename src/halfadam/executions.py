"""Ways to run :func:`halfadam.functional.adam_update_` over a parameter group.

Each execution receives the same inputs from the optimizer: a list of ``(param, grad)`` pairs, the
optimizer's per-parameter ``state`` (already initialised), and the group's resolved hyperparameters.
It advances ``state["step"]``, updates the fp32 master weights (or fp32 parameters) and moments, and
writes every low-precision parameter back in place (``param.copy_``: round to nearest even), never
rebinding ``param.data``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch
from torch import Tensor

from .functional import adam_update_

__all__ = ["Hyperparameters", "reference_step"]


@dataclass(frozen=True)
class Hyperparameters:
    """A parameter group's hyperparameters resolved for the current step (plain Python numbers)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decay: str
    optimized_update: bool


def reference_step(pairs: List[Tuple[Tensor, Tensor]], state: Dict[Tensor, dict], hp: Hyperparameters) -> None:
    """The readable definition: one :func:`adam_update_` call per parameter.

    For a parameter with a master weight the update runs on ``state["master_weight"]`` and the result
    is copied into the parameter; for a float32 (or float64) parameter without one it runs on the
    parameter itself; for a half-precision parameter whose master weights are off it runs on a
    temporary fp32 copy (the "fp32 compute, no master" baseline, which loses updates below half an ulp).
    """
    for param, grad in pairs:
        st = state[param]
        st["step"] += 1
        master = st.get("master_weight")
        compute_dtype = st["exp_avg"].dtype
        weight = master if master is not None else param.to(compute_dtype)
        adam_update_(
            weight,
            grad.to(compute_dtype),
            st["exp_avg"],
            st["exp_avg_sq"],
            step=st["step"].item(),
            lr=hp.lr,
            beta1=hp.beta1,
            beta2=hp.beta2,
            eps=hp.eps,
            weight_decay=hp.weight_decay,
            decay=hp.decay,
            optimized_update=hp.optimized_update,
        )
        if weight is not param:
            param.copy_(weight)
