"""NAIVE LION, written for ``halfadam train --optimizer lion`` only: not halfadam's optimizer, and not torch's
(torch has no Lion).

It is to Lion what ``torch.optim.AdamW`` on bfloat16 parameters is to AdamW: the naive modes' optimizer.
Each step computes the reference Lion update (:func:`halfadam.lion.lion_elementwise_`, the paper's
Algorithm 2, each operation rounded once to float32) in float32 from the parameter, its gradient and
its moment, then rounds the new weight straight back into the half-precision parameter and the new
moment into a moment of the parameter's dtype (as torch's optimizers keep their state). There is no
master weight: a step or decay below half an ulp of the weight is lost, which is what the mode shows.
On float32 parameters it is ``halfadam.Lion`` without a master, the reference mode's optimizer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from halfadam.lion import lion_coefficients, lion_elementwise_

__all__ = ["NaiveLion", "naive_lion_step_"]


def naive_lion_step_(param: Tensor, grad: Tensor, exp_avg: Tensor, *, lr: float, weight_decay: float,
                     betas: tuple[float, float]) -> None:
    """One naive Lion step, in place: the update in float32, rounded into ``param`` and ``exp_avg``.

    ``param``, ``grad`` and ``exp_avg``: tensors of one shape (``exp_avg`` in ``param``'s dtype, any
    floating dtype; float16/bfloat16 is the point). ``lr``, ``weight_decay``: floats; ``betas``:
    ``(beta1, beta2)``. Nothing is checked: :class:`NaiveLion` calls it on what it built.
    """
    weight, moment = param.float(), exp_avg.float()  # float32 copies (of a float32 param: the param itself)
    coefficients = lion_coefficients(0, lr, weight_decay, beta1=betas[0], beta2=betas[1])
    lion_elementwise_(weight, grad.float(), [moment], coefficients, (False, False))
    param.copy_(weight)  # rounded to the parameter's dtype once, no master kept
    exp_avg.copy_(moment)


class NaiveLion(torch.optim.Optimizer):
    """Lion on half-precision weights without a master (:func:`naive_lion_step_`; see the module's docstring).

    ``NaiveLion(params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0)``, the signature of
    ``halfadam.Lion``; decoupled decay ``w <- w * (1 - lr * wd)``. State per parameter: ``exp_avg`` in the
    parameter's dtype. ``ValueError`` for a negative ``lr``/``weight_decay`` or betas outside [0, 1).
    """

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0):
        if not lr >= 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must lie in [0, 1), got {betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        """One step of every parameter with a gradient; returns ``closure()``'s loss where given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                naive_lion_step_(p, p.grad, state["exp_avg"], lr=float(group["lr"]),
                                 weight_decay=float(group["weight_decay"]), betas=group["betas"])
        return loss
