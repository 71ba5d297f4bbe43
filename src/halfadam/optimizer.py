"""AdamW, Adam and AdamFP16 with fp32 master weights for float16/bfloat16 parameters.

One engine (:class:`_Engine`) reads as torch's ``optim/adamw.py``: arguments (validated by
:mod:`halfadam.hyperparams` and :mod:`halfadam.param_groups`), groups, ``step`` and state dicts
(:mod:`halfadam.state_dict`). Each step checks everything first (:func:`_plan`), then hands
each group to an execution (:mod:`halfadam.executions`), which runs the single statement of the
update math (:func:`halfadam.functional.adam_update_`). How each parameter's state is laid out, made
and kept fitting the parameter is the layer below, :mod:`halfadam.state`. The public classes only
choose defaults and how weight decay enters.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import encodings, hyperparams
from . import state_dict as _state_dict
from ._dtensor import flat_offset, is_dtensor, localize
from .executions import (Hyperparameters, capturable_step, check_capturable, check_implementation, flat_step,
                         reference_step, shard_step)
from .functional import ADAM, DECAY_MODES, Rule
from .param_groups import (check_disjoint, check_grad, check_order_params, check_pairs, check_step_keys,
                           check_torch_flags, normalize_group, raise_foreign_key, split_params)
from .state import HALF_DTYPES, ParamStates, check_row_shards

__all__ = ["AdamW", "Adam", "AdamFP16", "WeightDecay"]


def _outside_inference_mode(method: Any) -> Any:
    """Run ``method`` with inference mode off: state made inside ``torch.inference_mode()`` would be
    inference tensors, which no later step outside it could update in place."""
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_inference_mode_enabled():
            return method(*args, **kwargs)
        with torch.inference_mode(False):
            return method(*args, **kwargs)
    return wrapper


class _Engine(torch.optim.Optimizer):
    """The shared engine of every halfadam optimizer (:class:`AdamW`, :class:`Adam`, :class:`AdamFP16`,
    :class:`halfadam.SGD`, :class:`halfadam.Lion`): groups, state, masters, state dicts and the step.

    An optimizer is its update rule (:class:`halfadam.functional.Rule`) and these class hooks: ``_parsers``
    (its group keys and their parsers), ``_required`` (group keys a step needs), :meth:`_rule_for`
    (the rule, given the groups) and :meth:`_options` (a group's rule options for a step). Adam's are
    the defaults.

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

    # The hooks an optimizer class sets (halfadam.lion, halfadam.sgd, _Adam below; docs/engine.md):
    #: its rule's group keys and their parsers ``(value, where) -> stored value``, and the keys a step needs;
    _parsers: Dict[str, Callable[[Any, str], Any]] = {}
    _required: Tuple[str, ...] = ()
    #: its counterpart outside halfadam, whose state dicts :meth:`to_torch_state_dict` writes and
    #: :meth:`load_state_dict` reads (:mod:`halfadam.state_dict`): its name (for messages), the keys that make
    #: a group its (every key of one of these tuples), whether its state holds ``step`` (torch.optim.SGD's
    #: does not: a loaded entry counts as one step taken) and its per-parameter keys that a load drops;
    _torch_name: str = ""
    _torch_keys: Tuple[Tuple[str, ...], ...] = ()
    _torch_step: bool = True
    _torch_dropped: Tuple[str, ...] = ()
    #: group keys whose value the class sets (AdamW's decay "decoupled", Adam's "l2"): a halfadam
    #: checkpoint's replaces this optimizer's with a warning (written by another class?).
    _class_keys: Tuple[str, ...] = ()

    def _rule_for(self, groups: List[Dict[str, Any]]) -> Rule:
        """The update rule of an optimizer with these (normalized) groups."""
        raise NotImplementedError

    def _options(self, group: Dict[str, Any], where: str) -> Dict[str, Any]:
        """``group``'s options of the rule for a step (checked by :func:`check_step_keys` already); a
        ValueError naming ``where`` for a value the rule cannot step with."""
        raise NotImplementedError

    def _torch_group(self, group: Dict[str, Any], weight_decay: float, where: str) -> Dict[str, Any]:
        """The rule's keys of the counterpart's group for ``group`` (beside ``lr``, ``weight_decay``, of
        which ``weight_decay`` is the next step's, ``params`` and the user's keys)."""
        raise NotImplementedError

    def _from_torch_group(self, saved: Mapping[str, Any], current: Dict[str, Any],
                          where: str) -> Tuple[Dict[str, Any], List[str]]:
        """The keys that a group of the counterpart's state dict (``saved``, without ``params``) loads into
        ``current``, and the warnings to give; ValueError for what halfadam does not implement."""
        raise NotImplementedError

    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: Any,
        learning_rate: Any,
        weight_decay: Any,
        options: Dict[str, Any],
        master_weights: Optional[bool],
        implementation: str = "auto",
        state_mode: str = "fp32",
        store_param_remainders: Optional[bool] = None,
        exp_avg_dtype: Optional[torch.dtype] = None,
        exp_avg_sq_dtype: Optional[torch.dtype] = None,
        capturable: bool = False,
    ):
        lr, lr_name = hyperparams.lr_argument(lr, learning_rate)
        check_implementation(implementation, capturable)
        self.implementation, self.capturable = implementation, capturable
        self.state_format = encodings.state_format(state_mode, store_param_remainders=store_param_remainders,
                                                   exp_avg_dtype=exp_avg_dtype, exp_avg_sq_dtype=exp_avg_sq_dtype)
        self._states = ParamStates(self)
        self._written: Dict[int, Tuple[float, float]] = {}  # id(group) -> (lr, weight_decay) of the last step
        self._valid_keys: Dict[int, Tuple[Any, ...]] = {}  # id(group) -> its keys last checked (check_step_keys)
        self._override_warned = False
        if master_weights is not None and not isinstance(master_weights, bool):
            raise TypeError(f"master_weights must be None, True or False, got {master_weights!r}")

        lr_value, lr_schedule = hyperparams.parse_lr(lr, lr_name)
        wd_value, wd_schedule = hyperparams.parse_weight_decay(weight_decay, "weight_decay")
        defaults = dict(lr=lr_value, lr_schedule=lr_schedule, weight_decay=wd_value, weight_decay_schedule=wd_schedule,
                        **options, master_weights=master_weights)
        groups, order_params = split_params(params)
        # Validate every group before anything is built; add_param_group validates again (cheaply)
        # because it is also the public way to add a group later.
        groups = [normalize_group(g, self.state_format, f"param_groups[{i}]", self._parsers)
                  for i, g in enumerate(groups)]
        self.rule = self._rule_for([{**defaults, **g} for g in groups])
        self.state_format = self.state_format.for_rule(self.rule.moments)
        check_disjoint(groups)
        if not any(g["params"] for g in groups):
            raise ValueError("params holds no parameter: every parameter group is empty")
        check_order_params(order_params, groups)
        check_row_shards(groups, self.state_format)
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
        self._states = ParamStates(self)  # its buckets are rebuilt from the state on the next step
        self._written, self._valid_keys, self._override_warned = {}, {}, False
        super().__setstate__(state)
        self.rule = self._rule_for(self.param_groups)

    # ------------------------------------------------------------------ groups
    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a parameter group (validated first; on error nothing is added).

        Its ``global_step`` starts at the optimizer's, so schedules stay aligned across groups, and
        its scheduled ``lr``/``weight_decay`` show their values at that step (the coming step's).
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        group = normalize_group(param_group, self.state_format, f"param_groups[{len(self.param_groups)}]", self._parsers)
        check_disjoint(self.param_groups + [group])
        group.setdefault("global_step", max((g["global_step"] for g in self.param_groups), default=0))
        where = f"param_groups[{len(self.param_groups)}]"
        for key in ("lr", "weight_decay"):  # show the coming step's value, as every group does
            if group.get(f"{key}_schedule") is not None:
                group[key] = hyperparams.resolve(group, key, where, group["global_step"])
        super().add_param_group(group)
        if self._order_params is not None and len(self.param_groups) > 1:
            known = {id(p) for p in self._order_params}
            self._order_params += [p for p in group["params"] if id(p) not in known]

    def params_in_order(self) -> List[Tensor]:
        """Every parameter, in the optimizer's order: ``order_params`` when given, else group by group."""
        if self._order_params is not None:
            return list(self._order_params)
        return [p for g in self.param_groups for p in g["params"]]

    # ------------------------------------------------------------------ masters
    @_outside_inference_mode
    def master_weight(self, param: Tensor) -> Tensor:
        """The fp32 master weight of ``param``, in sync with the parameter.

        The master copy for a parameter with master weights (created from the parameter now if no step
        has run yet; elements where the parameter was changed since take its value, see
        :meth:`sync_master_weights`), or the parameter itself for a float32 parameter without one. In
        ``state_mode="fp32"`` it is the tensor the optimizer updates; with a split or split8 master
        (``"split"``, ``"bf16"``, ``"compact"``, ``"tiny"``) it is a new decoded tensor each call, so an
        in-place edit of it changes nothing (set masters with
        :func:`halfadam.checkpoint.load_master_state_dict`).
        A frozen parameter (``requires_grad=False``) that never took a step has no state and gets a
        new float32 copy of its value (no state is made for it).

        Raises:
            KeyError: ``param`` is not in this optimizer.
            ValueError: ``param`` is float16/bfloat16 and its master weights are off (no fp32 tensor
                exists: each step computes on a temporary copy).
        """
        for group in self.param_groups:
            if any(p is param for p in group["params"]):
                if not param.requires_grad and not self.state.get(param) and self._states.use_master(param, group):
                    return param.detach().to(torch.float32, copy=True)  # frozen, never stepped: no state made
                master = self._states.synced_master(param, group)
                if master is not None:
                    return master
                if param.dtype in HALF_DTYPES:
                    raise ValueError(f"master weights are off for this {param.dtype} parameter: it has no fp32 copy")
                return param
        raise KeyError("the tensor is not a parameter of this optimizer")

    @_outside_inference_mode
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

        Raises:
            ValueError: as :meth:`step`, for a state that another shares or that no rule reads.
        """
        self._states.check_shared()
        for group in self.param_groups:
            for p in group["params"]:
                if self.state.get(p):
                    self._states.synced_master(p, group, decode=False)

    # ------------------------------------------------------------------ checkpoints
    # The work is in halfadam.state_dict; these methods only delegate to it.
    def state_dict(self) -> Dict[str, Any]:
        """The state in torch's layout, fp32 state as fp32, schedules as plain data.

        See :func:`halfadam.state_dict.optimizer_state_dict`; ``torch.load(weights_only=True)`` reads it.
        8-bit codes (compact, tiny) have a label in ``step``, which torch's ``load_state_dict`` refuses.
        """
        return _state_dict.optimizer_state_dict(self)

    @_outside_inference_mode
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a halfadam state_dict of this update rule, or its counterpart's (torch.optim.Adam/AdamW,
        torch.optim.SGD, a Lion's): checked first, never changes a state dtype.

        See :func:`halfadam.state_dict.load_optimizer_state_dict` (labelled 8-bit codes load, and older
        unlabelled ones). Raises :class:`halfadam.checkpoint.CheckpointError` (a ValueError) with
        nothing changed on a mismatch or a ``step`` label this version does not read.
        """
        _state_dict.load_optimizer_state_dict(self, state_dict)
        self._written.clear()  # the loaded lr and weight decay are no change from outside (_warn_if_overridden)

    def to_torch_state_dict(self) -> Dict[str, Any]:
        """This state as its counterpart's state_dict (``torch.optim.AdamW``, ``torch.optim.SGD``, lucidrains'
        ``Lion``; no masters); see :func:`halfadam.state_dict.to_torch_state_dict`."""
        return _state_dict.to_torch_state_dict(self)

    def master_state_dict(self, model: torch.nn.Module) -> Dict[str, Tensor]:
        """``model.state_dict()`` with the fp32 master weights in place of the fp16/bf16 parameters.

        See :func:`halfadam.state_dict.master_state_dict`; load it back with
        :func:`halfadam.checkpoint.load_master_state_dict`.
        """
        return _state_dict.master_state_dict(self, model)

    # ------------------------------------------------------------------ step
    @_outside_inference_mode
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, grads: Mapping[Tensor, Tensor | None] | None = None,
             grad_scale: Tensor | None = None, found_inf: Tensor | None = None) -> Any:
        """Take one optimization step.

        Args:
            closure: re-evaluates the model and returns the loss (optional, as in torch), which the
                call returns (``None`` without a closure).
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
                a schedule) that is negative, nan or inf; a parameter's state that another shares, or that
                no rule reads (resized since, written by hand: :meth:`halfadam.state.ParamStates.check_state`).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        plan = _plan(self, grads, grad_scale, found_inf)  # a call that raises here changes nothing
        if found_inf is not None and not self.capturable:
            if found_inf.item() != 0:
                return loss
            found_inf = None
        work = [self._states.sort(group, pairs) for group, _, _, pairs in plan]  # every state checked, then a step
        for (group, hp, after, pairs), sorted_pairs in zip(plan, work):
            if pairs:
                _run_group(self, group, sorted_pairs, hp, grad_scale, found_inf)
        for group, hp, after, pairs in plan:  # the schedules move once every group has stepped
            group["global_step"] += 1
            group.update((k, v) for k, v in after.items() if v is not None)
            self._written[id(group)] = (group["lr"], group["weight_decay"])
        return loss

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


# ---------------------------------------------------------------------- the step's work
# What _Engine.step does between its checks and its bookkeeping, group by group: plan the step
# (everything checked before anything changes), then hand each group to an execution.
def _plan(opt: _Engine, grads: Optional[Mapping], grad_scale: Optional[Tensor],
          found_inf: Optional[Tensor]) -> list:
    """Check a step's arguments, gradients and scheduled values, before anything changes (the
    states: :meth:`halfadam.state.ParamStates.sort`); one ``(group, hp, after, pairs)`` per group:
    the hyperparameters of this step, those ``group`` shows after it (``after``: the next step's
    scheduled values) and its ``(param, grad)`` pairs. Raises the errors :meth:`_Engine.step` lists."""
    if grads is not None and not isinstance(grads, Mapping):
        raise TypeError(f"grads must be a mapping from parameter to gradient, got {type(grads).__name__}")
    for name, value in (("grad_scale", grad_scale), ("found_inf", found_inf)):
        if value is not None and not (isinstance(value, Tensor) and value.numel() == 1
                                      and value.is_floating_point()):
            raise TypeError(f"{name} must be None or a 1-element floating tensor, got {value!r}")
    plan, matched = [], 0  # matched: keys of grads that are this optimizer's parameters
    for gi, group in enumerate(opt.param_groups):
        where = f"param_groups[{gi}]"
        _warn_if_overridden(opt, group, where)
        check_step_keys(group, where, opt._valid_keys, opt._parsers, opt._required)  # every group's, first
        step = group["global_step"]
        lr = hyperparams.resolve(group, "lr", where, step)
        weight_decay = hyperparams.resolve(group, "weight_decay", where, step)
        # what group["lr"] / ["weight_decay"] show after the step: the values of the next one (a bad
        # value there is the next step's error, not this one's)
        after = {key: hyperparams.peek(group, key, step + 1) for key in ("lr", "weight_decay")
                 if group.get(f"{key}_schedule") is not None}
        if grads is None:
            pairs = [(p, p.grad) for p in group["params"]]
        else:
            pairs = [(p, grads[p]) for p in group["params"] if p in grads]
            matched += len(pairs)
        pairs = [pg for pg in pairs if pg[1] is not None]
        check_pairs(pairs, group["params"], where)
        if opt.capturable:
            check_capturable(pairs, group["params"], where, lambda p: opt._states.use_master(p, group))
        hp = Hyperparameters(lr, weight_decay, opt.rule, **opt._options(group, where))
        plan.append((group, hp, after, pairs))
    if grads is not None and matched != len(grads):
        raise_foreign_key(grads, opt.param_groups)
    return plan


@torch.compiler.disable
def _run_group(opt: _Engine, group: Dict[str, Any], work: tuple, hp: Hyperparameters,
               grad_scale: Optional[Tensor], found_inf: Optional[Tensor] = None) -> None:
    """Dispatch one group's step: buckets to the flat path, everything else to the reference.

    The parameters of a bucket that have a gradient this step (all of them, or a subset: frozen
    or unused parameters leave gaps) go to one flat step when their step counts agree. Never
    traced by an outer ``torch.compile`` (``torch.compile(opt.step)``, a compiled train step):
    the update runs halfadam's own kernels, called through a graph break, so it is the same
    update, compiled the way it must be (see :func:`halfadam.functional.sync_master_`).
    """
    layout, (per_bucket, rest, new) = work  # ParamStates.sort
    opt._states.init_group(group, new)
    for bucket in () if layout is None else layout.buckets:
        items = per_bucket.get(id(bucket))
        if not items:
            continue
        items.sort(key=lambda item: item[0])
        if opt.capturable:  # the step counts stay on the device: one launch whatever they are
            capturable_step(bucket, items, hp, opt.implementation, grad_scale, found_inf)
            continue
        # One step count: one flat step. Step counts that diverged (a parameter without a gradient
        # at some step: an unused expert, a frozen-then-thawed layer): one flat step per count, so
        # that state["step"] keeps torch's per-parameter meaning (bias corrections per parameter).
        if bucket.steps_uniform(None if len(items) == len(bucket.params) else [i for i, _ in items]):
            flat_step(bucket, items, hp, opt.implementation, grad_scale)
        else:
            counts = bucket.steps[[i for i, _ in items]].tolist()
            for count in sorted(set(counts)):
                flat_step(bucket, [it for it, c in zip(items, counts) if c == count], hp, opt.implementation,
                          grad_scale)
    if rest:
        offsets = [flat_offset(p) for p, _ in rest]  # a shard's first element in its parameter
        local_pairs, local_state = localize(rest, opt.state)
        if opt.implementation in ("auto", "triton", "cpp") and any(is_dtensor(p) for p, _ in rest):
            # FSDP2's local shards: the C++ kernel (CPU) or the Triton one (GPU) where it runs
            left = shard_step(local_pairs, local_state, hp, opt.implementation, grad_scale,
                              opt.state_format, offsets)
            local_pairs, offsets = [local_pairs[k] for k in left], [offsets[k] for k in left]
        if local_pairs:
            reference_step(local_pairs, local_state, hp, grad_scale, opt.state_format, offsets)


def _warn_if_overridden(opt: _Engine, group: Dict[str, Any], where: str) -> None:
    """Warn once when a scheduled value was changed from outside since the last step (e.g. by a
    torch ``lr_scheduler``): the schedule sets it at every step, so that change has no effect."""
    written = opt._written.get(id(group))
    if written is None or opt._override_warned:
        return
    for key, value in zip(("lr", "weight_decay"), written):
        if group.get(f"{key}_schedule") is not None and group[key] != value:
            opt._override_warned = True
            warnings.warn(
                f"{where}['{key}'] was changed outside the optimizer (by a torch lr_scheduler?), but this "
                f"{key} is a schedule of the global step, which sets it at every step: the change has no "
                f"effect", UserWarning, stacklevel=4)


#: torch.optim.AdamW's flags, at the values of halfadam's update (:meth:`_Engine._torch_group`).
_ADAM_TORCH_FLAGS = dict(amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False,
                         fused=None)


def _adam_options(betas: Any, eps: Any, decay: str, optimized_update: bool) -> Dict[str, Any]:
    """Adam's group options, validated (the errors :class:`AdamW` lists)."""
    if decay not in DECAY_MODES:
        raise ValueError(f"decay must be one of {DECAY_MODES}, got {decay!r}")
    return dict(betas=hyperparams.parse_betas(betas, "betas"), eps=hyperparams.parse_eps(eps, "eps"), decay=decay,
                optimized_update=bool(optimized_update))


class _Adam(_Engine):
    """Adam's rule and hooks (:class:`_Engine`) under :class:`AdamW`, :class:`Adam` and :class:`AdamFP16`
    (:data:`halfadam.functional.ADAM`; the counterpart: torch.optim.Adam/AdamW)."""

    _parsers = {"betas": hyperparams.parse_betas, "eps": hyperparams.parse_eps}
    _required = ("betas", "eps", "decay", "optimized_update")
    _torch_name, _torch_keys, _class_keys = "torch.optim.Adam/AdamW", (("betas", "eps"),), ("decay", "optimized_update")

    def _rule_for(self, groups: List[Dict[str, Any]]) -> Rule:
        return ADAM

    def _options(self, group: Dict[str, Any], where: str) -> Dict[str, Any]:
        beta1, beta2 = group["betas"]
        return dict(beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]), decay=group["decay"],
                    optimized_update=group["optimized_update"])

    def _torch_group(self, group: Dict[str, Any], weight_decay: float, where: str) -> Dict[str, Any]:
        """The rule's keys of the counterpart's group for ``group`` (beside ``lr``, ``weight_decay``, of
        which ``weight_decay`` is the next step's, ``params`` and the user's keys). ValueError where the
        counterpart has no equivalent (decay ``"absolute"``); a UserWarning for ``optimized_update``."""
        if group["decay"] == "absolute" and weight_decay > 0:
            raise ValueError(f"{where}: decay 'absolute' (w <- w * (1 - wd)) has no torch.optim equivalent")
        if group["optimized_update"]:
            warnings.warn(f"{where}: optimized_update=True has no torch.optim equivalent; torch adds eps after "
                          f"bias correction", UserWarning, stacklevel=4)
        return dict(betas=tuple(group["betas"]), eps=group["eps"], **_ADAM_TORCH_FLAGS,
                    decoupled_weight_decay=group["decay"] == "decoupled")

    def _from_torch_group(self, saved: Mapping[str, Any], current: Dict[str, Any],
                          where: str) -> Tuple[Dict[str, Any], List[str]]:
        """The keys that a group of the counterpart's state dict (``saved``, without ``params``) loads into
        ``current`` (the rule's and the user's: the counterpart's flags dropped), and the warnings to give.
        ValueError for a flag that halfadam does not implement (``amsgrad``, ``maximize``)."""
        for flag in ("amsgrad", "maximize"):
            if saved.get(flag):
                raise ValueError(f"{where}: the checkpoint was written with {flag}=True, which halfadam does not "
                                 f"implement")
        keys = {k: v for k, v in saved.items() if k not in (*_ADAM_TORCH_FLAGS, "decoupled_weight_decay")}
        new = {**current, **keys}
        dwd, wd = saved.get("decoupled_weight_decay"), new["weight_decay"]
        if dwd is not None and bool(wd.ne(0).any() if isinstance(wd, Tensor) else wd) and bool(dwd) != (
                new["decay"] == "decoupled"):
            return keys, [f"{where}: the checkpoint decays weights {'decoupled (AdamW)' if dwd else 'as L2 (Adam)'}, "
                          f"this optimizer with decay={new['decay']!r}; continuing with this optimizer's"]
        return keys, []


class AdamW(_Adam):
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
            (``amsgrad=False``, ``maximize=False``, ``capturable=False``, ``differentiable=False``;
            the kernel hints ``foreach`` and ``fused`` None, False or True); any other key is the
            user's metadata (``param_names``, ``initial_lr``, timm's ``lr_scale``...) and is kept
            untouched, as torch keeps it); one dict may instead hold
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
        implementation: how a step runs; every choice computes the same bits (docs/implementations.md).
            ``"reference"``: one :func:`halfadam.functional.adam_update_` call per
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
            10.008 B), ``"bf16"`` (split, bf16 moments with stochastic rounding; 6.008 B),
            ``"compact"`` (split, 8-bit block-wise moments; 4.02 B) or ``"tiny"`` (the master as a
            bf16 parameter plus an 8-bit remainder rounded stochastically, 8-bit block-wise moments;
            3.02 B; float16 parameters keep compact's 16-bit split). 1-D parameters keep float32
            fields in every mode.
        store_param_remainders: overrides the preset's master field (Megatron's name): split
            masters (16-bit remainders) on/off; ``None`` (default) keeps the preset's.
        exp_avg_dtype: overrides the preset's ``exp_avg`` field (Megatron's name): ``torch.float32``,
            ``torch.bfloat16`` or ``torch.uint8`` (8-bit block-wise); ``None`` (default) keeps it.
        exp_avg_sq_dtype: the same for ``exp_avg_sq``.
        capturable: torch's name: the step reads no value on the host, so it can be captured in a
            CUDA graph (``torch.cuda.graph``; build the tensor table with a warm-up step first, and
            keep the gradients' storage: ``zero_grad(set_to_none=False)``). The step counts then live
            on the parameters' device, ``step(found_inf=...)`` skips inside the kernel, and the lr
            and weight decay of each call are baked into a captured graph (as torch's with float
            lr). Runs the Triton kernel only (``implementation="auto"`` or ``"triton"``; CUDA, or CPU
            tensors under ``TRITON_INTERPRET=1``); parameters of the reference path (float64,
            DTensor, half without master weights) are a ValueError at the step.
        amsgrad: torch.optim.AdamW's flag, accepted at its "off" value ``False`` (the default), so
            code written for torch runs unchanged; any other value is a ValueError. The same holds
            for ``maximize`` and ``differentiable`` (``False``).
        foreach: torch.optim.AdamW's kernel hint, accepted as ``None``, ``False`` or ``True`` and
            changing nothing: every implementation computes the same bits, ``implementation``
            chooses one, and ``"auto"`` runs one kernel per bucket already.
        fused: the same (torchtitan passes ``fused=True, foreach=False``); ``foreach`` and ``fused``
            both ``True`` is a ValueError (torch refuses it with a RuntimeError).

    Whatever is written to a parameter between steps (``load_state_dict``, ``copy_``, ``.data``) is
    the next step's start: see :meth:`sync_master_weights` for the rule; a parameter whose dtype or
    device changed gets the state it would have had from the start (see
    :meth:`halfadam.state.ParamStates.conform`).

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
            ``amsgrad=True``...; ``foreach`` and ``fused`` both True); bad ``order_params``; an
            unknown ``state_mode`` or a moment dtype other than float32/bfloat16/uint8; a DTensor (FSDP2) parameter whose
            local shard is not whole rows (a dim other than 0 sharded) where the state mode keeps
            per-block state (split masters, uint8 moments).
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[tuple[str, Tensor]] | Iterable[dict[str, Any]],
                 lr: float | Tensor | Sequence[float] | Callable[[int], float] | None = None,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float | Callable[[int], float] = 0.0, *,
                 learning_rate: float | Tensor | Sequence[float] | Callable[[int], float] | None = None,
                 master_weights: bool | None = None,
                 implementation: str = "auto", state_mode: str = "fp32", store_param_remainders: bool | None = None,
                 exp_avg_dtype: torch.dtype | None = None, exp_avg_sq_dtype: torch.dtype | None = None,
                 amsgrad: bool = False, maximize: bool = False, foreach: bool | None = None,
                 capturable: bool = False, differentiable: bool = False, fused: bool | None = None):
        check_torch_flags(dict(amsgrad=amsgrad, maximize=maximize, foreach=foreach,
                                differentiable=differentiable, fused=fused), type(self).__name__)
        super().__init__(params, lr=lr, learning_rate=learning_rate, weight_decay=weight_decay,
                         options=_adam_options(betas, eps, "decoupled", False), master_weights=master_weights,
                         implementation=implementation, state_mode=state_mode,
                         store_param_remainders=store_param_remainders, exp_avg_dtype=exp_avg_dtype,
                         exp_avg_sq_dtype=exp_avg_sq_dtype, capturable=capturable)


class Adam(_Adam):
    r"""Adam with L2 weight decay and fp32 master weights for float16/bfloat16 parameters.

    As :class:`AdamW` except that weight decay is added to the gradient, ``g <- g + wd * w``, before
    the moments (the behaviour of ``torch.optim.Adam``; Kingma & Ba 2015, Algorithm 1, plus L2).
    Arguments, defaults and errors are those of :class:`AdamW`.
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[tuple[str, Tensor]] | Iterable[dict[str, Any]],
                 lr: float | Tensor | Sequence[float] | Callable[[int], float] | None = None,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float | Callable[[int], float] = 0.0, *,
                 learning_rate: float | Tensor | Sequence[float] | Callable[[int], float] | None = None,
                 master_weights: bool | None = None,
                 implementation: str = "auto", state_mode: str = "fp32", store_param_remainders: bool | None = None,
                 exp_avg_dtype: torch.dtype | None = None, exp_avg_sq_dtype: torch.dtype | None = None,
                 amsgrad: bool = False, maximize: bool = False, foreach: bool | None = None,
                 capturable: bool = False, differentiable: bool = False, fused: bool | None = None):
        check_torch_flags(dict(amsgrad=amsgrad, maximize=maximize, foreach=foreach,
                                differentiable=differentiable, fused=fused), type(self).__name__)
        super().__init__(params, lr=lr, learning_rate=learning_rate, weight_decay=weight_decay,
                         options=_adam_options(betas, eps, "l2", False), master_weights=master_weights,
                         implementation=implementation, state_mode=state_mode,
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


class AdamFP16(_Adam):
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

    def __init__(self, params: Iterable[Tensor] | Iterable[tuple[str, Tensor]] | Iterable[dict[str, Any]],
                 lr: float | Tensor | Sequence[float] | Callable[[int], float] | None = None,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-16,
                 weight_decay: WeightDecay = WeightDecay(), optimized_update: bool = True, *,
                 learning_rate: float | Tensor | Sequence[float] | Callable[[int], float] | None = None,
                 master_weights: bool | None = None,
                 implementation: str = "auto", state_mode: str = "fp32", store_param_remainders: bool | None = None,
                 exp_avg_dtype: torch.dtype | None = None, exp_avg_sq_dtype: torch.dtype | None = None,
                 capturable: bool = False):
        if not isinstance(weight_decay, WeightDecay):
            raise TypeError(f"weight_decay must be a halfadam.WeightDecay, got {type(weight_decay).__name__}")
        super().__init__(params, lr=lr, learning_rate=learning_rate, weight_decay=weight_decay.weight_decay,
                         options=_adam_options(betas, eps, weight_decay.decay, optimized_update),
                         master_weights=master_weights, implementation=implementation, state_mode=state_mode,
                         store_param_remainders=store_param_remainders, exp_avg_dtype=exp_avg_dtype,
                         exp_avg_sq_dtype=exp_avg_sq_dtype, capturable=capturable)
