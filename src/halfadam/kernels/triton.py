"""halfadam's hand-written Triton kernel: one optimizer step over a bucket in one launch (``"triton"``).

The kernel steps one update rule per launch (the constexpr ``RULE``: :data:`RULE_ADAM`, :data:`RULE_SGD`,
:data:`RULE_LION`; :attr:`halfadam.functional.Rule.kernel`). Everything but the rule's per-element math
is shared: the gradient read and its scale, the master decode and sync (none, fp32, split, split8), the
moment encodings, the random bits, the write-back of the master and the parameter. The rule's moments
sit in two slots: a signed one in ``exp_avg`` (Adam's ``exp_avg``, SGD's ``momentum_buffer``, Lion's
``exp_avg``), a square one in ``exp_avg_sq`` (Adam's); a slot the rule does not keep is absent
(:data:`MOMENT_NONE`: nothing loaded, stored or drawn). The per-element math is in :func:`_adam_math`,
:func:`_sgd_math` and :func:`_lion_math`.

The equations are :mod:`halfadam.functional`'s (Adam's; SGD's and Lion's are the rule specification's,
:mod:`halfadam.sgd` and :mod:`halfadam.lion`) and the encodings :mod:`halfadam.encodings`' (their
specification), term for term and in the same order of operations, as in the C++ CPU kernel
(``adam_cpu.cpp`` beside this module, whose comments state the per-element steps): every float32 operation is
rounded once (the launch turns fused multiply-adds off, divisions and square roots are the IEEE
ones, ``div_rn``/``sqrt_rn``), so a step computes the same bits as every other execution. One division
is computed otherwise, to the same bits: ``sqrt(v) / sqrt(1 - beta2**t)`` divides every element by
one number, so the kernel takes its reciprocal once and corrects ``x * (1 / c)`` twice with fused
multiply-adds to the correctly rounded quotient (Markstein's theorem; :func:`_div_by_coefficient`).
The encodings' integer steps are spelled out on float32 bit patterns as the specification writes
them (the uint8 codes' tiers, mantissa bits and reserved codes are read from it at import), in
equivalent forms where they are cheaper (the comments say why they are the same).

The parameters and gradients stay where they are. A launch reads two small device tables:

* the **tensor table** (int64, one row per parameter of the launch, :data:`TABLE_COLUMNS`): the
  addresses of the parameter and of its gradient, the element count, the elements the kernel steps
  (its blocks times ``BLOCK`` in a blocked format), the parameter's offsets in the bucket's flat state
  buffers (per element and per block), the length of its rows of blocks and the position of its first
  element in the whole parameter (the random bits' positions);
* the **work list** (int64, one row per program): a row of the tensor table and the first element
  of the program's :data:`CHUNK` elements (a multiple of ``BLOCK``), so small and large tensors
  share one grid. A program steps its elements a tile (:data:`TILE`) after the other.

A parameter's rows of blocks (:func:`halfadam.encodings.row_length` elements each; one row, the
flat tensor, where the format has no per-block keys) are cut into blocks of ``BLOCK``, a row's last
one shorter where the length is no multiple of it (:func:`halfadam.encodings.has_rows`). A launch
with such a tensor (:func:`tensor_table`'s ``rows``) gets the kernel that finds each block's row
(``ROWS``): its programs' elements are then counted in whole blocks (each row padded to whole
blocks, as the specification's layout: ``encodings._layout``), and block ``j`` of row ``r = j //
per_row`` is the tensor's elements ``r * length + c * BLOCK + lane`` for ``c = j - r * per_row``.
The others step ``BLOCK`` consecutive elements of the flat tensor per block.

The work list depends only on the bucket's layout and which parameters step (cached); the tensor
table only on the addresses (rebuilt when one changes: ``zero_grad(set_to_none=True)`` gives new
gradients every step, and a rebuild is one host list and one copy). The step's scalars (the rule's
coefficients, :func:`halfadam.functional.adam_coefficients`' for Adam, and the step, for the random bits)
reach the kernel as one small device tensor, the loss scale and ``found_inf`` as device tensors:
a launch waits for nothing on the host, and a set ``found_inf`` makes the kernel write nothing
(as torch's fused AdamW). A table whose addresses are all 16-byte aligned and whose counts, offsets
and positions are multiples of 8 (:func:`tensor_table`'s ``aligned``; nearly every model's), and that
has no short blocks, gets the kernel that loads and stores 16 bytes at a time.

On CPU tensors the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, as Triton reads
it: ``triton.knobs.runtime.interpret``, at each launch): that is how the test suite checks it without
a GPU. Two things differ there: its tiles are larger (:data:`INTERPRETED_BLOCKS_PER_TILE`; the
results do not depend on them), and bfloat16 conversions are spelled out in integer operations
where the GPU converts itself: to bfloat16 (the interpreter's conversion truncates; the GPU's rounds
to nearest even, a nan then is the GPU's nan pattern, as torch's CUDA conversion writes) and from
it (the interpreter's loses subnormals).
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .. import encodings as _encodings
from ..encodings import BLOCK, _INF_CODE, _MAGNITUDE_MASK, _NAN_CODE, _SALT, _SPAN, _V_ROUNDING, _V_ROUNDING_MIN_SHIFT

__all__ = ["available", "unavailable_reason", "launch", "CHUNK", "interpreted", "RULE_ADAM", "RULE_SGD", "RULE_LION"]

#: The launch shape: a program steps CHUNK elements, a tile of BLOCKS_PER_TILE blocks of BLOCK after the
#: other (TILES_PER_PROGRAM of them, fewer at a tensor's end), with NUM_WARPS warps: 8 elements per
#: thread and tile, few registers (about 90-125: many programs per SM), the program's setup (its
#: tensor-table row, the scalars, the divisions' slow paths) spread over CHUNK elements
#: (``benchmarks/triton_compile_check.py`` counts the instructions of each choice).
BLOCKS_PER_TILE = 4
TILES_PER_PROGRAM = 32
TILE = BLOCKS_PER_TILE * BLOCK
CHUNK = TILES_PER_PROGRAM * TILE
NUM_WARPS = 2
#: Under the interpreter the tiles are larger (CHUNK is the same): it pays per operation, not per element.
#: The results do not depend on the tile (every encoding works on whole blocks).
INTERPRETED_BLOCKS_PER_TILE = 16

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
MASTER_NONE, MASTER_FP32, MASTER_SPLIT, MASTER_SPLIT8 = 0, 1, 2, 3
#: MOMENT_NONE: the slot is absent (a rule without that moment): nothing loaded, stored or drawn for it
MOMENT_FP32, MOMENT_BF16, MOMENT_UINT8, MOMENT_NONE = 0, 1, 2, 3
_MOMENT_KIND = {torch.float32: MOMENT_FP32, torch.bfloat16: MOMENT_BF16, torch.uint8: MOMENT_UINT8, None: MOMENT_NONE}
#: The update rules (the kernel's constexpr RULE; :attr:`halfadam.functional.Rule.kernel`), and the
#: coefficients each reads from the step's scalars (:func:`scalars`; the rows are as wide as Adam's)
RULE_ADAM, RULE_SGD, RULE_LION = 0, 1, 2
RULE_COEFFICIENTS = {RULE_ADAM: 8, RULE_SGD: 6, RULE_LION: 6}
_SCALARS_WIDTH = 10  # 8 coefficients (fewer padded with zeros), 0, the step (the random bits' seed)

#: Columns of the tensor table: addresses of the parameter and its gradient, element count, elements the
#: kernel steps (a blocked format's blocks times BLOCK: each row padded to whole blocks), offset in the
#: per-element state buffers, position of the first element in the whole parameter, elements per row of
#: blocks, offset in the per-block state buffers, then (for tensors whose state is their own, not a
#: bucket's: FSDP2's local shards; offsets 0) the state tensors' addresses.
STATE_COLUMNS = ("master_weight", "master_hi", "master_lo", "master_tie", "exp_avg", "exp_avg_sq",
                 _encodings.scale_key("exp_avg"), _encodings.scale_key("exp_avg_sq"))
TABLE_COLUMNS = ("param", "grad", "numel", "size", "offset", "position", "row_length",
                 "block_offset") + STATE_COLUMNS
#: A launch's tables are "aligned" (the kernel's loads and stores of 16 bytes) when every address in
#: them is a multiple of 16 bytes and every element count, offset and position a multiple of :data:`VECTOR`.
VECTOR = 8


def _code_tiers(name: str) -> Tuple[Tuple[int, int, int], ...]:
    """encodings' uint8 codes of moment ``name``, tier by tier from the smallest values up: (mantissa
    bits, first binade over the block's base, first code)."""
    return tuple(tuple(int(v) for v in tier) for tier in _encodings._TIER_TABLE[name][0])


if triton is not None:
    # encodings.py's constants, as compile-time values of the kernels
    _SALT_C = tl.constexpr(_SALT)
    _M_TIERS = tl.constexpr(_code_tiers("exp_avg"))
    _V_TIERS = tl.constexpr(_code_tiers("exp_avg_sq"))
    _M_NTIERS = tl.constexpr(len(_code_tiers("exp_avg")))
    _V_NTIERS = tl.constexpr(len(_code_tiers("exp_avg_sq")))
    _M_SPAN = tl.constexpr(_SPAN["exp_avg"])
    _V_SPAN = tl.constexpr(_SPAN["exp_avg_sq"])
    _V_ROUNDING = tl.constexpr(_V_ROUNDING)
    _V_MIN_SHIFT = tl.constexpr(_V_ROUNDING_MIN_SHIFT)
    _M_MAGNITUDE = tl.constexpr(_MAGNITUDE_MASK["exp_avg"])  # the sign bit above it
    _V_MAGNITUDE = tl.constexpr(_MAGNITUDE_MASK["exp_avg_sq"])
    _M_NAN = tl.constexpr(_NAN_CODE["exp_avg"])
    _M_INF = tl.constexpr(_INF_CODE["exp_avg"])
    _V_NAN = tl.constexpr(_NAN_CODE["exp_avg_sq"])
    _V_INF = tl.constexpr(_INF_CODE["exp_avg_sq"])
    # 0x7F7F8000: float32 magnitudes from it up round to bfloat16's inf (it is halfway between inf and the
    # largest value, whose pattern is odd)
    _BF16_OVERFLOW = tl.constexpr(float.fromhex("0x1.ffp+127"))
    assert _MAGNITUDE_MASK["exp_avg"] == 127  # its sign is bit 7: the float32 sign bit shifted by 24

    @triton.jit
    def _hash(position, seed_term):
        """encodings._random_bits (uint32): three xor-shift-multiply rounds of position ^ seed_term."""
        h = position ^ seed_term
        return _hash_rounds(h ^ (h >> 16))

    @triton.jit
    def _hash_rounds(h):
        """:func:`_hash` from its first xor-shift's result on."""
        h = h * 0x7FEB352D
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
    def _bf16_bits(x, CVT: tl.constexpr):
        """float32 -> bfloat16 bits (uint32, in the low half), round to nearest even (as Tensor.copy_). CVT:
        the GPU's conversion (cvt.rn.bf16; a nan -> a nan, 0x7FFF as torch's CUDA conversion writes);
        else spelled out, nan -> 0x7FC0 (c10::BFloat16's rule on the CPU): the interpreter's conversion
        truncates."""
        if CVT:
            return x.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.uint32)
        else:
            u = x.to(tl.uint32, bitcast=True)
            r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
            return tl.where(x != x, 0x7FC0, r)

    @triton.jit
    def _to_f32(x, CVT: tl.constexpr):
        """x (float16, bfloat16 or float32) as float32, exactly. CVT: the GPU's conversion; else a bfloat16
        through its bits: the interpreter's conversion loses subnormals (2.9e-39 -> 0, 1e-38 -> 8.3e-39;
        Triton 3.9, found by halfadam.selfcheck)."""
        if x.dtype == tl.bfloat16 and not CVT:
            return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            return x.to(tl.float32)

    @triton.jit
    def _round_to(x, P_DTYPE: tl.constexpr, CVT: tl.constexpr):
        """x rounded to the parameter's dtype (nearest even, as Tensor.copy_), as float32."""
        if P_DTYPE == tl.bfloat16:
            if CVT:
                return x.to(tl.bfloat16).to(tl.float32)
            else:
                return (_bf16_bits(x, CVT) << 16).to(tl.float32, bitcast=True)
        else:
            return x.to(P_DTYPE).to(tl.float32)

    @triton.jit
    def _store_param(ptr, x, mask, P_DTYPE: tl.constexpr, CVT: tl.constexpr):
        """Store x rounded to the parameter's dtype."""
        if P_DTYPE == tl.bfloat16 and not CVT:
            tl.store(ptr.to(tl.pointer_type(tl.uint16)), _bf16_bits(x, CVT).to(tl.uint16), mask=mask)
        else:
            tl.store(ptr, x.to(P_DTYPE), mask=mask)

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
    def _div_by_coefficient(x, c, y, special):
        """tl.div_rn(x, c), correctly rounded, for x = sqrt(v) (>= 0 or nan) and the step's divisor c =
        sqrt(1 - beta2**t) in [2**-27, 1] (beta2 in (0, 1), t >= 1) or 0, with y = tl.div_rn(1.0, c):
        without a division per element. q = x * y is within 1.5 ulps of x / c; a correction step
        q + (x - c q) y (each in one rounding: fma; the remainder x - c q is exact) makes it faithful
        (within an ulp), and a second one correctly rounded (Markstein's theorem: y within half an ulp
        of 1 / c and q faithful give RN(q + (x - c q) y) = RN(x / c), without underflow or overflow: x is
        0, inf, nan or in [2**-75, 2**64], so x / c is in [2**-75, 2**91]). x = 0 or inf (and nan), and
        every x where c = 0 (y inf), take x * y, IEEE's quotient there: ``special`` (:func:`_coefficient_special`).
        (Exact while c is in [2**-64, 2**51].)"""
        q = x * y
        q = tl.fma(tl.fma(-c, q, x), y, q)
        q = tl.fma(tl.fma(-c, q, x), y, q)
        return tl.where((x.to(tl.int32, bitcast=True) - 1).to(tl.uint32, bitcast=True) >= special, x * y, q)

    @triton.jit
    def _coefficient_special(y):
        """The threshold of :func:`_div_by_coefficient`'s x * y: the patterns of 0, inf and nan less 1 (as
        uint32) reach 0x7F7FFFFF; every pattern reaches 0 (c = 0)."""
        return tl.where(y == float("inf"), 0, 0x7F7FFFFF).to(tl.uint32)

    @triton.jit
    def _decode_uint8(code_ptr, scale_ptr, mask, bmask, IS_EXP_AVG: tl.constexpr):
        """encodings._decode_moment of uint8 codes ([blocks, BLOCK] pointers) over their blocks' scales
        (``[blocks]`` pointers): _decode_magnitude, then the reserved codes and exp_avg's sign bit. A
        masked-off code is 0 (the value 0, as the specification's padding)."""
        base = tl.load(scale_ptr, mask=bmask, other=0).to(tl.int32)[:, None]
        if IS_EXP_AVG:  # (the code as int8: its sign bit spread over the upper bits, bit 31 among them)
            TIERS: tl.constexpr = _M_TIERS
            NTIERS: tl.constexpr = _M_NTIERS
            code = tl.load(code_ptr.to(tl.pointer_type(tl.int8)), mask=mask, other=0).to(tl.int32)
            k = code & _M_MAGNITUDE
        else:
            TIERS: tl.constexpr = _V_TIERS
            NTIERS: tl.constexpr = _V_NTIERS
            k = tl.load(code_ptr, mask=mask, other=0).to(tl.int32)
        M0: tl.constexpr = TIERS[0][0]
        # encodings._decode_magnitude: code k of tier (mantissa bits m, first binade r0, first code c) has the
        # pattern (k - c) * 2**(23 - m) + (r0 << 23) + (base << 23), a line in k above base << 23. The lines'
        # slopes fall from tier to tier and each meets the next at its first code (the value rounded up from
        # a binade's top is the next binade's first): each tier's line is the lowest in its codes, so the
        # pattern is base << 23 plus the lowest of the lines (integers mod 2**32, as the specification's)
        line = k * (1 << (23 - M0)) - (TIERS[0][2] << (23 - M0))
        for i in tl.static_range(1, NTIERS):  # (mantissa bits, first binade, first code)
            line = tl.minimum(line, k * (1 << (23 - TIERS[i][0]))
                              + ((TIERS[i][1] << 23) - (TIERS[i][2] << (23 - TIERS[i][0]))))
        unit = base << 23
        sub = k < (1 << M0)  # a subnormal: unit * k / 2**M0, the value of unit * (1 + k / 2**M0) less unit
        value = (line + tl.where(sub, unit + (1 << 23), unit)).to(tl.float32, bitcast=True)
        value = tl.where(sub, value - unit.to(tl.float32, bitcast=True), value)
        nan = tl.full(value.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)  # math.nan's bits
        if IS_EXP_AVG:
            value = tl.where(k == _M_INF, float("inf"), value)
            # the sign bit: -value (the sign bit flipped)
            value = (value.to(tl.int32, bitcast=True) ^ (code & -2147483648)).to(tl.float32, bitcast=True)
            value = tl.where(k == _M_NAN, nan, value)
        else:
            value = tl.where(k == _V_INF, float("inf"), value)
            value = tl.where(k == _V_NAN, nan, value)
        return value

    @triton.jit
    def _encode_uint8(x, r16, IS_EXP_AVG: tl.constexpr):
        """encodings._encode_moment_ for uint8 (x: [blocks, BLOCK] float32; r16: the elements' 16 random
        bits, int32): (codes int32, the blocks' scales int32)."""
        if IS_EXP_AVG:
            TIERS: tl.constexpr = _M_TIERS
            NTIERS: tl.constexpr = _M_NTIERS
            SPAN: tl.constexpr = _M_SPAN
        else:
            TIERS: tl.constexpr = _V_TIERS
            NTIERS: tl.constexpr = _V_NTIERS
            SPAN: tl.constexpr = _V_SPAN
        M0: tl.constexpr = TIERS[0][0]
        bits = x.to(tl.int32, bitcast=True)
        a = bits & 0x7FFFFFFF  # |x| (bits); the codes of +-inf and nan are set at the end
        # encodings._block_base over the finite values: 2 |x| + 2**24 (uint32 bits) is 2**24 (E + 1) and more
        # for E the biased exponent of a finite x, and wraps around below 2**24 for +-inf and nan, so the
        # blocks' integer max is 2**24 (E + 1) and more for E their largest finite magnitude's (a block
        # without one: below 2**24, "E = -1", and the base 1 of E = 0)
        top = tl.max(((bits << 1) + (1 << 24)).to(tl.uint32, bitcast=True), axis=1)
        base1 = tl.maximum((top >> 24).to(tl.int32) - (SPAN + 1), 1)
        base = base1[:, None]
        unit = base << 23
        # encodings._encode_magnitude: a subnormal's (a < unit) pattern is that of a + unit, one binade lower
        # (2**23 below: its code (y >> (23 - M0)) less 2**M0); that pattern is at least a's where a < unit
        # (a value of [(a + unit) / 2, unit)), at most a's elsewhere: the larger of the two
        shifted = (a.to(tl.float32, bitcast=True) + unit.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)
        y = tl.maximum(a, shifted - (1 << 23))
        # the code in the binade's tier (mantissa bits m, first binade r0, first code c), rounded with r16
        # below the kept bits: ((y + (r16 << (7 - m))) >> (23 - m)) + c - ((base + r0) << m). Each tier's
        # codes, a line in y (its slope rising from tier to tier; each meets the next at its first code), are
        # at least the other tiers' there (floors of lines apart by a multiple of y's distance to the edge):
        # the code is the largest of the tiers'
        if IS_EXP_AVG:
            k = ((y + (r16 << (7 - M0))) >> (23 - M0)) + (TIERS[0][2] - (base << M0))
            for i in tl.static_range(1, NTIERS):  # (mantissa bits, first binade, first code)
                k = tl.maximum(k, ((y + (r16 << (7 - TIERS[i][0]))) >> (23 - TIERS[i][0]))
                               + (TIERS[i][2] - ((base + TIERS[i][1]) << TIERS[i][0])))
        else:  # the tier by the binade (a subnormal's is below the lowest), then its rounding up by
            # (5 f8 (256 - f8)) >> max(mantissa + 4, 6), f8 the remainder's top 8 bits (unbiased in v**(1/4))
            binade = (y >> 23) - base
            mantissa = tl.zeros_like(y) + M0
            offset = TIERS[0][2] - (base << M0)
            for i in tl.static_range(1, NTIERS):
                taken = binade >= TIERS[i][1]
                mantissa = tl.where(taken, TIERS[i][0], mantissa)
                offset = tl.where(taken, TIERS[i][2] - ((base + TIERS[i][1]) << TIERS[i][0]), offset)
            kept = y >> (7 - mantissa)
            f8 = (kept >> 8) & 255
            k = ((kept + r16 + ((_V_ROUNDING * f8 * (256 - f8)) >> tl.maximum(mantissa + 4, _V_MIN_SHIFT))) >> 16) + offset
        finite = a < 0x7F800000
        if IS_EXP_AVG:  # the sign bit (bit 7), a nan's aside
            code = tl.where(finite, k, _M_INF) | ((bits >> 24) & 128)
            code = tl.where(a > 0x7F800000, _M_NAN, code)
        else:  # nonzero never to 0 (x > 0: a positive pattern; nan and +inf are set next)
            code = tl.where(bits > 0, tl.maximum(k, 1), 0)
            code = tl.where(finite, code, tl.where(bits == 0x7F800000, _V_INF, _V_NAN))
        return code, base1

    @triton.jit
    def _load_moment(ptr, scale_ptr, mask, bmask, KIND: tl.constexpr, IS_EXP_AVG: tl.constexpr, CVT: tl.constexpr):
        """The moment's float32 values ([blocks, BLOCK]); an absent one (KIND 3) reads nothing (zeros, unused)."""
        if KIND == 2:
            return _decode_uint8(ptr, scale_ptr, mask, bmask, IS_EXP_AVG)
        elif KIND == 3:
            return tl.zeros(mask.shape, tl.float32)
        else:
            return _to_f32(tl.load(ptr, mask=mask, other=0.0), CVT)

    @triton.jit
    def _store_moment(x, ptr, scale_ptr, mask, bmask, r16, KIND: tl.constexpr, IS_EXP_AVG: tl.constexpr):
        """encodings._encode_moment_ (x: [blocks, BLOCK] float32, 0 where ``mask`` is off (a block's short
        end: no value of its scale); r16: the moment's 16 random bits). An absent moment (KIND 3) stores nothing."""
        if KIND == 0:
            tl.store(ptr, x, mask=mask)
        elif KIND == 1:  # stochastic rounding: add 16 random bits below bfloat16's, truncate
            # a nan: bfloat16's (its bits plus r16 could carry into the sign); the upper halves are stored
            t = tl.where(x != x, 0x7FC00000, x.to(tl.uint32, bitcast=True)) + r16.to(tl.uint32)
            tl.store(ptr.to(tl.pointer_type(tl.uint16)), (t >> 16).to(tl.uint16), mask=mask)
        elif KIND == 2:
            code, base = _encode_uint8(x, r16, IS_EXP_AVG)
            tl.store(ptr, code.to(tl.uint8), mask=mask)
            tl.store(scale_ptr, base.to(tl.uint8), mask=bmask)

    @triton.jit
    def _moment_ptr(address, KIND: tl.constexpr):
        if KIND == 0:
            return address.to(tl.pointer_type(tl.float32))
        elif KIND == 1:
            return address.to(tl.pointer_type(tl.bfloat16))
        else:
            return address.to(tl.pointer_type(tl.uint8))

    @triton.jit
    def _adam_math(w, g, m, v, decay_factor, l2, step_size, sqrt_bias_correction2, reciprocal, special,
                   one_minus_beta1, beta2, one_minus_beta2, eps, L2: tl.constexpr, OPTIMIZED: tl.constexpr):
        """functional.adam_elementwise_, each operation rounded once: (w, m, v)."""
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
            d = _div_by_coefficient(root, sqrt_bias_correction2, reciprocal, special) + eps
        w = w - tl.div_rn(m, d) * step_size
        return w, m, v

    @triton.jit
    def _sgd_math(w, g, buf, l2, momentum_a, momentum_b, nesterov_momentum, lr, sign, L2: tl.constexpr,
                  MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr):
        """The engine's SGD rule (halfadam.sgd), each operation rounded once: (w, buf). MOMENTUM: the
        momentum buffer exists (else ``buf`` is unused and returned as it came)."""
        g = g * sign  # +1 or -1 (maximize)
        if L2:  # weight_decay != 0
            g = g + l2 * w
        if MOMENTUM:
            buf = buf * momentum_a + g * momentum_b
            if NESTEROV:
                d = g + buf * nesterov_momentum
            else:
                d = buf
        else:
            d = g
        w = w - d * lr
        return w, buf

    @triton.jit
    def _lion_math(w, g, m, decay_factor, lr, beta1, one_minus_beta1, beta2, one_minus_beta2):
        """The engine's Lion rule (halfadam.lion), each operation rounded once: (w, m). The update's sign
        is +1, -1, or +0.0 for +-0 and nan (as torch.sign on the CPU)."""
        w = w * decay_factor
        c = m * beta1 + g * one_minus_beta1
        s = (c > 0.0).to(tl.float32) - (c < 0.0).to(tl.float32)
        w = w - s * lr
        m = m * beta2 + g * one_minus_beta2
        return w, m

    @triton.jit
    def _tile(param, grad, e, eb, first, pmask, emask, bmask, lanes, idx, position0, scalars_row,
              k0, k1, k2, k3, reciprocal, special, k4, k5, k6, k7,
              grad_scale_ptr, master_ptr, hi_ptr, lo_ptr, tie_ptr, m_ptr, v_ptr, m_scale_ptr, v_scale_ptr,
              P_DTYPE: tl.constexpr, MASTER: tl.constexpr, M_KIND: tl.constexpr, V_KIND: tl.constexpr,
              RULE: tl.constexpr, L2: tl.constexpr, OPTIMIZED: tl.constexpr, NESTEROV: tl.constexpr,
              HAS_SCALE: tl.constexpr, OCTETS: tl.constexpr, CVT: tl.constexpr, BLOCK_: tl.constexpr):
        """One tile of the step: its elements ``idx`` ([blocks, BLOCK]) from ``param``/``grad`` (the tile's
        first ones; those of ``pmask``) and from element ``e`` (block ``eb``) of the flat state buffers
        (those of ``emask``, blocks of ``bmask``); ``first``: its first element's index in the tensor.
        Elements off the masks (a block's short end) are loaded as zeros, the specification's padding
        (``encodings._pad``): they step to zeros, change no block's scale or first tie, and are not stored
        (where ``emask`` takes a bucket's whole blocks, the zeros of its padding are stored back). OCTETS:
        the first element's position ``position0 + first`` is a multiple of 8. ``k0``..``k7``: the
        rule's coefficients in the order of :func:`scalars` (Adam's 8; SGD's and Lion's 6, then unused);
        ``reciprocal``, ``special``: Adam's divisor's (:func:`_div_by_coefficient`; unused by the others)."""
        blocks = tl.arange(0, idx.shape[0])
        g = _to_f32(tl.load(grad + idx, mask=pmask, other=0.0), CVT)
        if HAS_SCALE:
            g = g * tl.load(grad_scale_ptr)
        p = _to_f32(tl.load(param + idx, mask=pmask, other=0.0), CVT)
        # the weight: master sync (functional.sync_master_) or split decode (encodings._split_decode)
        if MASTER == 0:
            w = p
        elif MASTER == 1:
            master = tl.load(master_ptr + e + idx, mask=emask, other=0.0)
            w = tl.where(_written(p, _round_to(master, P_DTYPE, CVT)), p, master)
        elif MASTER == 3:  # encodings._split8_decode (bfloat16 parameters): bits(p) + 256 c, one more at c = -128
            tl.static_assert(P_DTYPE == tl.bfloat16)
            c8 = tl.load(hi_ptr + e + idx, mask=emask, other=0).to(tl.int32)
            pb = p.to(tl.int32, bitcast=True)
            decoded = pb + (c8 << 8) + (c8 == -128).to(tl.int32)
            # p +-0, +-inf or nan: 2 |p|'s pattern less 2 (uint32) reaches 2 * 0x7F800000 - 2 (no written() check:
            # every decoded master rounds to p)
            keep = ((pb << 1) - 2).to(tl.uint32, bitcast=True) >= 0xFEFFFFFE
            w = tl.where(keep, pb, decoded).to(tl.float32, bitcast=True)
        else:
            tie = tl.load(tie_ptr + eb + blocks, mask=bmask, other=0).to(tl.int32) - 1  # its lane, or -1
            r = ((tl.load(hi_ptr + e + idx, mask=emask, other=0).to(tl.int32) << 8)
                 | tl.load(lo_ptr + e + idx, mask=emask, other=0).to(tl.int32))
            r += tl.where(lanes[None, :] == tie[:, None], 65536, 0)
            if P_DTYPE == tl.bfloat16:
                pb = p.to(tl.int32, bitcast=True)
                decoded = pb + r
                # _written(p, round(decoded)) where p is finite and nonzero: round(decoded)'s pattern is not p's
                # (the same sign: no carry reaches the sign bit; decoded is no nan); and p +-0, +-inf or nan:
                # 2 |p|'s pattern less 2 (uint32) reaches 2 * 0x7F800000 - 2
                if CVT:
                    rounded = _round_to(decoded.to(tl.float32, bitcast=True), P_DTYPE, CVT)
                    written = rounded.to(tl.int32, bitcast=True) != pb
                else:  # r + 0x7FFF + (decoded's bit 16: the rounding's tie to even) outside [0, 2**16)
                    written = (r + 0x7FFF + ((decoded >> 16) & 1)).to(tl.uint32, bitcast=True) >= 65536
                keep = written | (((pb << 1) - 2).to(tl.uint32, bitcast=True) >= 0xFEFFFFFE)
                w = tl.where(keep, pb, decoded).to(tl.float32, bitcast=True)
            else:
                decoded = p + r.to(tl.float32) * (_fp16_ulp(p) * (1.0 / 65536.0))
                keep = _written(p, _round_to(decoded, P_DTYPE, CVT)) | ~(tl.abs(p) < float("inf")) | (p == 0.0)
                w = tl.where(keep, p, decoded)
        m = _load_moment(m_ptr + e + idx, m_scale_ptr + eb + blocks, emask, bmask, M_KIND, True, CVT)
        v = _load_moment(v_ptr + e + idx, v_scale_ptr + eb + blocks, emask, bmask, V_KIND, False, CVT)

        # the rule's per-element math (the only rule-specific lines of the step)
        if RULE == 0:
            w, m, v = _adam_math(w, g, m, v, k0, k1, k2, k3, reciprocal, special, k4, k5, k6, k7, L2, OPTIMIZED)
        elif RULE == 1:
            w, m = _sgd_math(w, g, m, k0, k1, k2, k3, k4, k5, L2, M_KIND != 3, NESTEROV)
        else:
            w, m = _lion_math(w, g, m, k0, k1, k2, k3, k4, k5)

        if (M_KIND == 1) or (M_KIND == 2) or (V_KIND == 1) or (V_KIND == 2) or (MASTER == 3):
            # one hash per element: the exp_avg slot the upper 16 bits, the exp_avg_sq slot the lower, a
            # split8 master the upper byte of one more round (encodings._master_bits)
            seed_term = tl.load(scalars_row + 9).to(tl.uint32, bitcast=True) * 0x27D4EB2F + _SALT_C
            if OCTETS:  # the tile's first position a multiple of 8: element idx's is that of its group of 8,
                # idx & ~7, or'ed with idx & 7, so position ^ seed_term is the group's g ^ (idx & 7), whose
                # upper 16 bits are g's: the first xor-shift g ^ (g >> 16) is the group's (a thread's 8 elements
                # of a tile are one group: once for them)
                g = ((position0 + first).to(tl.uint32) + (idx & ~7).to(tl.uint32)) ^ seed_term
                h = _hash_rounds((g ^ (g >> 16)) ^ (idx & 7).to(tl.uint32))
            else:
                h = _hash((position0 + first).to(tl.uint32) + idx.to(tl.uint32), seed_term)
            if MASTER == 3:
                master_bits = (((h ^ (h >> 16)) * 0x7FEB352D) >> 24).to(tl.int32)
            h = h.to(tl.int32, bitcast=True)
            m_bits = (h >> 16) & 0xFFFF
            v_bits = h & 0xFFFF
        else:
            m_bits = idx
            v_bits = idx
        _store_moment(m, m_ptr + e + idx, m_scale_ptr + eb + blocks, emask, bmask, m_bits, M_KIND, True)
        _store_moment(v, v_ptr + e + idx, v_scale_ptr + eb + blocks, emask, bmask, v_bits, V_KIND, False)
        if MASTER == 0:
            _store_param(param + idx, w, pmask, P_DTYPE, CVT)
        elif MASTER == 1:
            tl.store(master_ptr + e + idx, w, mask=emask)
            _store_param(param + idx, w, pmask, P_DTYPE, CVT)
        elif MASTER == 3:  # encodings._split8_encode_ (the step's: stochastic, with master_bits)
            rounded = _bf16_bits(w, CVT).to(tl.int32)  # round(w), nearest even (a nan: a nan)
            pb = rounded << 16
            # r = bits(w) - bits(round(w)), c = floor((r + master_bits) / 256) in [-128, 128]
            c8 = (w.to(tl.int32, bitcast=True) - pb + master_bits) >> 8
            valid = ((pb << 1) - 2).to(tl.uint32, bitcast=True) < 0xFEFFFFFE  # round(w) finite and nonzero
            top = c8 == 128
            at_max = (rounded & 0x7FFF) == 0x7F7F  # the largest finite bfloat16 magnitude: 127 there
            bump = valid & top & ~at_max  # one bfloat16 value away from zero: its bits + 1
            tl.store((param + idx).to(tl.pointer_type(tl.uint16)), (rounded + bump.to(tl.int32)).to(tl.uint16),
                     mask=pmask)
            # c = 128 stored as int8 is -128, the bumped code; at the largest magnitude 127; 0 over +-0, nan, +-inf
            c8 = tl.where(valid, c8 - (top & at_max).to(tl.int32), 0)
            tl.store(hi_ptr + e + idx, c8.to(tl.int8), mask=emask)
        else:  # encodings._split_encode_
            if P_DTYPE == tl.bfloat16:
                _store_param(param + idx, w, pmask, P_DTYPE, CVT)
                # the difference of patterns (|rem| <= 2**15: nearest rounding); none over nan or +-inf, the
                # rounding of w from 0x7F7F8000 up (a tie with an odd bfloat16 value: to inf) and of nan
                rounded = _bf16_bits(w, CVT).to(tl.int32)
                rem = tl.where(tl.abs(w) < _BF16_OVERFLOW, w.to(tl.int32, bitcast=True) - rounded * 65536, 0)
            else:
                _store_param(param + idx, w, pmask, P_DTYPE, CVT)
                r32 = _round_to(w, P_DTYPE, CVT)
                q = _round_half_even(tl.div_rn(w - r32, _fp16_ulp(r32)) * 65536.0)
                rem = tl.where(tl.abs(r32) < float("inf"), q, 0.0).to(tl.int32)
            first_tie = tl.min(tl.where(rem == 32768, lanes[None, :], BLOCK_), axis=1)  # (BLOCK: none)
            tl.store(tie_ptr + eb + blocks, tl.where(first_tie < BLOCK_, first_tie + 1, 0).to(tl.uint8), mask=bmask)
            # the first tie stores -2**15, the others 2**15 - 1
            if P_DTYPE == tl.bfloat16:
                rem = tl.minimum(rem, 32767)
            else:
                rem = tl.minimum(tl.maximum(rem, -32768), 32767)
            rem = tl.where(lanes[None, :] == first_tie[:, None], -32768, rem)
            tl.store(hi_ptr + e + idx, (rem >> 8).to(tl.int8), mask=emask)
            tl.store(lo_ptr + e + idx, rem.to(tl.uint8), mask=emask)


    @triton.jit
    def _step_kernel(work_ptr, table_ptr, scalars_ptr, grad_scale_ptr, found_inf_ptr,
                     master_ptr, hi_ptr, lo_ptr, tie_ptr, m_ptr, v_ptr, m_scale_ptr, v_scale_ptr,
                     P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, MASTER: tl.constexpr, M_KIND: tl.constexpr,
                     V_KIND: tl.constexpr, RULE: tl.constexpr, L2: tl.constexpr, OPTIMIZED: tl.constexpr,
                     NESTEROV: tl.constexpr, HAS_SCALE: tl.constexpr,
                     HAS_FOUND_INF: tl.constexpr, SCALARS_STRIDE: tl.constexpr, STATE_IN_TABLE: tl.constexpr,
                     ALIGNED: tl.constexpr, ROWS: tl.constexpr, CVT: tl.constexpr, NB: tl.constexpr,
                     BLOCK_: tl.constexpr, CHUNK_: tl.constexpr):
        """One step of update rule RULE (0 Adam, 1 SGD, 2 Lion) over the programs of the work list (see
        the module docstring); M_KIND / V_KIND 3: that moment slot absent."""
        if HAS_FOUND_INF:
            if tl.load(found_inf_ptr) != 0.0:
                return
        # (a bfloat16 moment rounds stochastically: its random bits need each element's position)
        BLOCKED: tl.constexpr = ((MASTER == 2) or (MASTER == 3) or (M_KIND == 1) or (M_KIND == 2) or (V_KIND == 1)
                                 or (V_KIND == 2))
        TILE_: tl.constexpr = NB * BLOCK_
        pid = tl.program_id(0)
        t = tl.load(work_ptr + 2 * pid)
        start = tl.multiple_of(tl.load(work_ptr + 2 * pid + 1), CHUNK_)  # a multiple of CHUNK
        row = table_ptr + 16 * t
        numel = tl.load(row + 2)
        size = tl.load(row + 3)  # the elements it steps: numel, its blocks times BLOCK when blocked
        offset = tl.load(row + 4)
        if BLOCKED:
            offset = tl.multiple_of(offset, BLOCK_)
        elif ALIGNED:
            offset = tl.multiple_of(offset, 8)
        position0 = tl.load(row + 5)
        block_offset = tl.load(row + 7)
        param = tl.load(row).to(tl.pointer_type(P_DTYPE))
        grad = tl.load(row + 1).to(tl.pointer_type(G_DTYPE))
        if ALIGNED:  # (a hint on a value made here: one on a jit function's argument is lost)
            param = tl.multiple_of(param, 16)
            grad = tl.multiple_of(grad, 16)
        if STATE_IN_TABLE:  # the tensor's own state tensors (offset 0 in them)
            master_ptr = tl.load(row + 8).to(tl.pointer_type(tl.float32))
            hi_ptr = tl.load(row + 9).to(tl.pointer_type(tl.int8))
            lo_ptr = tl.load(row + 10).to(tl.pointer_type(tl.uint8))
            tie_ptr = tl.load(row + 11).to(tl.pointer_type(tl.uint8))
            m_ptr = _moment_ptr(tl.load(row + 12), M_KIND)
            v_ptr = _moment_ptr(tl.load(row + 13), V_KIND)
            m_scale_ptr = tl.load(row + 14).to(tl.pointer_type(tl.uint8))
            v_scale_ptr = tl.load(row + 15).to(tl.pointer_type(tl.uint8))
            if ALIGNED:
                master_ptr = tl.multiple_of(master_ptr, 16)
                hi_ptr = tl.multiple_of(hi_ptr, 16)
                lo_ptr = tl.multiple_of(lo_ptr, 16)
                m_ptr = tl.multiple_of(m_ptr, 16)
                v_ptr = tl.multiple_of(v_ptr, 16)
        scalars_row = scalars_ptr + SCALARS_STRIDE * t  # one row for all, or one per tensor (capturable)
        c = scalars_row.to(tl.pointer_type(tl.float32))
        # the rule's coefficients (Adam: decay_factor, l2, step_size, sqrt_bias_correction2, one_minus_beta1,
        # beta2, one_minus_beta2, eps; SGD: l2, momentum_a, momentum_b, nesterov_momentum, lr, sign; Lion:
        # decay_factor, lr, beta1, one_minus_beta1, beta2, one_minus_beta2)
        k0 = tl.load(c)
        k1 = tl.load(c + 1)
        k2 = tl.load(c + 2)
        k3 = tl.load(c + 3)
        k4 = tl.load(c + 4)
        k5 = tl.load(c + 5)
        if RULE == 0:
            k6 = tl.load(c + 6)
            k7 = tl.load(c + 7)
            reciprocal = tl.div_rn(1.0, k3)  # (once: the divisor sqrt_bias_correction2 of every element)
            special = _coefficient_special(reciprocal)
        else:  # (unused)
            k6 = k0
            k7 = k0
            reciprocal = k0
            special = k0

        blocks = tl.arange(0, NB)
        lanes = tl.arange(0, BLOCK_)
        idx = blocks[:, None] * BLOCK_ + lanes[None, :]  # int32 indices from the tile's first element
        block0 = block_offset + (start >> 7)  # (BLOCK_: 128) the program's first block in the per-block buffers
        if ROWS:  # rows of `length` elements: block j is row r = j // per_row's block c = j - r * per_row, its
            length = tl.load(row + 6)  # elements r * length + c * BLOCK + lane for lane < length - c * BLOCK
            per_row = ((length + (BLOCK_ - 1)) >> 7).to(tl.int32)
            n_blocks = (size >> 7).to(tl.int32)
        # the program's tiles of NB blocks (its CHUNK, cut at the tensor's end), one after the other
        for tile in tl.range(0, tl.cdiv(tl.minimum(size - start, CHUNK_), TILE_)):
            if ROWS:
                j0 = ((start >> 7) + tile * NB).to(tl.int32)  # the tile's first block, its row and column
                r0 = j0 // per_row
                c0 = j0 - r0 * per_row
                first = r0.to(tl.int64) * length + c0 * BLOCK_  # the tile's first element in the tensor
                j = j0 + blocks
                r = j // per_row
                col = j - r * per_row
                width = tl.minimum(length - col.to(tl.int64) * BLOCK_, BLOCK_).to(tl.int32)  # each block's elements
                # each block's first element from the tile's (int32 arithmetic wraps around mod 2**32: the terms
                # may, their sum is below TILE)
                at = (r - r0) * length.to(tl.int32) + (col - c0) * BLOCK_
                bmask = j < n_blocks
                mask = bmask[:, None] & (lanes[None, :] < width[:, None])
                _tile(param + first, grad + first, offset + first, block0 + tile * NB, first, mask, mask, bmask,
                      lanes, at[:, None] + lanes[None, :], position0, scalars_row, k0, k1, k2, k3, reciprocal,
                      special, k4, k5, k6, k7,
                      grad_scale_ptr, master_ptr, hi_ptr, lo_ptr, tie_ptr, m_ptr, v_ptr, m_scale_ptr, v_scale_ptr,
                      P_DTYPE, MASTER, M_KIND, V_KIND, RULE, L2, OPTIMIZED, NESTEROV, HAS_SCALE, False, CVT, BLOCK_)
            else:  # BLOCK consecutive elements per block
                first = tl.multiple_of(start + tile * TILE_, TILE_)
                left = tl.minimum(numel - first, TILE_).to(tl.int32)
                if ALIGNED:
                    left = tl.multiple_of(left, 8)
                pmask = idx < left  # (in a blocked format the last block is short where numel is no multiple of BLOCK)
                bmask = blocks * BLOCK_ < left
                if BLOCKED and not (ALIGNED or STATE_IN_TABLE):
                    # a bucket's state buffers hold whole blocks (zeros after the tensor, which step to zeros):
                    # one mask per block, so that their loads and stores move 16 bytes where the tensor's do not
                    emask = tl.broadcast_to(bmask[:, None], (NB, BLOCK_))
                else:
                    emask = pmask
                _tile(param + first, grad + first, offset + first, block0 + tile * NB, first, pmask, emask, bmask,
                      lanes, idx, position0, scalars_row, k0, k1, k2, k3, reciprocal, special, k4, k5, k6, k7,
                      grad_scale_ptr, master_ptr, hi_ptr, lo_ptr, tie_ptr, m_ptr, v_ptr, m_scale_ptr, v_scale_ptr,
                      P_DTYPE, MASTER, M_KIND, V_KIND, RULE, L2, OPTIMIZED, NESTEROV, HAS_SCALE, ALIGNED, CVT, BLOCK_)

    @triton.jit
    def _uint8_kernel(x_ptr, code_ptr, scale_ptr, seed_ptr, IS_EXP_AVG: tl.constexpr, ENCODE: tl.constexpr,
                      N: tl.constexpr, NB: tl.constexpr, BLOCK_: tl.constexpr):
        """The uint8 encoder (ENCODE) or decoder alone, over N elements (whole blocks) from position 0 (tests)."""
        blocks = tl.program_id(0) * NB + tl.arange(0, NB)
        local = blocks[:, None] * BLOCK_ + tl.arange(0, BLOCK_)[None, :]
        bmask = blocks * BLOCK_ < N
        mask = tl.broadcast_to(bmask[:, None], (NB, BLOCK_))
        if ENCODE:
            x = tl.load(x_ptr + local, mask=mask, other=0.0)
            seed = tl.load(seed_ptr).to(tl.uint32, bitcast=True)
            h = _hash(local.to(tl.uint32), seed * 0x27D4EB2F + _SALT_C).to(tl.int32, bitcast=True)
            r16 = (h >> 16) & 0xFFFF if IS_EXP_AVG else h & 0xFFFF
            _store_moment(x, code_ptr + local, scale_ptr + blocks, mask, bmask, r16, 2, IS_EXP_AVG)
        else:
            x = _decode_uint8(code_ptr + local, scale_ptr + blocks, mask, bmask, IS_EXP_AVG)
            tl.store(x_ptr + local, x, mask=mask)

    @triton.jit
    def _divide_kernel(x_ptr, out_ptr, c_ptr, N: tl.constexpr, BLOCK_: tl.constexpr):
        """_div_by_coefficient over N elements (tests)."""
        i = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
        c = tl.load(c_ptr)
        x = tl.load(x_ptr + i, mask=i < N, other=0.0)
        y = tl.div_rn(1.0, c)
        tl.store(out_ptr + i, _div_by_coefficient(x, c, y, _coefficient_special(y)), mask=i < N)


_TL_DTYPES = {}
if tl is not None:
    _TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def work_list(sizes: List[int], device: torch.device) -> Tensor:
    """The work list (int64 ``[programs, 2]``: tensor-table row, first element) for tensors of which the
    kernel steps ``sizes`` elements (a blocked format's blocks times BLOCK), each cut into chunks of
    :data:`CHUNK`."""
    counts = torch.tensor([max(-(-n // CHUNK), 1) for n in sizes], dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(sizes), dtype=torch.int64), counts)
    first = torch.cumsum(counts, 0) - counts
    starts = (torch.arange(rows.numel(), dtype=torch.int64) - first[rows]) * CHUNK
    return torch.stack([rows, starts], 1).contiguous().to(device)


def tensor_table(params: List[Tensor], grads: List[Tensor], sizes: List[int], offsets: List[int],
                 positions: List[int], device: torch.device, row_lengths: List[int], block_offsets: List[int],
                 states: Optional[List[Dict[str, Tensor]]] = None) -> Tensor:
    """The tensor table (int64 ``[len(params), 16]``, :data:`TABLE_COLUMNS`: ``sizes``, the elements the
    kernel steps, as :func:`work_list`'s; ``row_lengths``, the elements per row of blocks (a tensor's
    numel where the format has no per-block keys); the state columns from ``states``, each tensor's own
    state, else 0); on a GPU copied without waiting. Its attribute ``rows`` says whether some tensor's
    rows end in short blocks (the row length no multiple of BLOCK, nor the numel: the launch then
    finds each block's row), ``aligned`` whether every address in it is a multiple of 16 bytes and every
    element count, size, offset and position a multiple of :data:`VECTOR` (the launch then moves 16 bytes
    at a time, where it has no short blocks)."""
    own = [[st[k].data_ptr() if k in st else 0 for k in STATE_COLUMNS] for st in states] if states else None
    rows = [[p.data_ptr(), g.data_ptr(), p.numel(), n, o, q, length, b] + (own[i] if own else [0] * len(STATE_COLUMNS))
            for i, (p, g, n, o, q, length, b) in enumerate(zip(params, grads, sizes, offsets, positions, row_lengths,
                                                               block_offsets))]
    aligned = all(r[0] % 16 == 0 and r[1] % 16 == 0 and r[2] % VECTOR == 0 and r[3] % VECTOR == 0
                  and r[4] % VECTOR == 0 and r[5] % VECTOR == 0 and all(a % 16 == 0 for a in r[8:]) for r in rows)
    host = torch.tensor(rows, dtype=torch.int64).view(-1, len(TABLE_COLUMNS))
    table = host if device.type == "cpu" else host.pin_memory().to(device, non_blocking=True)
    table.aligned = aligned
    table.rows = any(_encodings.has_short_blocks(r[2], r[6]) for r in rows)
    return table


def _check_coefficients(coefficients) -> int:
    """The number of ``coefficients`` (8: Adam's, 6: SGD's or Lion's); ValueError naming the argument otherwise."""
    n = len(coefficients)
    if n not in (6, 8):
        raise ValueError(f"coefficients must be the 8 of Adam or the 6 of SGD or Lion, got {n}")
    return n


def scalars(coefficients: Tuple[float, ...], step: int, device: torch.device) -> Tensor:
    """The step's scalars as one int32 tensor of 10: the coefficients' float32 bits (Adam's 8, or SGD's or
    Lion's 6 and two zeros: :data:`RULE_COEFFICIENTS`), 0, the step mod 2**32 (the random bits' seed); on
    a GPU copied without waiting. Raises ValueError for another number of coefficients."""
    n = _check_coefficients(coefficients)
    host = torch.tensor(list(coefficients) + [0.0] * (_SCALARS_WIDTH - n), dtype=torch.float32).view(torch.int32)
    seed = int(step) & 0xFFFFFFFF
    host[9] = seed - (1 << 32) if seed >= 1 << 31 else seed
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def device_scalars(coefficients: Tuple[Tensor, ...], steps: Tensor) -> Tensor:
    """The scalars of :func:`scalars`, one row per tensor, computed on the device (int32 ``[n, 10]``):
    ``coefficients`` are the rule's (float32 tensors: :func:`halfadam.functional.adam_coefficients`'
    8, or SGD's or Lion's 6, padded with zeros) of a 1-D step tensor, ``steps`` the steps being taken
    (float32, one per tensor). No host value is read (capturable). Raises ValueError for another number
    of coefficients."""
    n = _check_coefficients(coefficients)
    columns = [c.reshape(-1).expand(steps.numel()).view(torch.int32) for c in coefficients]
    columns += [torch.zeros_like(columns[0])] * (_SCALARS_WIDTH - 1 - n)
    columns += [steps.to(torch.int64).bitwise_and(0xFFFFFFFF).to(torch.int32)]
    return torch.stack(columns, 1)


def _blocks_per_tile() -> int:
    return INTERPRETED_BLOCKS_PER_TILE if interpreted() else BLOCKS_PER_TILE


def _check_rule(rule: int, exp_avg: Optional[torch.dtype], exp_avg_sq: Optional[torch.dtype], l2: bool,
                nesterov: bool) -> None:
    """ValueError (naming the argument) for a rule id that is none, or moment slots or flags it does not have."""
    if rule not in RULE_COEFFICIENTS:
        raise ValueError(f"rule must be RULE_ADAM (0), RULE_SGD (1) or RULE_LION (2), got {rule!r}")
    for name, dtype in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if dtype not in _MOMENT_KIND:
            raise ValueError(f"{name} must be torch.float32, torch.bfloat16, torch.uint8 or None, got {dtype!r}")
    if rule == RULE_ADAM and (exp_avg is None or exp_avg_sq is None):
        raise ValueError(f"Adam (rule {RULE_ADAM}) keeps both moments: exp_avg and exp_avg_sq must be dtypes, "
                         f"got exp_avg={exp_avg}, exp_avg_sq={exp_avg_sq}")
    if rule != RULE_ADAM and exp_avg_sq is not None:
        raise ValueError(f"rule {rule} keeps no square moment: exp_avg_sq must be None, got {exp_avg_sq}")
    if rule == RULE_LION and exp_avg is None:
        raise ValueError(f"Lion (rule {RULE_LION}) keeps its moment in the exp_avg slot: exp_avg must be a dtype, "
                         f"got None")
    if rule == RULE_LION and l2:
        raise ValueError("Lion (rule 2) has no L2 decay (its decay is decoupled): l2 must be False")
    if nesterov and rule != RULE_SGD:
        raise ValueError(f"nesterov is SGD's (rule {RULE_SGD}) flag, not rule {rule}'s: nesterov must be False")


def launch(work: Tensor, table: Tensor, scalars_: Tensor, stored: Dict[str, Tensor], *,
           param_dtype: torch.dtype, grad_dtype: torch.dtype, master: int, exp_avg: Optional[torch.dtype],
           exp_avg_sq: Optional[torch.dtype], l2: bool, optimized_update: bool = False,
           grad_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None, rule: int = RULE_ADAM,
           nesterov: bool = False) -> None:
    """One launch of the kernel over the programs of ``work`` (see the module docstring).

    ``table``: :func:`tensor_table` (its ``rows`` attribute picks the kernel that finds each block's row,
    else its ``aligned`` attribute, when it has one, the one that moves 16 bytes at a time);
    ``scalars_``: :func:`scalars` (one row for every tensor) or :func:`device_scalars` (a row per
    tensor-table row), with ``rule``'s coefficients; ``stored``: the bucket's flat state buffers by
    key (:func:`halfadam.encodings.element_keys`, :func:`~halfadam.encodings.block_keys`, the rule's
    moments under the kernel's slot names: a signed one as ``exp_avg`` (and ``exp_avg_scale``), a square
    one as ``exp_avg_sq`` (and ``exp_avg_sq_exponent``); empty: each tensor's own state tensors are in
    the table); ``grad_scale``, ``found_inf``: 1-element float32 device tensors or ``None``.

    ``rule``: :data:`RULE_ADAM` (``exp_avg`` and ``exp_avg_sq`` dtypes; flags ``l2``: decay "l2",
    ``optimized_update``), :data:`RULE_SGD` (``exp_avg``: the momentum buffer's dtype, ``None`` without
    momentum; ``exp_avg_sq`` ``None``; flags ``l2``: weight_decay != 0, ``nesterov``) or
    :data:`RULE_LION` (``exp_avg`` a dtype, ``exp_avg_sq`` ``None``; no flags). A slot whose dtype is
    ``None`` is neither read nor written. ``optimized_update`` is Adam's (ignored by the others).

    Raises:
        ValueError: an unknown ``rule``, a moment dtype that is no encoding, moment slots or flags the
            rule does not have (checked before anything runs).
    """
    _check_rule(rule, exp_avg, exp_avg_sq, l2, nesterov)
    dummy = scalars_
    get = lambda key: stored.get(key, dummy)  # noqa: E731  (stored empty: the state is in the table)
    rows = bool(table.rows)
    aligned = not rows and bool(getattr(table, "aligned", False)) and all(t.data_ptr() % 16 == 0 for t in stored.values())
    _step_kernel[(work.shape[0],)](
        work, table, scalars_, dummy if grad_scale is None else grad_scale, dummy if found_inf is None else found_inf,
        *(get(key) for key in STATE_COLUMNS),  # the kernel's state arguments, in this order
        P_DTYPE=_TL_DTYPES[param_dtype], G_DTYPE=_TL_DTYPES[grad_dtype], MASTER=master,
        M_KIND=_MOMENT_KIND[exp_avg], V_KIND=_MOMENT_KIND[exp_avg_sq], RULE=rule,
        L2=bool(l2), OPTIMIZED=bool(optimized_update) and rule == RULE_ADAM,
        NESTEROV=bool(nesterov) and exp_avg is not None,
        HAS_SCALE=grad_scale is not None, HAS_FOUND_INF=found_inf is not None,
        SCALARS_STRIDE=_SCALARS_WIDTH if scalars_.dim() == 2 else 0, STATE_IN_TABLE=not stored, ALIGNED=aligned,
        ROWS=rows, CVT=not interpreted(),
        NB=_blocks_per_tile(), BLOCK_=BLOCK, CHUNK_=CHUNK, num_warps=NUM_WARPS, enable_fp_fusion=False)


def encode_uint8(name: str, x: Tensor, seed: int) -> Tuple[Tensor, Tensor]:
    """``x`` (float32, whole blocks, one parameter from position 0) encoded as ``name``'s uint8 moment by the
    kernel's encoder with the random bits of step ``seed``: (codes, scales). The test suite compares it
    with :mod:`halfadam.encodings`."""
    n = x.numel()
    codes = torch.zeros(n, dtype=torch.uint8, device=x.device)
    scale = torch.zeros(n // BLOCK, dtype=torch.uint8, device=x.device)
    seed = int(seed) & 0xFFFFFFFF
    seed_t = torch.tensor([seed - (1 << 32) if seed >= 1 << 31 else seed], dtype=torch.int32, device=x.device)
    nb = _blocks_per_tile()
    _uint8_kernel[(-(-n // (nb * BLOCK)),)](x, codes, scale, seed_t, IS_EXP_AVG=name == "exp_avg", ENCODE=True,
                                            N=n, NB=nb, BLOCK_=BLOCK, num_warps=NUM_WARPS,
                                            enable_fp_fusion=False)
    return codes, scale


def divide_by_coefficient(x: Tensor, c: float) -> Tensor:
    """The kernel's ``x / c`` for the step's ``sqrt_bias_correction2`` ``c`` (float32 ``x``; tests)."""
    out = torch.empty_like(x)
    c_t = torch.tensor([c], dtype=torch.float32, device=x.device)
    _divide_kernel[(-(-x.numel() // 1024),)](x, out, c_t, N=x.numel(), BLOCK_=1024, enable_fp_fusion=False)
    return out


def decode_uint8(name: str, codes: Tensor, scale: Tensor) -> Tensor:
    """The kernel's decoder of ``name``'s uint8 codes over their blocks' scales (float32)."""
    n = codes.numel()
    out = torch.zeros(n, dtype=torch.float32, device=codes.device)
    nb = _blocks_per_tile()
    _uint8_kernel[(-(-n // (nb * BLOCK)),)](out, codes, scale, scale, IS_EXP_AVG=name == "exp_avg", ENCODE=False,
                                            N=n, NB=nb, BLOCK_=BLOCK, num_warps=NUM_WARPS,
                                            enable_fp_fusion=False)
    return out
