"""What a user or a load wrote into a parameter's state, checked and taken in (the layer of
:mod:`halfadam.state`, whose :class:`~halfadam.state.ParamStates` has these functions as its methods).

``optimizer.state[p]`` is the user's to write (``opt.state[p][key] = ...``, ``del``, ``state[p1] =
state[p2]``) and a load's (``ZeroRedundancyOptimizer.load_state_dict`` puts state_dict entries there as
they are). Before a step or a rebuild reads a state, :func:`check_state` refuses, by the parameter's
place, one no rule reads (a state made for another shape: :func:`stale_shape`), and :func:`check_shared`
one dict of two parameters; :func:`adopt` then takes what passed into the optimizer's own form, values
kept (:func:`foreign`: whether it has anything to take in).
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any, Callable, Dict, Optional, Protocol, Tuple

import torch
from torch import Tensor

from . import encodings
from ._dtensor import is_dtensor, like_param, like_rows, local


class States(Protocol):
    """What these functions read of their owner, :class:`halfadam.state.ParamStates` (which imports this
    module: a protocol here, so that the import goes one way)."""

    state: Dict[Tensor, dict]
    owner: Any  # the optimizer (its param_groups)
    state_format: encodings.StateFormat

    def place(self, param: Tensor, group: Dict[str, Any]) -> str: ...
    def stale_shape(self, param: Tensor) -> Optional[Tuple[int, ...]]: ...
    def check_state(self, param: Tensor, group: Dict[str, Any]) -> None: ...
    def check_shared(self) -> None: ...

__all__ = ["REMAINDER_DTYPE", "adopt", "check_shared", "check_state", "foreign", "readable", "stale_shape"]

#: The state_dict key (per parameter with a split master) naming the parameter dtype its remainders are
#: in units of, ``{"float16": 1}`` or ``{"bfloat16": 1}`` (they mean nothing over another dtype): a dict of
#: a number, as ``flatten_optimizer_state_dict=True`` of ``torch.distributed.checkpoint.state_dict`` needs
#: (releases up to 673f2dc wrote the name as a str; it loads). ``ZeroRedundancyOptimizer.load_state_dict``
#: puts entries into the state as they are: :func:`check_state` lets it pass, and :func:`adopt` drops it.
REMAINDER_DTYPE = "remainder_dtype"


def check_state(states: States, param: Tensor, group: Dict[str, Any]) -> None:
    """ValueError naming ``param`` (its place) where its state cannot be stepped as it is; nothing changes.

    Its state was made for another shape (:func:`stale_shape`): the parameter was resized since, and
    no rule makes the state fit. Or it was written (``opt.state[p][key] = ...``, ``del``, a load that
    puts entries as they are) into a form no rule reads:

    * a key missing (no moment restarts silently), or one of no encoding (a user's own: the
      ``state_dict()`` holding it would not load); a value that is no tensor, or a moment of no
      encoding's form (:func:`halfadam.encodings.format_of`);
    * a tensor on the meta device (no values), or of another shape than the state mode keeps
      (the parameter's, or its block shape; for a DTensor parameter a DTensor's whole shape, a
      plain tensor's that of this rank's shard), or a DTensor sharded otherwise than the parameter;
    * a ``step`` that is neither a 1-element tensor nor a whole number >= 0.

    What passes is taken in as it is, or by :func:`adopt` (a Python number ``step``, a tensor
    requiring grad, a DTensor parameter's local shard); another dtype or device, by
    :meth:`halfadam.state.ParamStates.conform`.
    """
    state = states.state.get(param)
    if not state:
        return
    where = functools.partial(states.place, param, group)
    if encodings.is_labelled(state):  # a state_dict entry put there as it is: checked as adopt() reads it
        state = encodings.unlabelled(state, where())
    _check_keys(state, where, states.state_format.moments)
    made = states.stale_shape(param)
    if made is not None and not any(_param_shaped(state[k], param)
                                    for k in encodings.present_element_keys(state)):  # resized
        states.check_shared()  # or another parameter's state dict, put here (state[p1] = state[p2])
        raise ValueError(
            f"{where()} has shape {tuple(param.shape)}, but its optimizer state (moments, master) "
            f"was made for shape {made}: the parameter was resized since (p.data = ...). To continue with "
            f"fresh state for it (step 0, zero moments, the master from its new value), remove its state "
            f"first: del optimizer.state[p]; or give it back its shape {made}")
    _check_tensors(state, param, where)
    step = state["step"]
    if not (_counts(step) if isinstance(step, Tensor) else _is_count(step)):
        raise ValueError(f"{where()}: its state['step'] must be a 1-element tensor or a number holding a whole "
                         f"number >= 0 (the steps taken), got {step!r}")


def check_shared(states: States) -> None:
    """ValueError naming two parameters whose state is one dict (``opt.state[p1] = opt.state[p2]``):
    a step would update it with both parameters' gradients."""
    seen: Dict[int, Tuple[Tensor, Dict[str, Any]]] = {}
    entries = states.state
    for group in states.owner.param_groups:
        for p in group["params"]:
            state = entries.get(p)
            if state is not None and seen.setdefault(id(state), (p, group))[0] is not p:
                raise ValueError(
                    f"{states.place(*seen[id(state)])} and {states.place(p, group)} share one state dict "
                    f"(optimizer.state[p1] = optimizer.state[p2]?): a step would update it with both "
                    f"parameters' gradients. Give each its own: optimizer.state[p1] = "
                    f"{{k: v.clone() for k, v in optimizer.state[p2].items()}}, or del optimizer.state[p1] "
                    f"to restart its state")


def adopt(states: States, param: Tensor, state: dict, group: Dict[str, Any]) -> None:
    """Take what a load or the user put into ``state`` into the optimizer's own form, values kept
    (:func:`check_state` has passed them): the step count of a labelled state_dict entry put there
    as it is (``ZeroRedundancyOptimizer.load_state_dict`` does) back in ``step``
    (:func:`encodings.unlabel_`), its :data:`REMAINDER_DTYPE` dropped (the parameter's dtype says
    it); a Python number ``step`` as a 0-d float32 tensor; a tensor that requires grad (a leaf, or
    a non-leaf and its graph) as a detached copy, the user's tensor left as it is (the kernels copy
    every value into their buffers likewise); a plain tensor in a DTensor parameter's state (its
    local shard's shape) as a DTensor sharded like the parameter.

    Raises:
        ValueError: a label this version does not read (named by the parameter's place).
    """
    if state and encodings.is_labelled(state):
        encodings.unlabel_(state, states.place(param, group))
    if not state or not foreign(param, state):
        return
    state.pop(REMAINDER_DTYPE, None)
    shard = tuple(local(param).shape)
    for key, v in list(state.items()):
        if key == "step" and _is_count(v):
            state[key] = torch.tensor(float(v), dtype=torch.float32)
        elif key == "step" and isinstance(v, Tensor) and (v.dtype != torch.float32 or v.dim() or v.requires_grad):
            state[key] = v.detach().reshape(()).to(torch.float32, copy=True)  # torch's form: 0-d float32
        elif isinstance(v, Tensor):
            if v.requires_grad:
                v = state[key] = v.detach().clone()
            block = encodings.is_block_key(key)
            if key != "step" and is_dtensor(param) and not is_dtensor(v) and (  # this rank's shard
                    v.shape == (encodings.block_shape(shard) if block else shard)):
                state[key] = like_rows(v, param, encodings.block_shape(tuple(param.shape))) if block else \
                    like_param(v, param)


def stale_shape(states: States, param: Tensor) -> Optional[Tuple[int, ...]]:
    """The shape ``param``'s state was made for, when it is not ``param``'s own (it was resized
    since: ``p.data = torch.randn(...)`` of a new size between steps); else ``None``."""
    state = states.state.get(param)
    first = next(iter(encodings.present_element_keys(state)), None) if state else None
    t = state[first] if first else None
    return None if not isinstance(t, Tensor) or _param_shaped(t, param) else tuple(t.shape)



def foreign(param: Tensor, state: dict) -> bool:
    """Whether :func:`adopt` changes ``state``: a ``step`` that is no 0-d float32 tensor, a
    :data:`REMAINDER_DTYPE`, a tensor that requires grad, a plain tensor (but ``step``) in a DTensor
    parameter's state."""
    sharded = is_dtensor(param)
    step = state.get("step")
    return not isinstance(step, Tensor) or step.dtype != torch.float32 or step.dim() or REMAINDER_DTYPE in state or any(
        isinstance(v, Tensor) and (v.requires_grad or (sharded and k != "step" and not is_dtensor(v)))
        for k, v in state.items())


def readable(states: States, param: Tensor, group: Dict[str, Any]) -> bool:
    """Whether ``param``'s state passes :func:`check_state` (a rebuild leaves one that does not as it is,
    outside the buckets, for the step that reads it to refuse by name; a load replaces it)."""
    try:
        states.check_state(param, group)
    except ValueError:
        return False
    return True


#: The keys a state may hold (besides user keys: none): ``step``, every encoding's, and :data:`REMAINDER_DTYPE`.
_KNOWN = {"step", REMAINDER_DTYPE, *encodings.ELEMENT_KEYS, *encodings.BLOCK_KEYS, *encodings.LEGACY_BLOCK_KEYS}
#: Keys a state may hold besides its encoding's: :data:`REMAINDER_DTYPE`, and a moment's per-block scale
#: left by a moment put there as floats (read as floats and encoded: the scale is dropped).
_LEFTOVERS = {REMAINDER_DTYPE, *(k for k in encodings.BLOCK_KEYS + encodings.LEGACY_BLOCK_KEYS if k != "master_tie")}


def _check_keys(state: dict, where: Callable[[], str], moments: Tuple[Tuple[str, str], ...]) -> None:
    """ValueError (named ``where()``) where ``state`` holds a key of no encoding (a user's), lacks
    ``step``, a moment or a key its encoding needs, holds another encoding's key (but the per-block
    scale of a moment given as floats in place of its codes, which conversion drops), a value other
    than ``step``'s that is no tensor, or a moment of no encoding's form (:func:`halfadam.encodings.format_of`)."""
    for key, value in state.items():
        if key in _KNOWN and key not in ("step", REMAINDER_DTYPE) and not isinstance(value, Tensor):
            raise ValueError(f"{where()}: its state[{key!r}] must be a tensor, got {type(value).__name__}")
    dtypes = tuple(state[k].dtype if k in state else None for k, _ in moments)
    problem = _keys_problem(frozenset(state), moments, dtypes)
    if problem:
        raise ValueError(f"{where()}: {problem}")


@functools.lru_cache(maxsize=256)
def _keys_problem(keys: frozenset, moments: Tuple[Tuple[str, str], ...],
                  dtypes: Tuple[Optional[torch.dtype], ...]) -> Optional[str]:
    """:func:`_check_keys`' finding for a state of ``keys`` whose ``moments`` (the rule's) have these
    dtypes, or ``None`` (cached: a step checks the same few key sets over and over)."""
    fmt, extra = None, sorted(keys - _KNOWN)
    missing = [] if extra else [k for k in ("step", *(key for key, _ in moments)) if k not in keys]
    if not (extra or missing):
        try:  # format_of reads the keys and the moments' dtypes
            fmt = encodings.format_of({**dict.fromkeys(keys), **{key: torch.empty(0, dtype=dtype)
                                                                for (key, _), dtype in zip(moments, dtypes)}},
                                      moments)
        except ValueError as exc:
            return str(exc)
        master = fmt.master != "fp32" or "master_weight" in keys
        expected = {"step", *encodings.element_keys(fmt, master), *encodings.block_keys(fmt, master)}
        missing, extra = sorted(expected - keys), sorted(keys - expected - _LEFTOVERS)
    if not (missing or extra):
        return None
    hint = ("a key deleted leaves the step nothing to start from, and no moment restarts silently: write its "
            "value instead" if missing else "another encoding's key: give that whole encoding, or write this "
            "one's" if fmt else "halfadam keeps only its own keys in optimizer.state[p] (load_state_dict refuses "
            "others, so state_dict() would not load back): keep your own data elsewhere")
    found = "; ".join(f"{what} {names}" for what, names in (("missing", missing), ("unexpected", extra)) if names)
    return (f"its state's keys are not those of {'its encoding, ' + fmt.describe() if fmt else 'an encoding'} "
            f"({found}): {hint}; or restart this parameter's state: del optimizer.state[p]")


def _check_tensors(state: dict, param: Tensor, where: Callable[[], str]) -> None:
    """ValueError (named ``where()``) for a tensor of ``state`` (but ``step``) on the meta device, a DTensor
    sharded otherwise than ``param``, or of another shape than the state mode keeps: the parameter's (a
    plain tensor in a DTensor parameter's state: its local shard's), or its block shape for a per-block
    key of a parameter with rows."""
    sharded, shapes = is_dtensor(param), {}  # whole or not: (element shape, block shape or None)
    for key, t in state.items():
        if key == "step" or not isinstance(t, Tensor):
            continue
        whole = is_dtensor(t)
        if (t.to_local() if whole else t).is_meta:
            problem = f"is on the meta device (no values): give a tensor on {local(param).device}"
        elif whole and not (sharded and t.placements == param.placements):
            problem = (f"is a DTensor of placements {t.placements}, where the parameter is "
                       f"{'a DTensor of placements ' + str(param.placements) if sharded else 'a plain tensor'}: "
                       f"its state is sharded like it")
        else:
            if whole not in shapes:  # a plain tensor in a DTensor parameter's state: its local shard's
                shape = tuple((param if whole or not sharded else local(param)).shape)
                shapes[whole] = shape, encodings.block_shape(shape) if encodings.has_rows(tuple(param.shape)) else None
            shape = shapes[whole][encodings.is_block_key(key)]
            if shape is None or t.shape == shape or key in encodings.LEGACY_BLOCK_KEYS:
                continue  # None: blocks over the flat parameter (checkpoints before 2026-12-01); an old release's codes
            problem = f"has shape {tuple(t.shape)}, where this state mode keeps {shape}" + (
                " (this rank's shard of the DTensor parameter; or a DTensor sharded like it)" if sharded and not whole
                else "")
        raise ValueError(f"{where()}: its state[{key!r}] {problem}")


def _is_count(step: Any) -> bool:
    """Whether ``step`` is a Python number that counts steps: a whole number >= 0 (not a bool)."""
    return (isinstance(step, numbers.Real) and not isinstance(step, bool) and math.isfinite(step) and step >= 0
            and step == int(step))


def _counts(step: Tensor) -> bool:
    """Whether the tensor ``step`` holds a count of steps: one element, a whole number >= 0 where it can be
    read without a device synchronisation (on the CPU, where halfadam keeps it; a capturable step's is on
    the device, and only its form is checked)."""
    if step.numel() != 1 or step.is_meta or step.is_complex():
        return False
    return step.device.type != "cpu" or _is_count(step.detach().reshape(()).item())


def _param_shaped(t: Tensor, param: Tensor) -> bool:
    """Whether state tensor ``t`` has ``param``'s shape: its whole shape, or, a plain tensor in a DTensor
    parameter's state, that of this rank's shard (:func:`adopt` makes it one)."""
    return t.shape == (local(param).shape if is_dtensor(param) and not is_dtensor(t) else param.shape)
