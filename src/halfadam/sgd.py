r"""SGD with momentum, and exact fp32 master weights for float16/bfloat16 parameters.

The rule (``torch.optim.SGD``'s, term for term), at step ``t`` (1-based) with gradient ``g``, weight
``w`` (the fp32 master of a float16/bfloat16 parameter), learning rate ``lr``, weight decay ``wd``,
momentum ``mu``, dampening ``tau``:

=========================  ==========================================================================
maximize                   ``g <- -g``
weight decay (L2)          ``g <- g + wd * w``                 (where ``wd != 0``)
momentum buffer            ``b <- g`` at ``t = 1``, else ``b <- mu * b + (1 - tau) * g``   (``mu != 0``)
direction                  ``d <- g + mu * b`` (nesterov), ``d <- b`` (momentum), ``d <- g`` (none)
update                     ``w <- w - lr * d``
=========================  ==========================================================================

Everything else (masters and their encodings, the buffer's encodings, buckets, kernels, the
master-sync rule, the GradScaler, checkpoints, FSDP2) is the engine's (docs/engine.md).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Sequence, Tuple

import torch
from torch import Tensor

from . import hyperparams
from .functional import Rule, Scalar, as_coefficients, coefficient_operands, select
from .optimizer import _Engine
from .param_groups import check_torch_flags

__all__ = ["SGD"]


def sgd_coefficients(step: Scalar, lr: Scalar, weight_decay: Scalar, *, momentum: float, dampening: float,
                     nesterov: bool, maximize: bool, weight_decay_on: bool = True) -> Tuple[Scalar, ...]:
    """Every scalar of one SGD step, in the order :func:`sgd_elementwise_` and the kernels take them:
    ``l2`` (``wd``), ``momentum_a`` (``mu``; 0 at step 1, where the buffer is the gradient),
    ``momentum_b`` (``1 - tau``; 1 at step 1 and without momentum: a group of momentum 0 beside groups
    with it steps by ``g``, as torch's), ``nesterov_momentum`` (``mu``), ``lr``, ``sign`` (-1 with
    ``maximize``, else 1); ``weight_decay_on`` is the kernels' flag (:attr:`SGD_MOMENTUM.flags`), not a
    coefficient. Python floats from numbers; float32 tensors of the broadcast shape when
    ``step``, ``lr`` or ``weight_decay`` is a tensor (computed in float64 first, as
    :func:`halfadam.functional.adam_coefficients`)."""
    step, lr, weight_decay, zero = coefficient_operands(step, lr, weight_decay)
    first = (step <= 1) | (momentum == 0)  # no momentum: the buffer is the gradient (torch keeps none)
    return as_coefficients((weight_decay, select(first, 0.0, momentum), select(first, 1.0, 1.0 - dampening), momentum,
                            lr, -1.0 if maximize else 1.0), zero)


def sgd_elementwise_(weight: Tensor, grad: Tensor, moments: List[Tensor], coefficients: Tuple[Scalar, ...],
                     flags: Tuple[bool, bool]) -> None:
    """One SGD step on float32 tensors, in place (``weight``, the momentum buffer ``moments[0]`` if any);
    ``flags``: weight decay on (``wd != 0``), nesterov. Each operation rounded once, in this order (the
    kernels' too)."""
    l2, momentum_a, momentum_b, nesterov_momentum, lr, sign = coefficients
    weight_decay_on, nesterov = flags
    g = grad * sign
    if weight_decay_on:
        g = g + l2 * weight
    if moments:
        buf = moments[0]
        buf.mul_(momentum_a).add_(g * momentum_b)
        d = g + buf * nesterov_momentum if nesterov else buf
    else:
        d = g
    weight.sub_(d * lr)


def _check_options(options: Dict[str, Any]) -> Dict[str, Any]:
    """The self-check's options: the same flags (weight decay on, nesterov), momentum 0.9, dampening 0.1
    where nesterov allows it."""
    return dict(options, momentum=0.9, dampening=0.0 if options["nesterov"] else 0.1)


def _rule(momentum: bool) -> Rule:
    return Rule(name="sgd", kernel=1, moments=(("momentum_buffer", "signed"),) if momentum else (),
                coefficients=sgd_coefficients, elementwise=sgd_elementwise_,
                flags=lambda o: (o["weight_decay_on"], o["nesterov"]), check_options=_check_options,
                flag_names=("weight decay", "nesterov"))


#: SGD with a momentum buffer, and without one (every group's momentum 0: a master only).
SGD_MOMENTUM, SGD_PLAIN = _rule(True), _rule(False)


class SGD(_Engine):
    r"""``torch.optim.SGD`` with fp32 master weights for float16/bfloat16 parameters.

    Drop-in for ``torch.optim.SGD(params, lr=1e-3, momentum=0, dampening=0, weight_decay=0,
    nesterov=False, *, maximize=False, foreach=None, differentiable=False, fused=None)``: the same
    update (:mod:`halfadam.sgd`), on an fp32-accurate master of each half parameter, so that a weight decay
    or step below half a bf16 ulp lands as it would in float32.

    Args:
        params: parameters, ``(name, parameter)`` pairs or parameter groups (as :class:`halfadam.AdamW`);
            a group may set ``lr``, ``momentum``, ``dampening``, ``weight_decay``, ``nesterov``,
            ``maximize``, ``master_weights``.
        lr: learning rate (default 1e-3): a float >= 0, a tensor, a per-step sequence or a schedule of
            the global step (as :class:`halfadam.AdamW`).
        momentum: ``mu`` >= 0 (default 0: no momentum buffer is kept).
        dampening: ``tau`` >= 0 (default 0).
        weight_decay: L2 coefficient >= 0 added to the gradient (default 0), or a schedule.
        nesterov: Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``, as torch).
        maximize: maximize the objective (ascend the gradient).
        master_weights: as :class:`halfadam.AdamW` (on for float16/bfloat16 parameters by default).
        implementation: as :class:`halfadam.AdamW` (``"auto"``: the C++ kernel on the CPU, Triton on CUDA).
        capturable: as :class:`halfadam.AdamW`.
        state_mode: ``"fp32"`` (default: fp32 master + fp32 buffer, 8 B per bf16 parameter with momentum,
            4 B without), ``"split"`` (16-bit remainder: 2 + 4), ``"bf16"`` (split + bf16 buffer: 2 + 2),
            ``"compact"`` (split + 8-bit buffer: 2 + 1), ``"tiny"`` (8-bit remainder + 8-bit buffer: 1 + 1);
            see docs/state-modes.md.
        store_param_remainders: overrides the preset's master (as :class:`halfadam.AdamW`).
        foreach: torch's kernel hint, accepted (None, False, True) and changing nothing.
        fused: the same (``foreach`` and ``fused`` both True is a ValueError, as torch).
        differentiable: accepted at ``False`` only.
        learning_rate: the same as ``lr``.

    State per parameter: ``step`` (0-d float32; torch's SGD keeps none: its state dicts load as one step
    taken), ``momentum_buffer`` (with momentum) and the master fields of the state mode.

    The momentum buffer is kept where some group has ``momentum > 0`` at construction (then in every
    group: a group of momentum 0 steps as torch's with its buffer unused); an optimizer built with
    momentum 0 everywhere keeps none, and a step whose group has a momentum set since raises.

    Raises:
        TypeError/ValueError: as :class:`halfadam.AdamW` for ``params``, ``lr``, ``weight_decay`` and the
            state mode; ``momentum``/``dampening`` negative, nan or inf; ``nesterov`` without momentum or
            with dampening, in any group (torch checks only the defaults, and ignores a group's nesterov
            without momentum); ``differentiable=True``; at a step, a group's ``momentum`` set > 0 in an
            optimizer built without a momentum buffer.
    """

    _parsers = {"momentum": hyperparams.parse_nonnegative, "dampening": hyperparams.parse_nonnegative,
                "nesterov": hyperparams.parse_bool, "maximize": hyperparams.parse_bool}
    _required = ("momentum", "dampening", "nesterov", "maximize")
    # torch.optim.SGD's state dicts (halfadam.state_dict): its groups hold the rule's keys and its kernel
    # hints; its state only a momentum_buffer per parameter (none at momentum 0), and no step count.
    _torch_name, _torch_keys, _torch_step, _class_keys = "torch.optim.SGD", (("momentum",),), False, ()

    def _torch_group(self, group: Dict[str, Any], weight_decay: float, where: str) -> Dict[str, Any]:
        return {**{key: group[key] for key in self._parsers}, **_TORCH_HINTS}

    def _from_torch_group(self, saved: Dict[str, Any], current: Dict[str, Any],
                          where: str) -> Tuple[Dict[str, Any], List[str]]:
        return {k: v for k, v in saved.items() if k not in _TORCH_HINTS}, []

    def __init__(self, params: Iterable[Tensor] | Iterable[tuple[str, Tensor]] | Iterable[dict[str, Any]],
                 lr: float | Tensor | Sequence[float] | Callable[[int], float] | None = None,
                 momentum: float = 0, dampening: float = 0, weight_decay: float | Callable[[int], float] = 0,
                 nesterov: bool = False, *, maximize: bool = False, foreach: bool | None = None,
                 differentiable: bool = False, fused: bool | None = None,
                 learning_rate: float | Tensor | Sequence[float] | Callable[[int], float] | None = None,
                 master_weights: bool | None = None, implementation: str = "auto", state_mode: str = "fp32",
                 store_param_remainders: bool | None = None, capturable: bool = False):
        check_torch_flags(dict(foreach=foreach, differentiable=differentiable, fused=fused), type(self).__name__)
        options = {key: parse(value, key) for (key, parse), value in
                   zip(self._parsers.items(), (momentum, dampening, nesterov, maximize))}
        _check_nesterov(options, "SGD(...)")
        super().__init__(params, lr=lr, learning_rate=learning_rate, weight_decay=weight_decay, options=options,
                         master_weights=master_weights, implementation=implementation, state_mode=state_mode,
                         store_param_remainders=store_param_remainders, capturable=capturable)
        for i, group in enumerate(self.param_groups):  # a group's nesterov without momentum: refused now, not at a step
            _check_nesterov(group, f"param_groups[{i}]")

    def _rule_for(self, groups: List[Dict[str, Any]]) -> Rule:
        return SGD_MOMENTUM if any(g.get("momentum") for g in groups) else SGD_PLAIN

    def _options(self, group: Dict[str, Any], where: str) -> Dict[str, Any]:
        options = {key: group[key] for key in self._required}
        _check_nesterov(options, where)
        if options["momentum"] and not self.rule.moments:
            raise ValueError(f"{where}['momentum'] is {options['momentum']}, but this SGD was built with momentum 0 "
                             f"in every group and keeps no momentum_buffer: build it with the momentum")
        wd = group["weight_decay"]  # this step's (a schedule's value shows in the group)
        return dict(options, weight_decay_on=bool(wd.item() if isinstance(wd, Tensor) else wd))

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """As :meth:`halfadam.AdamW.add_param_group`; ValueError for a group with momentum where this
        optimizer keeps no momentum buffer (nothing added)."""
        where = f"param_groups[{len(self.param_groups)}]"
        if isinstance(param_group, dict):
            if param_group.get("momentum") and not self.rule.moments:
                raise ValueError(f"{where}['momentum'] is {param_group['momentum']}, but this SGD was built with "
                                 f"momentum 0 and keeps no momentum_buffer")
            _check_nesterov({**self.defaults, **param_group}, where)
        super().add_param_group(param_group)


#: torch.optim.SGD's kernel hints, at their defaults: written into its groups, dropped from them on load.
_TORCH_HINTS = dict(foreach=None, differentiable=False, fused=None)


def _check_nesterov(options: Dict[str, Any], where: str) -> None:
    if options["nesterov"] and (options["momentum"] <= 0 or options["dampening"] != 0):
        raise ValueError(f"{where}: nesterov momentum requires a momentum > 0 and zero dampening "
                         f"(as torch.optim.SGD), got momentum={options['momentum']}, dampening={options['dampening']}")
