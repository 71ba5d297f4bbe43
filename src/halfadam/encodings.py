"""How the optimizer state is stored: one encoding per state kind, each stated once.

A :class:`StateFormat` names the encoding of each kind of per-parameter state. The step is always:
decode what the math needs to float32, run :func:`halfadam.functional.adam_elementwise_`, encode the
results back (:func:`encoded_update_`); every execution (reference, foreach, fused) runs that same
composition, so no execution carries its own copy of an encoding.

Bytes of state per parameter element (the ``step`` counter aside), by encoding:

=================  =================================  =================  ======================================
state              encoding (stored keys)              bytes / element    exact?
=================  =================================  =================  ======================================
master weight      ``"fp32"``: ``master_weight``        4                  yes
master weight      ``"split"``: ``master_hi`` (int8),   2 + 1/128          bf16: yes, bit for bit; fp16: yes for
                   ``master_lo`` (uint8): a 16-bit                        masters in fp16's normal range (one
                   remainder; ``master_tie`` (uint8                       tie per block, see below)
                   per block)
exp_avg            ``float32``: ``exp_avg``             4                  yes
exp_avg            ``bfloat16``                         2                  no: stochastic rounding
exp_avg            ``uint8``: codes + ``exp_avg_absmax``  1 + 4/128        no: dynamic tree, nearest
exp_avg_sq         ``float32`` / ``bfloat16``           4 / 2              yes / no (stochastic rounding)
exp_avg_sq         ``uint8``: codes + ``..._absmax``      1 + 4/128        no: log2 levels, stochastic rounding
=================  =================================  =================  ======================================

Presets (:data:`PRESETS`), for a float16/bfloat16 parameter: ``"fp32"`` 12 B (the default),
``"split"`` 10.01 B, ``"bf16"`` 6.01 B, ``"compact"`` 4.07 B. float32 parameters have no master
(the parameter is the weight) and use the moment encodings; float64 parameters keep float64 state.

The encodings:

* **split master** (Megatron's ``store_param_remainders``): the fp32 master is the parameter plus a
  16-bit remainder. bfloat16 is the upper half of float32, so for a bf16 parameter the remainder is
  the difference of bit patterns, ``master_bits - param_bits * 2**16`` in [-2**15, 2**15]; the
  parameter stays ``round(master)`` (nearest even). One value does not fit an int16: the tie
  ``+2**15`` (the master exactly halfway above an even parameter). Each block of 128 elements has
  one byte ``master_tie`` = 1 + the index of its first such element (0: none); that element stores
  ``-2**15`` and decodes with ``+2**16``. A second tie in the same block stores ``2**15 - 1`` (the
  master moves by one fp32 ulp); with random low bits two ties meet in a block about
  C(128, 2) * 2**-34 ~ 2**-21 times per block and step, more often when equal weights take identical
  steps (the first step from a constant initialisation). For float16 parameters the remainder is
  ``(master - param) / ulp(param) * 2**16``, rounded: exact while the master is in fp16's normal
  range (fp32 has 13 more significant bits than fp16); below 2**-14 its absolute error is at most
  2**-41; a master beyond fp16's range is lost with the parameter (inf). No remainder is kept over a
  parameter of +-0 or +-inf (either dtype): a master that rounds to zero (|m| <= 2**-25 in float16,
  2**-134 in bfloat16) or to an infinity is that zero or infinity, so that a zero or an infinity
  written to the parameter is exactly what the fp32 state would hold (the stored remainder over a
  nan or an infinity is 0).
  Writes to the parameter: the split cannot see them. The decoded master is the written value plus
  the old remainder (within half an ulp of it); where that does not round to the parameter (nan, or
  a zero of the other sign) or the written value is +-0, nan or +-inf, the parameter's value is
  taken (the master-sync rule of :mod:`halfadam.functional`). :func:`set_master_`
  (``load_master_state_dict``) and checkpoint loads set exact masters. A dtype change keeps the
  master where the conversion kept the parameter's value (``AdamW._conform_state``):
  ``model.float()`` makes each parameter its master, bit for bit; fp16 -> bf16 restarts it from the
  parameter (the remainder was over the fp16 value).
* **bfloat16 moments**: stochastic rounding (add 16 random bits to the fp32 pattern, truncate):
  unbiased in value. Nearest rounding would freeze ``exp_avg_sq``: its per-step decay
  ``1 - beta2`` is below half a bf16 step.
* **uint8 moments**, block-wise with one fp32 absmax per block of 128 (Dettmers et al., "8-bit
  Optimizers via Block-wise Quantization", ICLR 2022). ``exp_avg``: Dettmers' signed dynamic tree
  map (bitsandbytes' ``create_dynamic_map``), nearest code (ties to the smaller magnitude).
  ``exp_avg_sq``: code 0 is 0, codes 1..255 are ``absmax * 2**(-24 * (255 - c) / 254)`` (24 octaves,
  log-spaced), stochastic rounding unbiased in value between the largest level ``<= v`` and the next
  one, and a nonzero value never encodes to 0 (it would make ``m / sqrt(v)`` explode); values below
  the range take code 1. Both are defined by exact float32 comparisons with their tables: the
  ``log10``/``log2`` that find the code only estimate it, so their rounding changes no code, and the
  C++ kernel writes the same bytes. Chosen on measurements (``docs/research/compact-state``):
  Dettmers' unsigned map and linear maps for ``exp_avg_sq`` lost 20-109% of validation loss on the
  digits task.

Random bits are a hash of the element's position in its parameter (its index in the flattened
parameter), the step and the state kind (no generator state, nothing computed): every execution
draws the same bits, float32 values that differ by an ulp between two executions round with the
same bits, a resumed run continues bitwise, and a shard that knows its offset draws its elements'
bits. (Elements at the same position of two parameters of one step draw the same bits.)

Non-finite values (a nan or inf gradient, an overflowing ``g * g``): bfloat16 moments keep them
(stochastic rounding of nan is nan, of inf is inf). A uint8 block that holds one is flagged by
the sign bit of its stored absmax (the absmax of its finite values, so the rest of the block keeps
its precision); in a flagged block reserved codes hold them (``exp_avg``: the map's values nearest
zero, indices 126, 128, 129, mean -inf, +inf, nan; ``exp_avg_sq``: codes 1, 2 mean +inf, nan) and
the finite values that would take those codes take 0.0 (``exp_avg``, an error below 6e-6 of the
absmax) or code 3 (``exp_avg_sq``). Blocks without one are stored exactly as before.

Layout: per-element keys have the parameter's shape. Blocks are 128 consecutive elements of the
flattened parameter and never straddle a row (an index of dim 0): the per-block encodings apply only
to parameters whose rows hold whole blocks (:func:`rows_fit_blocks`; others store those fields in
float32, :func:`for_param`), and per-block keys (``*_absmax``, ``master_tie``) have the shape
``(rows, blocks per row)`` (:func:`block_shape`), so FSDP2 shards them with the parameter's rows and a
shard's state is exactly the unsharded state's rows, on any number of ranks; no padding anywhere.
In flat buckets each parameter starts at a multiple of 128 (:mod:`halfadam.buckets`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Union

import torch
from torch import Tensor

from ._dtensor import like_param, like_rows, zeros_like_rows
from .functional import adam_elementwise_, sync_master_, written

__all__ = ["BLOCK", "PRESETS", "StateFormat", "state_format", "element_keys", "block_keys", "new_state",
           "decode_state", "encode_state_", "encoded_update_", "update_param_", "tables", "bytes_per_element", "for_param",
           "rows_fit_blocks", "block_shape",
           "format_of", "convert_state"]

#: Elements per quantization block (per-block keys have one entry per block).
BLOCK = 128

MASTER_ENCODINGS = ("fp32", "split")
MOMENT_DTYPES = (torch.float32, torch.bfloat16, torch.uint8)
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class StateFormat:
    """The encoding of each kind of state: ``master`` ("fp32" or "split"), ``exp_avg`` and
    ``exp_avg_sq`` (torch.float32, torch.bfloat16 or torch.uint8)."""

    master: str = "fp32"
    exp_avg: torch.dtype = torch.float32
    exp_avg_sq: torch.dtype = torch.float32

    @property
    def stochastic(self) -> bool:
        """Whether some moment rounds stochastically (bfloat16 moments, uint8 ``exp_avg_sq``)."""
        return self.exp_avg == torch.bfloat16 or self.exp_avg_sq != torch.float32

    @property
    def blocked(self) -> bool:
        """Whether flat buffers start each parameter at a multiple of BLOCK: some key is per block, or
        the random bits need each element's position in its parameter (:func:`positions`)."""
        return self.master == "split" or torch.uint8 in (self.exp_avg, self.exp_avg_sq) or self.stochastic

    @property
    def is_fp32(self) -> bool:
        return self == StateFormat()

    def describe(self) -> str:
        name = {v: k for k, v in PRESETS.items()}.get(self)
        dt = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.uint8: "uint8"}
        parts = f"master={self.master}, exp_avg={dt[self.exp_avg]}, exp_avg_sq={dt[self.exp_avg_sq]}"
        return f"{name!r} ({parts})" if name else parts


#: The state modes reachable with one argument (``state_mode=``).
PRESETS: Dict[str, StateFormat] = {
    "fp32": StateFormat(),
    "split": StateFormat("split"),
    "bf16": StateFormat("split", torch.bfloat16, torch.bfloat16),
    "compact": StateFormat("split", torch.uint8, torch.uint8),
}


def state_format(state_mode: str = "fp32", *, store_param_remainders: Optional[bool] = None,
                 exp_avg_dtype: Optional[torch.dtype] = None,
                 exp_avg_sq_dtype: Optional[torch.dtype] = None) -> StateFormat:
    """The :class:`StateFormat` of a preset, with any of its fields overridden (Megatron's names).

    Raises:
        ValueError: an unknown preset, or a dtype not in (float32, bfloat16, uint8).
        TypeError: ``store_param_remainders`` not a bool.
    """
    if not isinstance(state_mode, str) or state_mode not in PRESETS:
        raise ValueError(f"state_mode must be one of {tuple(PRESETS)}, got {state_mode!r}")
    fmt = PRESETS[state_mode]
    master = fmt.master
    if store_param_remainders is not None:
        if not isinstance(store_param_remainders, bool):
            raise TypeError(f"store_param_remainders must be None, True or False, got {store_param_remainders!r}")
        master = "split" if store_param_remainders else "fp32"
    dtypes = []
    for name, value, default in (("exp_avg_dtype", exp_avg_dtype, fmt.exp_avg),
                                 ("exp_avg_sq_dtype", exp_avg_sq_dtype, fmt.exp_avg_sq)):
        if value is None:
            value = default
        if value not in MOMENT_DTYPES:
            raise ValueError(f"{name} must be one of torch.float32, torch.bfloat16, torch.uint8 (8-bit block-wise), "
                             f"got {value!r}")
        dtypes.append(value)
    return StateFormat(master, *dtypes)


def rows_fit_blocks(shape: Tuple[int, ...]) -> bool:
    """Whether a parameter of ``shape`` can keep per-block state: it has a dim 0 (the dim FSDP2
    shards) and every index of it, a *row*, holds a whole number of blocks (the product of the other
    dims a positive multiple of BLOCK). Blocks then never straddle a row, so no shard of whole rows, on
    any number of ranks, cuts one: the encoded state does not depend on the sharding. (A shard of
    whole rows, even an empty one, gets the answer of its whole parameter.)"""
    row = math.prod(shape[1:])
    return len(shape) >= 2 and row > 0 and row % BLOCK == 0


def block_shape(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    """The shape of the per-block keys of a parameter of ``shape``: ``(rows, blocks per row)`` where
    :func:`rows_fit_blocks` (sharded with the parameter's rows), else ``(ceil(numel / BLOCK),)``
    (the layout of checkpoints written before 2026-12-01, read for conversion)."""
    if rows_fit_blocks(shape):
        return (shape[0], math.prod(shape[1:]) // BLOCK)
    return (n_blocks(math.prod(shape)),)


def for_param(fmt: StateFormat, param: Tensor, use_master: bool) -> StateFormat:
    """The format that applies to ``param``: float64 keeps float32 -> float64 state (fp32 format);
    no master for float32 parameters or with master weights off (``master`` then means nothing).

    The per-block encodings (a split master, uint8 moments) need rows of whole blocks
    (:func:`rows_fit_blocks`); a parameter without them (1-D: biases, norm weights; rows of 64 or 200
    elements) stores those fields in float32 (an fp32 master, float32 moments), as bitsandbytes keeps
    32-bit state for small tensors. So a parameter's format depends on its shape, never on how it is
    sharded."""
    if param.dtype == torch.float64:
        return StateFormat()
    master = fmt.master if use_master and param.dtype in _HALF else "fp32"
    exp_avg, exp_avg_sq = fmt.exp_avg, fmt.exp_avg_sq
    if not rows_fit_blocks(tuple(param.shape)):
        master = "fp32"
        exp_avg, exp_avg_sq = (torch.float32 if dt == torch.uint8 else dt for dt in (exp_avg, exp_avg_sq))
    return StateFormat(master, exp_avg, exp_avg_sq)


#: Every per-element state key of any encoding (besides ``step``), and every per-block one.
ELEMENT_KEYS = ("master_weight", "master_hi", "master_lo", "exp_avg", "exp_avg_sq")
BLOCK_KEYS = ("master_tie", "exp_avg_absmax", "exp_avg_sq_absmax")


@functools.lru_cache(maxsize=None)
def element_keys(fmt: StateFormat, has_master: bool) -> Dict[str, torch.dtype]:
    """The per-element state keys of ``fmt`` and their dtypes (the parameter's shape)."""
    keys: Dict[str, torch.dtype] = {}
    if has_master:
        keys.update({"master_weight": torch.float32} if fmt.master == "fp32"
                    else {"master_hi": torch.int8, "master_lo": torch.uint8})
    keys["exp_avg"] = fmt.exp_avg
    keys["exp_avg_sq"] = fmt.exp_avg_sq
    return keys


@functools.lru_cache(maxsize=None)
def block_keys(fmt: StateFormat, has_master: bool) -> Dict[str, torch.dtype]:
    """The per-block state keys of ``fmt`` and their dtypes (1-D, one entry per BLOCK elements)."""
    keys: Dict[str, torch.dtype] = {}
    if has_master and fmt.master == "split":
        keys["master_tie"] = torch.uint8
    for name, dtype in (("exp_avg", fmt.exp_avg), ("exp_avg_sq", fmt.exp_avg_sq)):
        if dtype == torch.uint8:
            keys[f"{name}_absmax"] = torch.float32
    return keys


def bytes_per_element(fmt: StateFormat, has_master: bool = True) -> float:
    """State bytes per parameter element (per-block keys spread over their BLOCK elements)."""
    size = lambda dt: torch.empty((), dtype=dt).element_size()  # noqa: E731
    return (sum(size(dt) for dt in element_keys(fmt, has_master).values())
            + sum(size(dt) for dt in block_keys(fmt, has_master).values()) / BLOCK)


def n_blocks(numel: int) -> int:
    return -(-numel // BLOCK)


# ---------------------------------------------------------------------------------- random bits
_MASK32 = 0xFFFFFFFF


def _random_bits(position: Tensor, seed: Tensor, salt: int) -> Tensor:
    """32 pseudo-random bits (int64 in [0, 2**32)) per element: a hash of the element's ``position``
    in its parameter (int64, the index in the flattened parameter), the 0-d int64 ``seed`` (the
    step) and ``salt`` (the state kind); three xor-shift-multiply rounds (the "lowbias32" family)
    with multipliers below 2**31, so int64 products never overflow.

    The bits depend on nothing computed: implementations whose float32 values differ by an ulp (an
    eager and a compiled ``sqrt``) draw the same bits, and so do a resumed run and a sharded one."""
    h = (position & _MASK32) ^ ((seed * 0x27D4EB2F + salt) & _MASK32)
    h = ((h ^ (h >> 16)) * 0x7FEB352D) & _MASK32
    h = ((h ^ (h >> 15)) * 0x2C1B3C6D) & _MASK32
    h = ((h ^ (h >> 16)) * 0x297A2D39) & _MASK32
    return h ^ (h >> 15)


#: The key of the per-block int32 index of each block within its parameter, passed to
#: :func:`encoded_update_` with the state (not stored in it): element ``lane`` of block ``b`` is at
#: position ``block_index[b] * BLOCK + lane``. Without it the flat tensors hold one parameter from 0.
BLOCK_INDEX = "block_index"


#: The key of per-element int64 positions passed with the state instead (a shard of a parameter).
POSITION = "position"


def positions(stored: Dict[str, Tensor], n: int, device: torch.device) -> Tensor:
    """Each of ``n`` flat elements' position in its parameter (int64): ``stored[POSITION]``, else from
    ``stored[BLOCK_INDEX]``, else ``0 .. n - 1``."""
    if POSITION in stored:
        return stored[POSITION]
    index = stored.get(BLOCK_INDEX)
    if index is None:
        return torch.arange(n, dtype=torch.int64, device=device)
    lane = torch.arange(BLOCK, dtype=torch.int64, device=device)
    return (index.to(torch.int64).view(-1, 1) * BLOCK + lane).view(-1)


def random_seed(fmt: StateFormat, step: Union[int, float, Tensor], device: torch.device) -> Optional[Tensor]:
    """The random bits' seed (the step, 0-d int64 on ``device``), or ``None`` when ``fmt`` draws none
    (only bfloat16 and uint8 ``exp_avg_sq``/bfloat16 ``exp_avg`` round stochastically)."""
    if not fmt.stochastic:
        return None
    if isinstance(step, Tensor):
        return step.to(device=device, dtype=torch.int64)
    return torch.tensor(int(step), dtype=torch.int64, device=device)


def _uniform(position: Tensor, seed: Tensor, salt: int) -> Tensor:
    """A float32 in [0, 1) per element (24 random bits)."""
    return (_random_bits(position, seed, salt) >> 8).to(torch.float32) * (1.0 / (1 << 24))


# ---------------------------------------------------------------------------------- constants
def dynamic_map(signed: bool = True) -> Tensor:
    """Dettmers' dynamic tree map (bitsandbytes ``create_dynamic_map``, 7 exponent bits): 256 sorted
    float32 values in [-1, 1]. Decade ``i`` (values in [0.1, 1] * 10**(i - 6)) holds ``2**i`` linear levels."""
    data = []
    for i in range(7):
        items = 2 ** i + 1 if signed else 2 ** (i + 1) + 1
        bounds = torch.linspace(0.1, 1, items, dtype=torch.float64)
        means = ((bounds[:-1] + bounds[1:]) / 2 * 10.0 ** (i - 6)).tolist()
        data += means + ([-x for x in means] if signed else [])
    data += [0.0, 1.0]
    data += [0.0] * (256 - len(data))
    return torch.tensor(sorted(data), dtype=torch.float32)


#: The index of 0.0 in the sorted signed dynamic map; ``exp_avg`` stores ``(index - _DYN_ZERO) mod 256``
#: so that zero-filled state (new, or the padding after a parameter) decodes to 0.
_DYN_ZERO = 127

#: log2 octaves spanned by the uint8 exp_avg_sq levels below each block's absmax.
V_OCTAVES = 24.0


def tables(fmt: StateFormat, device: torch.device) -> Optional[Tuple[Tensor, Tensor, Tensor]]:
    """The uint8 moments' lookup tables on ``device`` (cached), or ``None`` when ``fmt`` has none:
    (dynamic map, its decades' scales ``10**(i - 6)``, exp_avg_sq levels)."""
    if torch.uint8 not in (fmt.exp_avg, fmt.exp_avg_sq):
        return None
    found = _CONSTANTS.get(device)
    if found is None:
        dyn = dynamic_map(signed=True)
        codes = torch.arange(256, dtype=torch.float64)
        levels = torch.where(codes > 0, torch.exp2((codes - 255) * (V_OCTAVES / 254)), 0.0).float()
        decades = torch.tensor([10.0 ** (i - 6) for i in range(7)], dtype=torch.float32)
        found = _CONSTANTS[device] = tuple(t.to(device) for t in (dyn, decades, levels))
    return found


_CONSTANTS: Dict[torch.device, Tuple[Tensor, Tensor, Tensor]] = {}


# ---------------------------------------------------------------------------------- master weights
def _split_remainder(master: Tensor, param: Tensor) -> Tensor:
    """The remainder of ``master`` (fp32) over ``param`` (its rounding, fp16/bf16), int32 in [-2**15, 2**15];
    0 over a nan or an infinity (never decoded: the bytes are then the same on every execution, whatever
    nan pattern it writes)."""
    if param.dtype == torch.bfloat16:  # difference of bit patterns (same sign: the patterns' signs cancel)
        return torch.where(param.isfinite(), master.view(torch.int32) - _bits(param), 0)
    r = torch.round((master - param.to(torch.float32)) / _fp16_ulp(param) * 65536.0)
    return torch.where(param.isfinite(), r, 0.0).to(torch.int32)


# Bit manipulation goes through float32 and int32 (bf16 -> fp32 is exact, and a bf16 value's fp32
# pattern is its own followed by 16 zero bits): Inductor's CPU code generator vectorizes those, while a
# bitcast of a 16-bit float or any int16 load/store makes it emit scalar code (8-10x slower here); int64
# arithmetic was 2.3x slower than int32. The 16-bit remainder is stored as two byte planes for the
# same reason.
def _bits(param: Tensor) -> Tensor:
    """The float32 bit pattern of ``param``'s values (int32)."""
    return param.to(torch.float32).view(torch.int32)


def _fp16_ulp(param: Tensor) -> Tensor:
    """The spacing of float16 values at ``param`` (float32): 2**(max(e, -14) - 10) for |param| in [2**e, 2**(e+1))."""
    exponent = (param.to(torch.float32).view(torch.int32) >> 23) & 0xFF  # float32's biased exponent
    return ((torch.clamp(exponent, min=127 - 14) - 10) << 23).view(torch.float32)


def _split_decode(param: Tensor, hi: Tensor, lo: Tensor, tie: Tensor) -> Tensor:
    """The fp32 master from flat ``param`` (fp16/bf16), the remainder's bytes ``hi`` (int8) and ``lo``
    (uint8), and ``tie`` (uint8 per block).

    Where the decoded value does not round to ``param`` (the parameter was written and the old
    remainder no longer fits it; :func:`halfadam.functional.written`, the sign of a zero included)
    the parameter's value is taken (the master-sync rule), and so it is where ``param`` is +-0, nan
    or +-inf: a remainder over them is not kept (a zero written to the parameter, ``p.mul_(0)`` or a
    pruning mask, is then exactly the fp32 state's zero)."""
    lane = torch.arange(BLOCK, dtype=torch.int32, device=lo.device)
    flagged = (lane == tie.view(-1, 1).to(torch.int32) - 1).view(-1)
    r = hi.to(torch.int32) * 256 + lo.to(torch.int32) + flagged.to(torch.int32) * 65536
    p32 = param.to(torch.float32)
    if param.dtype == torch.bfloat16:
        # a stale remainder over a parameter written to +-0 can carry the pattern across the sign bit:
        # the result is then nan or of the other sign, and the check below takes the parameter
        master = (_bits(param) + r).view(torch.float32)
    else:
        master = p32 + r.to(torch.float32) * (_fp16_ulp(param) * (1.0 / 65536))
    return torch.where(written(param, master) | ~p32.isfinite() | (p32 == 0), p32, master)


def _split_encode_(master: Tensor, param: Tensor, hi: Tensor, lo: Tensor, tie: Tensor) -> None:
    """Write ``round(master)`` into ``param`` and the remainder into ``hi``/``lo``/``tie`` (flat, block-padded)."""
    rounded = master.to(param.dtype)
    param.copy_(rounded)
    r = _split_remainder(master, rounded).view(-1, BLOCK)
    is_tie = r == 32768
    lane = torch.arange(BLOCK, dtype=torch.int32, device=lo.device)
    first = torch.where(is_tie, lane, BLOCK).amin(dim=1, keepdim=True)
    tie.copy_(torch.where(first < BLOCK, first + 1, 0).view(-1).to(torch.uint8))
    r = torch.where(is_tie & (lane == first), -32768, r.clamp(-32768, 32767)).view(-1)
    hi.copy_((r >> 8).to(torch.int8))
    lo.copy_((r & 255).to(torch.uint8))


# ---------------------------------------------------------------------------------- moments
_SALT = {"exp_avg": 0x3C6EF372, "exp_avg_sq": 0x1B873593}


#: Codes that a block holding non-finite values (its stored absmax has the sign bit set) gives to
#: them, by index into the moment's table (dynamic map index for ``exp_avg``, the code for
#: ``exp_avg_sq``): values the block's finite elements then never take (they round to 0.0, or take
#: the next level up, an error below 2**-17 of the block's absmax).
_NONFINITE = {"exp_avg": ((128, math.inf), (126, -math.inf), (129, math.nan)),
              "exp_avg_sq": ((1, math.inf), (2, math.nan))}


def _nonfinite_codes(name: str, x: Tensor) -> Tensor:
    """The reserved code (table index) of each element of ``x`` as if it were non-finite: its
    :data:`_NONFINITE` entry, nan's for anything else (``exp_avg_sq`` has no -inf: a -inf is a nan)."""
    codes = torch.full_like(x, next(c for c, v in _NONFINITE[name] if math.isnan(v)), dtype=torch.int64)
    for code, value in _NONFINITE[name]:
        if not math.isnan(value):
            codes = torch.where(x == value, code, codes)
    return codes


def _decode_moment(dtype: torch.dtype, name: str, stored: Dict[str, Tensor], tables) -> Tensor:
    q = stored[name]
    if dtype == torch.float32:
        return q
    if dtype == torch.bfloat16:
        return q.to(torch.float32)
    if name == "exp_avg":
        table, index = tables[0], (q.to(torch.int64) + _DYN_ZERO) & 255
    else:
        table, index = tables[2], q.to(torch.int64)
    absmax = stored[f"{name}_absmax"].view(-1, 1)
    flagged = absmax.view(torch.int32) < 0  # the sign bit: this block holds non-finite values
    index = index.view(-1, BLOCK)
    values = table[index] * absmax.abs()
    for code, special in _NONFINITE[name]:
        values = torch.where(flagged & (index == code), special, values)
    return values.view(-1)


def _encode_moment_(dtype: torch.dtype, name: str, x: Tensor, stored: Dict[str, Tensor], tables,
                    seed: Tensor) -> None:
    """Encode float32 ``x`` (flat; a multiple of BLOCK long for uint8) into ``stored[name]`` (and its
    absmax), any float included: nan and +-inf decode as themselves (``exp_avg_sq``: -inf as nan)."""
    if dtype == torch.float32:
        return  # updated in place
    if dtype == torch.bfloat16:  # stochastic rounding: add 16 random bits below bf16's, truncate
        bits = x.view(torch.int32).to(torch.int64) + (
            _random_bits(positions(stored, x.numel(), x.device), seed, _SALT[name]) >> 16)
        truncated = ((bits >> 16) << 16).to(torch.int32).view(torch.float32)  # exactly a bf16 value (inf, nan kept)
        stored[name].copy_(truncated.to(torch.bfloat16))
        return
    blocks = x.view(-1, BLOCK)
    finite = blocks.isfinite()
    flagged = ~finite.all(dim=1, keepdim=True)  # the block holds nan or inf: reserved codes for them
    xf = torch.where(finite, blocks, 0.0)
    absmax = xf.abs().amax(dim=1, keepdim=True)  # over the finite values
    y = xf / torch.where(absmax > 0, absmax, 1.0)
    if name == "exp_avg":
        index = _dynamic_nearest(y, tables[0], tables[1])
        reserved = functools.reduce(torch.logical_or, [index == c for c, _ in _NONFINITE[name]])
        index = torch.where(flagged & reserved, _DYN_ZERO, index)  # a flagged block's finite values: 0.0
        index = torch.where(finite, index, _nonfinite_codes(name, blocks))
        codes = (index - _DYN_ZERO) & 255  # stored so that code 0 is 0.0
    else:  # log2 levels; stochastic rounding unbiased in value; nonzero never to 0
        levels = tables[2]
        # lo: the largest code in 1..254 whose level is <= y (1 below the range), by exact comparisons
        # with the table: log2 only estimates it (within one code: 0.09 octave), so its rounding (an
        # eager, a compiled or the C++ kernel's log2) never changes a code
        # (a negative value, which no step makes but a loaded state may hold, encodes to 0 below)
        lo = torch.floor(255 + torch.log2(y.clamp(min=0)) * (254 / V_OCTAVES)).clamp(1, 254).to(torch.int64)
        lo = (lo + (levels[lo + 1] <= y).to(torch.int64) - (levels[lo] > y).to(torch.int64)).clamp(1, 254)
        lowest = 1 + max(c for c, _ in _NONFINITE[name])  # above the codes of inf and nan in a flagged block
        lo = torch.maximum(lo, torch.where(flagged, lowest, 1))
        v_lo, v_hi = levels[lo], levels[lo + 1]
        p = ((y - v_lo) / (v_hi - v_lo)).clamp(0, 1)
        u = _uniform(positions(stored, x.numel(), x.device).view(-1, BLOCK), seed, _SALT[name])
        # nonzero never to 0: test the value itself (v / absmax can underflow to 0 when absmax is huge)
        codes = torch.where(xf > 0, lo + (u < p).to(torch.int64), 0)
        codes = torch.where(finite, codes, _nonfinite_codes(name, blocks))
    stored[name].copy_(codes.view(-1).to(torch.uint8))
    stored[f"{name}_absmax"].copy_(torch.where(flagged, -absmax, absmax).view(-1))


def _dynamic_nearest(y: Tensor, dyn: Tensor, decades: Tensor) -> Tensor:
    """The index (int32) of the dynamic map's value nearest to ``y`` (in [-1, 1]), computed, not searched.

    The rule: for ``a = |y|``, the index ``j`` in 127..255 (the positive half) with the smallest
    float32 distance ``|dyn[j] - a|``; an exact tie goes to the lower index (the smaller magnitude);
    for ``y < 0`` the mirrored index ``max(254 - j, 0)``.

    The map's positive half is 0.0 (index 127), decade ``i`` = 0..6 at indices ``128 + 2**i - 1 + k``
    (``k`` < 2**i, value ``10**(i-6) * (0.1 + (k + 0.5) * 0.9 / 2**i)``) and 1.0 (255); the negative
    half mirrors it at ``254 - index`` (there is no -1.0). The decade and ``k`` come from
    ``log10(|y|)``: an index that is one of the two map values around ``a`` whatever ``log10``'s
    rounding, also at the decade boundaries; the rule is applied to it and its two neighbours (in
    rising order, a strict ``<``), which hold the two, so the result never depends on ``log10`` (the
    C++ kernel finds the decade by comparisons). (A search, ``torch.bucketize``, runs in Inductor as a
    separate ATen pass, 30x slower than the rest of the encoding on the CPU.)
    """
    a = y.abs()
    i = (torch.floor(torch.log10(a)) + 7).clamp(0, 6).to(torch.int32)  # decade i: [1e-7, 1e-6] * 10**i
    levels = (1 << i).to(torch.float32)  # 2**i levels in decade i
    k = torch.round((a / decades[i] - 0.1) * (levels / 0.9) - 0.5).clamp(min=0)
    k = torch.minimum(k, levels - 1).to(torch.int32)
    c = 127 + (1 << i) + k
    best = (c - 1).clamp(127, 255)  # the candidates in rising order, a strict "<": ties to the lower index
    best_err = (dyn[best] - a).abs()
    for step in (0, 1):
        other = (c + step).clamp(127, 255)
        err = (dyn[other] - a).abs()
        closer = err < best_err
        best, best_err = torch.where(closer, other, best), torch.where(closer, err, best_err)
    return torch.where(y < 0, (254 - best).clamp(min=0), best)


# ---------------------------------------------------------------------------------- the step
def encoded_update_(stored: Dict[str, Tensor], param: Optional[Tensor], grad: Tensor,
                    coefficients: Tuple[Tensor, ...], seed: Tensor, tables: Optional[Tuple[Tensor, ...]], *,
                    master: str, exp_avg: torch.dtype, exp_avg_sq: torch.dtype, decay: str,
                    optimized_update: bool) -> None:
    """One Adam step over flat, block-padded state: decode, :func:`adam_elementwise_`, encode.

    Args:
        stored: the state's flat tensors by key (:func:`element_keys`, :func:`block_keys`).
        param: the flat parameter values (fp16/bf16) when the parameter has a master: read (the
            master-sync rule), then written with the rounded new master. ``None``: ``stored`` has no
            master and the weight is ``stored["weight"]`` (float32, updated in place).
        grad: flat float32 gradient.
        coefficients, seed: :func:`halfadam.functional.adam_coefficients` (0-d tensors), and the step
            as a 0-d int64 tensor (the random bits' seed).
        tables: :func:`tables` of the device (``None`` without uint8 moments): passed in, so that a
            compiled caller neither builds nor captures them.
    Every tensor is 1-D with a length that is a multiple of BLOCK when the format is blocked.
    """
    if param is None:
        weight = stored["weight"]
    elif master == "fp32":
        weight = stored["master_weight"]
        sync_master_(weight, param)
    else:
        weight = _split_decode(param, stored["master_hi"], stored["master_lo"], stored["master_tie"])
    m = _decode_moment(exp_avg, "exp_avg", stored, tables)
    v = _decode_moment(exp_avg_sq, "exp_avg_sq", stored, tables)
    adam_elementwise_(weight, grad, m, v, *coefficients, decay=decay, optimized_update=optimized_update)
    _encode_moment_(exp_avg, "exp_avg", m, stored, tables, seed)
    _encode_moment_(exp_avg_sq, "exp_avg_sq", v, stored, tables, seed)
    if param is not None:
        if master == "fp32":
            param.copy_(weight)
        else:
            _split_encode_(weight, param, stored["master_hi"], stored["master_lo"], stored["master_tie"])


# ---------------------------------------------------------------------------------- per parameter
def new_state(fmt: StateFormat, param: Tensor, has_master: bool) -> Dict[str, Tensor]:
    """Fresh state tensors for ``param`` (zero moments, master from the parameter, zero remainders)."""
    state = {}
    for key, dtype in element_keys(fmt, has_master).items():  # *_like: a DTensor parameter gets DTensor state
        state[key] = (param.detach().to(torch.float32, copy=True) if key == "master_weight"
                      else torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format))
    for key, dtype in block_keys(fmt, has_master).items():
        state[key] = zeros_like_rows(param, block_shape(tuple(param.shape)), dtype)
    return state


def has_master(state: Dict[str, Tensor]) -> bool:
    """Whether ``state`` (a parameter's state, or flat buffers) holds a master weight, fp32 or split."""
    return "master_weight" in state or "master_lo" in state


def is_block_key(key: str) -> bool:
    """Whether state entry ``key`` is per block of BLOCK elements (else per element)."""
    return key in BLOCK_KEYS or key == BLOCK_INDEX


def slice_flat(stored: Dict[str, Tensor], a: int, b: int) -> Dict[str, Tensor]:
    """Elements ``a:b`` (multiples of BLOCK when some key is per block) of flat state buffers."""
    return {k: t[a // BLOCK:b // BLOCK] if is_block_key(k) else t[a:b] for k, t in stored.items()}


def _pad(t: Tensor, length: int, like: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """``t`` flattened into a new tensor of ``length`` elements on ``like``'s device, zero-padded."""
    flat = t.detach().reshape(-1).to(device=like.device, dtype=dtype or t.dtype)
    return torch.cat([flat, flat.new_zeros(length - flat.numel())]) if flat.numel() < length else flat.clone()


def _flat_copies(fmt: StateFormat, param: Tensor, state: Dict[str, Tensor]) -> Tuple[Dict[str, Tensor], Tensor]:
    """Flat, block-padded (with zeros) copies of ``state``'s tensors and of the parameter's values."""
    length = n_blocks(param.numel()) * BLOCK
    with_master = has_master(state)
    stored = {k: _pad(state[k], length, param) for k in element_keys(fmt, with_master)}
    stored.update({k: state[k].reshape(-1).clone() for k in block_keys(fmt, with_master)})
    return stored, _pad(param, length, param)


def _write_back(state: Dict[str, Tensor], stored: Dict[str, Tensor], param: Optional[Tensor],
                flat_param: Tensor) -> None:
    for key, t in stored.items():
        if key in state:
            state[key].copy_(t[:state[key].numel()].view(state[key].shape))
    if param is not None:
        param.detach().copy_(flat_param[:param.numel()].view(param.shape))


def _encode_master_(stored: Dict[str, Tensor], flat_param: Tensor, master: Tensor) -> None:
    """Store the flat float32 ``master`` (a tensor of its own, changed here): copied, or as a split
    remainder after the master-sync rule (where the parameter differs from ``round(master)`` the
    parameter wins), so the parameter keeps its value."""
    if "master_weight" in stored:
        stored["master_weight"].copy_(master)
    else:
        sync_master_(master, flat_param)
        _split_encode_(master, flat_param, stored["master_hi"], stored["master_lo"], stored["master_tie"])


def update_param_(fmt: StateFormat, param: Tensor, state: Dict[str, Tensor], grad: Tensor,
                  coefficients: tuple, step: int, *, decay: str, optimized_update: bool, offset: int = 0) -> None:
    """:func:`encoded_update_` for one parameter and its own (not flat) state tensors; ``offset``: the
    position of its first element in the whole parameter (a shard's, :func:`halfadam._dtensor.flat_offset`)."""
    stored, flat_param = _flat_copies(fmt, param, state)
    if fmt.stochastic:
        stored[POSITION] = torch.arange(offset, offset + flat_param.numel(), dtype=torch.int64, device=param.device)
    with_master = has_master(state)
    if not with_master:
        stored["weight"] = flat_param.to(torch.float32)
    g = _pad(grad, flat_param.numel(), param, torch.float32)
    encoded_update_(stored, flat_param if with_master else None, g, coefficients, random_seed(fmt, step, param.device),
                    tables(fmt, param.device), master=fmt.master, exp_avg=fmt.exp_avg, exp_avg_sq=fmt.exp_avg_sq,
                    decay=decay, optimized_update=optimized_update)
    if not with_master:
        flat_param.copy_(stored.pop("weight"))
    _write_back(state, stored, param, flat_param)


def decode_state(fmt: StateFormat, param: Tensor, state: Dict[str, Tensor],
                 names: Tuple[str, ...] = ("master_weight", "exp_avg", "exp_avg_sq")) -> Dict[str, Tensor]:
    """``state``'s master weight (when it has one), ``exp_avg`` and ``exp_avg_sq`` (those of ``names``) as
    new float32 tensors of the parameter's shape (a split master synced with ``param``, see
    :func:`_split_decode`)."""
    stored, flat_param = _flat_copies(fmt, param, state)
    tables_ = tables(fmt, param.device)
    out = {}
    if "master_weight" in names:
        if "master_weight" in stored:
            out["master_weight"] = stored["master_weight"]
        elif "master_lo" in stored and param.dtype in _HALF:
            out["master_weight"] = _split_decode(flat_param, stored["master_hi"], stored["master_lo"],
                                                 stored["master_tie"])
    for name, dtype in (("exp_avg", fmt.exp_avg), ("exp_avg_sq", fmt.exp_avg_sq)):
        if name in names:
            out[name] = _decode_moment(dtype, name, stored, tables_)
    n = param.numel()
    return {k: v[:n].reshape(param.shape).to(torch.float32, copy=True) for k, v in out.items()}


def encode_state_(fmt: StateFormat, param: Tensor, state: Dict[str, Tensor], values: Dict[str, Tensor],
                  step: float, offset: int = 0) -> None:
    """Encode float32 ``values`` (``master_weight`` when ``state`` has a master, ``exp_avg``,
    ``exp_avg_sq``; the parameter's shape) into ``state``'s tensors, in place. A split master keeps
    the master where the parameter equals its rounding and takes the parameter's value elsewhere
    (the master-sync rule), so the parameter is never changed. ``offset``: the position of the first
    element in the whole parameter (a shard's, as in :func:`update_param_`)."""
    stored, flat_param = _flat_copies(fmt, param, state)
    length = flat_param.numel()
    if fmt.stochastic:
        stored[POSITION] = torch.arange(offset, offset + length, dtype=torch.int64, device=param.device)
    seed, tables_ = random_seed(fmt, step, param.device), tables(fmt, param.device)
    for name, dtype in (("exp_avg", fmt.exp_avg), ("exp_avg_sq", fmt.exp_avg_sq)):
        x = _pad(values[name], length, param, torch.float32)
        stored[name].copy_(x) if dtype == torch.float32 else _encode_moment_(dtype, name, x, stored, tables_, seed)
    if has_master(stored):
        _encode_master_(stored, flat_param, _pad(values["master_weight"], length, param, torch.float32))
    _write_back(state, stored, None, flat_param)


def format_of(state: Dict[str, Tensor]) -> StateFormat:
    """The format a parameter's state was stored in, read off its keys and dtypes (checkpoints carry no
    other record). Raises ValueError for a moment dtype that is not an encoding."""
    dtypes = []
    for name in ("exp_avg", "exp_avg_sq"):
        dtype = state[name].dtype
        if dtype == torch.float64:
            dtype = torch.float32
        if dtype not in MOMENT_DTYPES:
            raise ValueError(f"{name} has dtype {dtype}, expected torch.float32 (or an encoding's dtype: "
                             f"torch.bfloat16, torch.uint8)")
        dtypes.append(dtype)
    return StateFormat("split" if "master_lo" in state else "fp32", *dtypes)


def convert_state(state: Dict[str, Tensor], param: Tensor, fmt: StateFormat, has_master: bool,
                  master: Optional[Tensor] = None, offset: int = 0) -> Dict[str, Tensor]:
    """``state`` (any format; on any device) re-encoded in ``fmt`` for ``param``: new tensors, ``step`` kept.

    The master is ``master`` when given, else decoded from ``state`` (a split master against the
    parameter's current values), else the parameter's value. The encoded moments' random bits are
    seeded with the step and drawn at the elements' positions (``offset``: the first one's, as in
    :func:`encode_state_`), so a conversion is reproducible and the same on every FSDP2 mesh.
    """
    step = state.get("step", torch.tensor(0.0))
    old = {k: (v.to(param.device) if isinstance(v, Tensor) else v) for k, v in state.items() if k != "step"}
    values = decode_state(format_of(old), param, old)
    if master is not None:
        values["master_weight"] = master
    values.setdefault("master_weight", param.detach().to(torch.float32))
    new = new_state(fmt, param, has_master)
    encode_state_(fmt, param, new, values, float(step), offset)
    new["step"] = step
    return new


def like_param_state(state: Dict[str, Tensor], param: Tensor) -> Dict[str, Tensor]:
    """``state`` (tensors for ``param``'s local shard: per element of its shape, per block of its
    rows; ``step`` as it is) as ``param`` is: itself for a plain parameter, else ``DTensor``\\ s
    sharded like it (:func:`halfadam._dtensor.like_param`, :func:`halfadam._dtensor.like_rows`)."""
    shape = block_shape(tuple(param.shape))
    return {k: v if k == "step" else like_rows(v, param, shape) if is_block_key(k) else like_param(v, param)
            for k, v in state.items()}


def set_master_(param: Tensor, state: Dict[str, Tensor], master: Tensor) -> None:
    """Make ``master`` (float32, the parameter's shape) the master weight in ``state``, whatever its
    encoding (an fp32 master is copied, a split master's remainder encoded); the parameter must hold
    ``round(master)`` already (elements where it does not keep the parameter's value, as in
    :func:`encode_state_`). A state without a master is left alone."""
    if has_master(state):
        stored, flat_param = _flat_copies(format_of(state), param, state)
        _encode_master_(stored, flat_param, _pad(master, flat_param.numel(), param, torch.float32))
        _write_back(state, stored, None, flat_param)
