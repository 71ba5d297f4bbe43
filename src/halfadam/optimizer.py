"""AdamW, Adam and AdamFP16 with fp32 master weights for float16/bfloat16 parameters.

One engine (:class:`_AdamBase`) holds the parameter groups and the state and hands each group to an
execution (:mod:`halfadam.executions`), which runs the single statement of the update math
(:func:`halfadam.functional.adam_update_`). The public classes only choose defaults and how weight
decay enters.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Mapping
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import hyperparams
from . import state_dict as _state_dict
from . import encodings
from ._dtensor import flat_offset, is_dtensor, like_param, local, localize, row_sharded
from .buckets import Bucket, bucket_key, build_buckets
from .executions import (IMPLEMENTATIONS, Hyperparameters, capturable_step, flat_step, reference_step, shard_step,
                         triton_unavailable)
from .functional import DECAY_MODES, sync_master_
from .param_groups import (STATE_FORMAT_KEYS, check_disjoint, check_grad, check_group_keys, check_order_params,
                           check_pairs, check_param, check_torch_flags, is_named, raise_foreign_key, split_params)

__all__ = ["AdamW", "Adam", "AdamFP16", "WeightDecay"]

_HALF_DTYPES = (torch.float16, torch.bfloat16)


class _AdamBase(torch.optim.Optimizer):
    """The shared engine of :class:`AdamW`, :class:`Adam` and :class:`AdamFP16`.

    Per-parameter state (``optimizer.state[param]``):

    * ``step``: 0-d float32 CPU tensor, steps taken by this parameter (as torch.optim.AdamW);
    * ``exp_avg``, ``exp_avg_sq``: first and second moments, float32 (float64 for float64 parameters),
      the parameter's shape;
    * ``master_weight``: the float32 master copy, present when master weights are on for the parameter
      (by default: float16 and bfloat16 parameters).

    Other state modes (``state_mode=``) store encodings instead: see :mod:`halfadam.encodings`.

    Per-group keys beyond torch's: ``lr_schedule`` and ``weight_decay_schedule`` (a callable of the
    global step, or ``None``), ``decay``, ``optimized_update``, ``master_weights`` and ``global_step``
    (steps taken by the optimizer; 0-based index of the next step, which schedules are evaluated at).
    """

    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: Any,
        learning_rate: Any,
        betas: Any,
        eps: Any,
        weight_decay: Any,
        decay: str,
        optimized_update: bool,
        master_weights: Optional[bool],
        implementation: str = "auto",
        state_mode: str = "fp32",
        store_param_remainders: Optional[bool] = None,
        exp_avg_dtype: Optional[torch.dtype] = None,
        exp_avg_sq_dtype: Optional[torch.dtype] = None,
        capturable: bool = False,
    ):
        if learning_rate is not None:
            if lr is not None:
                raise TypeError("pass the learning rate as either lr or learning_rate, not both")
            lr, lr_name = learning_rate, "learning_rate"
        else:
            lr, lr_name = (1e-3 if lr is None else lr), "lr"
        if decay not in DECAY_MODES:
            raise ValueError(f"decay must be one of {DECAY_MODES}, got {decay!r}")
        if not isinstance(implementation, str) or implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
        self.implementation = implementation
        if not isinstance(capturable, bool):
            raise TypeError(f"capturable must be True or False, got {capturable!r}")
        if capturable and implementation not in ("auto", "triton"):
            raise ValueError(f"capturable=True runs the Triton kernel (implementation='auto' or 'triton'), "
                             f"not implementation={implementation!r}")
        self.capturable = capturable
        self.state_format = encodings.state_format(state_mode, store_param_remainders=store_param_remainders,
                                                   exp_avg_dtype=exp_avg_dtype, exp_avg_sq_dtype=exp_avg_sq_dtype)
        self._layouts: Dict[int, "_GroupLayout"] = {}
        self._dtypes: Dict[int, torch.dtype] = {}  # id(param) -> its dtype when its state was made
        self._written: Dict[int, Tuple[float, float]] = {}  # id(group) -> (lr, weight_decay) of the last step
        self._override_warned = self._narrowing_warned = False
        if master_weights is not None and not isinstance(master_weights, bool):
            raise TypeError(f"master_weights must be None, True or False, got {master_weights!r}")

        lr_value, lr_schedule = hyperparams.parse_lr(lr, lr_name)
        wd_value, wd_schedule = hyperparams.parse_weight_decay(weight_decay, "weight_decay")
        defaults = dict(
            lr=lr_value,
            lr_schedule=lr_schedule,
            betas=hyperparams.parse_betas(betas, "betas"),
            eps=hyperparams.parse_eps(eps, "eps"),
            weight_decay=wd_value,
            weight_decay_schedule=wd_schedule,
            decay=decay,
            optimized_update=bool(optimized_update),
            master_weights=master_weights,
        )
        groups, order_params = split_params(params)
        # Validate every group before anything is built; add_param_group validates again (cheaply)
        # because it is also the public way to add a group later.
        groups = [self._normalize_group(g, f"param_groups[{i}]") for i, g in enumerate(groups)]
        check_disjoint(groups)
        if not any(g["params"] for g in groups):
            raise ValueError("params holds no parameter: every parameter group is empty")
        check_order_params(order_params, groups)
        if encodings.block_keys(self.state_format, True):
            for gi, g in enumerate(groups):
                for j, p in enumerate(g["params"]):
                    if not row_sharded(p) and encodings.block_keys(
                            encodings.for_param(self.state_format, p, True), True):
                        raise ValueError(
                            f"param_groups[{gi}]['params'][{j}] is a DTensor whose local shard is not a run of whole "
                            f"rows (placements {p.placements}); the state format {self.state_format.describe()} "
                            f"keeps per-block state, which is sharded by rows: shard dim 0 (FSDP2's default "
                            f"Shard(0)), or use state_mode='fp32' or bfloat16 moments without split masters")
        if order_params is not None:
            rank = {id(p): i for i, p in enumerate(order_params)}
            for g in groups:
                g["params"] = sorted(g["params"], key=lambda p: rank[id(p)])
        self._order_params: Optional[List[Tensor]] = order_params
        super().__init__(groups, defaults)

    def __getstate__(self) -> Dict[str, Any]:  # torch keeps only defaults, state and param_groups
        state = super().__getstate__()
        state["implementation"] = self.implementation
        state["capturable"] = self.capturable
        state["state_format"] = self.state_format
        state["_order_params"] = self._order_params
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        state = dict(state)
        self.implementation = state.pop("implementation", "auto")
        self.capturable = state.pop("capturable", False)
        self.state_format = state.pop("state_format", encodings.StateFormat())
        self._order_params = state.pop("_order_params", None)
        self._layouts = {}  # rebuilt from the state on the next step (values are copied in)
        self._dtypes = {}
        self._written, self._override_warned, self._narrowing_warned = {}, False, False
        super().__setstate__(state)

    # ------------------------------------------------------------------ groups
    def _normalize_group(self, group: Dict[str, Any], where: str) -> Dict[str, Any]:
        """Validate one parameter group and turn its hyperparameters into their stored form.

        Raises TypeError/ValueError naming the group and key (see the class docstring); nothing is
        built before every group has passed.
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
            if fmt != self.state_format:
                raise ValueError(f"{where} asks for the state format {fmt.describe()}, this optimizer has "
                                 f"{self.state_format.describe()}: the state format is per optimizer, not per group")
        check_group_keys(group, where)
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
        if "betas" in group:
            group["betas"] = hyperparams.parse_betas(group["betas"], f"{where}['betas']")
        if "eps" in group:
            group["eps"] = hyperparams.parse_eps(group["eps"], f"{where}['eps']")
        return group

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a parameter group (validated first; on error nothing is added).

        Its ``global_step`` starts at the optimizer's, so schedules stay aligned across groups, and
        its scheduled ``lr``/``weight_decay`` show their values at that step (the coming step's).
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        group = self._normalize_group(param_group, f"param_groups[{len(self.param_groups)}]")
        check_disjoint(self.param_groups + [group])
        group.setdefault("global_step", max((g["global_step"] for g in self.param_groups), default=0))
        where = f"param_groups[{len(self.param_groups)}]"
        for key in ("lr", "weight_decay"):  # show the coming step's value, as every group does
            if group.get(f"{key}_schedule") is not None:
                group[key] = _resolve(group, key, where, group["global_step"])
        super().add_param_group(group)
        if self._order_params is not None and len(self.param_groups) > 1:
            known = {id(p) for p in self._order_params}
            self._order_params += [p for p in group["params"] if id(p) not in known]

    def params_in_order(self) -> List[Tensor]:
        """Every parameter, in the optimizer's order: ``order_params`` when given, else group by group."""
        if self._order_params is not None:
            return list(self._order_params)
        return [p for g in self.param_groups for p in g["params"]]

    # ------------------------------------------------------------------ state
    def _use_master(self, param: Tensor, group: Dict[str, Any]) -> bool:
        use_master = group["master_weights"]
        return param.dtype in _HALF_DTYPES if use_master is None else use_master

    def _format(self, param: Tensor, group: Dict[str, Any]) -> encodings.StateFormat:
        """The state format of ``param`` (the optimizer's, less what does not apply to it)."""
        return encodings.for_param(self.state_format, param, self._use_master(param, group))

    def _state_fits(self, param: Tensor, state: dict, group: Dict[str, Any]) -> bool:
        """Whether ``state`` was made for ``param`` as it is now (dtype, device, master setting, format)."""
        ea = state.get("exp_avg")
        if ea is None or ea.device != param.device or self._dtypes.get(id(param), param.dtype) != param.dtype:
            return False
        expected = self._state_dtypes(param, group)
        present = [k for k in encodings.ELEMENT_KEYS if k in state]
        return sorted(present) == sorted(expected) and all(state[k].dtype == dt for k, dt in expected.items())

    def _state_dtypes(self, param: Tensor, group: Dict[str, Any]) -> Dict[str, torch.dtype]:
        """The per-element state keys ``param`` has in this optimizer, and their dtypes."""
        use_master = self._use_master(param, group)
        if param.dtype == torch.float64:
            return dict.fromkeys(("master_weight",) * use_master + ("exp_avg", "exp_avg_sq"), torch.float64)
        return encodings.element_keys(self._format(param, group), use_master)

    @torch.no_grad()
    def _conform_state(self, param: Tensor, state: dict, group: Dict[str, Any]) -> None:
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
        """
        old_dtype = self._dtypes.get(id(param), param.dtype)
        if not (self.state_format.is_fp32 and encodings.format_of(state).is_fp32):
            # on a DTensor's (FSDP2's) local shards, whose elements keep their positions in the whole
            master = None
            p = local(param).detach()
            if old_dtype != param.dtype and encodings.has_master(state):
                old = {k: local(v).to(p.device) for k, v in state.items() if k != "step"}
                master = encodings.decode_state(encodings.format_of(old), p.to(old_dtype), old,
                                                ("master_weight",))["master_weight"]
                # an fp32 master (a 1-D parameter) never depended on the old value
                kept = (_converted_exactly(old_dtype, p) if "master_lo" in state
                        else torch.ones_like(p, dtype=torch.bool))
                unwritten = kept & (p == master.to(old_dtype).to(p.dtype))
                p.copy_(torch.where(unwritten, master.to(p.dtype), p))
                master = torch.where(unwritten, master, p.to(torch.float32))
                if not self._narrowing_warned and not bool(kept.all()):
                    self._narrowing_warned = True
                    warnings.warn(
                        f"a {old_dtype} parameter with a split master (state mode {self.state_format.describe()}) "
                        f"was converted to {param.dtype}, which does not hold every {old_dtype} value: the remainders "
                        f"were over the old values, so the masters of {int((~kept).sum())} element(s) restart from "
                        f"the converted parameter (within half a {param.dtype} ulp of the old masters). To keep "
                        f"exact masters across fp16 <-> bf16, use state_mode='fp32', or carry them with "
                        f"master_state_dict / halfadam.checkpoint.load_master_state_dict", UserWarning, stacklevel=4)
            new = encodings.convert_state({k: local(v) for k, v in state.items()}, p, self._format(param, group),
                                          self._use_master(param, group), master, flat_offset(param))
            new = encodings.like_param_state(new, param)
            state.clear()
            state.update({k: v.to(torch.float64) if param.dtype == torch.float64 and k != "step" else v
                          for k, v in new.items()})
            self._dtypes[id(param)] = param.dtype
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
        if self._use_master(param, group):
            state["master_weight"] = master if master is not None else param.detach().to(compute, copy=True)
        self._dtypes[id(param)] = param.dtype

    def _stale_shape(self, param: Tensor) -> Optional[Tuple[int, ...]]:
        """The shape ``param``'s state was made for, when it is not ``param``'s own (it was resized
        since: ``p.data = torch.randn(...)`` of a new size between steps); else ``None``."""
        state = self.state.get(param)
        exp_avg = state.get("exp_avg") if state else None
        return None if exp_avg is None or exp_avg.shape == param.shape else tuple(exp_avg.shape)

    def _check_state_shape(self, param: Tensor, group: Dict[str, Any], where: Optional[str] = None) -> None:
        """ValueError when ``param``'s state was made for another shape (:meth:`_stale_shape`): it does
        not fit the parameter, and no rule makes it fit."""
        made = self._stale_shape(param)
        if made is None:
            return
        if where is None:
            where = f"param_groups[{next(i for i, g in enumerate(self.param_groups) if g is group)}]"
        k = next(i for i, q in enumerate(group["params"]) if q is param)
        raise ValueError(
            f"{where}['params'][{k}] has shape {tuple(param.shape)}, but its optimizer state (exp_avg, exp_avg_sq, "
            f"master) was made for shape {made}: the parameter was resized since (p.data = ...). To continue with "
            f"fresh state for it (step 0, zero moments, the master from its new value), remove its state first: "
            f"del optimizer.state[p]; or give it back its shape {made}")

    def _check_state_shapes(self, group: Dict[str, Any], pairs: List[Tuple[Tensor, Tensor]], where: str) -> None:
        """:meth:`_check_state_shape` for a step's ``pairs``, cheaply: a bucketed parameter of its
        bucket's shape has state of that shape (the bucket's views). A bucketed parameter whose shape
        changed and passes (its state was deleted) drops the group's layout, to be rebuilt around it."""
        layout = self._layouts.get(id(group))
        where_ = {} if layout is None else layout.where
        for p, _ in pairs:
            loc = where_.get(id(p))
            if loc is None or loc[0].shapes[loc[1]] != p.shape:
                self._check_state_shape(p, group, where)
                if loc is not None:
                    self._layouts.pop(id(group), None)

    def _init_state(self, param: Tensor, group: Dict[str, Any]) -> dict:
        """Parameter ``param``'s state, initialised if empty and conformed to its dtype and device.

        Raises:
            ValueError: the state was made for another shape of ``param`` (:meth:`_check_state_shape`).
        """
        self._check_state_shape(param, group)
        state = self.state[param]
        if not state or not self._state_fits(param, state, group):
            self._init_group_state(group, [param])
        return state

    def _init_group_state(self, group: Dict[str, Any], params: Optional[List[Tensor]] = None) -> None:
        """Initialise the state of ``params`` (default: every parameter of ``group``) where empty.

        The one place state is created. Bucketed parameters (see :mod:`halfadam.buckets`) get views
        into their bucket's flat buffers (values already in ``state[p]`` are copied in); the others
        get separately allocated tensors. Keys and dtypes are the same either way. State made for
        another dtype or device of the parameter is conformed first (:meth:`_conform_state`).
        """
        if params is not None and not params:
            return  # the common case in a step: every parameter already has its state
        layout = self._group_layout(group) if self.implementation != "reference" else None
        for param in group["params"] if params is None else params:
            state = self.state[param]
            if state and not self._state_fits(param, state, group):
                self._conform_state(param, state, group)
            loc = None if layout is None else layout.where.get(id(param))
            if loc is not None and _moved(param, loc):
                layout = self._group_layout(group, rebuild=True)  # converted since the layout was built
                loc = layout.where.get(id(param))
            if loc is not None:
                if not state or not loc[0].is_attached(state, loc[1]):
                    loc[0].attach(state, loc[1])
                    self._dtypes[id(param)] = param.dtype
                continue
            if state:
                continue
            compute_dtype = _compute_dtype(param)
            self._dtypes[id(param)] = param.dtype
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            if param.dtype != torch.float64 and not self.state_format.is_fp32:
                state.update(encodings.new_state(self._format(param, group), param, self._use_master(param, group)))
                continue
            if self._use_master(param, group):
                state["master_weight"] = param.detach().to(compute_dtype, copy=True)
            state["exp_avg"] = torch.zeros_like(param, dtype=compute_dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=compute_dtype, memory_format=torch.preserve_format)

    def _group_layout(self, group: Dict[str, Any], rebuild: bool = False) -> "_GroupLayout":
        """The buckets of ``group``, (re)built when the group, its parameters or ``self.state`` changed,
        or when ``rebuild`` (a parameter's dtype, device or ``requires_grad`` changed: see
        :meth:`_run_group`).

        On a rebuild, parameters that already have state (e.g. after ``load_state_dict`` replaced
        ``self.state``, or after ``model.half()``) are conformed to their parameter and attached to
        the new buffers with their values; state left outside every bucket gets its own tensors.
        """
        layout = self._layouts.get(id(group))
        ids = [id(p) for p in group["params"]]  # ints: cheap to build and compare every step
        if (not rebuild and layout is not None and layout.group is group and layout.state is self.state
                and layout.ids == ids):
            return layout
        params = group["params"]
        buckets = build_buckets(params, [self._use_master(p, group) for p in params], self.state_format,
                                steps_on_device=self.capturable)
        layout = _GroupLayout(group, self.state, ids, buckets)
        self._layouts[id(group)] = layout
        for p in params:
            state = self.state.get(p)
            if not state or self._stale_shape(p) is not None:  # none, or made for an old shape: its next use raises
                continue
            if not self._state_fits(p, state, group) or (id(p) not in layout.where and _is_view(state["exp_avg"])):
                self._conform_state(p, state, group)  # new tensors: nothing keeps an old bucket alive
            loc = layout.where.get(id(p))
            if loc is not None:
                loc[0].attach(state, loc[1])
                self._dtypes[id(p)] = p.dtype
        return layout

    @torch.compiler.disable
    def _run_group(self, group: Dict[str, Any], pairs: List[Tuple[Tensor, Tensor]], hp: Hyperparameters,
                   grad_scale: Optional[Tensor], found_inf: Optional[Tensor] = None) -> None:
        """Dispatch one group's step: buckets to the flat path, everything else to the reference.

        The parameters of a bucket that have a gradient this step (all of them, or a subset: frozen
        or unused parameters leave gaps) go to one flat step when their step counts agree. Never
        traced by an outer ``torch.compile`` (``torch.compile(opt.step)``, a compiled train step):
        the update runs halfadam's own kernels, called through a graph break, so it is the same
        update, compiled the way it must be (see :func:`halfadam.functional.sync_master_`).
        """
        layout = None if self.implementation == "reference" else self._group_layout(group)
        sorted_pairs = self._sort_pairs(group, pairs, layout)
        if sorted_pairs is None:  # a parameter changed dtype, device or requires_grad since the layout was built
            layout = self._group_layout(group, rebuild=True)
            sorted_pairs = self._sort_pairs(group, pairs, layout)
        per_bucket, rest, new = sorted_pairs
        self._init_group_state(group, new)
        for bucket in () if layout is None else layout.buckets:
            items = per_bucket.get(id(bucket))
            if not items:
                continue
            items.sort(key=lambda item: item[0])
            if self.capturable:  # the step counts stay on the device: one launch whatever they are
                capturable_step(bucket, items, hp, self.implementation, grad_scale, found_inf)
                continue
            # One step count: one flat step. Step counts that diverged (a parameter without a gradient
            # at some step: an unused expert, a frozen-then-thawed layer): one flat step per count, so
            # that state["step"] keeps torch's per-parameter meaning (bias corrections per parameter).
            if bucket.steps_uniform(None if len(items) == len(bucket.params) else [i for i, _ in items]):
                flat_step(bucket, items, hp, self.implementation, grad_scale)
            else:
                counts = bucket.steps[[i for i, _ in items]].tolist()
                for count in sorted(set(counts)):
                    flat_step(bucket, [it for it, c in zip(items, counts) if c == count], hp, self.implementation,
                              grad_scale)
        if rest:
            offsets = [flat_offset(p) for p, _ in rest]  # a shard's first element in its parameter
            local_pairs, local_state = localize(rest, self.state)
            if self.implementation in ("auto", "triton", "cpp") and any(is_dtensor(p) for p, _ in rest):
                # FSDP2's local shards: the C++ kernel (CPU) or the Triton one (GPU) where it runs
                left = shard_step(local_pairs, local_state, hp, self.implementation, grad_scale,
                                  self.state_format, offsets)
                local_pairs, offsets = [local_pairs[k] for k in left], [offsets[k] for k in left]
            if local_pairs:
                reference_step(local_pairs, local_state, hp, grad_scale, self.state_format, offsets)

    def _sort_pairs(self, group: Dict[str, Any], pairs: List[Tuple[Tensor, Tensor]],
                    layout: Optional["_GroupLayout"]) -> Optional[tuple]:
        """One pass over a step's ``(param, grad)`` pairs: ``(per_bucket, rest, new)``.

        ``per_bucket``: id(bucket) -> ``(index in the bucket, grad)`` pairs; ``rest``: the pairs of
        parameters outside every bucket; ``new``: the parameters whose state must be made (or
        conformed to a new dtype/device). ``None`` when the layout no longer fits a parameter (its
        dtype or device changed, or it was unfrozen or converted into a bucket's kind).
        """
        per_bucket: Dict[int, List[Tuple[int, Tensor]]] = {}
        rest, new = [], []
        where = {} if layout is None else layout.where
        for p, g in pairs:
            state = self.state[p]
            loc = where.get(id(p))
            if loc is None:
                if layout is not None and bucket_key(p, self._use_master(p, group)) is not None:
                    return None
                rest.append((p, g))
                if not state or not self._state_fits(p, state, group):
                    new.append(p)
            elif _moved(p, loc, shape=False):  # shape changes: the step's validation dropped the layout
                return None
            else:
                if not state:
                    new.append(p)
                per_bucket.setdefault(id(loc[0]), []).append((loc[1], g))
        return per_bucket, rest, new

    def master_weight(self, param: Tensor) -> Tensor:
        """The fp32 tensor this optimizer updates for ``param``, in sync with the parameter.

        The master copy for a parameter with master weights (created from the parameter now if no step
        has run yet; elements where the parameter was changed since take its value, see
        :meth:`sync_master_weights`), or the parameter itself for a float32 parameter without one.
        A frozen parameter (``requires_grad=False``) that never took a step has no state and gets a
        new float32 copy of its value (no state is made for it).

        Raises:
            KeyError: ``param`` is not in this optimizer.
            ValueError: ``param`` is float16/bfloat16 and its master weights are off (no fp32 tensor
                exists: each step computes on a temporary copy).
        """
        for group in self.param_groups:
            if any(p is param for p in group["params"]):
                if not param.requires_grad and not self.state.get(param) and self._use_master(param, group):
                    return param.detach().to(torch.float32, copy=True)  # frozen, never stepped: no state made
                master = self._synced_master(param, group)
                if master is not None:
                    return master
                if param.dtype in _HALF_DTYPES:
                    raise ValueError(f"master weights are off for this {param.dtype} parameter: it has no fp32 copy")
                return param
        raise KeyError("the tensor is not a parameter of this optimizer")

    @torch.no_grad()
    def sync_master_weights(self) -> None:
        """Apply the master-sync rule to every parameter that has state, now.

        Wherever a float16/bfloat16 parameter no longer equals its fp32 master rounded to the
        parameter's dtype (it was written outside the optimizer: ``model.load_state_dict``, ``copy_``,
        ``.data``, a framework), the master takes the parameter's value, element by element
        (:func:`halfadam.functional.sync_master_`); elsewhere it keeps its extra bits. State made for
        another dtype or device of a parameter (``model.half()``, ``.to(device)``) is conformed too.

        :meth:`step` applies the rule itself, inside the update, to every parameter it updates, and
        :meth:`master_weight`, :meth:`state_dict` and :meth:`master_state_dict` before they read the
        masters, so calling this is never required; it is for code that reads
        ``optimizer.state[p]["master_weight"]`` directly.
        """
        for group in self.param_groups:
            for p in group["params"]:
                if self.state.get(p):
                    self._synced_master(p, group, decode=False)

    @torch.no_grad()
    def _synced_master(self, param: Tensor, group: Dict[str, Any], decode: bool = True) -> Optional[Tensor]:
        """``param``'s master weight (state made or conformed first), synced with it; ``None`` if it has none.

        A split master (:mod:`halfadam.encodings`) needs no sync (it is decoded against the parameter);
        with ``decode`` it is decoded into a new float32 tensor, else ``None`` is returned."""
        state = self._init_state(param, group)
        if "master_lo" in state:  # decoded on the local shard of a DTensor (FSDP2), sharded like it
            if not decode:
                return None
            lp = local(param)
            master = encodings.decode_state(self._format(param, group), lp, {k: local(v) for k, v in state.items()},
                                            ("master_weight",))["master_weight"]
            return like_param(master, param)
        master = state.get("master_weight")
        if master is not None:
            sync_master_(local(master), local(param))
        return master

    # ------------------------------------------------------------------ checkpoints
    # The work is in halfadam.state_dict; these methods only delegate to it.
    def state_dict(self) -> Dict[str, Any]:
        """The state in torch's layout, fp32 state as fp32, schedules as plain data.

        See :func:`halfadam.state_dict.optimizer_state_dict`; ``torch.load(weights_only=True)`` reads it.
        """
        return _state_dict.optimizer_state_dict(self)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a halfadam or torch.optim.Adam/AdamW state_dict: checked first, never changes a state dtype.

        See :func:`halfadam.state_dict.load_optimizer_state_dict`. Raises
        :class:`halfadam.checkpoint.CheckpointError` (a ValueError) with nothing changed on a mismatch.
        """
        _state_dict.load_optimizer_state_dict(self, state_dict)

    def to_torch_state_dict(self) -> Dict[str, Any]:
        """This state as a ``torch.optim.AdamW`` state_dict (no masters); see :mod:`halfadam.checkpoint`."""
        return _state_dict.to_torch_state_dict(self)

    def master_state_dict(self, model: torch.nn.Module) -> Dict[str, Tensor]:
        """``model.state_dict()`` with the fp32 master weights in place of the fp16/bf16 parameters.

        See :func:`halfadam.state_dict.master_state_dict`; load it back with
        :func:`halfadam.checkpoint.load_master_state_dict`.
        """
        return _state_dict.master_state_dict(self, model)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None, *, grads: Optional[Dict[Tensor, Optional[Tensor]]] = None,
             grad_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None):
        """Take one optimization step.

        Args:
            closure: re-evaluates the model and returns the loss (optional, as in torch).
            grads: gradients to use instead of ``param.grad``: a mapping from parameter to gradient of
                the parameter's shape (any floating dtype; fp32 keeps small values that fp16 flushes to
                zero). Parameters missing from the mapping, or mapped to ``None``, are skipped, as are
                parameters whose ``.grad`` is ``None`` when ``grads`` is not given. This is how
                :class:`halfadam.GradScaler` hands over unscaled fp32 gradients.
            grad_scale: a 1-element float32 tensor multiplying every gradient (converted to float32)
                before the update, or ``None``. This is how :class:`halfadam.GradScaler` hands over
                still-scaled gradients with the inverse loss scale (times a clipping coefficient),
                so the fused kernel unscales as it reads them: no unscaled copy is written.
            found_inf: a 1-element floating tensor, or ``None``; nonzero means "skip": the step then
                changes no parameter, state or step count (as torch's fused AdamW). With
                ``capturable=False`` it is read on the host (one synchronisation) and a skipped call
                also leaves ``global_step``; with ``capturable=True`` it reaches the kernel as a device
                value and nothing waits for it (``global_step``, a host count for the schedules,
                then counts the call). This is how :class:`halfadam.GradScaler` hands over its inf/nan
                check to a capturable optimizer.

        Every gradient, key and scheduled hyperparameter is checked before any state changes: a call
        that raises leaves parameters, state and ``global_step`` as they were. (Should a kernel still
        fail inside the update, the step counts, ``global_step`` and the scheduled values do not
        move; buckets updated before the failure keep their new values.) Each parameter that
        has a master weight first applies the master-sync rule (:meth:`sync_master_weights`), so a
        value written to it since the last step is where this step starts. Afterwards
        ``group["lr"]`` and ``group["weight_decay"]`` hold the values of the coming step when they
        are scheduled.

        Raises:
            TypeError: a sparse or non-floating gradient; ``grads`` not a mapping; ``grad_scale``
                not a 1-element floating tensor.
            ValueError: a gradient whose shape or device differs from its parameter's; a key of
                ``grads`` that is not a parameter of this optimizer (``p.detach()``, ``p.data``); a
                parameter whose elements share memory; a learning rate or weight decay (fixed or from
                a schedule) that is negative, nan or inf.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        # Everything is checked before anything changes: a failing call leaves the optimizer as it was.
        if grads is not None and not isinstance(grads, Mapping):
            raise TypeError(f"grads must be a mapping from parameter to gradient, got {type(grads).__name__}")
        matched = 0  # keys of grads that are this optimizer's parameters
        if grad_scale is not None and not (isinstance(grad_scale, Tensor) and grad_scale.numel() == 1
                                           and grad_scale.is_floating_point()):
            raise TypeError(f"grad_scale must be None or a 1-element floating tensor, got {grad_scale!r}")
        if found_inf is not None and not (isinstance(found_inf, Tensor) and found_inf.numel() == 1
                                          and found_inf.is_floating_point()):
            raise TypeError(f"found_inf must be None or a 1-element floating tensor, got {found_inf!r}")
        plan = []
        for gi, group in enumerate(self.param_groups):
            where = f"param_groups[{gi}]"
            self._warn_if_overridden(group, where)
            step = group["global_step"]
            lr, weight_decay = _resolve(group, "lr", where, step), _resolve(group, "weight_decay", where, step)
            # what group["lr"] / ["weight_decay"] show after the step: the values of the next one (a bad
            # value there is the next step's error, not this one's)
            after = {key: _peek(group, key, step + 1) for key in ("lr", "weight_decay")
                     if group.get(f"{key}_schedule") is not None}
            if grads is None:
                pairs = [(p, p.grad) for p in group["params"]]
            else:
                pairs = [(p, grads[p]) for p in group["params"] if p in grads]
                matched += len(pairs)
            pairs = [pg for pg in pairs if pg[1] is not None]
            check_pairs(pairs, group["params"], where)
            self._check_state_shapes(group, pairs, where)
            if self.capturable:
                self._check_capturable(pairs, group, where)
            plan.append((group, lr, weight_decay, after, pairs))
        if grads is not None and matched != len(grads):
            raise_foreign_key(grads, self.param_groups)
        if found_inf is not None and not self.capturable:
            if found_inf.item() != 0:
                return loss
            found_inf = None

        for group, lr, weight_decay, after, pairs in plan:
            if pairs:
                beta1, beta2 = group["betas"]
                hp = Hyperparameters(lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=weight_decay,
                                     decay=group["decay"], optimized_update=group["optimized_update"])
                self._run_group(group, pairs, hp, grad_scale, found_inf)
        for group, lr, weight_decay, after, pairs in plan:  # the schedules move once every group has stepped
            group["global_step"] += 1
            group.update((k, v) for k, v in after.items() if v is not None)
            self._written[id(group)] = (group["lr"], group["weight_decay"])
        return loss

    def _check_capturable(self, pairs: List[Tuple[Tensor, Tensor]], group: Dict[str, Any], where: str) -> None:
        """ValueError for a parameter a capturable step cannot take: one on a device the Triton kernel
        does not run on (the CPU, unless under Triton's interpreter), or one outside the buckets
        (float64, a DTensor, a half parameter without master weights, a frozen one), which runs the
        reference path, which reads its step count on the host."""
        for device in {p.device for p, _ in pairs}:
            reason = triton_unavailable(device)
            if reason is not None:
                k = next(i for i, q in enumerate(group["params"]) if q.device == device)
                raise ValueError(
                    f"capturable=True cannot step {where}['params'][{k}], a {device.type} tensor: a capturable step "
                    f"runs the Triton kernel, which needs CUDA tensors ({reason}). Use capturable=True with the "
                    f"model on a CUDA device; elsewhere leave it False (the default)")
        for p, _ in pairs:
            if bucket_key(p, self._use_master(p, group)) is None:
                k = next(i for i, q in enumerate(group["params"]) if q is p)
                raise ValueError(
                    f"{where}['params'][{k}] ({p.dtype}{', a DTensor' if is_dtensor(p) else ''}) takes the "
                    f"per-parameter reference path, which reads its step count on the host: capturable=True "
                    f"steps float32 parameters and float16/bfloat16 ones with master weights")

    def _warn_if_overridden(self, group: Dict[str, Any], where: str) -> None:
        """Warn once when a scheduled value was changed from outside since the last step (e.g. by a
        torch ``lr_scheduler``): the schedule sets it at every step, so that change has no effect."""
        written = self._written.get(id(group))
        if written is None or self._override_warned:
            return
        for key, value in zip(("lr", "weight_decay"), written):
            if group.get(f"{key}_schedule") is not None and group[key] != value:
                self._override_warned = True
                warnings.warn(
                    f"{where}['{key}'] was changed outside the optimizer (by a torch lr_scheduler?), but this "
                    f"{key} is a schedule of the global step, which sets it at every step: the change has no "
                    f"effect", UserWarning, stacklevel=4)

    def __call__(self, gradients: Sequence[Tensor]) -> Tuple[bool, ...]:
        """Functional call (mindformers style): one step with ``gradients`` instead of ``.grad``.

        Args:
            gradients: one gradient per parameter, in :meth:`params_in_order` order (``order_params``
                order when given), each of its parameter's shape; ``None`` skips a parameter.

        Returns:
            A tuple of ``True``, one per parameter (mindformers returns the update's success flags).

        Raises:
            ValueError: wrong number of gradients or a wrong shape (before any state changes).
        """
        order = self.params_in_order()
        gradients = tuple(gradients)
        if len(gradients) != len(order):
            raise ValueError(f"gradients has {len(gradients)} entries, expected one per parameter ({len(order)})")
        for i, (p, g) in enumerate(zip(order, gradients)):
            if g is not None:
                check_grad(g, p, f"gradients[{i}]")
        self.step(grads=dict(zip(order, gradients)))
        return tuple(True for _ in order)


def _peek(group: Dict[str, Any], key: str, step: int) -> Optional[float]:
    """The scheduled value of ``key`` at ``step``, or ``None`` if the schedule fails there."""
    try:
        return hyperparams.value_at(group[f"{key}_schedule"], step, key)
    except Exception:
        return None


def _moved(param: Tensor, loc: Tuple[Bucket, int], shape: bool = True) -> bool:
    """Whether ``param`` changed dtype, device or (with ``shape``) shape since it was placed in bucket
    ``loc[0]``."""
    bucket, i = loc
    return (param.dtype is not bucket.dtype or param.device != bucket.device
            or (shape and param.shape != bucket.shapes[i]))


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


def _resolve(group: Dict[str, Any], key: str, where: str, step: int) -> float:
    """The group's value of ``key`` at global step ``step`` (its schedule's, or the fixed value), validated."""
    schedule = group.get(f"{key}_schedule")
    if schedule is not None:
        return hyperparams.value_at(schedule, step, f"{where}['{key}']")
    value = group[key]  # a number, or a tensor set by the user or a torch lr_scheduler
    if isinstance(value, Tensor) and value.numel() == 1 and not value.is_meta:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where}['{key}'] must be a number (or a 1-element tensor), got "
                        f"{type(value).__name__}: {value!r}")
    return hyperparams.check_value(value, f"{where}['{key}']")


class AdamW(_AdamBase):
    r"""AdamW with fp32 master weights for float16/bfloat16 parameters.

    A drop-in :class:`torch.optim.Optimizer`. For every fp16/bf16 parameter it keeps an fp32 master
    copy and fp32 moments, applies the update in fp32 and writes the rounded result back into the
    parameter in place (its storage, ``data_ptr()``, tied weights and views are kept). float32
    parameters are updated in place with no copy. The math (Loshchilov & Hutter 2019, Algorithm 2;
    identical to ``torch.optim.AdamW`` and mindformers ``AdamW``), at step ``t`` (1-based):

    .. math::
        w &\leftarrow w (1 - \text{lr}\cdot\text{wd}) \\
        m &\leftarrow \beta_1 m + (1-\beta_1) g, \quad v \leftarrow \beta_2 v + (1-\beta_2) g^2 \\
        w &\leftarrow w - \frac{\text{lr}}{1-\beta_1^t}\,\frac{m}{\sqrt{v}/\sqrt{1-\beta_2^t} + \epsilon}

    Args:
        params: an iterable of parameters (floating-point leaf tensors), of ``(name, parameter)``
            pairs (``model.named_parameters()``; the names are kept in ``group["param_names"]``, as
            torch does) or of dicts (parameter groups with ``params`` and optionally
            ``lr``/``learning_rate``, ``betas``, ``eps``, ``weight_decay``, ``decay``,
            ``optimized_update``, ``master_weights``, and torch.optim.AdamW's flags at their off value
            (``amsgrad=False``, ``maximize=False``, ``foreach`` and ``fused`` None or False,
            ``capturable=False``, ``differentiable=False``); any other key is the user's metadata
            (``param_names``, ``initial_lr``, timm's ``lr_scale``...) and is kept untouched, as
            torch keeps it); one dict may instead hold
            ``order_params``, the parameters in the order the optimizer stores and iterates them
            (exactly the groups' parameters, each once); its other keys are ignored. Each parameter
            may appear once.
        lr: learning rate (default 1e-3): a float or int >= 0, a 0-d tensor, a 1-D tensor or
            iterable of numbers (global step ``t`` uses element ``t``; past the end the last value
            holds), or a schedule (a callable of the global step, such as
            :class:`halfadam.schedules.CosineWithWarmUpLR`). The value used at each step is written
            into ``group["lr"]``. Works with ``torch.optim.lr_scheduler`` when a number.
        betas: ``(beta1, beta2)``, floats in (0.0, 1.0).
        eps: float > 0, added to the denominator.
        weight_decay: decoupled weight decay (default 0.0, as mindformers; torch's default is 0.01):
            a float or int >= 0, or a schedule of the global step.
        learning_rate: the same as ``lr`` (mindformers' name); giving both is a TypeError.
        master_weights: ``None`` (default): on for float16/bfloat16 parameters, off for float32;
            ``True``/``False`` force it.
        implementation: how a step runs; every choice computes the same bits (README,
            "Implementations"). ``"reference"``: one :func:`halfadam.functional.adam_update_` call per
            parameter (the readable definition). ``"foreach"``: the same math run eagerly over flat
            fp32 buffers, one op per bucket (group, device, dtype). ``"fused"``: that function
            compiled by ``torch.compile`` into one kernel per bucket (Inductor C++ on CPU, Triton on
            CUDA; the first step compiles, later processes reuse Inductor's cache). ``"cpp"``: a
            hand-written C++ CPU kernel (:mod:`halfadam.kernels.cpp`, built on first use), one call
            per bucket over the parameters' own storage, in every state mode. ``"auto"``
            (default): cpp for CPU parameters where it applies and builds, else fused, or foreach
            (with a one-time warning) where compiling fails. Parameters without a gradient leave
            gaps in the flat step; buckets whose step counts differ take the reference path that
            step.
        state_mode: how the state is stored (:mod:`halfadam.encodings`), per fp16/bf16 parameter:
            ``"fp32"`` (default: fp32 master, ``exp_avg``, ``exp_avg_sq``; 12 B), ``"split"`` (the
            master as the parameter plus a 16-bit remainder: bf16 training bit for bit the same;
            10.008 B), ``"bf16"`` (split, bf16 moments with stochastic rounding; 6.008 B) or
            ``"compact"`` (split, 8-bit block-wise moments; 4.02 B).
        store_param_remainders, exp_avg_dtype, exp_avg_sq_dtype: override the preset's fields
            (Megatron's names): split masters on/off; ``torch.float32``, ``torch.bfloat16`` or
            ``torch.uint8`` (8-bit block-wise) for each moment.
        capturable: torch's name: the step reads no value on the host, so it can be captured in a
            CUDA graph (``torch.cuda.graph``; build the tensor table with a warm-up step first, and
            keep the gradients' storage: ``zero_grad(set_to_none=False)``). The step counts then live
            on the parameters' device, ``step(found_inf=...)`` skips inside the kernel, and the lr
            and weight decay of each call are baked into a captured graph (as torch's with float
            lr). Runs the Triton kernel only (``implementation="auto"`` or ``"triton"``; CUDA, or CPU
            tensors under ``TRITON_INTERPRET=1``); parameters of the reference path (float64,
            DTensor, half without master weights) are a ValueError at the step.
        amsgrad, maximize, foreach, differentiable, fused: torch.optim.AdamW's flags, accepted at
            their "off" values (False; ``foreach``/``fused`` None or False), so code written for
            torch runs unchanged; any other value is a ValueError.

    Whatever is written to a parameter between steps (``load_state_dict``, ``copy_``, ``.data``) is
    the next step's start: see :meth:`sync_master_weights` for the rule; a parameter whose dtype or
    device changed gets the state it would have had from the start (see ``_conform_state``).

    Raises:
        TypeError: a wrong type for ``params`` or an element of it (not a floating tensor, a
            (name, tensor) pair nor a dict), ``lr`` (not a number, tensor, finite sequence or
            callable; a one-shot iterator; a dict), ``betas`` or ``eps`` (not floats),
            ``weight_decay`` (not a number or callable); both ``lr`` and ``learning_rate``; a group's
            ``master_weights`` not None/bool or ``optimized_update`` not a bool;
            ``store_param_remainders`` not None/bool.
        ValueError: ``params`` empty or without any parameter; a parameter given twice; an
            ``expand()``-ed parameter (elements sharing memory); ``implementation`` not one of the
            four; lr or weight_decay negative; a beta outside (0.0, 1.0); eps <= 0; nan or inf in any
            of them, or 0/inf once rounded to float32; a tensor lr of more than one dimension or on
            the meta device; a torch flag halfadam does not implement (``maximize=True``,
            ``amsgrad=True``, ``fused=True``...); bad ``order_params``; an unknown ``state_mode``
            or a moment dtype other than float32/bfloat16/uint8; a DTensor (FSDP2) parameter with
            split masters or uint8 moments (per-block state).
    """

    def __init__(self, params, lr=None, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *,
                 learning_rate=None, master_weights: Optional[bool] = None, implementation: str = "auto",
                 state_mode: str = "fp32", store_param_remainders: Optional[bool] = None,
                 exp_avg_dtype: Optional[torch.dtype] = None, exp_avg_sq_dtype: Optional[torch.dtype] = None,
                 amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False, fused=None):
        check_torch_flags(dict(amsgrad=amsgrad, maximize=maximize, foreach=foreach,
                                differentiable=differentiable, fused=fused), type(self).__name__)
        super().__init__(params, lr=lr, learning_rate=learning_rate, betas=betas, eps=eps,
                         weight_decay=weight_decay, decay="decoupled", optimized_update=False,
                         master_weights=master_weights, implementation=implementation, state_mode=state_mode,
                         store_param_remainders=store_param_remainders, exp_avg_dtype=exp_avg_dtype,
                         exp_avg_sq_dtype=exp_avg_sq_dtype, capturable=capturable)


class Adam(_AdamBase):
    r"""Adam with L2 weight decay and fp32 master weights for float16/bfloat16 parameters.

    As :class:`AdamW` except that weight decay is added to the gradient, ``g <- g + wd * w``, before
    the moments (the behaviour of ``torch.optim.Adam``; Kingma & Ba 2015, Algorithm 1, plus L2).
    Arguments, defaults and errors are those of :class:`AdamW`.
    """

    def __init__(self, params, lr=None, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *,
                 learning_rate=None, master_weights: Optional[bool] = None, implementation: str = "auto",
                 state_mode: str = "fp32", store_param_remainders: Optional[bool] = None,
                 exp_avg_dtype: Optional[torch.dtype] = None, exp_avg_sq_dtype: Optional[torch.dtype] = None,
                 amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False, fused=None):
        check_torch_flags(dict(amsgrad=amsgrad, maximize=maximize, foreach=foreach,
                                differentiable=differentiable, fused=fused), type(self).__name__)
        super().__init__(params, lr=lr, learning_rate=learning_rate, betas=betas, eps=eps,
                         weight_decay=weight_decay, decay="l2", optimized_update=False,
                         master_weights=master_weights, implementation=implementation, state_mode=state_mode,
                         store_param_remainders=store_param_remainders, exp_avg_dtype=exp_avg_dtype,
                         exp_avg_sq_dtype=exp_avg_sq_dtype, capturable=capturable)


class WeightDecay:
    """How :class:`AdamFP16` applies weight decay (labml's ``WeightDecay`` interface).

    Args:
        weight_decay: the coefficient ``wd`` >= 0.
        weight_decouple: decay the weight directly (``True``) instead of adding ``wd * w`` to the
            gradient (L2, ``False``).
        absolute: with ``weight_decouple``, decay by ``w <- w * (1 - wd)`` instead of
            ``w <- w * (1 - lr * wd)``. Ignored without ``weight_decouple``.

    Raises:
        TypeError/ValueError: ``weight_decay`` not a number >= 0 (see :mod:`halfadam.hyperparams`).
    """

    def __init__(self, weight_decay: float = 0.0, weight_decouple: bool = True, absolute: bool = False):
        hyperparams.parse_weight_decay(weight_decay, "weight_decay")
        self.weight_decay = weight_decay
        self.weight_decouple = bool(weight_decouple)
        self.absolute = bool(absolute)

    @property
    def decay(self) -> str:
        """The :data:`halfadam.functional.DECAY_MODES` entry this configuration means."""
        if not self.weight_decouple:
            return "l2"
        return "absolute" if self.absolute else "decoupled"

    def __repr__(self) -> str:
        return (f"WeightDecay(weight_decay={self.weight_decay}, weight_decouple={self.weight_decouple}, "
                f"absolute={self.absolute})")


class AdamFP16(_AdamBase):
    r"""labml's half-precision Adam interface, on halfadam's engine.

    ``AdamFP16(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-16, weight_decay=WeightDecay(),
    optimized_update=True)``: fp32 master weights and moments for fp16/bf16 parameters, weight decay
    as configured by :class:`WeightDecay`. With ``optimized_update`` (the default) ``eps`` is added
    before bias-correcting the second moment:
    ``w <- w - lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)``; without it, the
    :class:`AdamW` form ``w <- w - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``.

    Unlike labml's, parameters are written in place (``param.data`` is never rebound) and
    ``load_state_dict`` keeps the fp32 state in fp32. Other arguments and errors as :class:`AdamW`.
    """

    def __init__(self, params, lr=None, betas=(0.9, 0.999), eps=1e-16,
                 weight_decay: WeightDecay = WeightDecay(), optimized_update: bool = True, *,
                 learning_rate=None, master_weights: Optional[bool] = None, implementation: str = "auto",
                 state_mode: str = "fp32", store_param_remainders: Optional[bool] = None,
                 exp_avg_dtype: Optional[torch.dtype] = None, exp_avg_sq_dtype: Optional[torch.dtype] = None,
                 capturable: bool = False):
        if not isinstance(weight_decay, WeightDecay):
            raise TypeError(f"weight_decay must be a halfadam.WeightDecay, got {type(weight_decay).__name__}")
        super().__init__(params, lr=lr, learning_rate=learning_rate, betas=betas, eps=eps,
                         weight_decay=weight_decay.weight_decay, decay=weight_decay.decay,
                         optimized_update=optimized_update, master_weights=master_weights,
                         implementation=implementation, state_mode=state_mode,
                         store_param_remainders=store_param_remainders, exp_avg_dtype=exp_avg_dtype,
                         exp_avg_sq_dtype=exp_avg_sq_dtype, capturable=capturable)


class _GroupLayout:
    """A group's buckets and where each parameter sits in them (valid while group, state and the
    parameters' identities ``ids`` stay, and each parameter is :meth:`_AdamBase._in_place`)."""

    def __init__(self, group: Dict[str, Any], state: Any, ids: List[int], buckets: List[Bucket]):
        self.group, self.state, self.ids, self.buckets = group, state, ids, buckets
        self.where = {id(p): (b, i) for b in buckets for i, p in enumerate(b.params)}
