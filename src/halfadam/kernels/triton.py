"""halfadam's hand-written Triton kernel: one Adam/AdamW step over a bucket in one launch (``"triton"``).

The equations are :mod:`halfadam.functional`'s and the encodings :mod:`halfadam.encodings`' (their
specification), term for term and in the same order of operations, as in the C++ CPU kernel
(``adam_cpu.cpp`` beside this module, whose comments state the per-element steps): every float32 operation is
rounded once (the launch turns fused multiply-adds off, divisions and square roots are the IEEE
ones, ``div_rn``/``sqrt_rn``), so a step computes the same bits as every other execution.

The parameters and gradients stay where they are. A launch reads two small device tables:

* the **tensor table** (int64, one row per parameter of the launch): the addresses of the parameter
  and of its gradient, the element count, the parameter's offset in the bucket's flat state buffers
  and the position of its first element in the whole parameter (the random bits' positions);
* the **work list** (int64, one row per program): a row of the tensor table and the first element
  of the program's :data:`CHUNK` elements (a multiple of ``BLOCK``), so small and large tensors
  share one grid.

The work list depends only on the bucket's layout and which parameters step (cached); the tensor
table only on the addresses (rebuilt when one changes: ``zero_grad(set_to_none=True)`` gives new
gradients every step, and a rebuild is one host list and one copy). The step's scalars (the
coefficients of :func:`halfadam.functional.adam_coefficients` and the step, for the random bits)
reach the kernel as one small device tensor, the loss scale and ``found_inf`` as device tensors:
a launch waits for nothing on the host, and a set ``found_inf`` makes the kernel write nothing
(as torch's fused AdamW).

On CPU tensors the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, as Triton reads
it: ``triton.knobs.runtime.interpret``, at each launch): that is how the test suite checks it without
a GPU.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..encodings import BLOCK, V_OCTAVES, _DYN_ZERO, _SALT

__all__ = ["available", "unavailable_reason", "launch", "CHUNK", "interpreted"]

#: Elements per program: BLOCKS_PER_PROGRAM blocks of BLOCK.
BLOCKS_PER_PROGRAM = 8
CHUNK = BLOCKS_PER_PROGRAM * BLOCK

_import_error: Optional[str] = None
try:
    import triton
    import triton.language as tl
except Exception as exc:  # not installed, or no usable backend
    triton = tl = None
    _import_error = f"{type(exc).__name__}: {exc}"


def interpreted() -> bool:
    """Whether Triton's interpreter runs the kernels (``TRITON_INTERPRET`` true, as Triton parses it):
    they then take CPU tensors."""
    if triton is None:
        return False
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"  # triton before 3.4


def available(device: torch.device) -> bool:
    """Whether the kernel runs on ``device``: CUDA with Triton importable, or CPU under the interpreter."""
    return unavailable_reason(device) is None


def unavailable_reason(device: torch.device) -> Optional[str]:
    if triton is None:
        return f"the triton package does not import ({_import_error})"
    if device.type == "cpu":
        return None if interpreted() else "CPU tensors run the Triton kernels only under TRITON_INTERPRET=1"
    if device.type != "cuda":
        return f"Triton kernels run CUDA tensors (and CPU tensors under TRITON_INTERPRET=1), not {device.type}"
    return None


# state encodings, as constexpr codes
MASTER_NONE, MASTER_FP32, MASTER_SPLIT = 0, 1, 2
MOMENT_FP32, MOMENT_BF16, MOMENT_UINT8 = 0, 1, 2
_MOMENT_KIND = {torch.float32: MOMENT_FP32, torch.bfloat16: MOMENT_BF16, torch.uint8: MOMENT_UINT8}

#: Columns of the tensor table: addresses of the parameter and its gradient, element count, elements in
#: the state buffers, offset in them, position of the first element in the whole parameter, then (for
#: tensors whose state is their own, not a bucket's: FSDP2's local shards) the state tensors' addresses.
STATE_COLUMNS = ("master_weight", "master_hi", "master_lo", "master_tie", "exp_avg", "exp_avg_sq",
                 "exp_avg_absmax", "exp_avg_sq_absmax")
TABLE_COLUMNS = ("param", "grad", "numel", "size", "offset", "position") + STATE_COLUMNS

if triton is not None:
    # encodings.py's constants, as compile-time values of the kernels
    _SALT_EXP_AVG = tl.constexpr(_SALT["exp_avg"])
    _SALT_EXP_AVG_SQ = tl.constexpr(_SALT["exp_avg_sq"])
    _DYN_ZERO_C = tl.constexpr(_DYN_ZERO)
    _CODES_PER_OCTAVE = tl.constexpr(254.0 / V_OCTAVES)

    @triton.jit
    def _hash(position, seed_term):
        """encodings._random_bits (uint32): three xor-shift-multiply rounds of position ^ seed_term."""
        h = position ^ seed_term
        h = (h ^ (h >> 16)) * 0x7FEB352D
        h = (h ^ (h >> 15)) * 0x2C1B3C6D
        h = (h ^ (h >> 16)) * 0x297A2D39
        return h ^ (h >> 15)

    @triton.jit
    def _signbit(x):
        return x.to(tl.int32, bitcast=True) < 0

    @triton.jit
    def _written(p, r):
        """functional.written: another value, nan on either side, or a zero of the other sign."""
        return (p != r) | (_signbit(p) != _signbit(r))

    @triton.jit
    def _bf16_bits(x):
        """float32 -> bfloat16 bits (uint32, in the low half), round to nearest even, nan -> 0x7FC0
        (c10::BFloat16's rule, the C++ kernel's); spelled out: the interpreter's conversion truncates."""
        u = x.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        return tl.where(x != x, 0x7FC0, r)

    @triton.jit
    def _round_to(x, P_DTYPE: tl.constexpr):
        """x rounded to the parameter's dtype (nearest even, as Tensor.copy_), as float32."""
        if P_DTYPE == tl.bfloat16:
            return (_bf16_bits(x) << 16).to(tl.float32, bitcast=True)
        else:
            return x.to(P_DTYPE).to(tl.float32)

    @triton.jit
    def _store_param(ptr, local, x, mask, P_DTYPE: tl.constexpr):
        """Store x rounded to the parameter's dtype."""
        if P_DTYPE == tl.bfloat16:
            tl.store(ptr.to(tl.pointer_type(tl.uint16)) + local, _bf16_bits(x).to(tl.uint16), mask=mask)
        else:
            tl.store(ptr + local, x.to(P_DTYPE), mask=mask)

    @triton.jit
    def _fp16_ulp(x):
        """encodings._fp16_ulp: 2**(max(e, -14) - 10) for |x| in [2**e, 2**(e+1))."""
        e = (x.to(tl.int32, bitcast=True) >> 23) & 0xFF
        e = tl.maximum(e, 127 - 14)
        return ((e - 10) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _round_half_even(q):
        """torch.round of float32 values below 2**22 in magnitude."""
        f = tl.floor(q)
        d = q - f
        odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
        return tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)

    @triton.jit
    def _decode_uint8(code_ptr, absmax_ptr, eidx, bidx, emask, bmask, table_ptr, IS_EXP_AVG: tl.constexpr):
        """encodings._decode_moment for uint8 codes: table value times |absmax|; reserved codes of a flagged block."""
        codes = tl.load(code_ptr + eidx, mask=emask, other=0).to(tl.int32)
        absmax = tl.load(absmax_ptr + bidx, mask=bmask, other=0.0)
        flagged = _signbit(absmax)[:, None]
        if IS_EXP_AVG:
            index = (codes + _DYN_ZERO_C) & 255
        else:
            index = codes
        x = tl.load(table_ptr + index) * tl.abs(absmax)[:, None]
        inf = float("inf")
        if IS_EXP_AVG:
            x = tl.where(flagged & (index == 128), inf, x)
            x = tl.where(flagged & (index == 126), -inf, x)
            x = tl.where(flagged & (index == 129), float("nan"), x)
        else:
            x = tl.where(flagged & (index == 1), inf, x)
            x = tl.where(flagged & (index == 2), float("nan"), x)
        return x

    @triton.jit
    def _load_moment(ptr, absmax_ptr, eidx, bidx, emask, bmask, table_ptr, KIND: tl.constexpr, IS_EXP_AVG: tl.constexpr):
        if KIND == 2:
            return _decode_uint8(ptr, absmax_ptr, eidx, bidx, emask, bmask, table_ptr, IS_EXP_AVG)
        else:
            return tl.load(ptr + eidx, mask=emask, other=0.0).to(tl.float32)

    @triton.jit
    def _dynamic_nearest(y, dyn_ptr, decades_ptr):
        """encodings._dynamic_nearest: the index of the dynamic map's value nearest y (ties to the lower
        index), mirrored for y < 0. The decade by comparisons; its candidates c - 1, c, c + 1."""
        a = tl.abs(y)
        i = tl.zeros(a.shape, dtype=tl.int32)
        for d in tl.static_range(6):
            i += (a >= tl.load(decades_ptr + d)).to(tl.int32)
        levels = (1 << i).to(tl.float32)
        t = tl.div_rn(a, tl.load(decades_ptr + i)) - 0.1
        k = tl.floor(t * tl.div_rn(levels, 0.9) - 0.5 + 0.5)
        k = tl.minimum(tl.maximum(k, 0.0), levels - 1.0).to(tl.int32)
        c = 127 + (1 << i) + k
        best = tl.minimum(tl.maximum(c - 1, 127), 255)
        best_err = tl.abs(tl.load(dyn_ptr + best) - a)
        for s in tl.static_range(2):
            other = tl.minimum(tl.maximum(c + s, 127), 255)
            err = tl.abs(tl.load(dyn_ptr + other) - a)
            closer = err < best_err
            best = tl.where(closer, other, best)
            best_err = tl.where(closer, err, best_err)
        return tl.where(y < 0, tl.maximum(254 - best, 0), best)

    @triton.jit
    def _store_moment(x, ptr, absmax_ptr, eidx, bidx, emask, bmask, position, seed, dyn_ptr, decades_ptr,
                      levels_ptr, KIND: tl.constexpr, IS_EXP_AVG: tl.constexpr, SALT: tl.constexpr):
        """encodings._encode_moment_ (x: [blocks, BLOCK] float32)."""
        if KIND == 0:
            tl.store(ptr + eidx, x, mask=emask)
        elif KIND == 1:  # stochastic rounding: add 16 random bits below bfloat16's, truncate
            bits = _hash(position, seed * 0x27D4EB2F + SALT) >> 16
            t = (x.to(tl.uint32, bitcast=True) + bits) >> 16
            tl.store(ptr.to(tl.pointer_type(tl.uint16)) + eidx, t.to(tl.uint16), mask=emask)
        else:
            finite = tl.abs(x) < float("inf")  # false for nan and +-inf
            flagged = tl.max((~finite).to(tl.int32), axis=1) > 0
            xf = tl.where(finite, x, 0.0)
            absmax = tl.max(tl.abs(xf), axis=1)
            den = tl.where(absmax > 0, absmax, 1.0)
            y = tl.div_rn(xf, den[:, None])
            fl = flagged[:, None]
            if IS_EXP_AVG:
                index = _dynamic_nearest(y, dyn_ptr, decades_ptr)
                reserved = (index == 128) | (index == 126) | (index == 129)
                index = tl.where(fl & reserved, 127, index)
                special = tl.where(x == float("inf"), 128, tl.where(x == -float("inf"), 126, 129))
                index = tl.where(finite, index, special)
                codes = (index - _DYN_ZERO_C) & 255
            else:  # the largest level <= y (estimated by log2, corrected by comparisons), stochastic rounding up
                est = tl.floor(255.0 + tl.log2(tl.maximum(y, 1.1754944e-38)) * _CODES_PER_OCTAVE)
                lo = tl.minimum(tl.maximum(est, 1.0), 254.0).to(tl.int32)
                lo = lo + (tl.load(levels_ptr + lo + 1) <= y).to(tl.int32) - (tl.load(levels_ptr + lo) > y).to(tl.int32)
                lo = tl.minimum(tl.maximum(lo, 1), 254)
                lo = tl.maximum(lo, tl.where(fl, 3, 1))
                v_lo = tl.load(levels_ptr + lo)
                v_hi = tl.load(levels_ptr + lo + 1)
                p = tl.minimum(tl.maximum(tl.div_rn(y - v_lo, v_hi - v_lo), 0.0), 1.0)
                u = (_hash(position, seed * 0x27D4EB2F + SALT) >> 8).to(tl.float32) * (1.0 / 16777216.0)
                codes = tl.where(xf > 0, lo + (u < p).to(tl.int32), 0)
                codes = tl.where(finite, codes, tl.where(x == float("inf"), 1, 2))
            tl.store(ptr + eidx, codes.to(tl.uint8), mask=emask)
            tl.store(absmax_ptr + bidx, tl.where(flagged, -absmax, absmax), mask=bmask)

    @triton.jit
    def _moment_ptr(address, KIND: tl.constexpr):
        if KIND == 0:
            return address.to(tl.pointer_type(tl.float32))
        elif KIND == 1:
            return address.to(tl.pointer_type(tl.bfloat16))
        else:
            return address.to(tl.pointer_type(tl.uint8))

    @triton.jit
    def _adam_kernel(work_ptr, table_ptr, scalars_ptr, grad_scale_ptr, found_inf_ptr,
                     master_ptr, hi_ptr, lo_ptr, tie_ptr, m_ptr, v_ptr, m_absmax_ptr, v_absmax_ptr,
                     dyn_ptr, decades_ptr, levels_ptr,
                     P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, MASTER: tl.constexpr, M_KIND: tl.constexpr,
                     V_KIND: tl.constexpr, L2: tl.constexpr, OPTIMIZED: tl.constexpr, HAS_SCALE: tl.constexpr,
                     HAS_FOUND_INF: tl.constexpr, SCALARS_STRIDE: tl.constexpr, STATE_IN_TABLE: tl.constexpr,
                     NB: tl.constexpr, BLOCK_: tl.constexpr):
        if HAS_FOUND_INF:
            if tl.load(found_inf_ptr) != 0.0:
                return
        pid = tl.program_id(0)
        t = tl.load(work_ptr + 2 * pid)
        start = tl.load(work_ptr + 2 * pid + 1)
        row = table_ptr + 14 * t
        param = tl.load(row).to(tl.pointer_type(P_DTYPE))
        grad = tl.load(row + 1).to(tl.pointer_type(G_DTYPE))
        numel = tl.load(row + 2)
        size = tl.load(row + 3)  # its elements in the state buffers: numel, padded to whole blocks when blocked
        offset = tl.load(row + 4)
        position0 = tl.load(row + 5)
        if STATE_IN_TABLE:  # the tensor's own state tensors (offset 0 in them)
            master_ptr = tl.load(row + 6).to(tl.pointer_type(tl.float32))
            hi_ptr = tl.load(row + 7).to(tl.pointer_type(tl.int8))
            lo_ptr = tl.load(row + 8).to(tl.pointer_type(tl.uint8))
            tie_ptr = tl.load(row + 9).to(tl.pointer_type(tl.uint8))
            m_ptr = _moment_ptr(tl.load(row + 10), M_KIND)
            v_ptr = _moment_ptr(tl.load(row + 11), V_KIND)
            m_absmax_ptr = tl.load(row + 12).to(tl.pointer_type(tl.float32))
            v_absmax_ptr = tl.load(row + 13).to(tl.pointer_type(tl.float32))
        blocks = tl.arange(0, NB)
        lanes = tl.arange(0, BLOCK_)
        local = start + blocks[:, None] * BLOCK_ + lanes[None, :]  # int64, index in the flattened parameter
        pmask = local < numel
        emask = local < size
        bmask = (start + blocks * BLOCK_) < size
        eidx = offset + local  # flat state buffers
        bidx = (offset + start) // BLOCK_ + blocks
        position = (position0 + local).to(tl.uint32)
        scalars_row = scalars_ptr + SCALARS_STRIDE * t  # one row for all, or one per tensor (capturable)
        seed = tl.load(scalars_row + 9).to(tl.uint32, bitcast=True)
        c = scalars_row.to(tl.pointer_type(tl.float32))
        decay_factor = tl.load(c)
        l2 = tl.load(c + 1)
        step_size = tl.load(c + 2)
        sqrt_bias_correction2 = tl.load(c + 3)
        one_minus_beta1 = tl.load(c + 4)
        beta2 = tl.load(c + 5)
        one_minus_beta2 = tl.load(c + 6)
        eps = tl.load(c + 7)

        g = tl.load(grad + local, mask=pmask, other=0.0).to(tl.float32)
        if HAS_SCALE:
            g = g * tl.load(grad_scale_ptr)
        p = tl.load(param + local, mask=pmask, other=0.0).to(tl.float32)
        # the weight: master sync (functional.sync_master_) or split decode (encodings._split_decode)
        if MASTER == 0:
            w = p
        elif MASTER == 1:
            master = tl.load(master_ptr + eidx, mask=emask, other=0.0)
            w = tl.where(_written(p, _round_to(master, P_DTYPE)), p, master)
        else:
            tie = tl.load(tie_ptr + bidx, mask=bmask, other=0).to(tl.int32)
            r = (tl.load(hi_ptr + eidx, mask=emask, other=0).to(tl.int32) * 256
                 + tl.load(lo_ptr + eidx, mask=emask, other=0).to(tl.int32)
                 + (lanes[None, :] == tie[:, None] - 1).to(tl.int32) * 65536)
            if P_DTYPE == tl.bfloat16:
                decoded = (p.to(tl.int32, bitcast=True) + r).to(tl.float32, bitcast=True)
            else:
                decoded = p + r.to(tl.float32) * (_fp16_ulp(p) * (1.0 / 65536.0))
            keep = _written(p, _round_to(decoded, P_DTYPE)) | ~(tl.abs(p) < float("inf")) | (p == 0.0)
            w = tl.where(keep, p, decoded)
        m = _load_moment(m_ptr, m_absmax_ptr, eidx, bidx, emask, bmask, dyn_ptr, M_KIND, True)
        v = _load_moment(v_ptr, v_absmax_ptr, eidx, bidx, emask, bmask, levels_ptr, V_KIND, False)

        # functional.adam_elementwise_, each operation rounded once
        if L2:
            g = g + l2 * w
        else:
            w = w * decay_factor
        m = m + (g - m) * one_minus_beta1
        v = v * beta2 + (g * one_minus_beta2) * g
        root = tl.sqrt_rn(v)
        if OPTIMIZED:
            d = root + eps
        else:
            d = tl.div_rn(root, sqrt_bias_correction2) + eps
        w = w - tl.div_rn(m, d) * step_size

        _store_moment(m, m_ptr, m_absmax_ptr, eidx, bidx, emask, bmask, position, seed, dyn_ptr, decades_ptr,
                      levels_ptr, M_KIND, True, _SALT_EXP_AVG)
        _store_moment(v, v_ptr, v_absmax_ptr, eidx, bidx, emask, bmask, position, seed, dyn_ptr, decades_ptr,
                      levels_ptr, V_KIND, False, _SALT_EXP_AVG_SQ)
        if MASTER == 0:
            _store_param(param, local, w, pmask, P_DTYPE)
        elif MASTER == 1:
            tl.store(master_ptr + eidx, w, mask=emask)
            _store_param(param, local, w, pmask, P_DTYPE)
        else:  # encodings._split_encode_
            _store_param(param, local, w, pmask, P_DTYPE)
            r32 = _round_to(w, P_DTYPE)
            finite = tl.abs(r32) < float("inf")  # no remainder over nan or +-inf
            if P_DTYPE == tl.bfloat16:
                rem = tl.where(finite, w.to(tl.int32, bitcast=True) - r32.to(tl.int32, bitcast=True), 0)
            else:
                q = _round_half_even(tl.div_rn(w - r32, _fp16_ulp(r32)) * 65536.0)
                rem = tl.where(finite, q, 0.0).to(tl.int32)
            is_tie = rem == 32768
            first = tl.min(tl.where(is_tie, lanes[None, :], BLOCK_), axis=1)
            tl.store(tie_ptr + bidx, tl.where(first < BLOCK_, first + 1, 0).to(tl.uint8), mask=bmask)
            rem = tl.where(is_tie & (lanes[None, :] == first[:, None]), -32768, tl.minimum(tl.maximum(rem, -32768), 32767))
            tl.store(hi_ptr + eidx, (rem >> 8).to(tl.int8), mask=emask)
            tl.store(lo_ptr + eidx, (rem & 255).to(tl.uint8), mask=emask)


    @triton.jit
    def _uint8_kernel(x_ptr, code_ptr, absmax_ptr, seed_ptr, dyn_ptr, decades_ptr, levels_ptr,
                      IS_EXP_AVG: tl.constexpr, ENCODE: tl.constexpr, NB: tl.constexpr, BLOCK_: tl.constexpr):
        """The uint8 encoder (ENCODE) or decoder alone, over whole blocks from position 0 (tests)."""
        blocks = tl.program_id(0) * NB + tl.arange(0, NB)
        local = blocks[:, None] * BLOCK_ + tl.arange(0, BLOCK_)[None, :]
        emask = local >= 0
        bmask = blocks >= 0
        if ENCODE:
            x = tl.load(x_ptr + local)
            seed = tl.load(seed_ptr).to(tl.uint32, bitcast=True)
            salt: tl.constexpr = _SALT_EXP_AVG if IS_EXP_AVG else _SALT_EXP_AVG_SQ
            _store_moment(x, code_ptr, absmax_ptr, local, blocks, emask, bmask, local.to(tl.uint32), seed, dyn_ptr,
                          decades_ptr, levels_ptr, 2, IS_EXP_AVG, salt)
        else:
            table = dyn_ptr if IS_EXP_AVG else levels_ptr
            tl.store(x_ptr + local, _decode_uint8(code_ptr, absmax_ptr, local, blocks, emask, bmask, table, IS_EXP_AVG))


_TL_DTYPES = {}
if tl is not None:
    _TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}



def work_list(sizes: List[int], device: torch.device) -> Tensor:
    """The work list (int64 ``[programs, 2]``: tensor-table row, first element) for tensors of ``sizes``
    elements in the state buffers (padded blocks included), each cut into chunks of :data:`CHUNK`."""
    counts = torch.tensor([max(-(-n // CHUNK), 1) for n in sizes], dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(sizes), dtype=torch.int64), counts)
    first = torch.cumsum(counts, 0) - counts
    starts = (torch.arange(rows.numel(), dtype=torch.int64) - first[rows]) * CHUNK
    return torch.stack([rows, starts], 1).contiguous().to(device)


def tensor_table(params: List[Tensor], grads: List[Tensor], sizes: List[int], offsets: List[int],
                 positions: List[int], device: torch.device, states: Optional[List[Dict[str, Tensor]]] = None
                 ) -> Tensor:
    """The tensor table (int64 ``[len(params), 14]``, :data:`TABLE_COLUMNS`; the state columns from
    ``states``, each tensor's own state, else 0); on a GPU copied without waiting."""
    own = [[st[k].data_ptr() if k in st else 0 for k in STATE_COLUMNS] for st in states] if states else None
    rows = [[p.data_ptr(), g.data_ptr(), p.numel(), n, o, q] + (own[i] if own else [0] * len(STATE_COLUMNS))
            for i, (p, g, n, o, q) in enumerate(zip(params, grads, sizes, offsets, positions))]
    host = torch.tensor(rows, dtype=torch.int64)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def scalars(coefficients: Tuple[float, ...], step: int, device: torch.device) -> Tensor:
    """The step's scalars as one int32 tensor: the 8 coefficients' float32 bits, 0, the step mod 2**32
    (the random bits' seed); on a GPU copied without waiting."""
    host = torch.tensor(list(coefficients) + [0.0, 0.0], dtype=torch.float32).view(torch.int32)
    seed = int(step) & 0xFFFFFFFF
    host[9] = seed - (1 << 32) if seed >= 1 << 31 else seed
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def device_scalars(coefficients: Tuple[Tensor, ...], steps: Tensor) -> Tensor:
    """The scalars of :func:`scalars`, one row per tensor, computed on the device (int32 ``[n, 10]``):
    ``coefficients`` are :func:`halfadam.functional.adam_coefficients` of a 1-D step tensor, ``steps``
    the steps being taken (float32, one per tensor). No host value is read (capturable)."""
    columns = [c.reshape(-1).expand(steps.numel()).view(torch.int32) for c in coefficients]
    columns += [torch.zeros_like(columns[0]), steps.to(torch.int64).bitwise_and(0xFFFFFFFF).to(torch.int32)]
    return torch.stack(columns, 1)


def launch(work: Tensor, table: Tensor, scalars_: Tensor, stored: Dict[str, Tensor], tables, *,
           param_dtype: torch.dtype, grad_dtype: torch.dtype, master: int, exp_avg: torch.dtype,
           exp_avg_sq: torch.dtype, l2: bool, optimized_update: bool, grad_scale: Optional[Tensor] = None,
           found_inf: Optional[Tensor] = None) -> None:
    """One launch of the kernel over the programs of ``work`` (see the module docstring).

    ``scalars_``: :func:`scalars` (one row for every tensor) or :func:`device_scalars` (a row per
    tensor-table row); ``stored``: the bucket's flat state buffers by key (empty: each tensor's own state
    tensors are in the table)
    (:func:`halfadam.encodings.element_keys`, :func:`~halfadam.encodings.block_keys`); ``tables``:
    :func:`halfadam.encodings.tables` (uint8 moments) or ``None``; ``grad_scale``, ``found_inf``:
    1-element float32 device tensors or ``None``.
    """
    dummy = scalars_
    get = lambda key: stored.get(key, dummy)  # noqa: E731  (stored empty: the state is in the table)
    dyn, decades, levels = tables if tables is not None else (dummy, dummy, dummy)
    _adam_kernel[(work.shape[0],)](
        work, table, scalars_, dummy if grad_scale is None else grad_scale, dummy if found_inf is None else found_inf,
        get("master_weight"), get("master_hi"), get("master_lo"), get("master_tie"), get("exp_avg"),
        get("exp_avg_sq"), get("exp_avg_absmax"), get("exp_avg_sq_absmax"), dyn, decades, levels,
        P_DTYPE=_TL_DTYPES[param_dtype], G_DTYPE=_TL_DTYPES[grad_dtype], MASTER=master,
        M_KIND=_MOMENT_KIND[exp_avg], V_KIND=_MOMENT_KIND[exp_avg_sq], L2=l2, OPTIMIZED=optimized_update,
        HAS_SCALE=grad_scale is not None, HAS_FOUND_INF=found_inf is not None,
        SCALARS_STRIDE=10 if scalars_.dim() == 2 else 0, STATE_IN_TABLE=not stored, NB=BLOCKS_PER_PROGRAM,
        BLOCK_=BLOCK, enable_fp_fusion=False)


def encode_uint8(name: str, x: Tensor, seed: int, tables) -> Tuple[Tensor, Tensor]:
    """``x`` (float32, whole blocks, one parameter from position 0) encoded as ``name``'s uint8 moment by the
    kernel's encoder: (codes, stored absmax). The test suite compares it with :mod:`halfadam.encodings`."""
    codes = torch.zeros(x.numel(), dtype=torch.uint8, device=x.device)
    absmax = torch.zeros(x.numel() // BLOCK, dtype=torch.float32, device=x.device)
    seed_t = torch.tensor([seed & 0x7FFFFFFF], dtype=torch.int32, device=x.device)
    _uint8_kernel[(x.numel() // CHUNK,)](x, codes, absmax, seed_t, *tables, IS_EXP_AVG=name == "exp_avg", ENCODE=True,
                                         NB=BLOCKS_PER_PROGRAM, BLOCK_=BLOCK, enable_fp_fusion=False)
    return codes, absmax


def decode_uint8(name: str, codes: Tensor, absmax: Tensor, tables) -> Tensor:
    """The kernel's decoder of ``name``'s uint8 codes and stored absmax (float32)."""
    out = torch.zeros(codes.numel(), dtype=torch.float32, device=codes.device)
    _uint8_kernel[(codes.numel() // CHUNK,)](out, codes, absmax, absmax, *tables, IS_EXP_AVG=name == "exp_avg",
                                             ENCODE=False, NB=BLOCKS_PER_PROGRAM, BLOCK_=BLOCK, enable_fp_fusion=False)
    return out
