"""The per-parameter state of an optimizer: its format, its buckets, how it is made and how it follows
the parameter (the layer under :mod:`halfadam.optimizer`).

``optimizer.state[param]`` holds torch's keys (``step``, ``exp_avg``, ``exp_avg_sq``) and, with master
weights, ``master_weight``; other state modes store encodings (:mod:`halfadam.encodings`). This module
decides which keys and dtypes a parameter gets (:meth:`ParamStates.element_dtypes`), makes them
(:meth:`ParamStates.init_group`: views into a group's flat buckets, :mod:`halfadam.buckets`, or
tensors of their own), and keeps them fitting the parameter when it changes between steps: a new
dtype or device (:meth:`ParamStates.conform`), a new shape (:meth:`ParamStates.check_state`), a new
set of parameters (:meth:`ParamStates.group_layout`). What a user or a load wrote into a state is
checked (:meth:`ParamStates.check_state`, :meth:`ParamStates.check_shared`) and taken in
(:meth:`ParamStates.adopt`) by :mod:`halfadam.state_checks`, whose functions are those methods. The
optimizer asks it for a step's work (:meth:`ParamStates.sort_pairs`) and for masters
(:meth:`ParamStates.synced_master`).
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from . import encodings, state_checks
from ._dtensor import flat_offset, like_param, local, row_sharded
from .buckets import Bucket, bucket_key, build_buckets
from .functional import sync_master_
from .state_checks import REMAINDER_DTYPE, foreign, readable

__all__ = ["HALF_DTYPES", "REMAINDER_DTYPE", "ParamStates", "check_row_shards"]

#: The parameter dtypes that get a master weight by default (``master_weights=None``).
HALF_DTYPES = (torch.float16, torch.bfloat16)


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

    # What a user or a load wrote into a state, checked and taken in (halfadam.state_checks): the
    # module's functions, as methods of this class (no call between a step and them).
    check_state = state_checks.check_state
    check_shared = state_checks.check_shared
    adopt = state_checks.adopt
    stale_shape = state_checks.stale_shape

    @property
    def moment_keys(self) -> Tuple[str, ...]:
        """The update rule's moment keys (Adam's ``exp_avg``, ``exp_avg_sq``; SGD's ``momentum_buffer``...)."""
        return tuple(key for key, _ in self.state_format.moments)

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
        if "step" not in state or self.dtypes.get(id(param), param.dtype) != param.dtype:
            return False
        if encodings.is_labelled(state) or foreign(param, state):  # adopt() takes it in first
            return False
        expected = self.element_dtypes(param, group)
        return sorted(encodings.present_element_keys(state)) == sorted(expected) and all(
            state[k].dtype == dt and state[k].device == param.device for k, dt in expected.items())

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
            return dict.fromkeys(("master_weight",) * use_master + self.moment_keys, torch.float64)
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
            old_format = encodings.format_of(state, self.state_format.moments)
        except ValueError as exc:  # a moment of no encoding's form (one put there by hand): name the parameter
            raise ValueError(f"{self.place(param, group)}: {exc}") from None
        old_dtype = self.dtypes.get(id(param), param.dtype)
        if not (self.state_format.is_fp32 and old_format.is_fp32):
            # on a DTensor's (FSDP2's) local shards, whose elements keep their positions in the whole
            master = None
            p = local(param).detach()
            if old_dtype != param.dtype and encodings.has_master(state):
                old = {k: local(v).to(p.device) for k, v in state.items() if k != "step"}
                master = encodings.decode_state(encodings.format_of(old, self.state_format.moments), p.to(old_dtype), old,
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
        for key in self.moment_keys:
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
            for key in self.moment_keys:
                state[key] = torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)

    def group_layout(self, group: Dict[str, Any], rebuild: bool = False) -> "_GroupLayout":
        """The buckets of ``group``, (re)built when the group, its parameters or ``self.state`` changed,
        or when ``rebuild`` (a parameter's dtype, device or ``requires_grad`` changed: see
        :func:`halfadam.optimizer._run_group`).

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
            if not state or self.stale_shape(p) is not None or not readable(self, p, group):
                continue  # none, made for an old shape, or written into a form no rule reads: its next use raises
            self.adopt(p, state, group)
            if not self.fits(p, state, group) or (id(p) not in layout.where and any(
                    _is_view(state[k]) for k in encodings.present_element_keys(state))):
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
