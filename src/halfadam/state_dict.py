"""The optimizer's state_dict: its layout, loading it (checked, then committed), torch interop.

State (:func:`optimizer_state_dict`, :func:`load_optimizer_state_dict`; what
``AdamW.state_dict()`` / ``load_state_dict()`` call). The state_dict has torch's layout::

    {"state": {index: {"step": 0-d float32 tensor,
                       "master_weight": float32 tensor (only where the parameter has one),
                       "exp_avg": float32 tensor, "exp_avg_sq": float32 tensor}},
                       # other state modes store their encodings instead (halfadam.encodings):
                       # "master_hi" int8 + "master_lo" uint8 + "master_tie" uint8 per block (split master,
                       #   with "remainder_dtype": {dtype name: 1}, the parameter dtype its remainders are over),
                       # bfloat16 moments, or uint8 moments + "exp_avg_scale"/"exp_avg_sq_exponent"
                       #   (with "step" a dict: encodings.CODES_LABEL, and the count under "halfadam_step")
     "param_groups": [{"lr", "betas", "eps", "weight_decay", "lr_schedule", "weight_decay_schedule",
                       "decay", "optimized_update", "master_weights", "global_step", "params": [index, ...]}]}

(float64 instead of float32 for float64 parameters). That is AdamW's; every optimizer of the engine
keeps its update rule's moments (``optimizer.state_format.moments``: :class:`halfadam.SGD`'s
``momentum_buffer``, none when built with momentum 0; :class:`halfadam.Lion`'s ``exp_avg``), encoded the
same way (a signed moment's per-block key is ``<key>_scale``), and its rule's group keys
(``optimizer._parsers``, ``_required``: SGD's ``momentum``, ``dampening``, ``nesterov``, ``maximize``;
Lion's ``betas``) in place of Adam's. A checkpoint loads into an optimizer of its rule only.
``global_step`` is the position of the group's schedules, which are functions of it; a schedule object is
saved *by value* as plain data (``{"__schedule__": "module:Class", "attrs": {...}}`` for a plain Python
object such as the classes of :mod:`halfadam.schedules` and ``PerStepValues``; ``{"__schedule__": ...,
"state_dict": ...}`` for an object with ``state_dict()``/``load_state_dict()``); a schedule that cannot
be saved as data (a lambda, a closure) is recorded by name only and the optimizer loading the checkpoint
must have been built with one. The whole state_dict is therefore made of tensors, numbers, strings,
lists, tuples and dicts: ``torch.save`` it and ``torch.load(..., weights_only=True)`` reads it back.

A state_dict records each parameter's encoding in its keys and dtypes: loading one saved in another
state mode decodes it and encodes it in the loading optimizer's (a split master against the
parameter's current value: load the model first); the same mode loads bit for bit.

Loading never changes a state tensor's dtype (float32 state stays float32 for float16/bfloat16
parameters; ``torch.optim.Optimizer.load_state_dict`` would cast it to float16) and is atomic: every
count, key, shape, dtype and hyperparameter is checked first; on a mismatch :class:`CheckpointError`
names the parameter index and what differs, and the optimizer is left exactly as it was. Values are
then copied *into* the optimizer's state tensors (created through its state layer,
:class:`halfadam.state.ParamStates`), moving to the parameter's device. The state_dict of the
optimizer's counterpart outside halfadam loads too (``torch.optim.Adam``/``AdamW``, ``torch.optim.SGD``,
lucidrains' or optimi's ``Lion``: the optimizer's ``_torch_*`` hooks say how it looks; its moments are
upcast to float32, exactly; the master weights are rebuilt from the parameters with a warning), and
:func:`to_torch_state_dict` writes one.

This module sits below :mod:`halfadam.optimizer` (whose ``state_dict``/``load_state_dict`` call it) and
never imports it: it works on any optimizer with halfadam's groups and state layer
(``optimizer._states``).
:mod:`halfadam.checkpoint` re-exports everything public here.
"""

from __future__ import annotations

import copy
import importlib
import math
import numbers
import warnings
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import encodings, hyperparams
from ._dtensor import flat_offset, like_param, local
from .param_groups import check_group_keys
from .state import REMAINDER_DTYPE
from .state_checks import readable

__all__ = ["CheckpointError", "encode_schedule", "decode_schedule", "optimizer_state_dict",
           "load_optimizer_state_dict", "to_torch_state_dict", "master_state_dict"]

_HALF_DTYPES = (torch.float16, torch.bfloat16)
_SCHEDULE_KEYS = ("lr_schedule", "weight_decay_schedule")
#: The group keys of every halfadam optimizer (beside its rule's: the optimizer's ``_parsers`` and ``_required``).
_ENGINE_KEYS = ("params", "param_names", "lr", "weight_decay", *_SCHEDULE_KEYS, "master_weights", "global_step")
#: Modules whose schedule classes a checkpoint may name without the loading optimizer holding one.
_TRUSTED_SCHEDULE_MODULES = ("halfadam.",)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded (unreadable, corrupt, or not matching what it is loaded into)
    or written; public as ``halfadam.CheckpointError``.

    Raised with nothing changed (the message names the object, the parameter index or key, the file,
    and what differs). A ``ValueError``, so code that catches torch's ``ValueError`` on load still
    does; the DCP helpers of :mod:`halfadam.distributed` raise it with DCP's ``CheckpointException``
    (a ``BaseException``, which ``except Exception`` misses) as its ``__cause__``.
    """


# ============================================================================ schedules
def _class_ref(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _importable(cls: type) -> bool:
    if "<locals>" in cls.__qualname__:
        return False
    try:
        obj: Any = importlib.import_module(cls.__module__)
        for part in cls.__qualname__.split("."):
            obj = getattr(obj, part)
    except Exception:
        return False
    return obj is cls


def _is_plain(value: Any) -> bool:
    """Data ``torch.load(weights_only=True)`` reads back: numbers, strings, tensors and containers of them."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, Tensor, torch.dtype)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return False


def _plain_object(obj: Any) -> bool:
    """An instance whose whole state is a ``__dict__`` of plain data (pickle's default protocol)."""
    cls = type(obj)
    return (
        isinstance(getattr(obj, "__dict__", None), dict)
        and not hasattr(cls, "__slots__")
        and cls.__reduce_ex__ is object.__reduce_ex__
        and cls.__reduce__ is object.__reduce__
        and getattr(cls, "__getstate__", object.__getstate__) is getattr(object, "__getstate__", None)
        and getattr(cls, "__setstate__", None) is None
        and cls.__new__ is object.__new__
        and _importable(cls)
        and _is_plain(vars(obj))
    )


def encode_schedule(schedule: Any) -> Optional[dict]:
    """A schedule (callable of the global step) as plain data; ``None`` stays ``None``.

    * an object with ``state_dict()`` and ``load_state_dict()``: ``{"__schedule__": "module:Class",
      "state_dict": schedule.state_dict()}``;
    * a plain Python object (importable class, state in ``__dict__`` of numbers, strings, lists...;
      :mod:`halfadam.schedules`, ``PerStepValues``): ``{"__schedule__": ..., "attrs": {...}}``;
    * anything else (a lambda, a closure, a ``functools.partial``): ``{"__schedule__": ...,
      "repr": repr(schedule)}``, not saved by value.
    """
    if schedule is None:
        return None
    entry: Dict[str, Any] = {"__schedule__": _class_ref(type(schedule))}
    if callable(getattr(schedule, "state_dict", None)) and callable(getattr(schedule, "load_state_dict", None)):
        entry["state_dict"] = schedule.state_dict()
    elif _plain_object(schedule):
        entry["attrs"] = copy.deepcopy(dict(vars(schedule)))
    else:
        entry["repr"] = repr(schedule)
    return entry


def _import_schedule_class(ref: str, where: str) -> type:
    module, _, qualname = ref.partition(":")
    if not module.startswith(_TRUSTED_SCHEDULE_MODULES):
        raise CheckpointError(
            f"{where}: the checkpoint's schedule is a {ref}; build the optimizer with a schedule of that "
            f"class before loading (its saved attributes then replace the new one's)"
        )
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except Exception:
        raise CheckpointError(f"{where}: the checkpoint's schedule class {ref} does not exist here") from None
    if not isinstance(obj, type):
        raise CheckpointError(f"{where}: {ref} is not a class")
    return obj


def decode_schedule(entry: Any, current: Any, where: str) -> Any:
    """The schedule an :func:`encode_schedule` entry stands for (a new object; ``current`` is not changed).

    ``current`` is the loading optimizer's schedule for the same key: its class is used for an entry of
    the same class, and it is kept for an entry that was not saved by value.

    Raises:
        CheckpointError: a malformed entry; an entry not saved by value (or restored through
            ``load_state_dict``) while ``current`` is ``None`` or of another class; a class outside
            halfadam that ``current`` is not an instance of.
    """
    if entry is None:
        return None
    if not isinstance(entry, Mapping) or not isinstance(entry.get("__schedule__"), str):
        raise CheckpointError(f"{where}: expected None or a saved schedule (a dict with '__schedule__'), got {entry!r}")
    ref = entry["__schedule__"]
    same_class = current is not None and _class_ref(type(current)) == ref
    try:
        if "state_dict" in entry:
            if not same_class:
                raise CheckpointError(
                    f"{where}: the checkpoint's schedule is a {ref} restored through load_state_dict(); "
                    f"build the optimizer with a schedule of that class before loading"
                )
            schedule = copy.deepcopy(current)
            schedule.load_state_dict(copy.deepcopy(entry["state_dict"]))
            return schedule
        if "attrs" in entry:
            if not isinstance(entry["attrs"], Mapping):
                raise CheckpointError(f"{where}: the saved schedule's 'attrs' is not a dict")
            cls = type(current) if same_class else _import_schedule_class(ref, where)
            schedule = cls.__new__(cls)
            schedule.__dict__.update(copy.deepcopy(dict(entry["attrs"])))
            return schedule
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{where}: cannot restore the saved {ref} schedule: {exc}") from None
    if current is None:
        raise CheckpointError(
            f"{where}: the checkpoint's schedule {entry.get('repr', ref)} could not be saved by value "
            f"(a lambda or closure?); build the optimizer with the same schedule before loading"
        )
    return current


# ============================================================================ optimizer state
def optimizer_state_dict(optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """The state of a halfadam optimizer, in torch's layout (see the module docstring).

    Per parameter: ``step`` (0-d float32), the rule's moments (AdamW's ``exp_avg`` and ``exp_avg_sq``,
    SGD's ``momentum_buffer``, Lion's ``exp_avg``; float32, float64 for
    float64 parameters) and ``master_weight`` (float32) where the parameter has one; parameters that
    never took a step have no entry. Where the moments are 8-bit codes (uint8: state modes
    ``compact``, ``tiny``), ``step`` is a label, the dict :data:`halfadam.encodings.CODES_LABEL` with the
    count under ``halfadam_step``: ``torch.optim.Adam``/``AdamW.load_state_dict`` of it raises
    ``TypeError: float() argument must be a string or a real number, not 'dict'`` instead of
    stepping with the codes as moments (:func:`to_torch_state_dict` gives torch's). Per group: every
    hyperparameter, ``global_step`` (int) and the schedules as plain data. The tensors are the optimizer's own (not copies), as in torch: clone them
    (or ``torch.save``) before the next step if you keep the dict. Masters are synced with their
    parameters first (:meth:`halfadam.AdamW.sync_master_weights`). Keys that
    ``register_state_dict_post_hook`` hooks add, or the dict such a hook returns, are kept.
    """
    optimizer.sync_master_weights()  # masters of parameters written since the last step take their values
    packed = torch.optim.Optimizer.state_dict(optimizer)  # runs the state_dict pre/post hooks
    if isinstance(packed, dict) and isinstance(packed.get("param_groups"), list):
        packed["param_groups"] = [
            {k: encode_schedule(v) if k in _SCHEDULE_KEYS else v for k, v in group.items()}
            for group in packed["param_groups"]]
        state = packed.get("state")
        for group, saved in zip(optimizer.param_groups, packed["param_groups"]):
            for p, pid in zip(group["params"], saved.get("params", ())):
                st = state.get(pid) if isinstance(state, dict) else None
                if not isinstance(st, Mapping):
                    continue
                new = encodings.labelled(st)  # a new dict where it changes: the live state stays as it is
                if encodings.has_remainder(st):
                    new = {**new, REMAINDER_DTYPE: {_dtype_name(p.dtype): 1}}
                if new is not st:
                    state[pid] = new
    return packed


def _remainder_dtype(value: Any, where: str) -> Optional[str]:
    """The dtype name a :data:`REMAINDER_DTYPE` entry holds (None: none saved)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and len(value) == 1 and next(iter(value)) in ("float16", "bfloat16"):
        return next(iter(value))
    raise CheckpointError(f"{where}: {REMAINDER_DTYPE} must be {{'float16': 1}} or {{'bfloat16': 1}}, got {value!r}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class _ParamLoad:
    param: Tensor
    group_index: int
    index: int
    values: Dict[str, Tensor]
    step: float
    rebuild_master: bool
    format: encodings.StateFormat  # the checkpoint's encoding of this parameter's state


@dataclass
class _LoadPlan:
    groups: List[Dict[str, Any]]
    loads: List[_ParamLoad]
    clear: List[Tensor]
    warnings: List[str] = field(default_factory=list)


def _where(index: int, gi: int, j: int, p: Tensor) -> str:
    return f"parameter {index} (param_groups[{gi}]['params'][{j}], shape {tuple(p.shape)}, {p.dtype})"


def _group_kind(optimizer: torch.optim.Optimizer, group: Mapping[str, Any], gi: int) -> str:
    """"halfadam" (a group with ``global_step``) or "torch" (one of the optimizer's counterpart outside
    halfadam: ``optimizer._torch_keys``); CheckpointError naming its keys otherwise."""
    if "global_step" in group:
        return "halfadam"
    if any(all(k in group for k in keys) for keys in optimizer._torch_keys):  # type: ignore[attr-defined]
        return "torch"
    raise CheckpointError(
        f"param_groups[{gi}] in the checkpoint is neither a halfadam group nor a "
        f"{optimizer._torch_name} one (keys {sorted(k for k in group if k != 'params')})"  # type: ignore[attr-defined]
    )


def _rule_keys(optimizer: torch.optim.Optimizer) -> Tuple[str, ...]:
    """The group keys of ``optimizer``'s rule (Adam's ``betas``, ``eps``, ``decay``, ``optimized_update``)."""
    return tuple(dict.fromkeys((*optimizer._parsers, *optimizer._required)))  # type: ignore[attr-defined]


def _check_rule(optimizer: torch.optim.Optimizer, saved_groups: Sequence[Mapping[str, Any]]) -> None:
    """CheckpointError where a halfadam checkpoint's group lacks a key of ``optimizer``'s rule: it was
    written by an optimizer of another rule (an AdamW's loaded into an SGD); the message names the keys
    this optimizer's groups hold and those the checkpoint's hold instead."""
    own = _rule_keys(optimizer)
    for gi, group in enumerate(saved_groups):
        missing = [k for k in own if k not in group]
        if missing:
            other = sorted(k for k in group if k not in own and k not in _ENGINE_KEYS)
            rule = optimizer.rule.name  # type: ignore[attr-defined]
            raise CheckpointError(
                f"param_groups[{gi}] in the checkpoint has no {missing}, which every group of this "
                f"{type(optimizer).__name__} holds (its update rule {rule!r} keeps {list(own)}); it holds "
                f"{other} instead: it was written by another optimizer (load it into one of that class)")


def _check_number(value: Any, where: str, *, allow_tensor: bool = True) -> float:
    if isinstance(value, Tensor) and allow_tensor:
        if value.numel() != 1:
            raise CheckpointError(f"{where} must be a number, got a tensor of shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise CheckpointError(f"{where} must be a number, got {type(value).__name__}: {value!r}")
    return float(value)


def _check_step(value: Any, where: str) -> float:
    step = _check_number(value, where)
    if not (math.isfinite(step) and step >= 0 and step == int(step)):
        raise CheckpointError(f"{where} must be a whole number >= 0, got {step}")
    return step


def _merge_group(optimizer: torch.optim.Optimizer, current: Dict[str, Any], saved: Mapping[str, Any], kind: str,
                 gi: int) -> Tuple[Dict[str, Any], List[str]]:
    """The group after loading: the checkpoint's hyperparameters over the current group's, validated as a
    step validates a group (``optimizer``'s rule's parsers and options); and the warnings to give (a
    torch checkpoint's that ``optimizer._from_torch_group`` finds)."""
    where = f"param_groups[{gi}]"
    new = {k: v for k, v in current.items() if k != "params"}
    # master_weights is structure (which parameters own an fp32 copy, how state is laid out), not a
    # hyperparameter: the loading optimizer's setting stays, and the state must fit it.
    # the group's own param_names stay (the state was matched to them by name, _by_name); a group
    # without names takes the checkpoint's, as torch does
    kept = ("params", "master_weights") + (("param_names",) if "param_names" in current else ())
    saved = {k: v for k, v in saved.items() if k not in kept}
    notes: List[str] = []
    try:
        if kind == "torch":  # the rule's keys and the user's, the counterpart's flags dropped
            saved, notes = optimizer._from_torch_group(saved, current, where)  # type: ignore[attr-defined]
        else:
            for key in _SCHEDULE_KEYS:
                if key in saved:
                    saved[key] = decode_schedule(saved[key], current.get(key), f"{where}['{key}']")
        new.update(saved)
        gs = new.get("global_step")
        if isinstance(gs, bool) or not isinstance(gs, numbers.Integral) or gs < 0:
            raise CheckpointError(f"{where}['global_step'] must be an int >= 0, got {gs!r}")
        check_group_keys(new, where, tuple(optimizer._parsers))  # type: ignore[attr-defined]
        for key, parse in optimizer._parsers.items():  # type: ignore[attr-defined]
            new[key] = parse(new[key], f"{where}['{key}']")
        for key in ("lr", "weight_decay"):
            value = new[key]
            if isinstance(value, Tensor):
                if value.numel() != 1 or not value.is_floating_point():
                    raise CheckpointError(f"{where}['{key}'] must be a number or a 1-element float tensor")
                hyperparams.check_value(value.item(), f"{where}['{key}']")
            else:
                hyperparams.check_value(_check_number(value, f"{where}['{key}']"), f"{where}['{key}']")
        optimizer._options(new, where)  # type: ignore[attr-defined]  # the rule's own checks (SGD's nesterov...)
    except CheckpointError:
        raise
    except (TypeError, ValueError, KeyError) as exc:
        message = str(exc)
        raise CheckpointError(message if message.startswith(where) else f"{where}: {message}") from None
    return new, notes


def _prepare_load(optimizer: torch.optim.Optimizer, state_dict: Any) -> _LoadPlan:
    """Check ``state_dict`` against ``optimizer`` completely; change nothing. Raises CheckpointError."""
    saved_groups, saved_state, kind = _check_structure(optimizer, state_dict)
    slots = _slots(optimizer.param_groups, saved_groups, saved_state)
    merged = [_merge_group(optimizer, g, s, kind, gi)
              for gi, (g, s) in enumerate(zip(optimizer.param_groups, saved_groups))]
    new_groups = [group for group, _ in merged]
    plan = _LoadPlan(groups=new_groups, loads=[], clear=[])
    plan.warnings += ([note for _, notes in merged for note in notes] if kind == "torch"
                      else _decay_warnings(optimizer, new_groups))
    for pid, (p, gi, j, index) in slots.items():
        saved = saved_state.get(pid)
        if kind == "torch":
            saved = _torch_entry(optimizer, saved)
        if saved is None:
            plan.clear.append(p)
        else:
            plan.loads.append(_param_load(optimizer, p, new_groups[gi], saved, kind, _where(index, gi, j, p), gi,
                                          index))
    if kind == "torch":  # torch has no global step: the optimizer's steps are its parameters' most (0: none)
        for gi, group in enumerate(plan.groups):
            group["global_step"] = int(max([load.step for load in plan.loads if load.group_index == gi], default=0))
    cleared = {id(p) for p in plan.clear}
    dropped = [index for pid, (p, gi, j, index) in slots.items() if id(p) in cleared and optimizer.state.get(p)]
    if dropped:
        plan.warnings.append(
            f"parameter(s) {dropped[:10]}{'...' if len(dropped) > 10 else ''} have no state in the checkpoint (a "
            f"parameter that never took a step there): their moments and step counts are reset, as torch.optim does")
    _check_schedules(plan.groups)
    rebuilt = [load.index for load in plan.loads if load.rebuild_master]
    if rebuilt:
        source = (f"a {optimizer._torch_name} checkpoint" if kind == "torch"  # type: ignore[attr-defined]
                  else "a checkpoint written without master weights")
        plan.warnings.append(
            f"master weights rebuilt from the current parameter values for parameter(s) {rebuilt} ({source} has "
            f"none); load the model's weights before the optimizer's"
        )
    return plan


def _check_structure(optimizer: torch.optim.Optimizer, state_dict: Any) -> Tuple[list, Mapping, str]:
    """``(saved param_groups, saved state, kind)`` of a state_dict whose layout fits ``optimizer``'s groups
    (a dict with 'state' and 'param_groups', as many groups, all of one kind: "halfadam" or "torch" (the
    optimizer's counterpart's), a halfadam one of the optimizer's rule: :func:`_check_rule`)."""
    groups = optimizer.param_groups
    if not isinstance(state_dict, Mapping) or "state" not in state_dict or "param_groups" not in state_dict:
        raise CheckpointError("an optimizer state_dict must be a dict with 'state' and 'param_groups'")
    saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
    if not isinstance(saved_groups, (list, tuple)) or not all(isinstance(g, Mapping) for g in saved_groups):
        raise CheckpointError("the state_dict's 'param_groups' must be a list of dicts")
    if not isinstance(saved_state, Mapping):
        raise CheckpointError("the state_dict's 'state' must be a dict")
    if len(saved_groups) != len(groups):
        raise CheckpointError(
            f"the checkpoint has {len(saved_groups)} parameter group(s), this optimizer has {len(groups)}"
        )
    kinds = [_group_kind(optimizer, g, gi) for gi, g in enumerate(saved_groups)]
    if len(set(kinds)) > 1:
        raise CheckpointError("the checkpoint mixes halfadam and torch.optim parameter groups")
    if kinds and kinds[0] == "halfadam":
        _check_rule(optimizer, saved_groups)
    return saved_groups, saved_state, kinds[0] if kinds else "halfadam"


def _torch_entry(optimizer: torch.optim.Optimizer, saved: Any) -> Any:
    """A parameter's entry of a torch checkpoint as halfadam reads it: without the keys that
    ``optimizer._torch_dropped`` names (optimi's ``kahan_comp``) and the ``None`` values (an older
    torch.optim.SGD's ``momentum_buffer`` at momentum 0: none made); ``None`` (no state) where nothing
    is left of it."""
    if not isinstance(saved, Mapping) or not saved:
        return saved
    entry = {k: v for k, v in saved.items()
             if v is not None and k not in optimizer._torch_dropped}  # type: ignore[attr-defined]
    return entry or None


def _slots(groups: List[Dict[str, Any]], saved_groups: list,
           saved_state: Mapping) -> Dict[Any, Tuple[Tensor, int, int, int]]:
    """Saved index -> ``(parameter, group index, index in the group, index overall)``, by name or by
    position (:func:`_by_name`); CheckpointError where the groups' sizes differ, an index repeats or has no group."""
    slots: Dict[Any, Tuple[Tensor, int, int, int]] = {}
    index = 0
    for gi, (group, saved) in enumerate(zip(groups, saved_groups)):
        ids = saved.get("params")
        if not isinstance(ids, (list, tuple)):
            raise CheckpointError(f"param_groups[{gi}]['params'] in the checkpoint must be a list of indices")
        if len(ids) != len(group["params"]):
            raise CheckpointError(
                f"param_groups[{gi}] has {len(ids)} parameter(s) in the checkpoint, {len(group['params'])} in "
                f"this optimizer"
            )
        for j, (pid, p) in enumerate(zip(_by_name(ids, group, saved, gi), group["params"])):
            if pid in slots:
                raise CheckpointError(f"param_groups[{gi}]['params'][{j}]: index {pid!r} appears twice in the "
                                      f"checkpoint")
            slots[pid] = (p, gi, j, index)
            index += 1
    stray = [k for k in saved_state if k not in slots]
    if stray:
        raise CheckpointError(f"the checkpoint has state for parameter index(es) {stray[:5]} that are in no group")
    return slots


def _by_name(ids: Sequence[Any], group: Mapping[str, Any], saved: Mapping[str, Any], gi: int) -> List[Any]:
    """The saved indices in the order of ``group["params"]``: matched by name where the group and the
    checkpoint both have ``param_names`` (a reordered model loads each parameter's own state), else by
    position (as torch). CheckpointError naming both sides where the names differ."""
    names, saved_names = group.get("param_names"), saved.get("param_names")
    if not isinstance(names, (list, tuple)) or not isinstance(saved_names, (list, tuple)):
        return list(ids)
    if len(saved_names) != len(ids) or len(set(saved_names)) != len(saved_names):
        raise CheckpointError(f"param_groups[{gi}]['param_names'] in the checkpoint must name each of its "
                              f"{len(ids)} parameter(s) once, got {list(saved_names)[:10]}")
    if sorted(map(str, names)) != sorted(map(str, saved_names)):
        missing = [n for n in names if n not in saved_names]
        unexpected = [n for n in saved_names if n not in names]
        raise CheckpointError(f"param_groups[{gi}]: the checkpoint's parameters are not this optimizer's: "
                              f"{missing[:10]} only here, {unexpected[:10]} only in the checkpoint")
    position = {name: k for k, name in enumerate(saved_names)}
    return [ids[position[name]] for name in names]


def _decay_warnings(optimizer: torch.optim.Optimizer, new_groups: list) -> List[str]:
    """Where a halfadam checkpoint was written by another class of the optimizer's rule: its values of
    the keys the class sets (``optimizer._class_keys``: Adam's ``decay``, ``optimized_update``) replace
    this optimizer's. (A torch checkpoint's warnings are ``optimizer._from_torch_group``'s.)"""
    warnings_ = []
    for gi, (current, new) in enumerate(zip(optimizer.param_groups, new_groups)):
        for key in optimizer._class_keys:  # type: ignore[attr-defined]
            if key in current and current[key] != new[key]:
                warnings_.append(
                    f"param_groups[{gi}]: the checkpoint's {key}={new[key]!r} replaces this optimizer's "
                    f"{current[key]!r} (it was written by another halfadam optimizer class?)"
                )
    return warnings_


def _param_load(optimizer: torch.optim.Optimizer, p: Tensor, group: Dict[str, Any], saved: Any, kind: str,
                where: str, gi: int, index: int) -> _ParamLoad:
    """One parameter's saved state, checked against ``p`` and its (merged) ``group``: its keys, their
    encoding, shapes and dtypes, and its step."""
    if not isinstance(saved, Mapping):
        raise CheckpointError(f"{where}: its state in the checkpoint must be a dict, got {type(saved).__name__}")
    if not saved:
        raise CheckpointError(
            f"{where}: its state entry is empty. DCP's set_optimizer_state_dict with "
            f"flatten_optimizer_state_dict=True rebuilds each entry from the keys of the optimizer's own state, "
            f"which this optimizer had not made yet: call halfadam.distributed.init_state(optimizer) (or use "
            f"halfadam.distributed.get_optimizer_state_dict) before getting the state dict to load into")
    use_master = optimizer._states.use_master(p, group)  # type: ignore[attr-defined]
    try:
        saved = dict(encodings.unlabelled(saved, where))  # 8-bit codes: the step count from under their label
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    remainder_dtype = _remainder_dtype(saved.pop(REMAINDER_DTYPE, None), where) if kind == "halfadam" else None
    moments = optimizer.state_format.moments  # type: ignore[attr-defined]  # the rule's (key, kind)
    keys = [key for key, _ in moments]
    foreign = sorted(k for k in saved if k in encodings.MOMENT_KINDS and k not in keys)
    if foreign:
        rule = optimizer.rule.name  # type: ignore[attr-defined]
        raise CheckpointError(
            f"{where}: the checkpoint's state holds {foreign}, which this {type(optimizer).__name__} does not keep "
            f"(its update rule {rule!r} keeps {keys or 'no moment'}): it was written by another optimizer")
    allowed = ({"step", *encodings.ELEMENT_KEYS, *encodings.BLOCK_KEYS, *encodings.LEGACY_BLOCK_KEYS}
               if kind == "halfadam"
               else {"step", *keys})
    unexpected = sorted(set(saved) - allowed)
    if unexpected:
        raise CheckpointError(f"{where}: unexpected state key(s) {unexpected} in the checkpoint")
    # torch.optim.SGD's state holds no step count (optimizer._torch_step): each entry counts as one step taken
    counted = kind == "halfadam" or optimizer._torch_step  # type: ignore[attr-defined]
    missing = sorted({*keys, *(("step",) if counted else ())} - set(saved))
    if missing:
        raise CheckpointError(f"{where}: state key(s) {missing} missing from the checkpoint")
    has_master = encodings.has_master(saved)
    if has_master and not use_master:
        raise CheckpointError(
            f"{where}: the checkpoint has a master weight ({'master_weight' if 'master_weight' in saved else 'master_hi'}) "
            f"but this optimizer keeps none for this parameter "
            f"(master_weights={group['master_weights']!r}); build it with master_weights=True, or load the "
            f"fp32 weights with load_master_state_dict"
        )
    for name in saved:
        if name != "step" and not isinstance(saved[name], Tensor):
            raise CheckpointError(f"{where}: {name} must be a tensor, got {type(saved[name]).__name__}")
    fmt = _saved_format(saved, p, kind, remainder_dtype, moments, where)
    values = _checked_values(saved, p, fmt, has_master, kind, where)
    step = _check_step(saved["step"], f"{where}: step") if "step" in saved else 1.0
    return _ParamLoad(p, gi, index, values, step, use_master and not has_master, fmt)


def _saved_format(saved: Dict[str, Any], p: Tensor, kind: str, remainder_dtype: Optional[str],
                  moments: Tuple[Tuple[str, str], ...], where: str) -> encodings.StateFormat:
    """The state format ``saved`` is written in (torch's and float64 state: fp32's) for a rule keeping
    ``moments``, checked against ``p``."""
    if kind != "halfadam" or p.dtype == torch.float64:
        return encodings.StateFormat().for_rule(moments)
    try:
        fmt = encodings.format_of(saved, moments)
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    if fmt.master == "split" and p.dtype not in _HALF_DTYPES:
        raise CheckpointError(f"{where}: the checkpoint has a split master (master_hi, master_lo), which needs a "
                              f"float16/bfloat16 parameter")
    if fmt.master == "split8" and p.dtype != torch.bfloat16:
        raise CheckpointError(f"{where}: the checkpoint has an 8-bit split master (master_hi alone), which needs a "
                              f"bfloat16 parameter, got {_dtype_name(p.dtype)}")
    if fmt.master == "split" and remainder_dtype not in (None, _dtype_name(p.dtype)):
        raise CheckpointError(
            f"{where}: the checkpoint's split master holds remainders over a {remainder_dtype} parameter; "
            f"over this {_dtype_name(p.dtype)} one they mean another master. Load it into the model in "
            f"{remainder_dtype}, or carry exact masters across dtypes with master_state_dict and "
            f"halfadam.checkpoint.load_master_state_dict")
    return fmt


def _checked_values(saved: Dict[str, Any], p: Tensor, fmt: encodings.StateFormat, has_master: bool, kind: str,
                    where: str) -> Dict[str, Tensor]:
    """The tensors of ``saved`` that encoding ``fmt`` keeps, checked: every key there, shapes (1-D
    blocks of before 2026-12-01 reshaped where they are the same blocks) and dtypes (a torch
    checkpoint's may widen to the compute dtype, never narrow)."""
    compute = torch.float64 if p.dtype == torch.float64 else torch.float32
    expected = encodings.element_keys(fmt, has_master)
    blocks = encodings.block_keys(fmt, has_master)
    extra = sorted(k for k in set(saved) - {"step"} if k not in expected and k not in blocks)
    absent = sorted(k for k in list(expected) + list(blocks) if k not in saved)
    if extra or absent:
        raise CheckpointError(f"{where}: the checkpoint's state keys do not form one encoding "
                              f"({fmt.describe()}): unexpected {extra}, missing {absent}")
    values = {}
    for name in list(expected) + list(blocks):
        t = saved[name]
        shape = tuple(p.shape) if name in expected else encodings.block_shape(tuple(p.shape))
        flat = (encodings.n_blocks(p.numel()),)  # 1-D blocks over the flat parameter, as written before 2026-12-01
        if name in blocks and tuple(t.shape) == flat and math.prod(flat) == math.prod(shape):
            t = t.reshape(shape)  # the same blocks (rows of whole blocks): reshaped
        if tuple(t.shape) != shape and not (name in blocks and tuple(t.shape) == flat):
            raise CheckpointError(
                f"{where}: {name} has shape {tuple(t.shape)} in the checkpoint, expected {shape}"
                + (" (the parameter's)" if name in expected
                   else f" (one per {encodings.BLOCK} elements of each row, the last one per row shorter)")
            )
        if t.is_meta:
            raise CheckpointError(f"{where}: {name} is on the meta device (no data) in the checkpoint")
        want = compute if expected.get(name) == torch.float32 and name in expected else (
            expected.get(name) or blocks[name])
        if kind == "torch":
            if not t.is_floating_point():
                raise CheckpointError(f"{where}: {name} has dtype {t.dtype} in the checkpoint, expected {compute}")
            if torch.promote_types(t.dtype, compute) != compute:
                raise CheckpointError(
                    f"{where}: {name} has dtype {t.dtype} in the checkpoint; converting it to {compute} would "
                    f"lose precision"
                )
        elif t.dtype != want:
            raise CheckpointError(
                f"{where}: {name} has dtype {t.dtype} in the checkpoint, expected {want} (halfadam keeps "
                f"this state in {want})"
            )
        values[name] = t
    return values


def _check_schedules(groups: List[Dict[str, Any]]) -> None:
    """CheckpointError where a loaded group's schedule fails at its loaded global step."""
    for gi, group in enumerate(groups):
        for key in _SCHEDULE_KEYS:
            schedule = group.get(key)
            if schedule is not None:
                what = key.removesuffix("_schedule")
                try:
                    hyperparams.value_at(schedule, group["global_step"], f"param_groups[{gi}]['{what}']")
                except Exception as exc:
                    raise CheckpointError(
                        f"param_groups[{gi}]['{key}'] fails at global step {group['global_step']}: {exc}"
                    ) from None


def _drop_unfillable(optimizer: torch.optim.Optimizer, loads: List[_ParamLoad]) -> None:
    """Drop the state of each parameter of ``loads`` that the load cannot fill in place, which it then
    replaces (as torch's load replaces every state): one made for an old shape of the parameter, or written
    into a form no rule reads (:meth:`halfadam.state.ParamStates.check_state`), or one dict of several."""
    states = optimizer._states  # type: ignore[attr-defined]
    holders = Counter(id(optimizer.state.get(load.param)) for load in loads)
    for load in loads:
        state = optimizer.state.get(load.param)
        if not state:
            continue
        if holders[id(state)] > 1 or not readable(states, load.param, optimizer.param_groups[load.group_index]):
            optimizer.state.pop(load.param)


@torch.no_grad()
def _commit_load(optimizer: torch.optim.Optimizer, plan: _LoadPlan) -> None:
    for group, new in zip(optimizer.param_groups, plan.groups):
        params = group["params"]
        for key in [k for k in group if k not in new]:
            del group[key]
        group.update(new)
        group["params"] = params
    for p in plan.clear:
        optimizer.state.pop(p, None)
    _drop_unfillable(optimizer, plan.loads)
    deferred = []
    for load in plan.loads:
        p, group = load.param, optimizer.param_groups[load.group_index]
        target = optimizer._states.format(p, group)  # type: ignore[attr-defined]
        if p.dtype != torch.float64 and encodings.has_remainder(load.values) and target.master == "fp32":
            deferred.append(load)
            continue
        state = optimizer._states.init(p, group)  # the optimizer's own tensors (views into flat buffers)
        target = encodings.format_of(state, load.format.moments)  # this optimizer's encoding of the parameter's state
        same = load.format == target and all(v.shape == state[k].shape for k, v in load.values.items())
        if p.dtype == torch.float64 or (same and not load.rebuild_master):
            for name, value in load.values.items():  # the same encoding: bit for bit
                state[name].copy_(value)
            if load.rebuild_master:
                state["master_weight"].copy_(p.detach())
        else:  # another encoding or block layout, or no master in the checkpoint: decode, then encode in this one
            # (a DTensor's local shard: DCP loads the checkpoint's state sharded like the parameter)
            lp = local(p)
            values = encodings.decode_state(load.format, lp, {k: local(v).to(lp.device) for k, v in load.values.items()})
            values.setdefault("master_weight", lp.detach().to(torch.float32))
            encodings.encode_state_(target, lp, {k: local(v) for k, v in state.items()}, values, load.step,
                                    offset=flat_offset(p))
        if isinstance(state.get("step"), Tensor):
            state["step"].fill_(load.step)
        else:
            state["step"] = torch.tensor(load.step, dtype=torch.float32)
    # A split master is a remainder over the parameter's value: decoded now into an fp32 master, over a
    # model whose weights are loaded after the optimizer, it would be lost. The moments are decoded now;
    # the remainder stays (a split-mode state) until the optimizer's next use of the parameter converts
    # it against the value of that moment (ParamStates.conform: a step, master_weight, state_dict,
    # sync_master_weights), so the order of the two loads does not matter.
    for load in deferred:
        p = load.param
        lp = local(p)
        values = {k: local(v).to(lp.device) for k, v in load.values.items()}
        moments = encodings.decode_state(load.format, lp, values, tuple(key for key, _ in load.format.moments))
        kept = {k: v.clone() for k, v in values.items() if k.startswith("master_")}
        state = optimizer.state[p]
        state.clear()
        state.update(encodings.like_param_state({**kept, **moments}, p))
        state["step"] = torch.tensor(load.step, dtype=torch.float32)
        optimizer._states.dtypes[id(p)] = p.dtype  # type: ignore[attr-defined]
        optimizer._states.layouts.pop(id(optimizer.param_groups[load.group_index]), None)  # type: ignore[attr-defined]
    for message in plan.warnings:
        warnings.warn(message, UserWarning, stacklevel=4)


def load_optimizer_state_dict(optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]) -> None:
    """Load a halfadam state_dict of the optimizer's update rule, or one of its counterpart's
    (``torch.optim.Adam``/``AdamW`` for the Adam classes, ``torch.optim.SGD`` for :class:`halfadam.SGD`,
    lucidrains' or optimi's ``Lion`` for :class:`halfadam.Lion`), into a halfadam optimizer, atomically.

    From a halfadam state_dict: every hyperparameter (as torch: the checkpoint's values replace the
    optimizer's), ``global_step`` and schedule, and per parameter ``step``, the rule's moments (Adam's
    ``exp_avg``, ``exp_avg_sq``; SGD's ``momentum_buffer``; Lion's ``exp_avg``) and ``master_weight``
    (copied into the optimizer's tensors, which keep their dtype: float32, or
    float64 for float64 parameters; moved to the parameter's device). ``master_weights`` is not
    loaded: it is structure (which parameters own an fp32 copy), and the checkpoint must fit the
    loading optimizer's (a saved master for a parameter without one is an error; a parameter whose
    master is missing from the checkpoint gets it rebuilt from its value, with a warning).
    From a counterpart's: ``lr``, ``weight_decay``, the rule's keys (``betas``, ``eps``; SGD's
    ``momentum``, ``dampening``, ``nesterov``, ``maximize``; optimi's ``beta1``, ``beta2`` as ``betas``) and
    the steps and moments (upcast to float32, exactly); halfadam's own group keys (schedules,
    ``decay``...) stay as they are, each group's ``global_step`` becomes its parameters' largest step,
    and master weights are rebuilt from the parameters (a ``UserWarning`` says so: load the model
    first). torch's SGD and the Lions keep no step count: each loaded entry counts as *one step taken*
    (so a loaded ``momentum_buffer`` is carried on, ``b <- mu * b + (1 - dampening) * g``, not replaced
    by the first step's ``b <- g``; a ``None`` buffer, an older torch's at momentum 0, is no state);
    optimi's ``kahan_comp`` is dropped (the master is rebuilt from the parameter).

    Parameters without state in the checkpoint lose theirs (as in torch: it is rebuilt at their next step).
    A state the load cannot fill in place (made for an old shape of its parameter, written by hand into
    a form no rule reads, one dict of two parameters: :meth:`halfadam.state.ParamStates.check_state`) is
    replaced by the loaded one, as torch's load replaces every state.
    A split or split8 master loaded into an fp32-master mode stays a remainder (its moments are
    decoded) until the optimizer's next use of the parameter decodes it against the parameter's value
    then, so the model's weights may be loaded before or after the optimizer's state.
    Where a group and its saved group both have ``param_names`` (an optimizer built over
    ``model.named_parameters()``), each parameter loads the state saved under its name (a reordered
    model is right) and keeps its name; otherwise by position, as torch.
    A labelled entry of 8-bit codes (:func:`optimizer_state_dict`) takes its step count from
    ``halfadam_step``; one saved before labels (``step`` a tensor) loads as it is.

    Raises:
        CheckpointError (a ValueError), before anything changes: a different number of groups or of
            parameters in a group; a missing or unexpected state key; a shape that differs from the
            parameter's; a state tensor that is not in the optimizer's state dtype (halfadam
            checkpoints) or would lose precision converted to it (torch ones); a master weight for a
            parameter this optimizer keeps none for; an invalid hyperparameter, step or schedule;
            amsgrad or maximize in a torch checkpoint (optimi's ``decouple_lr`` in a Lion one); a
            checkpoint of another update rule (an AdamW's loaded into an SGD: the message names the group
            keys or the moments that differ); an SGD's with momentum loaded into one built without (it
            keeps no ``momentum_buffer``); ``param_names`` on both sides that differ (the
            message names what only one side has); a ``step`` label this version does not read (a
            newer halfadam's, or not halfadam's), a label over moments that are not uint8, or a
            ``halfadam_step`` without a label.
    """
    state_dict = dict(state_dict) if isinstance(state_dict, Mapping) else state_dict
    for hook in getattr(optimizer, "_optimizer_load_state_dict_pre_hooks", {}).values():
        result = hook(optimizer, state_dict)
        if result is not None:
            state_dict = result
    plan = _prepare_load(optimizer, state_dict)
    _commit_load(optimizer, plan)
    for hook in getattr(optimizer, "_optimizer_load_state_dict_post_hooks", {}).values():
        hook(optimizer)


def to_torch_state_dict(optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """The optimizer's state as its counterpart's state_dict, to continue there: ``torch.optim.AdamW``
    (or ``Adam``) for :class:`halfadam.AdamW`, ``Adam``, ``AdamFP16``; ``torch.optim.SGD`` for
    :class:`halfadam.SGD`; lucidrains' ``lion_pytorch.Lion`` for :class:`halfadam.Lion` (optimi's Lion
    keeps ``beta1``, ``beta2`` instead of ``betas``).

    Per parameter: float32 copies of the rule's moments (Adam's ``exp_avg`` and ``exp_avg_sq``, SGD's
    ``momentum_buffer``, Lion's ``exp_avg``; decoded from bfloat16 or 8-bit state modes) and, for Adam,
    ``step`` (a 0-d float32 tensor: never the label of :func:`optimizer_state_dict`). torch's SGD and
    Lion keep no step count: a parameter without a moment (SGD at momentum 0) or that has not stepped
    yet has no entry, as there. Master weights are dropped (torch updates the parameters themselves;
    ``torch.optim.Optimizer.load_state_dict`` casts the moments to the parameter's dtype). Per group:
    the learning rate and weight decay of the *next* step (a schedule evaluated at ``global_step``;
    attach a torch lr_scheduler to go on scheduling) and the rule's keys as the counterpart has them
    (the optimizer's ``_torch_group``): Adam's ``betas``, ``eps``, torch's flags with their defaults and
    ``decoupled_weight_decay`` (``True`` for decay ``"decoupled"``, so ``torch.optim.Adam`` loading it
    behaves as AdamW too); SGD's ``momentum``, ``dampening``, ``nesterov``, ``maximize`` and torch's
    kernel hints; Lion's ``betas``. Other keys (e.g. ``initial_lr``) are kept.

    Raises:
        ValueError: a group with decay ``"absolute"`` and a weight decay > 0 (torch has no such decay); a
            parameter resized since its state was made (``p.data = ...`` of another shape), or a state
            written into a form no rule reads (:meth:`halfadam.state.ParamStates.check_state`).
    Warns:
        UserWarning: a group with ``optimized_update`` (torch adds eps after bias correction).
    """
    for group in optimizer.param_groups:  # a state no rule reads (made for another shape...): a ValueError
        for p in group["params"]:
            optimizer._states.check_state(p, group)  # type: ignore[attr-defined]
    packed = torch.optim.Optimizer.state_dict(optimizer)
    halfadam_keys = {*_SCHEDULE_KEYS, "master_weights", "global_step", *_rule_keys(optimizer)}
    groups = []
    for gi, (group, pg) in enumerate(zip(optimizer.param_groups, packed["param_groups"])):
        where = f"param_groups[{gi}]"
        values = {}
        for key in ("lr", "weight_decay"):
            schedule = group.get(f"{key}_schedule")
            if schedule is not None:
                values[key] = hyperparams.value_at(schedule, group["global_step"], f"{where}['{key}']")
            else:
                v = group[key]
                values[key] = float(v.item() if isinstance(v, Tensor) else v)
        rule = optimizer._torch_group(group, values["weight_decay"], where)  # type: ignore[attr-defined]
        tg = {k: v for k, v in pg.items() if (k not in halfadam_keys or k in rule) and k != "params"}
        tg.update(lr=values["lr"], **rule, weight_decay=values["weight_decay"], params=list(pg["params"]))
        groups.append(tg)
    state = {}
    params = [p for g in optimizer.param_groups for p in g["params"]]  # torch's indices: this order
    moments = optimizer.state_format.moments  # type: ignore[attr-defined]
    counted = optimizer._torch_step  # type: ignore[attr-defined]  # torch.optim.SGD's state holds no step count
    for pid, st in packed["state"].items():
        st = encodings.unlabelled(st, f"parameter {pid}")  # a state ZeroRedundancyOptimizer loaded, labelled
        step = st["step"]
        step = (step.detach().to("cpu", torch.float32, copy=True) if isinstance(step, Tensor)
                else torch.tensor(float(step), dtype=torch.float32))
        if not counted and (not moments or step.item() == 0):
            continue  # no moment, or none made by a step yet: the counterpart keeps no state for it
        values = {k: st[k] for k, _ in moments}
        dtypes = {v.dtype for v in values.values()}
        if dtypes - {torch.float32, torch.float64} or len(dtypes) > 1:
            p = params[pid]  # encoded moments, decoded (a DTensor's on its local shard, sharded like it)
            decoded = encodings.decode_state(encodings.format_of(st, moments), local(p),
                                             {k: local(v) for k, v in st.items()})
            values = {k: like_param(decoded[k], p) for k in values}
        state[pid] = {**({"step": step} if counted else {}), **{k: v.detach().clone() for k, v in values.items()}}
    return {"state": state, "param_groups": groups}


# ============================================================================ fp32 export
def master_state_dict(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> "OrderedDict[str, Tensor]":
    """``model.state_dict()`` with the fp32 master weight in place of each parameter that has one.

    Every other float16/bfloat16 entry (parameters without a master, buffers) is upcast to float32,
    exactly; float32/float64 and non-floating entries keep their dtype. Each value is a new contiguous
    tensor on the device it was on (tied weights are separate copies), so the dict can go to
    ``torch.save`` or ``safetensors.torch.save_file`` directly. A parameter that has not taken a step
    yet is exported from its current value (its master would be created from it).

    Raises:
        TypeError: ``optimizer`` is not a halfadam optimizer.
    """
    if not callable(getattr(optimizer, "sync_master_weights", None)):
        raise TypeError(f"master_state_dict needs a halfadam optimizer, got {type(optimizer).__name__}")
    optimizer.sync_master_weights()
    masters = {id(p): optimizer.master_weight(p) if encodings.has_remainder(st) else st["master_weight"]
               for p, st in optimizer.state.items() if encodings.has_master(st)}
    source = model.state_dict(keep_vars=True)
    out: "OrderedDict[str, Tensor]" = OrderedDict()
    for key, value in source.items():
        t = masters.get(id(value), value)
        if not isinstance(t, Tensor):
            out[key] = value
            continue
        t = t.detach()
        if t.dtype in _HALF_DTYPES:
            t = t.float()
        out[key] = t.clone(memory_format=torch.contiguous_format)
    metadata = getattr(source, "_metadata", None)
    if metadata is not None:
        out._metadata = metadata  # type: ignore[attr-defined]
    return out
