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
  without DCP's fake zero-gradient step (see :func:`init_state`).

Seam for the fused (compiled, flat-buffer) execution: an execution receives ``(param, grad)`` pairs
and the per-parameter state; call :func:`localize` first (the optimizer does) and it sees ordinary
local tensors (``DTensor.to_local()`` shares storage, so in-place updates land in the shards). A flat
bucket for FSDP2 state holds the *local* shards, and the per-parameter ``DTensor`` views are rebuilt
with ``DTensor.from_local(view, param.device_mesh, param.placements, shape=param.shape,
stride=param.stride())``.
"""

from __future__ import annotations

import gc
import os
import socket
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ._dtensor import is_dtensor, local, localize  # noqa: F401  (public here: halfadam.distributed.local...)
from .optimizer import _AdamBase

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
    "launch",
    "init_from_env",
]

#: ``GradScaler(process_group=AUTO)``: agree on overflow over the default process group whenever
#: ``torch.distributed`` is initialized with more than one rank.
AUTO = "auto"

def halfadam_optimizer(optimizer: Any) -> Optional[Any]:
    """The halfadam optimizer behind ``optimizer``, or ``None``.

    ``optimizer`` itself for a :class:`halfadam.AdamW`/``Adam``/``AdamFP16``; its local optimizer
    (``.optim``) for a ``torch.distributed.optim.ZeroRedundancyOptimizer`` built with a halfadam
    ``optimizer_class``.
    """
    if isinstance(optimizer, _AdamBase):
        return optimizer
    inner = getattr(optimizer, "optim", None)
    if isinstance(inner, _AdamBase):
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
    norm). ``DTensor`` gradients (FSDP2) contribute the norm of the whole tensor: their sharded norm
    is reduced over their mesh (``full_tensor()``), so every rank gets the same value. With
    ``shard_group`` (ZeRO: each rank holds the gradients of its own parameters) the plain tensors'
    norm is combined over that group; every rank of it must call this, even with no gradients.
    """
    norm_type = float(norm_type)
    inf = norm_type == float("inf")
    device = local(grads[0]).device if grads else torch.device("cpu")
    norms = []
    plain: Dict[Any, List[Tensor]] = {}  # device -> plain (non-DTensor) gradients
    sharded: Dict[Any, List[Tensor]] = {}  # 1-D mesh -> local norms of gradients sharded over it
    for g in grads:
        if not is_dtensor(g):
            plain.setdefault(g.device, []).append(g)
            continue
        if is_dtensor(g) and g.device_mesh.ndim == 1 and all(pl.is_shard() for pl in g.placements):
            # Disjoint shards (FSDP2): combine the local norms with one collective per mesh.
            sharded.setdefault(g.device_mesh, []).append(
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
    for mesh, local_norms in sharded.items():
        part = torch.linalg.vector_norm(torch.stack(local_norms), norm_type)
        part = part if inf else part.double() ** norm_type
        _all_reduce_(part, dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, mesh.get_group())
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
            opt._init_state(p, group)


def get_optimizer_state_dict(model: torch.nn.Module, optimizer: Any, *, options: Any = None,
                             checkpoint_id: Any = None, key: str = "optim") -> Dict[str, Any]:
    """``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` for a halfadam optimizer.

    State is keyed by fully-qualified parameter name; under FSDP2 every state tensor (``master_weight``,
    encoded moments, per-block keys) is a ``DTensor`` sharded like its parameter, so
    ``torch.distributed.checkpoint.save`` writes them sharded and ``load`` reshards them. Creates
    missing state with :func:`init_state` first (no fake step).

    ``checkpoint_id`` (a DCP checkpoint directory to be loaded, whose optimizer state dict was saved
    under ``key``): the returned state dict has the state layout of that checkpoint's state mode, read
    from its metadata, so that ``dcp.load`` can fill it whatever this optimizer's mode; the
    :func:`set_optimizer_state_dict` that follows decodes it and encodes it in this optimizer's mode,
    as a single-process ``load_state_dict`` does. (It is laid out by a temporary optimizer of the same
    class and parameter groups in the checkpoint's mode.) Without it, the layout is ``optimizer``'s own.

    Raises:
        TypeError: ``optimizer`` is not a halfadam optimizer (with ``checkpoint_id``).
    """
    from torch.distributed.checkpoint import state_dict as dcp_sd

    if checkpoint_id is not None:
        optimizer = _layout_of(optimizer, checkpoint_id, key)
    init_state(optimizer)
    return dcp_sd.get_optimizer_state_dict(model, optimizer, options=options)


def _layout_of(optimizer: Any, checkpoint_id: Any, key: str) -> Any:
    """``optimizer``, or a temporary one of its class and groups whose state format is that of the
    optimizer state saved under ``key`` in the DCP checkpoint ``checkpoint_id`` (read off its keys and
    dtypes: the most encoded field of any parameter; each parameter's own follows from its shape)."""
    from torch.distributed.checkpoint import FileSystemReader

    from .encodings import StateFormat

    opt = halfadam_optimizer(optimizer)
    if opt is None or opt is not optimizer:
        raise TypeError(f"checkpoint_id needs a halfadam optimizer, got {type(optimizer).__name__}")
    prefix = f"{key}.state."
    saved = {name: meta for name, meta in FileSystemReader(str(checkpoint_id)).read_metadata()
             .state_dict_metadata.items() if name.startswith(prefix)}
    if not saved:
        return opt
    fields = {name.rsplit(".", 1)[-1] for name in saved}

    def moment(name: str) -> torch.dtype:
        if f"{name}_absmax" in fields:
            return torch.uint8
        dtypes = {getattr(getattr(meta, "properties", None), "dtype", None) for key_, meta in saved.items()
                  if key_.endswith(f".{name}")}
        return torch.bfloat16 if torch.bfloat16 in dtypes else torch.float32

    fmt = StateFormat("split" if "master_hi" in fields else "fp32", moment("exp_avg"), moment("exp_avg_sq"))
    if fmt == opt.state_format:
        return opt
    groups = [{"params": g["params"], "master_weights": g["master_weights"]} for g in opt.param_groups]
    return type(opt)(groups, lr=1e-3, implementation="reference", store_param_remainders=fmt.master == "split",
                     exp_avg_dtype=fmt.exp_avg, exp_avg_sq_dtype=fmt.exp_avg_sq)


def set_optimizer_state_dict(model: torch.nn.Module, optimizer: Any, optim_state_dict: Dict[str, Any], *,
                             options: Any = None) -> None:
    """``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict`` for a halfadam optimizer.

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

    init_state(optimizer)
    dcp_sd.set_optimizer_state_dict(model, optimizer, optim_state_dict, options=options)


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
    ``"nccl"`` when CUDA is available, else ``"gloo"``.
    """
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "WORLD_SIZE" not in os.environ:
        return 0, 1
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()
