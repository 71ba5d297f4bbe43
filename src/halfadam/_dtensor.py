"""DTensor (FSDP2) helpers every layer may use: the bottom of halfadam's import order.

``halfadam.distributed`` re-exports them; the state and optimizer layers import them from here, so no
lower layer imports ``distributed`` (which sits above the optimizer).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

import torch
from torch import Tensor

__all__ = ["is_dtensor", "local", "localize", "flat_offset", "row_sharded", "zeros_like_rows", "like_rows", "like_param"]

try:  # DTensor is public from torch 2.4 (torch.distributed.tensor)
    from torch.distributed.tensor import DTensor as _DTensor
except Exception:  # pragma: no cover - torch built without distributed
    _DTensor = None


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (an FSDP2 parameter, gradient or state)."""
    return _DTensor is not None and isinstance(t, _DTensor)


def local(t: Any) -> Any:
    """The local shard of a ``DTensor`` (sharing its storage), or ``t`` itself for anything else."""
    return t.to_local() if is_dtensor(t) else t


def _first_row(t: Any) -> Any:
    """The first row (index of dim 0) of ``t``'s local shard in the global tensor when that shard is a
    run of whole rows (FSDP2's ``Shard(0)``, ``Replicate``, a 2-D HSDP mesh of both), else ``None``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(shape[1:]) != tuple(t.shape[1:]) or any(offset[1:]):
        return None
    return int(offset[0]) if len(offset) else 0


def flat_offset(t: Any) -> int:
    """The index in the flattened global tensor of the first element of ``t``'s local shard: 0 for a
    plain tensor; for a ``DTensor`` whose shard is a run of whole rows, its first row times the row's
    size. For other layouts (a shard that is not one run of the flattened tensor) 0: its elements
    then count from the shard's start."""
    if not is_dtensor(t):
        return 0
    first = _first_row(t)
    return 0 if first is None else first * math.prod(t.shape[1:])


def row_sharded(t: Any) -> bool:
    """Whether ``t`` is a plain tensor or a ``DTensor`` whose local shard is a run of whole rows: the
    layouts per-block state follows (:func:`halfadam.encodings.has_rows`)."""
    return not is_dtensor(t) or _first_row(t) is not None


def zeros_like_rows(param: Any, shape: Tuple[int, ...], dtype: torch.dtype) -> Any:
    """Zeros of ``shape`` (``shape[0]``: the parameter's rows) on ``param``'s device; for a row-sharded
    ``DTensor`` parameter a ``DTensor`` of the same placements whose local shard holds the rows of
    ``param``'s local shard, so per-row state is sharded with its parameter."""
    lp = local(param)
    rows = lp.shape[0] if is_dtensor(param) else shape[0]
    return like_rows(torch.zeros((rows, *shape[1:]), dtype=dtype, device=lp.device), param, shape)


def like_rows(t: Tensor, param: Any, shape: Tuple[int, ...]) -> Any:
    """``t`` (the rows of ``param``'s local shard of a per-row tensor whose whole is ``shape``) as
    ``param`` is: itself for a plain parameter, else the local shard of a ``DTensor`` of ``param``'s
    mesh and placements and of global ``shape`` (see :func:`zeros_like_rows`)."""
    if not is_dtensor(param):
        return t
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return _DTensor.from_local(t, param.device_mesh, param.placements, run_check=False, shape=torch.Size(shape),
                               stride=stride)


def like_param(t: Tensor, param: Any) -> Any:
    """``t`` (a tensor of ``param``'s local shape) as ``param`` is: itself for a plain parameter, else
    the local shard of a ``DTensor`` of ``param``'s mesh, placements, shape and stride."""
    if not is_dtensor(param):
        return t
    return _DTensor.from_local(t, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                               stride=param.stride())


def localize(pairs: List[Tuple[Tensor, Tensor]], state: Dict[Tensor, dict]
             ) -> Tuple[List[Tuple[Tensor, Tensor]], Dict[Tensor, dict]]:
    """``pairs`` and ``state`` with every ``DTensor`` replaced by its local shard.

    Returns the inputs themselves when no ``DTensor`` is involved. Otherwise new lists/dicts whose
    tensors share storage with the originals, so an execution updating them in place updates the
    sharded parameters and state; non-``DTensor`` entries (the 0-d ``step``) are the same objects.
    """
    if not any(is_dtensor(p) or is_dtensor(g) for p, g in pairs):
        return pairs, state
    local_pairs, local_state = [], {}
    for p, g in pairs:
        lp = local(p)
        local_pairs.append((lp, local(g)))
        local_state[lp] = {k: local(v) for k, v in state[p].items()}
    return local_pairs, local_state
