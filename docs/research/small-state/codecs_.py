"""Candidate encodings of AdamW state beside a bf16 parameter (pure torch quantize/dequantize).

Masters  M16  exact fp32 (compact's split: bf16 param + int16 remainder; prototyped as an fp32 copy)
         M8sr bf16 param + int8 correction c, master = p + c * ulp(p) / 256, c stochastically rounded
         M8rn the same, c rounded to nearest (FlashOptim's kind of correction)
exp_avg  m8   compact's 8-bit tapered codes (halfadam.encodings, its hash bits)
         m4   sign + 3-bit log2 magnitude (levels 2^(E-5)..2^(E+1), E = the block max's exponent; below
              the lowest level linear to 0), stochastic rounding unbiased in value; uint8 E per block
exp_avg_sq V8 compact's 8-bit tapered codes
         V4log<s> 4 bits: 0 = zero, 15 levels s octaves apart, the top one 2^(E+1) over the block max's
              exponent E, value-unbiased stochastic rounding between levels, a nonzero v below the
              lowest level goes UP to it (never 0); uint8 E per block
         Vfac Adafactor-style factored v for rows x cols (fp32 EMAs of row and column means of g^2,
              v = r c^T / mean(r)); one fp32 per row and per column
Blocks are 128 consecutive elements of a row (rows = dim 0), a row's short last block counted as one.
"""
from __future__ import annotations

import math

import torch

from halfadam import encodings as E

BLOCK = 128


# ------------------------------------------------------------------ layout
def to_blocks(x: torch.Tensor) -> torch.Tensor:
    """(rows, L) -> (rows * ceil(L/128), 128), zero padded."""
    rows = x.shape[0]
    x2 = x.reshape(rows, -1)
    L = x2.shape[1]
    pad = -L % BLOCK
    if pad:
        x2 = torch.nn.functional.pad(x2, (0, pad))
    return x2.reshape(-1, BLOCK)


def from_blocks(b: torch.Tensor, shape) -> torch.Tensor:
    rows = shape[0]
    L = math.prod(shape[1:])
    return b.reshape(rows, -1)[:, :L].reshape(shape)


def n_blocks(shape) -> int:
    return shape[0] * -(-math.prod(shape[1:]) // BLOCK)


# ------------------------------------------------------------------ masters
def _unit(pf: torch.Tensor) -> torch.Tensor:
    """ulp(bf16 value) / 256 = 2^(e - 7 - 8) for |p| in [2^e, 2^(e+1)) (tiny values: clamped)."""
    e = (pf.view(torch.int32) >> 23) & 0xFF
    return ((torch.clamp(e, min=16) - 15) << 23).view(torch.float32)


def master8_encode(w: torch.Tensor, stochastic: bool, gen: torch.Generator | None):
    p = w.to(torch.bfloat16)
    pf = p.float()
    r = (w - pf) / _unit(pf)
    u = torch.rand(w.shape, generator=gen) if stochastic else None
    c = torch.floor(r + u) if stochastic else torch.round(r)
    over = c > 127  # within 1/256 ulp below the next bf16 value: correct from that one instead
    if over.any():
        bits = pf.view(torch.int32)
        nxt = torch.where(pf > 0, bits + 65536, bits - 65536).view(torch.float32)  # next value up
        pf = torch.where(over, nxt, pf)
        r = (w - pf) / _unit(pf)
        c = torch.where(over, torch.floor(r + u) if stochastic else torch.round(r), c)
        p = pf.to(torch.bfloat16)
    return p, c.clamp(-128, 127).to(torch.int8)


def master8_decode(p: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    pf = p.float()
    return pf + c.float() * _unit(pf)


# ------------------------------------------------------------------ compact's 8-bit moments
def compact8_encode(name: str, x: torch.Tensor, step: int):
    b = to_blocks(x)
    flat = b.reshape(-1)
    st = {name: torch.empty(flat.numel(), dtype=torch.uint8), f"{name}_scale": torch.empty(b.shape[0], dtype=torch.uint8)}
    bits = E._random_bits(torch.arange(flat.numel(), dtype=torch.int64), torch.tensor(step, dtype=torch.int64))
    E._encode_moment_(torch.uint8, name, flat.contiguous(), st, bits)
    return st


def compact8_decode(name: str, st, shape) -> torch.Tensor:
    return from_blocks(E._decode_moment(torch.uint8, name, st).view(-1, BLOCK), shape)


# ------------------------------------------------------------------ 4-bit log2 codes
def _block_exp(a: torch.Tensor) -> torch.Tensor:
    """Per block (rows of a), floor(log2(max)) as float (0 for zero blocks; uint8 storable in bias form)."""
    mx = a.amax(dim=1, keepdim=True)
    return torch.where(mx > 0, torch.floor(torch.log2(torch.where(mx > 0, mx, 1.0))), 0.0)


def log4_encode(x: torch.Tensor, *, signed: bool, step_octaves: float, levels: int, up_at_bottom: bool,
                gen: torch.Generator):
    """Codes 0..levels (0 = zero): level k = 2^(E + 1 - s (levels - k)). Returns (k int8, sign, E)."""
    b = to_blocks(x)
    a = b.abs()
    e = _block_exp(a)
    s = step_octaves
    j = torch.floor((torch.log2(torch.where(a > 0, a, 1.0)) - (e + 1)) / s)  # level index below a (<= 0)
    j = torch.where(a > 0, j, -1e9).clamp(min=1 - levels, max=-1)  # j = k - levels
    lo = torch.exp2(e + 1 + s * j)
    k_lo = j + levels  # 1..levels-1 (a below the lowest level: bottom)
    bottom = (a < lo) | (a == 0)
    hi = torch.where(bottom, lo, lo * 2.0 ** s)
    lo = torch.where(bottom, 0.0, lo)
    prob = ((a - lo) / (hi - lo)).clamp(0, 1)
    up = torch.rand(a.shape, generator=gen) < prob
    k = torch.where(bottom, up.float(), k_lo + up.float())  # bottom: 0 or the lowest level
    if up_at_bottom:
        k = torch.where(a > 0, k.clamp(min=1), 0.0)
    k = k.clamp(max=levels)
    return k.to(torch.int8), (b < 0) if signed else None, e


def log4_decode(k, sign, e, shape, *, step_octaves: float, levels: int) -> torch.Tensor:
    kf = k.float()
    v = torch.where(kf > 0, torch.exp2(e + 1 - step_octaves * (levels - kf)), 0.0)
    if sign is not None:
        v = torch.where(sign, -v, v)
    return from_blocks(v, shape)


# ------------------------------------------------------------------ bytes
def state_bytes(shape, master: str, m: str, v: str) -> float:
    """Bytes of one bf16 parameter's state in a prototype format (the step count aside). 1-D
    parameters keep an fp32 master and fp32 moments (12 B), as compact does."""
    n = math.prod(shape)
    if len(shape) < 2:
        return 12.0 * n
    nb = n_blocks(shape)
    total = {"M16": 2 * n + nb, "M8sr": n, "M8rn": n, "M32": 4 * n}[master]  # M16: + compact's tie byte
    total += n * elem_bytes(m) + nb if m in TAPER else {"m8": n + nb, "m4": n / 2 + nb, "m32": 4 * n}[m]
    if v in TAPER:
        total += n * elem_bytes(v) + nb
    elif v.startswith("V4log"):
        total += n / 2 + nb
    else:
        total += {"V8": n + nb, "V32": 4 * n, "Vfac": 4 * (shape[0] + n // shape[0])}[v]
    return total


# ------------------------------------------------------------------ narrower tapered codes (round 2)
# compact's 8-bit construction (halfadam.encodings' _TIERS / _tier_table / _encode_magnitude) with
# fewer mantissa bits: per block of 128 one uint8 exponent (the block max's binade is the top one),
# per element a small float over unit = 2^(E - binades + 1): tiers of (mantissa bits, binades) from
# the smallest values up, the lowest tier's 2^m0 linear subnormals below unit (k unit / 2^m0; with
# m0 = 0 only the zero code), the value just above the top binade (2^binades unit) the last code;
# two more codes are reserved per moment for nan and inf (as compact's), so a b-bit magnitude has
# at most 2^b - 2 codes. Stochastic rounding unbiased in value between neighbouring levels; a
# nonzero exp_avg_sq never rounds to 0 (it takes the first nonzero code, as compact's). exp_avg:
# a sign bit + (b - 1) magnitude bits. Implemented in value space (a level table and searchsorted),
# not with compact's bit shifts: the levels are the same for compact's own tiers (TAPER "m8t", "V8t").
TAPER = {
    # name: (magnitude bits, tiers)        codes used / binades
    "m8t": (7, ((2, 8), (3, 3), (4, 4))),  # compact's exp_avg (125 codes, 15 binades)
    "V8t": (8, ((2, 8), (3, 11), (4, 8))),  # compact's exp_avg_sq (253 codes, 27 binades)
    "m7": (6, ((0, 4), (1, 6), (2, 4), (3, 3))),  # 58 codes, 17 binades
    "m6": (5, ((0, 8), (1, 6), (2, 2))),  # 30 codes, 16 binades
    "m6b": (5, ((0, 4), (1, 6), (2, 3))),  # 30 codes, 13 binades, 2 bits in the top 3
    "m5": (4, ((0, 8), (1, 2))),  # 14 codes, 10 binades
    "v7": (7, ((1, 8), (2, 10), (3, 8))),  # 123 codes, 26 binades
    "v6": (6, ((0, 12), (1, 8), (2, 8))),  # 62 codes, 28 binades
    "v6b": (6, ((0, 4), (1, 8), (2, 6), (3, 2))),  # 62 codes, 20 binades, 3 bits in the top 2
    "v5": (5, ((0, 14), (1, 7))),  # 30 codes, 21 binades
    "v5b": (5, ((0, 8), (1, 6), (2, 2))),  # 30 codes, 16 binades, 2 bits in the top 2
}


def taper_levels(tiers) -> tuple[torch.Tensor, int]:
    """The code levels in units of unit (float64, ascending, code k = index k), and the binades."""
    m0 = tiers[0][0]
    lv = [k / 2 ** m0 for k in range(2 ** m0)]
    r0 = 0
    for m, nb in tiers:
        for r in range(r0, r0 + nb):
            lv += [2.0 ** r * (1 + j / 2 ** m) for j in range(2 ** m)]
        r0 += nb
    lv.append(2.0 ** r0)
    return torch.tensor(lv, dtype=torch.float64), r0


for _n, (_bits, _tiers) in TAPER.items():
    assert len(taper_levels(_tiers)[0]) <= 2 ** _bits - 2, _n


def taper_encode(x: torch.Tensor, spec: str, *, signed: bool, gen: torch.Generator):
    bits, tiers = TAPER[spec]
    levels, R = taper_levels(tiers)
    levels = levels.float()
    b = to_blocks(x)
    a = b.abs()
    e = _block_exp(a)  # floor(log2(block max)); 0 for zero blocks
    unit = torch.exp2(e - (R - 1))
    r = a / unit  # < 2^R
    i = (torch.searchsorted(levels, r.contiguous(), right=True) - 1).clamp(0, len(levels) - 2)
    lo, hi = levels[i], levels[i + 1]
    prob = ((r - lo) / (hi - lo)).clamp(0, 1)
    k = i + (torch.rand(r.shape, generator=gen) < prob).long()
    if not signed:
        k = torch.where(a > 0, k.clamp(min=1), 0)
    return k.to(torch.uint8), (b < 0) if signed else None, e


def taper_decode(k, sign, e, shape, spec: str) -> torch.Tensor:
    levels, R = taper_levels(TAPER[spec][1])
    v = levels.float()[k.long()] * torch.exp2(e - (R - 1))
    if sign is not None:
        v = torch.where(sign, -v, v)
    return from_blocks(v, shape)


def elem_bytes(spec: str) -> float:
    """Bytes per element of a moment code, packed (b bits = b / 8 B; e.g. 6 bits: 4 codes in 3 bytes)."""
    if spec in TAPER:
        return (TAPER[spec][0] + (1 if spec.startswith("m") else 0)) / 8
    return {"m8": 1, "V8": 1, "m4": 0.5}[spec]
