"""The per-parameter state of an optimizer: its format, its buckets, how it is made and how it follows
the parameter (the layer under :mod:`halfadam.optimizer`).

``optimizer.state[param]`` holds torch's keys (``step``, ``exp_avg``, ``exp_avg_sq``) and, with master
weights, ``master_weight``; other state modes store encodings (:mod:`halfadam.encodings`). This module
decides which keys and dtypes a parameter gets (:meth:`ParamStates.element_dtypes`), makes them
(:meth:`ParamStates.init_group`: views into a group's flat buckets, :mod:`halfadam.buckets`, or
tensors of their own), and keeps them fitting the parameter when it changes between steps: a new
dtype or device (:meth:`ParamStates.conform`), a new shape (:meth:`ParamStates.check_state`), a new
set of parameters (:meth:`ParamStates.group_layout`); and it checks what a user or a load wrote into a
state (:meth:`ParamStates.check_state`, :meth:`ParamStates.check_shared`) and takes it in
(:meth:`ParamStates.adopt`). The optimizer asks it for a step's work (:meth:`ParamStates.sort_pairs`)
and for masters (:meth:`ParamStates.synced_master`).
"""

from __future__ import annotations

import functools
import math
import numbers
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from . import encodings
from ._dtensor import flat_offset, is_dtensor, like_param, like_rows, local, row_sharded
from .buckets import Bucket, bucket_key, build_buckets
from .functional import sync_master_

__all__ = ["HALF_DTYPES", "REMAINDER_DTYPE", "ParamStates", "check_row_shards"]

#: The parameter dtypes that get a master weight by default (``master_weights=None``).
HALF_DTYPES = (torch.float16, torch.bfloat16)

#: The state_dict key (per parameter with a split master) naming the parameter dtype its remainders are
#: in units of, ``{"float16": 1}`` or ``{"bfloat16": 1}`` (they mean nothing over another dtype): a dict of
#: a number, as ``flatten_optimizer_state_dict=True`` of ``torch.distributed.checkpoint.state_dict`` needs
#: (releases up to 673f2dc wrote the name as a str; it loads). ``ZeroRedundancyOptimizer.load_state_dict``
#: puts entries into the state as they are: :meth:`ParamStates.check_state` lets it pass, and
#: :meth:`ParamStates.adopt` drops it.
REMAINDER_DTYPE = "remainder_dtype"


class ParamStates:
    """The state layout of one optimizer ``owner`` (an :class:`halfadam.AdamW`, ``Adam`` or ``AdamFP16``).

    It reads the owner's ``state`` (the per-parameter dict, which ``load_state_dict`` may replace),
    ``param_groups``, ``state_format``, ``implementation`` and ``capturable``, and keeps what the
    state's layout needs between steps: each group's buckets (:attr:`layouts`) and the dtype each
    parameter had when its state was made (:attr:`dtypes`). Nothing of it is saved: it is rebuilt
    from the state on the next use.
    """

    def __init__(self, owner: Any):
        self.owner = owner
        self.layouts: Dict[int, "_GroupLayout"] = {}  # id(group) -> its buckets
        self.dtypes: Dict[int, torch.dtype] = {}  # id(param) -> its dtype when its state was made
        self.narrowing_warned = False  # the split-master warning of conform() is given once

    @property
    def state(self) -> Dict[Tensor, dict]:
        return self.owner.state

    @property
    def state_format(self) -> encodings.StateFormat:
        return self.owner.state_format

    def use_master(self, param: Tensor, group: Dict[str, Any]) -> bool:
        """Whether ``param`` keeps a master weight: the group's ``master_weights``, where ``None``
        (the default) for float16/bfloat16 parameters only."""
        use_master = group["master_weights"]
        return param.dtype in HALF_DTYPES if use_master is None else use_master

    def format(self, param: Tensor, group: Dict[str, Any]) -> encodings.StateFormat:
        """The state format of ``param`` (the optimizer's, less what does not apply to it)."""
        return encodings.for_param(self.state_format, param, self.use_master(param, group))

    def fits(self, param: Tensor, state: dict, group: Dict[str, Any]) -> bool:
        """Whether ``state`` was made for ``param`` as it is now (dtype, device, master setting, format)."""
        ea = state.get("exp_avg")
        if ea is None or ea.device != param.device or self.dtypes.get(id(param), param.dtype) != param.dtype:
            return False
        if encodings.is_labelled(state) or _foreign(param, state):  # adopt() takes it in first
            return False
        expected = self.element_dtypes(param, group)
        present = [k for k in encodings.ELEMENT_KEYS if k in state]
        return sorted(present) == sorted(expected) and all(state[k].dtype == dt for k, dt in expected.items())

    def adopt(self, param: Tensor, state: dict, group: Dict[str, Any]) -> None:
        """Take what a load or the user put into ``state`` into the optimizer's own form, values kept
        (:meth:`check_state` has passed them): the step count of a labelled state_dict entry put there
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
            encodings.unlabel_(state, self.place(param, group))
        if not state or not _foreign(param, state):
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

    def place(self, param: Tensor, group: Dict[str, Any]) -> str:
        """``param``'s place in the optimizer, for messages: ``param_groups[0]['params'][3]``."""
        gi = next((i for i, g in enumerate(self.owner.param_groups) if g is group), "?")
        k = next((i for i, q in enumerate(group["params"]) if q is param), "?")
        return f"param_groups[{gi}]['params'][{k}]"

    def attach(self, loc: Tuple[Any, int], param: Tensor, state: dict, group: Dict[str, Any]) -> None:
        """``state`` pointed at its bucket's views (``loc``: the bucket and the index in it), the values it
        holds copied in (:meth:`halfadam.buckets.Bucket.attach`) once :meth:`check_state` has found them
        of their views' shapes."""
        self.check_state(param, group)
        loc[0].attach(state, loc[1])
        self.dtypes[id(param)] = param.dtype

    def element_dtypes(self, param: Tensor, group: Dict[str, Any]) -> Dict[str, torch.dtype]:
        """The per-element state keys ``param`` has in this optimizer, and their dtypes."""
        use_master = self.use_master(param, group)
        if param.dtype == torch.float64:
            return dict.fromkeys(("master_weight",) * use_master + ("exp_avg", "exp_avg_sq"), torch.float64)
        return encodings.element_keys(self.format(param, group), use_master)

    @torch.no_grad()
    def conform(self, param: Tensor, state: dict, group: Dict[str, Any]) -> None:
        """Give ``state`` the form it would have had if ``param`` had always had its current dtype and device.

        After ``model.half()``, ``.bfloat16()``, ``.float()``, ``.to(device)`` between steps. The fp32
        master trajectory does not depend on the parameter's dtype, so a master is kept (moved) and
        the elements the user left alone follow it: where the parameter equals its master rounded
        to the old dtype and converted (nobody wrote it), it becomes the master rounded to the new
        dtype (to float32 or float64: the master itself, which is then dropped: the parameter is its
        own weight); elements written since keep their value (the master-sync rule then adopts
        them). A parameter that gets a master and had none (float32 -> half) gets one from its
        value. The moments are moved and kept in the compute dtype; the step count stays. New
        tensors are made, never views into a previous bucket.

        With an encoded state (:mod:`halfadam.encodings`) the same rule holds where the conversion
        kept the parameter's old value (:func:`_converted_exactly`: to float32, bf16 -> fp16 in fp16's
        normal range): a split master is decoded against that value, exactly, and the parameter follows
        it (bf16 -> fp32 loses nothing). A split master is a remainder over the old value, so where the
        conversion rounded it (fp16 -> bf16, bf16 -> fp16 below 2**-14) the master restarts from the
        converted parameter, with a warning (once). The state is then encoded for the new form.

        This runs at the optimizer's next use of the parameter (a step, ``master_weight``,
        ``sync_master_weights``, ``state_dict``): ``model.float()`` alone does not write the masters
        into the parameters before that.

        Raises:
            ValueError: a moment of no encoding's form (a dtype of none, uint8 codes without their
                scale: put there by hand), named by the parameter's place; nothing changed.
        """
        try:
            old_format = encodings.format_of(state)
        except ValueError as exc:  # a moment of no encoding's form (one put there by hand): name the parameter
            raise ValueError(f"{self.place(param, group)}: {exc}") from None
        old_dtype = self.dtypes.get(id(param), param.dtype)
        if not (self.state_format.is_fp32 and old_format.is_fp32):
            # on a DTensor's (FSDP2's) local shards, whose elements keep their positions in the whole
            master = None
            p = local(param).detach()
            if old_dtype != param.dtype and encodings.has_master(state):
                old = {k: local(v).to(p.device) for k, v in state.items() if k != "step"}
                master = encodings.decode_state(encodings.format_of(old), p.to(old_dtype), old,
                                                ("master_weight",))["master_weight"]
                # an fp32 master (a 1-D parameter) never depended on the old value
                kept = (_converted_exactly(old_dtype, p) if encodings.has_remainder(state)
                        else torch.ones_like(p, dtype=torch.bool))
                unwritten = kept & (p == master.to(old_dtype).to(p.dtype))
                p.copy_(torch.where(unwritten, master.to(p.dtype), p))
                master = torch.where(unwritten, master, p.to(torch.float32))
                if not self.narrowing_warned and not bool(kept.all()):
                    self.narrowing_warned = True
                    warnings.warn(
                        f"a {old_dtype} parameter with a split master (state mode {self.state_format.describe()}) "
                        f"was converted to {param.dtype}, which does not hold every {old_dtype} value: the remainders "
                        f"were over the old values, so the masters of {int((~kept).sum())} element(s) restart from "
                        f"the converted parameter (within half a {param.dtype} ulp of the old masters). To keep "
                        f"exact masters across fp16 <-> bf16, use state_mode='fp32', or carry them with "
                        f"master_state_dict / halfadam.checkpoint.load_master_state_dict", UserWarning, stacklevel=4)
            new = encodings.convert_state({k: local(v) for k, v in state.items()}, p, self.format(param, group),
                                          self.use_master(param, group), master, flat_offset(param))
            new = encodings.like_param_state(new, param)
            state.clear()
            state.update({k: v.to(torch.float64) if param.dtype == torch.float64 and k != "step" else v
                          for k, v in new.items()})
            self.dtypes[id(param)] = param.dtype
            return
        compute = _compute_dtype(param)
        for key in ("exp_avg", "exp_avg_sq"):
            state[key] = state[key].to(device=param.device, dtype=compute, copy=True)
        master = state.pop("master_weight", None)
        if master is not None:
            master = master.to(device=param.device, dtype=compute, copy=True)
            if old_dtype != param.dtype:
                p, m = local(param), local(master)
                unwritten = p == m.to(old_dtype).to(p.dtype)
                p.copy_(torch.where(unwritten, m.to(p.dtype), p))
        if self.use_master(param, group):
            state["master_weight"] = master if master is not None else param.detach().to(compute, copy=True)
        self.dtypes[id(param)] = param.dtype

    def stale_shape(self, param: Tensor) -> Optional[Tuple[int, ...]]:
        """The shape ``param``'s state was made for, when it is not ``param``'s own (it was resized
        since: ``p.data = torch.randn(...)`` of a new size between steps); else ``None``."""
        state = self.state.get(param)
        exp_avg = state.get("exp_avg") if state else None
        return None if not isinstance(exp_avg, Tensor) or _param_shaped(exp_avg, param) else tuple(exp_avg.shape)

    def check_state(self, param: Tensor, group: Dict[str, Any]) -> None:
        """ValueError naming ``param`` (its place) where its state cannot be stepped as it is; nothing changes.

        Its state was made for another shape (:meth:`stale_shape`): the parameter was resized since, and
        no rule makes the state fit. Or it was written (``opt.state[p][key] = ...``, ``del``, a load that
        puts entries as they are) into a form no rule reads:

        * a key missing (no moment restarts silently), or one of no encoding (a user's own: the
          ``state_dict()`` holding it would not load); a value that is no tensor, or a moment of no
          encoding's form (:func:`halfadam.encodings.format_of`);
        * a tensor on the meta device (no values), or of another shape than the state mode keeps
          (the parameter's, or its block shape; for a DTensor parameter a DTensor's whole shape, a
          plain tensor's that of this rank's shard), or a DTensor sharded otherwise than the parameter;
        * a ``step`` that is neither a 1-element tensor nor a whole number >= 0.

        What passes is taken in as it is, or by :meth:`adopt` (a Python number ``step``, a tensor
        requiring grad, a DTensor parameter's local shard); another dtype or device, by :meth:`conform`.
        """
        state = self.state.get(param)
        if not state:
            return
        where = functools.partial(self.place, param, group)
        if encodings.is_labelled(state):  # a state_dict entry put there as it is: checked as adopt() reads it
            state = encodings.unlabelled(state, where())
        _check_keys(state, where)
        made = self.stale_shape(param)
        if made is not None and not _param_shaped(state["exp_avg_sq"], param):  # not a key replaced: resized
            self.check_shared()  # or another parameter's state dict, put here (state[p1] = state[p2])
            raise ValueError(
                f"{where()} has shape {tuple(param.shape)}, but its optimizer state (exp_avg, exp_avg_sq, master) "
                f"was made for shape {made}: the parameter was resized since (p.data = ...). To continue with "
                f"fresh state for it (step 0, zero moments, the master from its new value), remove its state "
                f"first: del optimizer.state[p]; or give it back its shape {made}")
        _check_tensors(state, param, where)
        step = state["step"]
        if not (_counts(step) if isinstance(step, Tensor) else _is_count(step)):
            raise ValueError(f"{where()}: its state['step'] must be a 1-element tensor or a number holding a whole "
                             f"number >= 0 (the steps taken), got {step!r}")

    def check_shared(self) -> None:
        """ValueError naming two parameters whose state is one dict (``opt.state[p1] = opt.state[p2]``):
        a step would update it with both parameters' gradients."""
        seen: Dict[int, Tuple[Tensor, Dict[str, Any]]] = {}
        states = self.state
        for group in self.owner.param_groups:
            for p in group["params"]:
                state = states.get(p)
                if state is not None and seen.setdefault(id(state), (p, group))[0] is not p:
                    raise ValueError(
                        f"{self.place(*seen[id(state)])} and {self.place(p, group)} share one state dict "
                        f"(optimizer.state[p1] = optimizer.state[p2]?): a step would update it with both "
                        f"parameters' gradients. Give each its own: optimizer.state[p1] = "
                        f"{{k: v.clone() for k, v in optimizer.state[p2].items()}}, or del optimizer.state[p1] "
                        f"to restart its state")

    def init(self, param: Tensor, group: Dict[str, Any]) -> dict:
        """Parameter ``param``'s state, initialised if empty and conformed to its dtype and device.

        Raises:
            ValueError: the state was made for another shape of ``param``, or written into a form no
                rule reads (:meth:`check_state`).
        """
        self.check_state(param, group)
        state = self.state[param]
        if not state or not self.fits(param, state, group):
            self.init_group(group, [param])
        return state

    def init_group(self, group: Dict[str, Any], params: Optional[List[Tensor]] = None) -> None:
        """Initialise the state of ``params`` (default: every parameter of ``group``) where empty.

        The one place state is created. Bucketed parameters (see :mod:`halfadam.buckets`) get views
        into their bucket's flat buffers (values already in ``state[p]`` are copied in); the others
        get separately allocated tensors. Keys and dtypes are the same either way. State made for
        another dtype or device of the parameter is conformed first (:meth:`conform`).
        """
        if params is not None and not params:
            return  # the common case in a step: every parameter already has its state
        layout = self.group_layout(group) if self.owner.implementation != "reference" else None
        for param in group["params"] if params is None else params:
            state = self.state[param]
            self.adopt(param, state, group)
            if state and not self.fits(param, state, group):
                self.conform(param, state, group)
            loc = None if layout is None else layout.where.get(id(param))
            if loc is not None and _moved(param, loc):
                layout = self.group_layout(group, rebuild=True)  # converted since the layout was built
                loc = layout.where.get(id(param))
            if loc is not None:
                if not state or not loc[0].is_attached(state, loc[1]):
                    self.attach(loc, param, state, group)
                continue
            if state:
                continue
            dtype = _compute_dtype(param)
            self.dtypes[id(param)] = param.dtype
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            if param.dtype != torch.float64 and not self.state_format.is_fp32:
                state.update(encodings.new_state(self.format(param, group), param, self.use_master(param, group)))
                continue
            if self.use_master(param, group):
                state["master_weight"] = param.detach().to(dtype, copy=True)
            state["exp_avg"] = torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)

    def group_layout(self, group: Dict[str, Any], rebuild: bool = False) -> "_GroupLayout":
        """The buckets of ``group``, (re)built when the group, its parameters or ``self.state`` changed,
        or when ``rebuild`` (a parameter's dtype, device or ``requires_grad`` changed: see
        :meth:`halfadam.optimizer._AdamBase._run_group`).

        On a rebuild, parameters that already have state (e.g. after ``load_state_dict`` replaced
        ``self.state``, or after ``model.half()``) are conformed to their parameter and attached to
        the new buffers with their values; state left outside every bucket gets its own tensors.
        """
        layout = self.layouts.get(id(group))
        ids = [id(p) for p in group["params"]]  # ints: cheap to build and compare every step
        if (not rebuild and layout is not None and layout.group is group and layout.state is self.state
                and layout.ids == ids):
            return layout
        params = group["params"]
        buckets = build_buckets(params, [self.use_master(p, group) for p in params], self.state_format,
                                steps_on_device=self.owner.capturable)
        layout = _GroupLayout(group, self.state, ids, buckets)
        self.layouts[id(group)] = layout
        for p in params:
            state = self.state.get(p)
            if not state or self.stale_shape(p) is not None or not _readable(self, p, group):
                continue  # none, made for an old shape, or written into a form no rule reads: its next use raises
            self.adopt(p, state, group)
            if not self.fits(p, state, group) or (id(p) not in layout.where and _is_view(state["exp_avg"])):
                self.conform(p, state, group)  # new tensors: nothing keeps an old bucket alive
            loc = layout.where.get(id(p))
            if loc is not None:
                self.attach(loc, p, state, group)
        return layout

    @torch.compiler.disable
    def sort(self, group: Dict[str, Any], pairs: List[Tuple[Tensor, Tensor]]) -> Optional[tuple]:
        """A step's work for ``group``, before any group steps: ``(layout, (per_bucket, rest, new))``
        (:meth:`sort_pairs`; the group's buckets, rebuilt where a parameter changed since), or ``None``
        for no ``pairs``. Never traced by an outer ``torch.compile`` (buckets are built here).

        Raises:
            ValueError: a state :meth:`sort_pairs` checks."""
        if not pairs:
            return None
        layout = None if self.owner.implementation == "reference" else self.group_layout(group)
        sorted_pairs = self.sort_pairs(group, pairs, layout)
        if sorted_pairs is None:  # a parameter changed dtype, device, shape or requires_grad since the layout was built
            layout = self.group_layout(group, rebuild=True)
            sorted_pairs = self.sort_pairs(group, pairs, layout)
        return layout, sorted_pairs

    def sort_pairs(self, group: Dict[str, Any], pairs: List[Tuple[Tensor, Tensor]],
                   layout: Optional["_GroupLayout"]) -> Optional[tuple]:
        """One pass over a step's ``(param, grad)`` pairs: ``(per_bucket, rest, new)``.

        ``per_bucket``: id(bucket) -> ``(index in the bucket, grad)`` pairs; ``rest``: the pairs of
        parameters outside every bucket; ``new``: the parameters whose state must be made (or
        conformed to a new dtype/device). ``None`` when the layout no longer fits a parameter (its
        dtype, device or shape changed, or it was unfrozen or converted into a bucket's kind). The
        states the step reads as they are, those outside the buckets and those a bucket did not put
        there (written or loaded since), are checked (:meth:`check_state`, :meth:`check_shared`).
        """
        per_bucket: Dict[int, List[Tuple[int, Tensor]]] = {}
        rest, new, read = [], [], False
        where = {} if layout is None else layout.where
        states = self.state  # the owner's, looked up once: this loop runs every step over every parameter
        for p, g in pairs:
            state = states.get(p)  # not states[p]: a failed check adds no empty entry
            loc = where.get(id(p))
            if loc is None:
                if layout is not None and bucket_key(p, self.use_master(p, group)) is not None:
                    return None
                rest.append((p, g))
                if state:  # checked before fits() reads it
                    self.check_state(p, group)
                    read = True
                if not state or not self.fits(p, state, group):
                    new.append(p)
            elif _moved(p, loc):
                self.check_state(p, group)  # its shape changed: its state made for the old one?
                return None
            else:
                if not state or not loc[0].is_attached(state, loc[1]):  # none, or replaced (the user, ZeRO's load)
                    new.append(p)
                    if state:
                        self.check_state(p, group)
                        read = True
                per_bucket.setdefault(id(loc[0]), []).append((loc[1], g))
        if read:  # of two parameters sharing a state dict, one has it as no bucket put it
            self.check_shared()
        return per_bucket, rest, new

    @torch.no_grad()
    def synced_master(self, param: Tensor, group: Dict[str, Any], decode: bool = True) -> Optional[Tensor]:
        """``param``'s master weight (state made or conformed first), synced with it; ``None`` if it has none.

        A split master (:mod:`halfadam.encodings`) needs no sync (it is decoded against the parameter);
        with ``decode`` it is decoded into a new float32 tensor, else ``None`` is returned."""
        state = self.init(param, group)
        if encodings.has_remainder(state):  # decoded on the local shard of a DTensor (FSDP2), sharded like it
            if not decode:
                return None
            lp = local(param)
            master = encodings.decode_state(self.format(param, group), lp, {k: local(v) for k, v in state.items()},
                                            ("master_weight",))["master_weight"]
            return like_param(master, param)
        master = state.get("master_weight")
        if master is not None:
            sync_master_(local(master), local(param))
        return master


def check_row_shards(groups: List[Dict[str, Any]], state_format: encodings.StateFormat) -> None:
    """ValueError naming the first DTensor parameter of ``groups`` whose local shard is not a run of
    whole rows where ``state_format`` keeps per-block state for it (blocks are cut along rows, so
    only row shards, FSDP2's default ``Shard(0)``, give every mesh the same blocks)."""
    if encodings.block_keys(state_format, True):
        for gi, g in enumerate(groups):
            for j, p in enumerate(g["params"]):
                if not row_sharded(p) and encodings.block_keys(
                        encodings.for_param(state_format, p, True), True):
                    raise ValueError(
                        f"param_groups[{gi}]['params'][{j}] is a DTensor whose local shard is not a run of whole "
                        f"rows (placements {p.placements}); the state format {state_format.describe()} "
                        f"keeps per-block state, which is sharded by rows: shard dim 0 (FSDP2's default "
                        f"Shard(0)), or use state_mode='fp32' or bfloat16 moments without split masters")


#: The keys a state may hold (besides user keys: none): ``step``, every encoding's, and :data:`REMAINDER_DTYPE`.
_KNOWN = {"step", REMAINDER_DTYPE, *encodings.ELEMENT_KEYS, *encodings.BLOCK_KEYS, *encodings.LEGACY_BLOCK_KEYS}
#: Keys a state may hold besides its encoding's: :data:`REMAINDER_DTYPE`, and a moment's per-block scale
#: left by a moment put there as floats (read as floats and encoded: the scale is dropped).
_LEFTOVERS = {REMAINDER_DTYPE, *(k for k in encodings.BLOCK_KEYS + encodings.LEGACY_BLOCK_KEYS if k != "master_tie")}


def _check_keys(state: dict, where: Callable[[], str]) -> None:
    """ValueError (named ``where()``) where ``state`` holds a key of no encoding (a user's), lacks
    ``step``, a moment or a key its encoding needs, holds another encoding's key (but the per-block
    scale of a moment given as floats in place of its codes, which conversion drops), a value other
    than ``step``'s that is no tensor, or a moment of no encoding's form (:func:`halfadam.encodings.format_of`)."""
    for key, value in state.items():
        if key in _KNOWN and key not in ("step", REMAINDER_DTYPE) and not isinstance(value, Tensor):
            raise ValueError(f"{where()}: its state[{key!r}] must be a tensor, got {type(value).__name__}")
    dtypes = (state[k].dtype if k in state else None for k in ("exp_avg", "exp_avg_sq"))
    problem = _keys_problem(frozenset(state), *dtypes)
    if problem:
        raise ValueError(f"{where()}: {problem}")


@functools.lru_cache(maxsize=256)
def _keys_problem(keys: frozenset, exp_avg: Optional[torch.dtype], exp_avg_sq: Optional[torch.dtype]) -> Optional[str]:
    """:func:`_check_keys`' finding for a state of ``keys`` whose moments have these dtypes, or ``None``
    (cached: a step checks the same few key sets over and over)."""
    fmt, extra = None, sorted(keys - _KNOWN)
    missing = [] if extra else [k for k in ("step", "exp_avg", "exp_avg_sq") if k not in keys]
    if not (extra or missing):
        try:  # format_of reads the keys and the moments' dtypes
            fmt = encodings.format_of({**dict.fromkeys(keys), "exp_avg": torch.empty(0, dtype=exp_avg),
                                       "exp_avg_sq": torch.empty(0, dtype=exp_avg_sq)})
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


def _readable(states: ParamStates, param: Tensor, group: Dict[str, Any]) -> bool:
    """Whether ``param``'s state passes :meth:`ParamStates.check_state` (a rebuild leaves one that does not
    as it is, outside the buckets, for the step that reads it to refuse by name)."""
    try:
        states.check_state(param, group)
    except ValueError:
        return False
    return True


def _counts(step: Tensor) -> bool:
    """Whether the tensor ``step`` holds a count of steps: one element, a whole number >= 0 where it can be
    read without a device synchronisation (on the CPU, where halfadam keeps it; a capturable step's is on
    the device, and only its form is checked)."""
    if step.numel() != 1 or step.is_meta or step.is_complex():
        return False
    return step.device.type != "cpu" or _is_count(step.detach().reshape(()).item())


def _param_shaped(t: Tensor, param: Tensor) -> bool:
    """Whether state tensor ``t`` has ``param``'s shape: its whole shape, or, a plain tensor in a DTensor
    parameter's state, that of this rank's shard (:meth:`ParamStates.adopt` makes it one)."""
    return t.shape == (local(param).shape if is_dtensor(param) and not is_dtensor(t) else param.shape)


def _foreign(param: Tensor, state: dict) -> bool:
    """Whether :meth:`ParamStates.adopt` changes ``state``: a ``step`` that is no 0-d float32 tensor, a
    :data:`REMAINDER_DTYPE`, a tensor that requires grad, a plain tensor (but ``step``) in a DTensor
    parameter's state."""
    sharded = is_dtensor(param)
    step = state.get("step")
    return not isinstance(step, Tensor) or step.dtype != torch.float32 or step.dim() or REMAINDER_DTYPE in state or any(
        isinstance(v, Tensor) and (v.requires_grad or (sharded and k != "step" and not is_dtensor(v)))
        for k, v in state.items())


def _moved(param: Tensor, loc: Tuple[Bucket, int]) -> bool:
    """Whether ``param`` changed dtype, device or shape since it was placed in bucket ``loc[0]``."""
    bucket, i = loc
    return param.dtype is not bucket.dtype or param.device != bucket.device or param.shape != bucket.shapes[i]


def _converted_exactly(old_dtype: torch.dtype, p: Tensor) -> Tensor:
    """Where converting a parameter from ``old_dtype`` to ``p``'s dtype kept its value, read off the new
    values ``p`` (bool, ``p``'s shape): everywhere when widening to float32/float64; bfloat16 ->
    float16 where ``p`` is in float16's normal range (bfloat16 values there all fit float16, and
    every other value lands below it or at inf); nowhere for float16 -> bfloat16 (3 bits fewer)."""
    if p.dtype in (torch.float32, torch.float64) or old_dtype == p.dtype:
        return torch.ones_like(p, dtype=torch.bool)
    if old_dtype == torch.bfloat16 and p.dtype == torch.float16:
        return p.isfinite() & (p.abs() >= 2.0 ** -14)
    return torch.zeros_like(p, dtype=torch.bool)


def _compute_dtype(param: Tensor) -> torch.dtype:
    """The dtype of the update math and moments for ``param``: float64 for float64, else float32."""
    return torch.float64 if param.dtype == torch.float64 else torch.float32


def _is_view(t: Tensor) -> bool:
    return local(t)._base is not None


class _GroupLayout:
    """A group's buckets and where each parameter sits in them (valid while group, state and the
    parameters' identities ``ids`` stay, and no parameter changed dtype, device or shape: :func:`_moved`)."""

    def __init__(self, group: Dict[str, Any], state: Any, ids: List[int], buckets: List[Bucket]):
        self.group, self.state, self.ids, self.buckets = group, state, ids, buckets
        self.where = {id(p): (b, i) for b in buckets for i, p in enumerate(b.params)}
