"""How :class:`halfadam.GradScaler` hands gradients to an optimizer (the layer under :mod:`halfadam.scaler`).

Two ways, per optimizer, their record kept in a dict (:func:`new_handover`) between ``unscale_``,
``step`` and ``update``:

* **unscaled copies** (:func:`unscale`): after an explicit ``unscale_``, or for optimizers that are
  not halfadam's. Float16/bfloat16 gradients are unscaled into new float32 tensors, which the step
  hands over as ``optimizer.step(grads=...)``; the unscaled values are written back into the half
  ``.grad`` (:func:`write_back`) and what user code then does to ``.grad`` is found by comparing bits
  (:func:`adopt_grad_edits`, :func:`_unchanged`) and takes effect.
* **the fused hand-over** (:func:`fused_check`): ``step`` without ``unscale_`` on a halfadam
  optimizer. One overflow-free norm of the scaled gradients (:func:`global_norm`) is both the
  inf/nan check and the clipping norm; the optimizer unscales as it reads (``grad_scale=``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .distributed import all_reduce_found_inf, halfadam_optimizer, local, total_norm, zero_process_group

__all__ = ["READY", "UNSCALED", "STEPPED", "new_handover", "unscale", "write_back", "adopt_grad_edits",
           "grads_of", "clip_", "clip_scale", "fused_check", "global_norm", "unscale_and_check_"]

#: The stages of one optimizer's hand-over between two ``update`` calls.
READY, UNSCALED, STEPPED = "ready", "unscaled", "stepped"


def new_handover() -> Dict[str, Any]:
    """A fresh record of one optimizer's hand-over: its ``stage``, ``found_inf`` (1-element float32,
    once checked), ``grads`` (parameter -> the gradient the step uses), ``shard_group`` (ZeRO's),
    and ``seen``/``watched`` (what ``unscale_`` wrote into ``.grad``, for :func:`adopt_grad_edits`)."""
    return {"stage": READY, "found_inf": None, "grads": None, "shard_group": None, "seen": None, "watched": None}


_HALF = (torch.float16, torch.bfloat16)
#: :func:`_unchanged` compares CPU tensors in chunks of this many elements (the first one smaller), so
#: a gradient changed near its start (any rescale, a clip) is found without a full pass.
_CHUNK = 1 << 20

def _int_view(t: Tensor) -> Tensor:
    """``t`` (float16/bfloat16) viewed as int16: equal views mean equal bits (nan, -0.0 included)."""
    return t.view(torch.int16)


def _unchanged(pairs: List[Tuple[Tensor, Tensor]]) -> List[bool]:
    """For each ``(grad, copy)``: whether ``grad`` still holds ``copy`` rounded to its dtype, bit for bit.

    ``grad`` is a float16/bfloat16 tensor, ``copy`` the float32 tensor written into it (both local
    shards). A different shape or device counts as changed. On the CPU each pair is compared in
    chunks, stopping at the first difference (a rescaled or clipped gradient usually costs a few
    thousand elements); elsewhere one flag per pair is computed on its device and read back with
    one synchronization per device.
    """
    result: List[Optional[bool]] = [None] * len(pairs)
    pending: Dict[torch.device, List[Tuple[int, Tensor]]] = defaultdict(list)
    for i, (grad, copy) in enumerate(pairs):
        if grad.shape != copy.shape or grad.device != copy.device or grad.dtype not in _HALF:
            result[i] = False
        elif grad.device.type == "cpu" and grad.is_contiguous() and copy.is_contiguous():
            flat_g, flat_c, n = grad.reshape(-1), copy.reshape(-1), grad.numel()
            start, size, same = 0, 4096, True
            while same and start < n:
                stop = min(n, start + size)
                same = torch.equal(_int_view(flat_g[start:stop]), _int_view(flat_c[start:stop].to(grad.dtype)))
                start, size = stop, _CHUNK
            result[i] = same
        else:
            differs = (_int_view(grad) != _int_view(copy.to(grad.dtype))).any()
            pending[grad.device].append((i, differs))
    for items in pending.values():
        for (i, _), flag in zip(items, torch.stack([d for _, d in items]).tolist()):
            result[i] = not flag
    return result  # type: ignore[return-value]

def global_norm(grads: List[Tensor], norm_type: float = 2.0, shard_group: Any = None) -> Tensor:
    """The ``norm_type``-norm of ``grads`` (see :func:`total_norm`) as a float64 0-d tensor, free of overflow.

    Accumulated in float64: in float32 the sum of squares of finite float32/bfloat16 values overflows
    from about 1.8e19, long before any value does. The 2-norm of float16 gradients alone stays in
    float32 (no overhead): each square is at most 65504**2, so the sum cannot overflow. The result is
    therefore inf/nan exactly when a gradient holds inf/nan, except for float64 gradients beyond
    about 1e154, whose squares overflow float64 (see :func:`fused_check`).
    """
    exact32 = norm_type == 2.0 and all(g.dtype == torch.float16 for g in grads)
    acc = torch.float32 if exact32 else torch.float64
    return total_norm(grads, norm_type, shard_group=shard_group, dtype=acc).double()

def unscale_and_check_(tensors: List[Tensor], inv_scale: Tensor, found_inf: Tensor) -> None:
    """Multiply ``tensors`` by ``inv_scale`` in place; set ``found_inf`` to 1.0 if any holds inf/nan.

    ``found_inf`` and ``inv_scale`` are 1-element float32 tensors on one device. Uses torch's fused
    ``_amp_foreach_non_finite_check_and_unscale_`` (the op behind torch.amp.GradScaler) when present,
    per (device, dtype) group; otherwise plain public ops with the same result: the check reads the
    values before unscaling, and the product is computed in float32 (float64 for float64 tensors).
    This is the only private torch op used here.
    """
    groups: Dict[Any, List[Tensor]] = defaultdict(list)
    for t in map(local, tensors):  # DTensor (FSDP2) gradients: their local shards, in place
        groups[(t.device, t.dtype)].append(t)
    fused = getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)
    for (device, _), ts in groups.items():
        local_inf = torch.zeros(1, dtype=torch.float32, device=device)
        local_inv = inv_scale.to(device)
        if fused is not None:
            fused(ts, local_inf, local_inv)
        else:
            for t in ts:
                local_inf = torch.maximum(local_inf, (~torch.isfinite(t)).any().float())
                t.mul_(local_inv.reshape(()))  # a 0-d factor: computed in float32, rounded once
        found_inf.copy_(torch.maximum(found_inf, local_inf.to(found_inf.device)))

def unscale(st: Dict[str, Any], optimizer: Any, scale: Tensor, process_group: Any, watch: bool) -> None:
    """Unscale ``optimizer``'s gradients by ``1 / scale`` and record in ``st`` (:func:`new_handover`)
    whether any is inf/nan (``st["found_inf"]``, agreed over ``process_group``, or over a
    ZeroRedundancyOptimizer's own group), as :meth:`halfadam.GradScaler.unscale_` describes.

    With a halfadam optimizer the float32 gradients go to ``st["grads"]`` (parameter -> tensor); with
    ``watch`` (an explicit ``unscale_``) a half ``.grad`` gets the unscaled values too and is
    watched for edits (``st["seen"]``, ``st["watched"]``, see :func:`adopt_grad_edits`).

    Raises:
        ValueError: a float16 gradient with an optimizer that is not halfadam's.
    """
    inv_scale = scale.double().reciprocal().float()
    found_inf = torch.zeros(1, dtype=torch.float32, device=scale.device)
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    inner = halfadam_optimizer(optimizer)
    # ZeroRedundancyOptimizer: ranks update disjoint shards, and its step is a collective; they
    # always agree over its process group, and only this rank's shard is unscaled into fp32.
    zero_group = zero_process_group(optimizer)
    if inner is not None:
        watched = [p for g in (optimizer if zero_group is None else inner).param_groups for p in g["params"]]
        if zero_group is not None:
            others = params
            params = [p for p in watched if p.grad is not None]
        grads = {p: p.grad if p.grad.dtype in (torch.float32, torch.float64) else p.grad.float() for p in params}
        unscale_and_check_(list(grads.values()), inv_scale, found_inf)
        st["grads"] = grads
        st["shard_group"] = zero_group
        if watch:
            # .grad of a half parameter gets the unscaled values (rounded); step() compares it
            # with them to find the gradients that user code changed (see adopt_grad_edits).
            st["seen"], st["watched"] = {p: p.grad for p in params}, watched
            write_back(st)
            if zero_group is not None:  # other ranks' shards: only so that .grad has one scale
                rest = [p.grad for p in others if p not in grads]
                if rest:
                    unscale_and_check_(rest, inv_scale, torch.zeros_like(found_inf))
    else:
        for p in params:
            if p.grad.dtype == torch.float16:
                raise ValueError(
                    "Attempting to unscale float16 gradients in place; they would flush to zero. "
                    "Use a halfadam optimizer, which takes unscaled float32 gradients."
                )
        unscale_and_check_([p.grad for p in params], inv_scale, found_inf)
    # Every rank skips the same steps.
    all_reduce_found_inf(found_inf, process_group if zero_group is None else zero_group)
    st["found_inf"] = found_inf

def write_back(st: Dict[str, Any]) -> None:
    """Copy each float32 gradient into the half ``.grad`` it was made from (rounded to its dtype)."""
    seen = st["seen"]
    for p, g in st["grads"].items():
        if g is not seen[p]:
            local(seen[p]).copy_(local(g))

def adopt_grad_edits(st: Dict[str, Any], check_fp16: bool = True) -> bool:
    """Make what user code did to ``.grad`` since ``unscale_`` the gradients the step uses.

    Per watched parameter: ``.grad`` set to ``None``: skipped; a new tensor, or a gradient where
    there was none: that tensor; the same half tensor whose bits differ anywhere from the float32
    copy rounded to its dtype (an in-place change, through any API: the check is on values, so
    ``torch.nn.utils.clip_grad_norm_`` with a coefficient of exactly 1.0 changes nothing): that
    tensor. An adopted float16/bfloat16 gradient becomes a new float32 copy of its values (exact),
    any other one is used itself. Untouched parameters keep their exact float32 copies. A no-op
    unless the user called ``unscale_`` (``st["seen"]`` set).

    Returns whether a float16 gradient holding a nonzero value was adopted (for the one-time
    :class:`halfadam.scaler.Float16GradWarning`; checked only with ``check_fp16``, until it was shown).
    """
    seen = st.get("seen")
    if seen is None:
        return False
    grads = st["grads"]
    adopt, compare = [], []
    for p in st["watched"]:
        cur, old = p.grad, seen.get(p)
        if old is None:
            if cur is not None:
                adopt.append(p)
        elif cur is None:
            del grads[p], seen[p]
        elif cur is not old:
            adopt.append(p)
        elif grads[p] is not cur:  # a half .grad next to its float32 copy
            compare.append(p)
    if compare:
        same = _unchanged([(local(seen[p]), local(grads[p])) for p in compare])
        adopt += [p for p, unchanged in zip(compare, same) if not unchanged]
    fp16_edit = False
    for p in adopt:
        cur = p.grad
        grads[p] = cur.float() if cur.dtype in _HALF else cur
        seen[p] = cur
        if check_fp16 and cur.dtype == torch.float16 and not fp16_edit:
            fp16_edit = bool(local(cur).any())
    return fp16_edit

def grads_of(st: Dict[str, Any], optimizer: Any) -> List[Tensor]:
    """The gradients ``optimizer`` will use: the unscaled float32 ones of ``st`` where there are, else
    every ``.grad``."""
    if st["grads"] is not None:
        return list(st["grads"].values())
    return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]

def clip_(st: Dict[str, Any], optimizer: Any, max_norm: float, norm_type: float) -> Tensor:
    """Clip the gradients the step will use (:func:`grads_of`) to a total ``norm_type``-norm of at most
    ``max_norm``, as :meth:`halfadam.GradScaler.clip_grad_norm_` describes; returns the norm before
    clipping (0-d float32). The clipped values are written into a watched half ``.grad`` too."""
    grads = grads_of(st, optimizer)
    shard_group = st["shard_group"] if st["grads"] is not None else None  # ZeRO: this rank's shard
    if not grads and shard_group is None:
        return torch.zeros(())
    # Across shards: DTensor (FSDP2) gradients over their mesh, ZeRO's shards over its group.
    total = global_norm(grads, norm_type, shard_group=shard_group)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in map(local, grads):
        g.mul_(coef.to(device=g.device, dtype=g.dtype))
    if st.get("seen") is not None:
        write_back(st)
    return total.float()


def fused_check(optimizer: Any, scale: Tensor, max_grad_norm: Optional[float],
                process_group: Any) -> Tuple[Tensor, Tensor, Optional[Tensor], Tensor]:
    """The fused hand-over's one pass over the scaled gradients: ``(found_inf, grad_scale, norm, all_zero)``.

    ``found_inf``: a 1-element float32 tensor on ``scale``'s device, agreed over ``process_group``;
    ``grad_scale``: what ``optimizer.step(grad_scale=...)`` multiplies each gradient by (the inverse
    scale, times the clipping coefficient with ``max_grad_norm``); ``norm``: the unscaled global norm
    before clipping (0-d float32) with ``max_grad_norm``, else ``None``; ``all_zero``: a bool tensor,
    whether every (local) gradient is 0.

    The norm of the raw gradients from :func:`global_norm` cannot overflow, so it is inf/nan
    exactly when a gradient holds inf/nan: one reduction gives both the inf check and the
    clipping norm (across shards and ranks, see :func:`halfadam.distributed.total_norm`). Only
    float64 gradients' squares can overflow it (beyond about 1e154); when such a norm is not
    finite, the max-norm (which cannot overflow) decides instead.
    """
    inv_scale = scale.double().reciprocal().float()
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    raw = global_norm(grads, 2.0)
    found_inf = ~torch.isfinite(raw)
    if any(g.dtype == torch.float64 for g in grads) and found_inf:
        found_inf = ~torch.isfinite(total_norm(grads, math.inf, dtype=torch.float64))
    found_inf = all_reduce_found_inf(found_inf.float().reshape(1).to(scale.device),
                                     process_group)
    grad_scale, norm = inv_scale, None
    if max_grad_norm is not None:
        total = (raw.to(scale.device) * inv_scale).reshape(())  # unscaled, float64
        norm = total.float()
        grad_scale = inv_scale * _clip_coefficient(total, max_grad_norm)
    return found_inf, grad_scale, norm, raw == 0


def _clip_coefficient(total: Tensor, max_norm: float) -> Tensor:
    """``min(1, max_norm / (total + 1e-6))`` in float32, as ``torch.nn.utils.clip_grad_norm_``."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0).float()


def clip_scale(optimizer: Any, max_grad_norm: float) -> Tuple[Optional[Tensor], Tensor]:
    """Clipping without loss scaling, for a halfadam optimizer: ``(grad_scale, norm)``.

    ``grad_scale``: the 1-element float32 clipping coefficient that ``optimizer.step(grad_scale=...)``
    multiplies each gradient by as it reads it (``None`` without gradients); ``norm``: the global L2
    norm of the gradients before clipping (0-d float32). No gradient is rewritten, so a float16
    gradient is clipped in float32.
    """
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if not grads:
        return None, torch.zeros(())
    total = global_norm(grads, 2.0)
    return _clip_coefficient(total, max_grad_norm).reshape(1).to(local(grads[0]).device), total.float()
