"""halfadam under ``torch.distributed``: DDP, ZeRO-1, FSDP2 and distributed checkpoints.

halfadam adds no distributed scheme of its own. It relies on torch's machinery and provides the few
seams that machinery needs:

* **DDP** (``DistributedDataParallel``, also with ``gradient_as_bucket_view=True``): gradients arrive
  averaged and replicated; the optimizer runs unchanged on every rank and replicas stay bitwise equal.
* **ZeRO-1** (``torch.distributed.optim.ZeroRedundancyOptimizer(params, optimizer_class=AdamW, ...)``):
  each rank's local halfadam optimizer holds masters and moments for its shard only; ZeRO broadcasts
  the parameters after the step. :func:`halfadam_optimizer` lets :class:`halfadam.GradScaler`
  recognise the wrapped optimizer and hand it unscaled fp32 gradients of this rank's shard only
  (``ZeroRedundancyOptimizer.step`` forwards keyword arguments to the local optimizer); the inf/nan
  flag is agreed and the clipping norm reduced over ZeRO's process group (:func:`zero_process_group`).
* **FSDP2** (``torch.distributed.fsdp.fully_shard``): parameters are ``DTensor``\\ s; the state
  (``master_weight``, ``exp_avg``, ``exp_avg_sq``) is created from them and so is a ``DTensor``
  sharded like its parameter, which DCP saves sharded. The update math runs on the local shards
  (:func:`local`, :func:`localize`): the math is elementwise, so shard by shard equals the whole.
* **Overflow agreement**: :func:`all_reduce_found_inf` (MAX over a process group), used by
  :class:`halfadam.GradScaler` (``process_group="auto"`` by default), so an inf/nan on any rank makes
  every rank skip the same step and the loss scale stays identical everywhere.
* **Global-norm clipping**: :func:`total_norm` reduces the norms of sharded (``DTensor``) gradients
  across their mesh; replicated gradients (DDP, ZeRO) already give the global norm locally.
* **Distributed checkpoints**: :func:`get_optimizer_state_dict` / :func:`set_optimizer_state_dict`
  wrap ``torch.distributed.checkpoint.state_dict``'s functions so that missing state is created
  without DCP's fake zero-gradient step (see :func:`init_state`). :func:`save_checkpoint` /
  :func:`load_checkpoint` save and load a model and its optimizer through DCP with a SHA-256
  manifest checked before anything is read, and a load that changes nothing unless it succeeds.

Seam for the fused (compiled, flat-buffer) execution: an execution receives ``(param, grad)`` pairs
and the per-parameter state; call :func:`localize` first (the optimizer does) and it sees ordinary
local tensors (``DTensor.to_local()`` shares storage, so in-place updates land in the shards). A flat
bucket for FSDP2 state holds the *local* shards, and the per-parameter ``DTensor`` views are rebuilt
with ``DTensor.from_local(view, param.device_mesh, param.placements, shape=param.shape,
stride=param.stride())``.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import io
import math
import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ._dtensor import is_dtensor, local, localize  # noqa: F401  (public here: halfadam.distributed.local...)
from .optimizer import _Engine
from .state_dict import CheckpointError, _rule_keys

__all__ = [
    "AUTO",
    "local",
    "is_dtensor",
    "localize",
    "halfadam_optimizer",
    "zero_process_group",
    "resolve_process_group",
    "all_reduce_found_inf",
    "total_norm",
    "init_state",
    "get_optimizer_state_dict",
    "set_optimizer_state_dict",
    "save_checkpoint",
    "load_checkpoint",
    "verify_checkpoint",
    "launch",
    "init_from_env",
]

AUTO = "auto"
"""``GradScaler(process_group=AUTO)``: agree on overflow over the default process group whenever
``torch.distributed`` is initialized with more than one rank."""

def halfadam_optimizer(optimizer: Any) -> Optional[Any]:
    """The halfadam optimizer behind ``optimizer``, or ``None``.

    ``optimizer`` itself for a :class:`halfadam.AdamW`/``Adam``/``AdamFP16``; its local optimizer
    (``.optim``) for a ``torch.distributed.optim.ZeroRedundancyOptimizer`` built with a halfadam
    ``optimizer_class``.
    """
    if isinstance(optimizer, _Engine):
        return optimizer
    inner = getattr(optimizer, "optim", None)
    if isinstance(inner, _Engine):
        try:
            from torch.distributed.optim import ZeroRedundancyOptimizer
        except Exception:  # pragma: no cover
            return None
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            return inner
    return None


def zero_process_group(optimizer: Any) -> Optional[Any]:
    """The process group of a ``ZeroRedundancyOptimizer`` around a halfadam optimizer, else ``None``.

    Over this group each rank updates its own shard of the parameters, and ``step`` is a collective:
    every rank must agree on skipping, and a norm over the shards' gradients is reduced over it.
    """
    inner = halfadam_optimizer(optimizer)
    if inner is None or inner is optimizer:
        return None
    return optimizer.process_group


def resolve_process_group(process_group: Any) -> Optional[Any]:
    """The process group to agree over, or ``None`` for no agreement.

    ``AUTO``: the default group when ``torch.distributed`` is initialized with world size > 1, else
    ``None``. ``None``: no agreement (each rank decides alone). A ``ProcessGroup``: that group.
    """
    if isinstance(process_group, str) and process_group != AUTO:
        raise ValueError(f"process_group must be {AUTO!r}, None or a ProcessGroup, got {process_group!r}")
    if process_group is None:
        return None
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if isinstance(process_group, str):
        return dist.group.WORLD if dist.get_world_size() > 1 else None
    return process_group


def all_reduce_found_inf(found_inf: Tensor, process_group: Any) -> Tensor:
    """Make ``found_inf`` (a 1-element float32 tensor, 0.0 or 1.0) the MAX over ``process_group``.

    In place; a no-op when ``process_group`` resolves to ``None``. The tensor is moved to the
    backend's device if needed (gloo: CPU; nccl: the current CUDA device) and back.
    """
    group = resolve_process_group(process_group)
    if group is not None:
        _all_reduce_(found_inf, torch.distributed.ReduceOp.MAX, group)
    return found_inf


def _all_reduce_(t: Tensor, op: Any, group: Any) -> None:
    """All-reduce ``t`` in place, through a copy on the backend's device when ``t`` is elsewhere."""
    dist = torch.distributed
    backend = dist.get_backend(group)
    device = t.device
    if backend == "nccl" and device.type != "cuda":
        buf = t.to(torch.device("cuda", torch.cuda.current_device()))
    elif backend == "gloo" and device.type != "cpu":
        buf = t.cpu()
    else:
        buf = t
    dist.all_reduce(buf, op=op, group=group)
    if buf is not t:
        t.copy_(buf.to(device))


def total_norm(grads: Sequence[Tensor], norm_type: float = 2.0, shard_group: Any = None,
               dtype: torch.dtype = torch.float32) -> Tensor:
    """The ``norm_type``-norm of all ``grads`` together, as a 0-d ``dtype`` tensor, across shards.

    ``dtype`` (default float32) is also the accumulation dtype: float64 keeps the sum of squares of
    large finite float32/bfloat16 values from overflowing (it overflows float32 from 1.8e19).

    Plain tensors contribute their local norm (DDP gradients are replicated, so this is the global
    norm). ``DTensor`` gradients (FSDP2) contribute the norm of the whole tensor, so every rank gets
    the same value: sharded and replicated placements (FSDP2's ``Shard(0)``, HSDP's ``(Replicate(),
    Shard(0))``) by the local shards' norms, reduced over each sharded mesh dimension's process group
    on that backend's device (host gradients of FSDP2's CPU offload on a CUDA mesh: the partial norm
    goes to the GPU for nccl and back), any other placement (``Partial``) by DTensor's own reduction
    (``full_tensor()``). With
    ``shard_group`` (ZeRO: each rank holds the gradients of its own parameters) the plain tensors'
    norm is combined over that group; every rank of it must call this, even with no gradients.
    """
    norm_type = float(norm_type)
    inf = norm_type == float("inf")
    device = local(grads[0]).device if grads else torch.device("cpu")
    norms = []
    plain: Dict[Any, List[Tensor]] = {}  # device -> plain (non-DTensor) gradients
    # (mesh, its sharded dims) -> local norms of gradients laid out so over it
    sharded: Dict[Tuple[Any, Tuple[int, ...]], List[Tensor]] = {}
    for g in grads:
        if not is_dtensor(g):
            plain.setdefault(g.device, []).append(g)
            continue
        if all(pl.is_shard() or pl.is_replicate() for pl in g.placements):
            # Disjoint shards (FSDP2, HSDP), replicated over the other dims: combine the local norms
            # with one collective per (mesh, sharded dims) and sharded dim.
            dims = tuple(i for i, pl in enumerate(g.placements) if pl.is_shard())
            sharded.setdefault((g.device_mesh, dims), []).append(
                torch.linalg.vector_norm(g.to_local(), norm_type, dtype=dtype))
            continue
        n = torch.linalg.vector_norm(g, norm_type, dtype=dtype)
        if is_dtensor(n):  # any other placement: let DTensor reduce it
            n = n.full_tensor()
        norms.append(n.to(device))
    foreach_norm = getattr(torch, "_foreach_norm", None)  # one kernel per device for many tensors
    for ts in plain.values():
        if foreach_norm is not None:
            norms += [n.to(device) for n in foreach_norm(ts, norm_type, dtype=dtype)]
        else:
            norms += [torch.linalg.vector_norm(t, norm_type, dtype=dtype).to(device) for t in ts]
    dist = torch.distributed
    for (mesh, dims), local_norms in sharded.items():
        part = torch.linalg.vector_norm(torch.stack(local_norms), norm_type)
        part = part if inf else part.double() ** norm_type
        for dim in dims:  # over each sharded dim in turn: all the disjoint shards (a replica each)
            _all_reduce_(part, dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, mesh.get_group(dim))
        norms.append((part if inf else part ** (1.0 / norm_type)).to(device, dtype))
    total = (torch.linalg.vector_norm(torch.stack(norms), norm_type) if norms
             else torch.zeros((), dtype=dtype, device=device))
    group = resolve_process_group(shard_group)
    if group is not None:
        dist = torch.distributed
        if norm_type == float("inf"):
            _all_reduce_(total, dist.ReduceOp.MAX, group)
        else:
            powered = total.double() ** norm_type
            _all_reduce_(powered, dist.ReduceOp.SUM, group)
            total = (powered ** (1.0 / norm_type)).to(dtype)
    return total


# ---------------------------------------------------------------------------------- checkpoints
def init_state(optimizer: Any) -> None:
    """Create the state (step 0, masters, zero moments) of every parameter that has none yet.

    ``torch.distributed.checkpoint.state_dict`` otherwise creates it by a step with zero gradients
    and ``lr=0``, which would advance halfadam's ``global_step`` and, with a learning-rate schedule or
    ``absolute`` decay, change the weights. Idempotent.
    """
    opt = halfadam_optimizer(optimizer)
    if opt is None:
        raise TypeError(f"not a halfadam optimizer: {type(optimizer).__name__}")
    for group in opt.param_groups:
        for p in group["params"]:
            opt._states.init(p, group)


def get_optimizer_state_dict(model: torch.nn.Module, optimizer: Any, *, options: Any = None,
                             checkpoint_id: Any = None, key: str = "optim") -> Dict[str, Any]:
    """``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` for a halfadam optimizer
    (any other optimizer, without ``checkpoint_id``: DCP's function itself).

    State is keyed by fully-qualified parameter name; under FSDP2 every state tensor (``master_weight``,
    encoded moments, per-block keys) is a ``DTensor`` sharded like its parameter, so
    ``torch.distributed.checkpoint.save`` writes them sharded and ``load`` reshards them. Creates
    missing state with :func:`init_state` first (no fake step).

    ``checkpoint_id`` (a DCP checkpoint directory to be loaded, whose optimizer state dict was saved
    under ``key``): the returned state dict has the state layout of that checkpoint's state mode, read
    from its metadata, so that ``dcp.load`` can fill it whatever this optimizer's mode; the
    :func:`set_optimizer_state_dict` that follows decodes it and encodes it in this optimizer's mode,
    as a single-process ``load_state_dict`` does. (It is laid out by a temporary optimizer of the same
    class and parameter groups in the checkpoint's mode; its ``param_groups`` have the checkpoint's
    keys, so a schedule saved there loads whether or not ``optimizer`` has one.) Without it, the
    layout is ``optimizer``'s own.

    ``options`` with ``flatten_optimizer_state_dict=True`` (torchtitan's) works in every state mode
    without ``checkpoint_id``.

    Raises:
        TypeError: ``optimizer`` is not a halfadam optimizer (with ``checkpoint_id``).
        ValueError: ``checkpoint_id`` with ``flatten_optimizer_state_dict=True`` in ``options``.
        CheckpointError: the state under ``key`` in ``checkpoint_id`` was saved flattened, or nothing is
            saved under ``key`` (the message lists the keys that are), or its ``.metadata`` fails the
            checkpoint's SHA-256 manifest or names a global that DCP's metadata never holds (it is
            unpickled admitting only DCP's classes); ``checkpoint_id`` does not exist (as for
            :func:`load_checkpoint`); ``.metadata`` is malformed (as for :func:`load_checkpoint`).
    """
    from torch.distributed.checkpoint import state_dict as dcp_sd

    if checkpoint_id is None:
        if halfadam_optimizer(optimizer) is not None:
            init_state(optimizer)
        return dcp_sd.get_optimizer_state_dict(model, optimizer, options=options)
    from ._dcp_io import ChecksummedReader, check_present

    _nested(options)
    check_present(checkpoint_id, f"cannot read the checkpoint {checkpoint_id}")
    saved_keys = ChecksummedReader(str(checkpoint_id)).read_metadata().state_dict_metadata
    _nested_checkpoint(saved_keys, key, checkpoint_id)
    return _checkpoint_layout(model, optimizer, options, checkpoint_id, saved_keys, key)


def _checkpoint_layout(model: torch.nn.Module, optimizer: Any, options: Any, checkpoint_id: Any, saved_keys: Any,
                       key: str, staging: bool = False) -> Dict[str, Any]:
    """:func:`get_optimizer_state_dict` with ``checkpoint_id`` (``saved_keys``: its metadata's keys);
    ``staging``: its state tensors are new ones even in ``optimizer``'s own mode (a temporary
    optimizer's), so ``dcp.load`` writes nothing of ``optimizer``'s."""
    from torch.distributed.checkpoint import state_dict as dcp_sd

    groups = _saved_groups(saved_keys, key, checkpoint_id)
    layout = _layout_of(optimizer, checkpoint_id, saved_keys, key, staging)
    init_state(layout)
    osd = dcp_sd.get_optimizer_state_dict(model, layout, options=options)
    osd["param_groups"] = groups
    _saved_fields(osd["state"], saved_keys, key, checkpoint_id)
    return osd


def _nested(options: Any) -> None:
    """Raise ValueError where ``options`` (DCP's ``StateDictOptions``) flattens the optimizer state dict:
    :func:`save_checkpoint`, :func:`load_checkpoint` and ``checkpoint_id`` (which lay the state out as the
    checkpoint saved it) take the nested one. Called by each before it reads or writes anything."""
    if getattr(options, "flatten_optimizer_state_dict", False):
        raise ValueError("halfadam's checkpoint_id, save_checkpoint and load_checkpoint take the nested optimizer "
                         "state dict: pass options without flatten_optimizer_state_dict=True, or use DCP's functions "
                         "(a flattened state dict loads into an optimizer of the state mode it was saved in)")


def _nested_checkpoint(saved_keys: Any, key: str, checkpoint_id: Any) -> None:
    """Raise CheckpointError where the optimizer state dict under ``key`` was saved flattened (DCP's
    ``flatten_optimizer_state_dict=True``: ``<key>.param_groups.<parameter name>.<hyperparameter>``, and no
    group's ``<key>.param_groups.<index>.params`` as the nested one has)."""
    prefix = f"{key}.param_groups."
    names = [name[len(prefix):] for name in saved_keys if name.startswith(prefix)]
    if names and not any(name.endswith(".params") and name[:-len(".params")].isdigit() for name in names):
        raise CheckpointError(
            f"the checkpoint {checkpoint_id} holds the optimizer state under {key!r} flattened "
            f"(flatten_optimizer_state_dict=True): load it with DCP's get/set_optimizer_state_dict and the same "
            f"options, into an optimizer of the state mode it was saved in")


def _saved_fields(state: Dict[str, Dict[str, Any]], saved_keys: Any, key: str, checkpoint_id: Any) -> None:
    """Give ``state`` (per parameter name, the layout's state tensors) the fields the checkpoint saved
    under ``key``, in place, so that ``load_state_dict`` judges them as it does in one process: a field
    the checkpoint lacks (a master saved without master weights, a parameter that never stepped) is
    dropped, and one the layout lacks (a master, for an optimizer without master weights) gets a
    tensor of its saved size and dtype (whole, on the CPU) to be read into, once that size is found to
    be no larger than the parameter (CheckpointError naming the key otherwise: nothing is allocated
    for a size that ``.metadata`` merely declares). A field saved as a tensor
    where the layout has an object, or the other way round, or nested where the layout's is not
    (``step``: a tensor in checkpoints of 8-bit codes written before their label, bytes in those up to
    673f2dc, a dict since, :data:`halfadam.encodings.CODES_LABEL`), takes the checkpoint's kind."""
    prefix, source = f"{key}.state.", Path(checkpoint_id) / ".metadata"
    saved: Dict[str, Dict[str, Any]] = {}
    for name, meta in saved_keys.items():
        if not name.startswith(prefix):
            continue
        parts = name[len(prefix):].split(".")  # <parameter name>.<field>[.<key in a nested field>]
        for cut in range(len(parts) - 1, 0, -1):  # the longest leading run that names a parameter (names hold dots)
            fqn = ".".join(parts[:cut])
            if fqn in state:
                _nest(saved.setdefault(fqn, {}), ".".join(parts[cut:]), meta, f"{source}: its key {name!r}")
                break
    for fqn in list(state):
        if fqn in saved:
            limit = max((v.numel() for v in state[fqn].values() if isinstance(v, Tensor)), default=0)
            state[fqn] = _saved_kinds(state[fqn], saved[fqn], limit, source, f"{prefix}{fqn}")
        else:
            del state[fqn]


def _saved_kinds(value: Any, saved: Any, limit: int, source: Path, name: str) -> Any:
    """``value`` (the layout's) where it is of the checkpoint's kind (``saved``: DCP metadata, or a dict of
    them for a nested value), else what ``dcp.load`` can read the saved value into: a new tensor of at
    most ``limit`` elements (its parameter's), else CheckpointError naming ``source`` (the metadata
    file) and ``name`` (the key)."""
    if isinstance(saved, dict):
        value = value if isinstance(value, dict) else {}
        return {k: _saved_kinds(value.get(k), meta, limit, source, f"{name}.{k}") for k, meta in saved.items()}
    if hasattr(saved, "size"):  # a tensor
        if isinstance(value, Tensor):
            return value  # DCP checks the saved size against it
        if math.prod(saved.size) > limit:
            raise CheckpointError(f"{source}: its key {name!r} is a tensor of {math.prod(saved.size)} elements "
                                  f"{list(saved.size)}, more than its parameter's {limit}, which no state tensor has; "
                                  f"refusing to allocate it")
        return torch.empty(tuple(saved.size), dtype=saved.properties.dtype)
    return value if value is not None and not isinstance(value, (Tensor, dict)) else b""  # any object: dcp.load replaces it


def _layout_of(optimizer: Any, checkpoint_id: Any, saved_keys: Any, key: str, staging: bool = False) -> Any:
    """``optimizer``, or a temporary one of its class and groups whose state format is that of the
    optimizer state saved under ``key`` in the DCP checkpoint ``checkpoint_id`` (``saved_keys``: its
    metadata's keys; the format is read off their names and dtypes: the most encoded field of any
    parameter; each parameter's own follows from its shape). ``staging``: a temporary one even when
    the formats agree (its state tensors are new ones to load into). Raises CheckpointError when
    nothing is saved under ``key``."""
    opt = halfadam_optimizer(optimizer)
    if opt is None or opt is not optimizer:
        raise TypeError(f"checkpoint_id needs a halfadam optimizer, got {type(optimizer).__name__}")
    if not any(name.startswith(f"{key}.") for name in saved_keys):
        tops = sorted({name.split(".", 1)[0] for name in saved_keys})
        raise CheckpointError(f"the checkpoint {checkpoint_id} has no optimizer state under key={key!r}: its "
                              f"top-level keys are {tops}; pass the key it was saved under")
    prefix = f"{key}.state."
    saved = {name: meta for name, meta in saved_keys.items() if name.startswith(prefix)}
    fmt = _saved_format(saved, opt.state_format.moments) if saved else opt.state_format
    if fmt == opt.state_format and not staging:
        return opt
    # the same class, rule and groups (their rule keys: SGD's momentum decides its moments), built by the
    # engine's constructor, whose arguments every rule's class shares
    keys = _rule_keys(opt)
    groups = [{"params": g["params"], "master_weights": g["master_weights"], **{k: g[k] for k in keys if k in g}}
              for g in opt.param_groups]
    layout = type(opt).__new__(type(opt))
    _Engine.__init__(layout, groups, lr=1e-3, learning_rate=None, weight_decay=0.0,
                     options={k: opt.defaults[k] for k in keys if k in opt.defaults}, master_weights=None,
                     implementation="reference", store_param_remainders=fmt.master != "fp32",
                     exp_avg_dtype=fmt.exp_avg, exp_avg_sq_dtype=fmt.exp_avg_sq)
    layout.rule = opt.rule
    layout.state_format = fmt  # an earlier release's codes (fmt.legacy): only loaded into, then converted
    return layout


def _saved_groups(saved_keys: Any, key: str, checkpoint_id: Any) -> List[Dict[str, Any]]:
    """A template of the ``param_groups`` saved under ``key`` (``saved_keys``: the checkpoint's DCP
    metadata keys), for ``dcp.load`` to fill: the checkpoint's own keys, whatever this optimizer's
    groups hold (a schedule is saved as nested plain data, whose keys depend on its class, or as
    ``None``). CheckpointError naming ``checkpoint_id``'s ``.metadata`` for a key that is not
    ``<key>.param_groups.<index>.<name>`` or groups not numbered from 0 on."""
    prefix, source = f"{key}.param_groups.", Path(checkpoint_id) / ".metadata"
    groups: Dict[int, Dict[str, Any]] = {}
    for name in saved_keys:
        if name.startswith(prefix):
            index, _, rest = name[len(prefix):].partition(".")
            if not (index.isascii() and index.isdigit() and rest):
                raise CheckpointError(f"{source}: its key {name!r} is not '{prefix}<group index>.<name>'")
            _nest(groups.setdefault(int(index), {}), rest, None, f"{source}: its key {name!r}")
    if sorted(groups) != list(range(len(groups))):
        raise CheckpointError(f"{source}: its parameter groups under {key!r} are numbered {sorted(groups)[:8]}, not "
                              f"0 to {len(groups) - 1}")
    return [groups[i] for i in sorted(groups)]


def _nest(tree: Dict[str, Any], dotted: str, value: Any, where: str) -> None:
    """Put ``value`` into ``tree`` (nested dicts, in place) at the path of a DCP key's ``dotted`` rest
    (DCP flattens nested dicts with "."): ``"step.halfadam_step"`` is ``tree["step"]["halfadam_step"]``.
    CheckpointError (``where``: its start, the file and the key) where another key holds a value at a
    dict of this path or the other way round (no state dict DCP writes has both ``a.b`` and ``a.b.c``)."""
    *path, leaf = dotted.split(".")
    for part in path:
        tree = tree.setdefault(part, {})
        if not isinstance(tree, dict):
            break
    if not isinstance(tree, dict) or isinstance(tree.get(leaf), dict):
        raise CheckpointError(f"{where} holds a value where another key holds values under it (or the other way "
                              f"round)")
    tree[leaf] = value


def _saved_format(saved: Dict[str, Any], moments: Tuple[Tuple[str, str], ...]) -> Any:
    """The state format of a checkpoint's optimizer state, from its DCP metadata (``saved``: its
    ``<key>.state.*`` entries), for an update rule keeping ``moments`` (``(key, kind)``: the loading
    optimizer's ``state_format.moments``)."""
    from .encodings import SIGNED, SQUARE, StateFormat, codes_of, master_of, scale_key

    fields = {name.rsplit(".", 1)[-1] for name in saved}
    codes = codes_of(fields)

    def moment(name: str, kind: str) -> torch.dtype:
        if scale_key(name, codes, kind) in fields:
            return torch.uint8
        dtypes = {getattr(getattr(meta, "properties", None), "dtype", None) for key_, meta in saved.items()
                  if key_.endswith(f".{name}")}
        return torch.bfloat16 if torch.bfloat16 in dtypes else torch.float32

    dtypes = {kind: moment(name, kind) for name, kind in moments}
    return StateFormat(master_of(fields), dtypes.get(SIGNED, torch.float32), dtypes.get(SQUARE, torch.float32),
                       codes=codes, moments=tuple(moments))


def set_optimizer_state_dict(model: torch.nn.Module, optimizer: Any, optim_state_dict: Dict[str, Any], *,
                             options: Any = None) -> None:
    """``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict`` for a halfadam optimizer
    (any other optimizer: DCP's function itself).

    Creates missing state with :func:`init_state` first (no fake step); the load itself is the
    optimizer's ``load_state_dict`` (:mod:`halfadam.checkpoint`), which keeps fp32 masters and moments
    fp32 and copies into the existing (under FSDP2: ``DTensor``) state tensors.

    Typical resume (any number of ranks, any sharding)::

        osd = halfadam.distributed.get_optimizer_state_dict(model, opt, checkpoint_id=path)
        torch.distributed.checkpoint.load({"model": msd, "optim": osd}, checkpoint_id=path)
        halfadam.distributed.set_optimizer_state_dict(model, opt, osd)

    (``checkpoint_id`` there: the checkpoint's state layout, so that ``opt`` may have another state
    mode.)
    """
    from torch.distributed.checkpoint import state_dict as dcp_sd

    if halfadam_optimizer(optimizer) is not None:
        init_state(optimizer)
    dcp_sd.set_optimizer_state_dict(model, optimizer, optim_state_dict, options=options)


#: The key under which :func:`save_checkpoint` stores its ``extra`` data.
EXTRA_KEY = "extra"


def save_checkpoint(checkpoint_id: Any, model: torch.nn.Module, optimizer: Any, *, extra: Optional[Dict[str, Any]] = None,
                    key: str = "optim", model_key: str = "model", options: Any = None) -> None:
    """Save ``model`` and ``optimizer`` as a DCP checkpoint in the directory ``checkpoint_id``, with a manifest.

    Every rank calls it (under FSDP2 each writes its shards). The state dict is
    ``{model_key: get_model_state_dict(model), key: get_optimizer_state_dict(model, optimizer)}`` (so
    plain ``dcp.load`` reads it too; ``optimizer`` may also be a ``torch.optim`` one), plus ``extra``
    under :data:`EXTRA_KEY`: plain data that ``torch.load(weights_only=True)`` reads back (numbers,
    strings, lists, dicts, tensors: a scaler's ``state_dict()``, an RNG state, a history), saved once,
    from rank 0 (every rank gets rank 0's back: key per-rank data by rank yourself). Written by
    :class:`halfadam._dcp_io.ChecksummedWriter`: DCP's ``FileSystemWriter``, then the SHA-256 of every
    file in ``halfadam.sha256`` (``sha256sum -c`` reads it), which :func:`load_checkpoint` checks
    before reading anything.

    Atomically: the checkpoint is written whole into a new directory beside ``checkpoint_id``
    (``.<name>.<random>.<pid>-<start>-<scope>.tmp``, named by rank 0 and broadcast), and once its
    manifest is written, rank 0 exchanges it with the previous checkpoint in one step
    (``renameat2(RENAME_EXCHANGE)``; where the file system lacks it, two renames) and removes the old
    one; every rank returns after that. So a save killed or failing at any point leaves the previous
    checkpoint (or, once exchanged, the new one) whole at ``checkpoint_id``; the temporary directory of
    a killed save is removed by the next save in that directory. Without the exchange, a save killed
    between its two renames leaves no ``checkpoint_id``, the new checkpoint and the old one beside it:
    a load names the new one, and the next save to ``checkpoint_id`` renames it back before it removes
    anything (a complete checkpoint is never removed while ``checkpoint_id`` is missing). An existing
    ``checkpoint_id`` must be a DCP checkpoint directory (or empty): one holding other files is refused,
    as the save replaces it.

    Raises:
        ValueError: ``options`` with ``flatten_optimizer_state_dict=True`` (before anything is written).
        CheckpointError: ``extra`` holds an object ``weights_only`` cannot load (before anything is
            written); the optimizer cannot give its state (a resized parameter: its ValueError is the
            cause); ``checkpoint_id`` is a file or a directory with other files; DCP failed to write
            (its ``CheckpointException`` or an ``OSError`` is the cause; the message names the rank
            and the first failure, and says when the disk is full). The previous checkpoint is as it
            was and the temporary directory is removed.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from . import _dcp_io

    _nested(options)  # load_checkpoint reads the nested state dict
    where = f"cannot save the checkpoint {checkpoint_id}"
    with _checkpoint_errors(where):
        state = {model_key: get_model_state_dict(model, options=options),
                 key: get_optimizer_state_dict(model, optimizer, options=options)}
    dist = torch.distributed
    if extra is not None and not (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0):
        blob = io.BytesIO()
        torch.save(extra, blob)
        try:
            torch.load(io.BytesIO(blob.getvalue()), weights_only=True)
        except Exception as exc:
            found = [line.strip() for line in str(exc).splitlines() if "Unsupported global" in line]
            raise CheckpointError(f"{where}: extra must hold plain data that torch.load(weights_only=True) reads "
                                  f"(numbers, strings, lists, dicts, tensors): {found[0] if found else exc}") from exc
        blob.seek(0)
        state[EXTRA_KEY] = blob
    lead = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    path = Path(os.path.realpath(checkpoint_id))  # a link to a checkpoint: the checkpoint it names
    tmp = None
    try:
        with _checkpoint_errors(where):
            tmp = _from_rank0(_dcp_io.new_sibling, path)
        with _checkpoint_errors(where), _quiet_dcp():
            dcp.save(state, storage_writer=_dcp_io.ChecksummedWriter(str(tmp)))
        with _checkpoint_errors(where):
            _from_rank0(_dcp_io.swap_in, tmp, path)
        tmp = None
    finally:
        if lead and tmp is not None:
            _dcp_io._remove_entry(tmp)


def _from_rank0(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on rank 0 (of the default process group; in one process: here), its result or
    its exception on every rank."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return fn(*args)
    box: List[Any] = [None, None]
    if dist.get_rank() == 0:
        try:
            box[0] = fn(*args)
        except Exception as exc:  # noqa: BLE001 - sent to every rank, raised there
            box[1] = exc
    dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise box[1]
    return box[0]


def load_checkpoint(checkpoint_id: Any, model: Optional[torch.nn.Module] = None, optimizer: Any = None, *,
                    key: str = "optim", model_key: str = "model", options: Any = None) -> Dict[str, Any]:
    """Load a checkpoint of :func:`save_checkpoint` into ``model`` and ``optimizer``: all of it, or nothing.

    Every rank calls it, with any number of ranks and any sharding (DCP reshards), and a halfadam
    optimizer of any state mode (the checkpoint's state is decoded and encoded in this one's, as
    :func:`get_optimizer_state_dict` with ``checkpoint_id`` does; a ``torch.optim`` optimizer loads
    DCP's way). State is matched to parameters by name, as DCP does. In order:

    1. the files are checked against the SHA-256 manifest before any is read (one of plain ``dcp.save`` has none:
       read unchecked); ``.metadata`` is unpickled admitting only DCP's classes and checked, every non-tensor item
       with ``torch.load(weights_only=True)``: nothing runs code; only regular files inside the directory are opened;
    2. DCP loads into staging tensors: new ones of the model's and of a temporary optimizer's state
       (one more copy of the model and of the optimizer state in memory while it runs);
    3. then the model's parameters and buffers are copied in, and the optimizer's state is loaded
       (halfadam's ``load_state_dict``, which checks everything first, as in one process); should
       that fail, the model's previous values are copied back.

    So a corrupt, truncated or mismatched checkpoint raises with ``model`` and ``optimizer`` as they
    were. ``model`` alone (``optimizer=None``) loads the model; neither reads only ``extra``.

    Returns:
        The ``extra`` data saved with the checkpoint (``{}`` when none was).

    Raises:
        ValueError: ``options`` with ``flatten_optimizer_state_dict=True`` (before anything is read).
        CheckpointError: no directory ``checkpoint_id`` (naming the complete one a killed save left beside it); the
            optimizer state was saved flattened; a file fails the manifest, lies outside the directory or is no regular
            file (named); ``.metadata`` is malformed, or it or a non-tensor item names a global a halfadam checkpoint
            never holds (named, with its file and why; nothing of it runs); nothing is saved under ``key``; other
            parameter groups; DCP fails to read (its ``CheckpointException``, a ``BaseException``, is the cause); the
            state does not fit ``optimizer`` (as its ``load_state_dict`` says).
        KeyboardInterrupt, SystemExit: as raised, also from inside DCP (nothing changed).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dcp_sd

    from ._dcp_io import SafeLoadPlanner

    where = f"cannot load the checkpoint {checkpoint_id}"
    reader, keys = _opened(checkpoint_id, model, optimizer, options, key, where)
    # state DCP's layout (torch optimizers) and halfadam's load make for stateless parameters; a failure drops it
    fresh = [] if optimizer is None else [p for g in optimizer.param_groups for p in g["params"]
                                          if not optimizer.state.get(p)]
    backup = None
    try:
        staged, live = _staging(model, optimizer, options, checkpoint_id, keys, key, model_key)
        if staged:
            with _checkpoint_errors(where, unchecked=reader.manifest is None), _quiet_dcp():
                dcp.load(staged, storage_reader=reader, planner=SafeLoadPlanner(checkpoint_id))
        extra: Dict[str, Any] = {}
        if EXTRA_KEY in staged:
            with _checkpoint_errors(f"{where}: its extra data"):
                extra = torch.load(io.BytesIO(staged[EXTRA_KEY].getvalue()), weights_only=True)
        if model is not None:
            if optimizer is not None:
                backup = {k: v.detach().clone() for k, v in live.items() if isinstance(v, Tensor)}
            dcp_sd.set_model_state_dict(model, staged[model_key], options=options)
        if optimizer is not None:
            with _checkpoint_errors(where):
                set_optimizer_state_dict(model, optimizer, staged[key], options=options)
    except BaseException:
        if backup is not None:
            dcp_sd.set_model_state_dict(model, backup, options=options)
        for p in fresh:
            optimizer.state.pop(p, None)
        raise
    return extra


def _opened(checkpoint_id: Any, model: Optional[torch.nn.Module], optimizer: Any, options: Any, key: str,
            where: str) -> Tuple[Any, Dict[str, Any]]:
    """``(reader, keys)`` for :func:`load_checkpoint`: the checkpoint's checked reader and its metadata's
    items, once everything that can be checked before a tensor is read has been (the options, the
    directory, the manifest and ``.metadata``, the optimizer's layout and group count); nothing changes."""
    from ._dcp_io import ChecksummedReader, check_present

    _nested(options)
    check_present(checkpoint_id, where)  # before any reading
    with _checkpoint_errors(where):
        reader = ChecksummedReader(str(checkpoint_id))
        keys = reader.read_metadata().state_dict_metadata  # checked first, on every rank
    if optimizer is not None:
        if model is None:
            raise TypeError("load_checkpoint: an optimizer is loaded with its model (pass model=)")
        _nested_checkpoint(keys, key, checkpoint_id)
        groups = len(_saved_groups(keys, key, checkpoint_id))
        if groups and groups != len(optimizer.param_groups):
            raise CheckpointError(f"{where}: it has {groups} parameter group(s) under {key!r}, this optimizer "
                                  f"{len(optimizer.param_groups)}")
    return reader, keys


def _staging(model: Optional[torch.nn.Module], optimizer: Any, options: Any, checkpoint_id: Any, keys: Any, key: str,
             model_key: str) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
    """``(staged, live)`` for :func:`load_checkpoint`: new tensors for DCP to load into, laid out as
    the model's and the optimizer's state (halfadam's in the checkpoint's layout, a torch.optim one
    in its own), a buffer for the extra data; ``live``: the model's current state dict (or ``None``)."""
    from torch.distributed.checkpoint import state_dict as dcp_sd

    staged: Dict[str, Any] = {}
    live = None
    if model is not None:
        live = dcp_sd.get_model_state_dict(model, options=options)
        staged[model_key] = {k: v.detach().clone() if isinstance(v, Tensor) else v for k, v in live.items()}
    if optimizer is not None and halfadam_optimizer(optimizer) is optimizer:
        staged[key] = _checkpoint_layout(model, optimizer, options, checkpoint_id, keys, key, staging=True)
    elif optimizer is not None:  # a torch.optim optimizer: its own layout, cloned
        staged[key] = _cloned(dcp_sd.get_optimizer_state_dict(model, optimizer, options=options))
    if EXTRA_KEY in keys:
        staged[EXTRA_KEY] = io.BytesIO()
    return staged, live


def verify_checkpoint(checkpoint_id: Any) -> None:
    """Check every file of the DCP checkpoint ``checkpoint_id`` against its SHA-256 manifest (all of
    them: a load checks only the files it reads), and read its ``.metadata`` and every non-tensor
    item as a load does (refusing anything but plain data), and check that every data file it names
    is a regular file inside the directory, without loading anything into a model. A checkpoint
    without a manifest is read unchecked (but as confined).

    Raises:
        CheckpointError: ``checkpoint_id`` does not exist (as for :func:`load_checkpoint`); a file is
            missing, corrupt, truncated or not in the manifest (named); the manifest does not list
            ``.metadata``; ``.metadata`` or a non-tensor item holds an object that a halfadam
            checkpoint never contains (named, with its file); ``.metadata`` is malformed or a file is not
            a regular file inside the directory (as for :func:`load_checkpoint`).
    """
    from ._dcp_io import ChecksummedReader, check_present

    check_present(checkpoint_id, f"cannot load the checkpoint {checkpoint_id}")
    with _checkpoint_errors(f"cannot load the checkpoint {checkpoint_id}"):
        reader = ChecksummedReader(str(checkpoint_id))
        if reader.manifest is not None:
            if ".metadata" not in reader.manifest:
                raise CheckpointError(f"{checkpoint_id}: its manifest does not list .metadata")
            reader.check(reader.manifest)
        reader.check_objects(reader.read_metadata())


def _cloned(tree: Any) -> Any:
    """``tree`` (dicts and lists of tensors and plain values) with every tensor cloned."""
    if isinstance(tree, Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _cloned(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_cloned(v) for v in tree]
    return tree


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    """Without DCP's ``UserWarning`` that ``torch.distributed`` is off (a one-process save or load)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


@contextlib.contextmanager
def _checkpoint_errors(what: str, unchecked: bool = False) -> Iterator[None]:
    """Any exception inside (DCP's ``CheckpointException``, a ``BaseException``, included) leaves as
    :class:`CheckpointError` with it as the cause and ``what`` and its first failure in the message;
    ``KeyboardInterrupt`` and ``SystemExit`` leave as themselves, also from inside DCP's exception.
    ``unchecked``: the checkpoint had no manifest (the message says so: no file was checked)."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        interrupt = _interrupt(exc)
        if interrupt is not None:
            raise interrupt from exc
        note = "; the checkpoint has no SHA-256 manifest (written by plain dcp.save?), so no file was checked" \
            if unchecked else ""
        raise CheckpointError(f"{what}: {_first_failure(exc)}{note}") from exc


def _failures(exc: BaseException) -> List[Tuple[int, BaseException]]:
    """A DCP ``CheckpointException``'s ``(rank, exception)`` pairs, by rank; ``[]`` for any other."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return []
    return [(rank, f[0] if isinstance(f, tuple) else f) for rank, f in sorted(failures.items())]


def _interrupt(exc: BaseException) -> Optional[BaseException]:
    """The ``KeyboardInterrupt``/``SystemExit`` that DCP wrapped in ``exc``, if any."""
    return next((e for _, e in _failures(exc) if isinstance(e, (KeyboardInterrupt, SystemExit))), None)


def _first_failure(exc: BaseException) -> str:
    """One line for ``exc``: a DCP ``CheckpointException``'s first failing rank and its exception (a
    CheckpointError's own message), else the exception's first line."""
    failures = _failures(exc)
    if failures:
        rank, inner = failures[0]
        where = f"rank {rank}: " if len(failures) > 1 or torch.distributed.is_initialized() else ""
        return where + _first_failure(inner)
    if isinstance(exc, CheckpointError):
        return str(exc)
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the disk is full (no space left on device{': ' + str(exc.filename) if exc.filename else ''})"
    if isinstance(exc, RuntimeError) and isinstance(exc.__context__, OSError):  # torch.save's "enforce fail"
        return _first_failure(exc.__context__)
    # DCP's metadata fallback wraps the first error in an AssertionError: keep halfadam's own message
    cause = exc.__cause__ or exc.__context__
    if isinstance(cause, CheckpointError):
        return str(cause)
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else f"{type(exc).__name__} (no message)"


# ---------------------------------------------------------------------------------- launching
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_entry(rank: int, world: int, backend: str, init_method: str, timeout_s: float, threads: int,
                  fn: Any, args: tuple) -> None:
    torch.set_num_threads(threads)
    if backend == "nccl":  # one GPU per process
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist = torch.distributed
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    try:
        fn(rank, world, *args)
        # Free fn's DDP/ZeRO/FSDP objects (DDP sits in reference cycles) and let every rank get here
        # before gloo is torn down: with a DDP module still alive, destroy_process_group was seen to
        # abort a process now and then ("terminate called without an active exception", torch 2.13).
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def launch(fn: Any, nproc: int, *args: Any, backend: str = "gloo", timeout_s: float = 1800.0) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``nproc`` processes on this machine, in one process group.

    Spawns with ``torch.multiprocessing`` (``fn`` and ``args`` must be picklable: ``fn`` a module-level
    function), initialises ``backend`` (``"gloo"``: CPU) over TCP on 127.0.0.1 with a free port and
    ``timeout_s`` for collectives, gives each process ``max(1, cpu_count // nproc)`` threads, and
    destroys the group at the end. An exception in any process is raised here
    (``torch.multiprocessing.ProcessRaisedException``). This is what ``halfadam train --nproc N``
    calls; ``torchrun`` plus :func:`init_from_env` is the equivalent for multi-machine jobs.
    """
    if not (isinstance(nproc, int) and nproc >= 1):
        raise ValueError(f"nproc must be an int >= 1, got {nproc!r}")
    import torch.multiprocessing as mp

    threads = max(1, (os.cpu_count() or 1) // nproc)
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    mp.spawn(_launch_entry, args=(nproc, backend, init_method, timeout_s, threads, fn, args), nprocs=nproc, join=True)


def init_from_env(backend: Optional[str] = None) -> Tuple[int, int]:
    """Initialise the default process group from ``torchrun``'s environment; returns ``(rank, world_size)``.

    Does nothing and returns ``(0, 1)`` outside ``torchrun`` (no ``WORLD_SIZE`` in the environment)
    or when the group already exists (then returns its rank and size). ``backend`` defaults to
    ``"nccl"`` when CUDA is available, else ``"gloo"``; any backend with nccl in it (``"nccl"``, or
    ``"cuda:nccl,cpu:gloo"``, which gives CPU tensors gloo: FSDP2's CPU offload) first sets this
    process's GPU, ``LOCAL_RANK``.
    """
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "WORLD_SIZE" not in os.environ:
        return 0, 1
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if "nccl" in backend:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()
