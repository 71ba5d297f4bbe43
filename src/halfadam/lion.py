r"""Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms", NeurIPS 2023, Algorithm 2), with
exact fp32 master weights for float16/bfloat16 parameters.

The rule, at each step with gradient ``g``, weight ``w`` (the fp32 master of a float16/bfloat16
parameter), learning rate ``lr``, weight decay ``wd``, moment ``m`` (``exp_avg``):

=========================  ==========================================================================
decoupled weight decay     ``w <- w * (1 - lr * wd)``
update direction           ``c <- b1 * m + (1 - b1) * g``;  ``s <- sign(c)`` (+1, -1; 0 for 0 and nan)
update                     ``w <- w - lr * s``
moment                     ``m <- b2 * m + (1 - b2) * g``
=========================  ==========================================================================

As lucidrains' ``lion-pytorch`` and optimi's ``Lion`` (no bias correction; defaults ``lr=1e-4``,
``betas=(0.9, 0.99)``). Everything else is the engine's (docs/engine.md).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Sequence, Tuple

import torch
from torch import Tensor

from . import hyperparams
from .functional import Rule, Scalar, as_coefficients, coefficient_operands
from .optimizer import _Engine

__all__ = ["Lion"]


def lion_coefficients(step: Scalar, lr: Scalar, weight_decay: Scalar, *, beta1: float,
                      beta2: float) -> Tuple[Scalar, ...]:
    """Every scalar of one Lion step, in the order :func:`lion_elementwise_` and the kernels take them:
    ``decay_factor`` (``1 - lr * wd``), ``lr``, ``beta1``, ``1 - beta1``, ``beta2``, ``1 - beta2``. Python
    floats from numbers; float32 tensors when ``step``, ``lr`` or ``weight_decay`` is a tensor (float64 first)."""
    step, lr, weight_decay, zero = coefficient_operands(step, lr, weight_decay)
    return as_coefficients((1 - lr * weight_decay, lr, beta1, 1 - beta1, beta2, 1 - beta2), zero)


def lion_elementwise_(weight: Tensor, grad: Tensor, moments: List[Tensor], coefficients: Tuple[Scalar, ...],
                      flags: Tuple[bool, bool]) -> None:
    """One Lion step on float32 tensors, in place (``weight``, ``moments[0]``: ``exp_avg``). Each operation
    rounded once, in this order (the kernels' too); the sign of ``c`` is +1, -1, or +0 for +-0 and nan
    (``torch.sign`` on the CPU)."""
    decay_factor, lr, beta1, one_minus_beta1, beta2, one_minus_beta2 = coefficients
    m = moments[0]
    weight.mul_(decay_factor)
    c = m * beta1 + grad * one_minus_beta1
    s = (c > 0).to(c.dtype) - (c < 0).to(c.dtype)
    weight.sub_(s * lr)
    m.mul_(beta2).add_(grad * one_minus_beta2)


#: optimi's Lion group keys beside ``lr`` and ``weight_decay``: ``betas`` as two keys, its flags (dropped on load).
_OPTIMI_KEYS = ("beta1", "beta2", "decouple_lr", "max_lr", "kahan_sum", "foreach", "gradient_release", "setup")

#: Lion's rule: options ``beta1``, ``beta2``.
LION = Rule(name="lion", kernel=2, moments=(("exp_avg", "signed"),), coefficients=lion_coefficients,
            elementwise=lion_elementwise_, flags=lambda o: (False, False),
            check_options=lambda o: dict(beta1=0.9, beta2=0.99))


class Lion(_Engine):
    r"""Lion with fp32 master weights for float16/bfloat16 parameters (:mod:`halfadam.lion`).

    ``Lion(params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0)``, the contract of optimi's and
    lucidrains' ``Lion``: decoupled weight decay ``w <- w * (1 - lr * wd)``. Lion's steps are ``lr``
    in every element; on bf16 weights a step or decay below half an ulp is lost without a master.

    Args:
        params: parameters, ``(name, parameter)`` pairs or parameter groups (as :class:`halfadam.AdamW`);
            a group may set ``lr``, ``betas``, ``weight_decay``, ``master_weights``.
        lr: learning rate (default 1e-4; Lion's is typically 3-10x smaller than AdamW's): a float >= 0,
            a tensor, a per-step sequence or a schedule of the global step.
        betas: ``(beta1, beta2)`` in (0.0, 1.0): the interpolation for the update's sign, and the moment's decay.
        weight_decay: decoupled decay >= 0 (default 0.0; Lion's is typically 3-10x larger than AdamW's),
            or a schedule.
        learning_rate: the same as ``lr`` (mindformers' name).
        master_weights: as :class:`halfadam.AdamW` (on for float16/bfloat16 parameters by default).
        implementation: as :class:`halfadam.AdamW` (``"auto"``: the C++ kernel on the CPU, Triton on CUDA).
        store_param_remainders: overrides the preset's master (as :class:`halfadam.AdamW`).
        capturable: as :class:`halfadam.AdamW`.
        state_mode: ``"fp32"`` (default: fp32 master + fp32 ``exp_avg``, 8 B per bf16 parameter),
            ``"split"`` (2 + 4), ``"bf16"`` (2 + 2), ``"compact"`` (2 + 1), ``"tiny"`` (1 + 1); docs/state-modes.md.

    State per parameter: ``step`` (0-d float32), ``exp_avg`` and the master fields of the state mode.

    Raises:
        TypeError/ValueError: as :class:`halfadam.AdamW` for ``params``, ``lr``, ``weight_decay``, ``betas``
            and the state mode.
    """

    _parsers = {"betas": hyperparams.parse_betas}
    _required = ("betas",)
    # Lion's state dicts outside halfadam (halfadam.state_dict): lucidrains' lion-pytorch's groups hold
    # ``betas`` (what to_torch_state_dict writes), optimi's ``beta1``, ``beta2`` and its own flags; the state
    # ``exp_avg`` per parameter (optimi's also ``kahan_comp``, dropped), and no step count.
    _torch_name = "Lion (lucidrains' lion-pytorch or optimi's)"
    _torch_keys, _torch_step, _torch_dropped, _class_keys = (("betas",), ("beta1", "beta2")), False, ("kahan_comp",), ()

    def _torch_group(self, group: Dict[str, Any], weight_decay: float, where: str) -> Dict[str, Any]:
        return dict(betas=tuple(group["betas"]))

    def _from_torch_group(self, saved: Dict[str, Any], current: Dict[str, Any],
                          where: str) -> Tuple[Dict[str, Any], List[str]]:
        """ValueError for optimi's ``decouple_lr=True`` with a weight decay (a decay not scaled by ``lr``)."""
        if saved.get("decouple_lr") and saved.get("weight_decay"):
            raise ValueError(f"{where}: the checkpoint was written with optimi's decouple_lr=True (a weight decay "
                             f"not scaled by lr), which halfadam's Lion does not implement")
        keys = {k: v for k, v in saved.items() if k not in _OPTIMI_KEYS}
        if "betas" not in keys and "beta1" in saved:
            keys["betas"] = (saved["beta1"], saved.get("beta2"))
        return keys, []

    def __init__(self, params: Iterable[Tensor] | Iterable[tuple[str, Tensor]] | Iterable[dict[str, Any]],
                 lr: float | Tensor | Sequence[float] | Callable[[int], float] | None = 1e-4,
                 betas: tuple[float, float] = (0.9, 0.99), weight_decay: float | Callable[[int], float] = 0.0, *,
                 learning_rate: float | Tensor | Sequence[float] | Callable[[int], float] | None = None,
                 master_weights: bool | None = None, implementation: str = "auto", state_mode: str = "fp32",
                 store_param_remainders: bool | None = None, capturable: bool = False):
        if learning_rate is not None and lr == 1e-4:
            lr = None  # the default gives way to mindformers' name
        super().__init__(params, lr=lr, learning_rate=learning_rate, weight_decay=weight_decay,
                         options=dict(betas=hyperparams.parse_betas(betas, "betas")), master_weights=master_weights,
                         implementation=implementation, state_mode=state_mode,
                         store_param_remainders=store_param_remainders, capturable=capturable)

    def _rule_for(self, groups: List[Dict[str, Any]]) -> Rule:
        return LION

    def _options(self, group: Dict[str, Any], where: str) -> Dict[str, Any]:
        beta1, beta2 = group["betas"]
        return dict(beta1=float(beta1), beta2=float(beta2))
