"""Validation of what a user hands the optimizers: parameters, parameter groups, ``order_params``,
gradients and torch's flags (the layer below :mod:`halfadam.optimizer`, which calls these before it
changes anything, so a call that raises leaves the optimizer as it was).

Every error names the argument or parameter it is about (``param_groups[1]['params'][3]``,
``gradient of param_groups[0]['params'][2]``, ``AdamW(fused=...)``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch import Tensor

from . import encodings, hyperparams
from .encodings import StateFormat
from .functional import DECAY_MODES
from .kernels import cpp as cpu_kernel

__all__ = ["STATE_FORMAT_KEYS", "TORCH_FLAGS_ACCEPTED", "check_disjoint", "check_grad", "check_group_keys",
           "check_order_params", "check_pairs", "check_param", "check_step_keys", "check_torch_flags", "check_writable", "is_named",
           "normalize_group", "raise_foreign_key", "split_params"]


def raise_foreign_key(grads: Mapping, groups: List[Dict[str, Any]]) -> None:
    """``step(grads=...)`` holds a key that is not one of this optimizer's parameters: name it."""
    known = {id(p) for g in groups for p in g["params"]}
    for key in grads:
        if id(key) not in known:
            what = f"a tensor of shape {tuple(key.shape)}" if isinstance(key, Tensor) else repr(key)
            raise ValueError(f"grads has a key that is not a parameter of this optimizer ({what}); key the "
                             f"gradients by the parameters themselves (p, not p.detach() or p.data)")


#: The optimizer's state-format arguments: accepted in a group when they repeat the optimizer's.
STATE_FORMAT_KEYS = ("state_mode", "store_param_remainders", "exp_avg_dtype", "exp_avg_sq_dtype")
#: torch.optim.AdamW's group flags and the values halfadam accepts: the algorithm flags at "off" (what
#: halfadam does; any other value asks for an algorithm it does not implement), the kernel hints
#: ``foreach`` and ``fused`` at None, False or True (torchtitan passes ``fused=True, foreach=False``):
#: every halfadam implementation computes the same bits, ``implementation=`` chooses one, and its
#: default ``"auto"`` already runs one kernel per bucket, so a hint changes nothing. Other keys a group
#: holds are the user's (timm's ``lr_scale``, a ``layer_id``...): kept untouched, as torch keeps them.
TORCH_FLAGS_ACCEPTED = {"amsgrad": (False,), "maximize": (False,), "capturable": (False,), "differentiable": (False,),
                        "foreach": (None, False, True), "fused": (None, False, True)}


def check_torch_flags(flags: Dict[str, Any], where: str) -> None:
    """ValueError for a torch.optim.AdamW flag of ``flags`` at a value halfadam does not accept
    (:data:`TORCH_FLAGS_ACCEPTED`), or ``foreach`` and ``fused`` both True (torch's error); ``where`` +
    key names it: ``param_groups[0]['fused']`` or ``AdamW(fused=...)``."""
    def name(key: str) -> str:
        return f"{where}['{key}']" if where.startswith("param_groups") else f"{where}({key}=...)"

    for key, off in TORCH_FLAGS_ACCEPTED.items():
        if key in flags and not any(flags[key] is v for v in off):
            hint = " (choose the execution with implementation=...)" if key in ("foreach", "fused") else ""
            accepted = " or ".join(repr(v) for v in off)
            raise ValueError(f"{name(key)}={flags[key]!r} is not supported by halfadam{hint}; only "
                             f"{accepted} is accepted")
    if flags.get("foreach") is True and flags.get("fused") is True:  # torch.optim.AdamW refuses it too
        raise ValueError(f"{name('fused')} and {name('foreach')} cannot be True together (torch.optim.AdamW refuses it too)")


def check_group_keys(group: Dict[str, Any], where: str, own: Tuple[str, ...] = ()) -> None:
    """Reject torch flags halfadam does not implement (but the rule's ``own`` keys: SGD's ``maximize``),
    and halfadam's own keys of the wrong type."""
    check_torch_flags({k: v for k, v in group.items() if k not in own} if own else group, where)
    if "master_weights" in group and group["master_weights"] is not None and not isinstance(
            group["master_weights"], bool):
        raise TypeError(f"{where}['master_weights'] must be None, True or False, got {group['master_weights']!r}")
    if "optimized_update" in group and not isinstance(group["optimized_update"], bool):
        raise TypeError(f"{where}['optimized_update'] must be True or False, got {group['optimized_update']!r}")
    if "decay" in group and group["decay"] not in DECAY_MODES:
        raise ValueError(f"{where}['decay'] must be one of {DECAY_MODES}, got {group['decay']!r}")
    gs = group.get("global_step", 0)
    if isinstance(gs, bool) or not isinstance(gs, int):
        raise TypeError(f"{where}['global_step'] must be an int, got {gs!r}")
    if gs < 0:
        raise ValueError(f"{where}['global_step'] must be >= 0, got {gs}")
    for key in ("lr_schedule", "weight_decay_schedule"):
        if group.get(key) is not None and not callable(group[key]):
            raise TypeError(f"{where}['{key}'] must be None or a callable of the global step, got {group[key]!r}")


def check_step_keys(group: Dict[str, Any], where: str, valid: Dict[int, Tuple[Any, ...]],
                    parsers: Dict[str, Any], required: Tuple[str, ...]) -> None:
    """:func:`check_group_keys` plus the rule's own keys (``parsers``: each parsed, Adam's ``betas`` and
    ``eps``; ``required``: present), for a group about to step.

    ``param_groups`` is public and may be written between steps; the step checks every group with
    this before any group steps, so a bad value raises the constructor's TypeError/ValueError
    (naming ``where`` and the key) with nothing changed. ``valid`` (the optimizer's) keeps, per
    ``id(group)``, the values last found valid, so an unchanged group costs one comparison.
    """
    current = tuple(group.get(k) for k in (*required, *parsers, "master_weights", "global_step"))
    last = valid.get(id(group))
    if last is not None and all(a is b or (type(a) is type(b) and a == b) for a, b in zip(last, current)):
        return
    check_group_keys(group, where, tuple(parsers))
    for name in required:
        if name not in group:
            raise ValueError(f"{where} has no '{name}' key (it was deleted from the group?)")
    for name, parse in parsers.items():
        if name in group:
            parse(group[name], f"{where}['{name}']")
    valid[id(group)] = current


def check_disjoint(groups: List[Dict[str, Any]]) -> None:
    """Each parameter once: in one group, once in it (ValueError naming both places otherwise)."""
    seen: Dict[int, str] = {}
    for gi, g in enumerate(groups):
        for j, p in enumerate(g["params"]):
            here = f"param_groups[{gi}]['params'][{j}]"
            if id(p) in seen:
                raise ValueError(f"{here} is the same tensor as {seen[id(p)]}: a parameter may appear once, not "
                                 f"twice in a group nor in more than one parameter group (it would be updated "
                                 f"twice per step)")
            seen[id(p)] = here
    check_no_overlap(groups)


def _extent(p: Tensor) -> Optional[Tuple[int, int, int]]:
    """``(storage address, first byte, end byte)`` of the memory ``p``'s elements span, or ``None``
    for a tensor with no memory of its own to compare (empty, meta, a DTensor or other subclass)."""
    if p.numel() == 0 or p.is_meta or type(p) not in (Tensor, torch.nn.Parameter):
        return None
    try:
        base = p.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    size = p.element_size()
    last = p.storage_offset() + sum((n - 1) * st for n, st in zip(p.shape, p.stride()))
    return base, p.storage_offset() * size, (last + 1) * size


def _offsets(p: Tensor) -> Tensor:
    """The storage offsets (in bytes) of every element of ``p``, as an int64 tensor."""
    index = torch.zeros((), dtype=torch.int64).add_(p.storage_offset())
    for n, st in zip(p.shape, p.stride()):
        index = index.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * st
    return index.flatten() * p.element_size()


def check_no_overlap(groups: List[Dict[str, Any]]) -> None:
    """ValueError naming both parameters when two of them share memory (a view of another
    parameter): each step would update the shared elements twice. Disjoint views of one storage
    (a flattened buffer's slices, interleaved strided views) are accepted."""
    spans = []
    for gi, g in enumerate(groups):
        for j, p in enumerate(g["params"]):
            extent = _extent(p)
            if extent is not None:
                spans.append((*extent, len(spans), f"param_groups[{gi}]['params'][{j}]", p))
    spans.sort(key=lambda s: s[:2])
    for k, (base, start, end, n, here, p) in enumerate(spans):
        for base2, start2, _, n2, there, q in spans[k + 1:]:
            if base2 != base or start2 >= end:
                break
            if (p.is_contiguous() and q.is_contiguous()) or bool(torch.isin(_offsets(q), _offsets(p)).any()):
                first, second = (here, there) if n < n2 else (there, here)
                raise ValueError(f"{second} shares memory with {first} (a view of it?): its shared elements "
                                 f"would be updated twice per step; pass parameters that do not overlap")


def check_param(p: Any, where: str) -> None:
    if not isinstance(p, Tensor):
        raise TypeError(f"{where} must be a tensor (a parameter) or a dict, got {type(p).__name__}")
    if not p.is_floating_point():
        raise TypeError(f"{where} must be a floating-point tensor, got dtype {p.dtype}")
    if p.is_sparse:
        raise TypeError(f"{where} is a sparse tensor; sparse parameters are not supported")
    if p.is_inference():
        raise ValueError(f"{where} is an inference tensor (made under torch.inference_mode()), which cannot be "
                         f"updated in place outside it; make the parameter outside inference mode")
    if not (p.is_leaf or p.retains_grad):
        raise ValueError(f"{where} is a non-leaf tensor; optimizers update leaf tensors only")
    check_writable(p, where)


def check_writable(p: Tensor, where: str) -> None:
    """A parameter whose elements share memory (an ``expand``-ed tensor: stride 0) cannot be updated in place."""
    if not p.is_contiguous() and any(st == 0 and n > 1 for st, n in zip(p.stride(), p.shape)):
        raise ValueError(f"{where} (shape {tuple(p.shape)}, stride {p.stride()}) has elements that share memory "
                         f"(an expand()-ed tensor?); it cannot be updated in place: pass a contiguous copy")


def check_pairs(pairs: List[Tuple[Tensor, Any]], params: List[Tensor], where: str) -> None:
    """:func:`check_grad` and :func:`check_writable` for every ``(param, grad)`` pair of a group.

    With the C++ kernel loaded (:mod:`halfadam.kernels.cpp`) one call checks them all and the Python
    checks run only to name what it rejected; without it, they run pair by pair.
    """
    kernel = cpu_kernel.loaded()
    if kernel is not None and len(pairs) > 8 and not torch.compiler.is_compiling():
        try:
            if kernel.first_invalid([p for p, _ in pairs], [g for _, g in pairs]) < 0:
                return
        except TypeError:  # a gradient that is not a tensor: the Python checks name it
            pass
    index = {id(p): j for j, p in enumerate(params)} if pairs else {}
    for p, g in pairs:
        j = index[id(p)]
        check_grad(g, p, f"gradient of {where}['params'][{j}]")
        check_writable(p, f"{where}['params'][{j}]")


def check_grad(g: Any, p: Tensor, where: str) -> None:
    if not isinstance(g, Tensor):
        raise TypeError(f"{where} must be a tensor, got {type(g).__name__}")
    if g.is_sparse:
        raise TypeError(f"{where} is sparse; halfadam does not support sparse gradients")
    if not g.is_floating_point():
        raise TypeError(f"{where} must be floating point, got dtype {g.dtype}")
    if g.shape != p.shape:
        raise ValueError(f"{where} has shape {tuple(g.shape)}, its parameter has {tuple(p.shape)}")
    if g.device != p.device:
        raise ValueError(f"{where} is on {g.device}, its parameter on {p.device}")


def split_params(params: Any) -> Tuple[List[Dict[str, Any]], Optional[List[Tensor]]]:
    """Turn ``params`` into a list of group dicts and the ``order_params`` list (or ``None``)."""
    if isinstance(params, (set, frozenset)):
        raise TypeError("params must be an ordered collection (a list, a generator); a set has no fixed order, "
                        "and the optimizer's state and checkpoints follow the parameters' order")
    if isinstance(params, Tensor) or not hasattr(params, "__iter__"):
        raise TypeError(
            f"params must be an iterable of tensors or of dicts, got {type(params).__name__}"
        )
    items = list(params)
    if not items:
        raise ValueError("params is empty: the optimizer got no parameters")
    tensors, groups, order_params = [], [], None
    for i, item in enumerate(items):
        if isinstance(item, dict):
            if "order_params" in item:
                if order_params is not None:
                    raise ValueError(f"params[{i}]: order_params given more than once")
                order_params = list(item["order_params"])
            else:
                groups.append(item)
        elif isinstance(item, Tensor) or is_named(item):
            tensors.append(item)
        else:
            raise TypeError(f"params[{i}] must be a tensor (a parameter), a (name, parameter) pair or a dict, "
                            f"got {type(item).__name__}")
    if tensors and groups:
        raise TypeError("params mixes tensors and dicts: give a list of parameters or a list of group dicts")
    if tensors:
        groups = [{"params": tensors}]
    if not groups:
        raise ValueError("params holds order_params but no parameter group")
    return groups, order_params


def is_named(item: Any) -> bool:
    """A ``(name, parameter)`` pair, as ``model.named_parameters()`` yields."""
    return isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)


def check_order_params(order: Optional[List[Any]], groups: List[Dict[str, Any]]) -> None:
    """``order_params`` must hold exactly the groups' parameters, each once."""
    if order is None:
        return
    in_groups = {id(p) for g in groups for p in g["params"]}
    seen = set()
    for i, p in enumerate(order):
        if not isinstance(p, Tensor):
            raise TypeError(f"order_params[{i}] must be a tensor, got {type(p).__name__}")
        if id(p) in seen:
            raise ValueError(f"order_params[{i}] (shape {tuple(p.shape)}) appears more than once")
        if id(p) not in in_groups:
            raise ValueError(f"order_params[{i}] (shape {tuple(p.shape)}) is in no parameter group")
        seen.add(id(p))
    for gi, g in enumerate(groups):
        for j, p in enumerate(g["params"]):
            if id(p) not in seen:
                raise ValueError(f"param_groups[{gi}]['params'][{j}] (shape {tuple(p.shape)}) is missing from order_params")


def normalize_group(group: Dict[str, Any], state_format: StateFormat, where: str,
                    parsers: Dict[str, Any]) -> Dict[str, Any]:
    """Validate one parameter group and turn its hyperparameters into their stored form.

    ``learning_rate`` becomes ``lr``; ``params`` a list (``param_names`` beside it for ``(name, param)``
    pairs); ``lr``/``weight_decay`` a value and a schedule (``<key>_schedule``); the state-format keys
    (:data:`STATE_FORMAT_KEYS`) are dropped once they are found to repeat ``state_format``, the
    optimizer's. Raises TypeError/ValueError naming the group (``where``) and key; nothing is built
    before every group has passed.
    """
    group = dict(group)
    if "learning_rate" in group:
        if "lr" in group:
            raise TypeError(f"{where} gives both 'lr' and 'learning_rate'")
        group["lr"] = group.pop("learning_rate")
    if "params" not in group:
        raise ValueError(f"{where} has no 'params' key")
    # The state format is the optimizer's; a group may repeat it (ZeroRedundancyOptimizer copies
    # the constructor's keyword arguments into every group) but not change it.
    format_keys = {k: group.pop(k) for k in STATE_FORMAT_KEYS if k in group}
    if format_keys:
        try:
            fmt = encodings.state_format(**format_keys)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{where}: {exc}") from None
        if fmt.for_rule(state_format.moments) != state_format:
            raise ValueError(f"{where} asks for the state format {fmt.describe()}, this optimizer has "
                             f"{state_format.describe()}: the state format is per optimizer, not per group")
    check_group_keys(group, where, tuple(parsers))
    params = group["params"]
    if isinstance(params, Tensor):
        params = [params]
    elif isinstance(params, set):
        raise TypeError(f"{where}['params'] must be an ordered collection of tensors, not a set")
    else:
        params = list(params)
    named = [is_named(p) for p in params]
    if any(named):
        if not all(named):
            raise ValueError(f"{where}['params'] mixes (name, parameter) pairs and bare parameters")
        group["param_names"] = [name for name, _ in params]
        params = [p for _, p in params]
    for j, p in enumerate(params):
        check_param(p, f"{where}['params'][{j}]")
    group["params"] = params
    # A group that already holds "<key>_schedule" is in stored form (normalized before).
    if "lr" in group and "lr_schedule" not in group:
        group["lr"], group["lr_schedule"] = hyperparams.parse_lr(group["lr"], f"{where}['lr']")
    if "weight_decay" in group and "weight_decay_schedule" not in group:
        group["weight_decay"], group["weight_decay_schedule"] = hyperparams.parse_weight_decay(
            group["weight_decay"], f"{where}['weight_decay']"
        )
    for name, parse in parsers.items():  # the rule's own keys (Adam's betas and eps)
        if name in group:
            group[name] = parse(group[name], f"{where}['{name}']")
    return group
