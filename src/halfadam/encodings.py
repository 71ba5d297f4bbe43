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
master weight      ``"split8"``: ``master_hi`` (int8):  1                  no: bf16 parameter + 8 bits, rounded
                   an 8-bit remainder                                     stochastically (float16: ``"split"``)
exp_avg            ``float32``: ``exp_avg``             4                  yes
exp_avg            ``bfloat16``                         2                  no: stochastic rounding
exp_avg            ``uint8``: codes + ``exp_avg_scale``   1 + 1/128        no: sign + a tapered 7-bit float
                   (uint8 per block)                                       (15 binades), stochastic rounding
exp_avg_sq         ``float32`` / ``bfloat16``           4 / 2              yes / no (stochastic rounding)
exp_avg_sq         ``uint8``: codes +                   1 + 1/128          no: a tapered 8-bit float (45
                   ``exp_avg_sq_exponent``                               binades), stochastic rounding
                   (uint8 per block)
=================  =================================  =================  ======================================

Presets (:data:`PRESETS`), for a float16/bfloat16 parameter: ``"fp32"`` 12 B (the default),
``"split"`` 10.01 B, ``"bf16"`` 6.01 B, ``"compact"`` 4.02 B, ``"tiny"`` 3.02 B (split8 and compact's
moments). float32 parameters have no master
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
  master where the conversion kept the parameter's value (:meth:`halfadam.state.ParamStates.conform`):
  ``model.float()`` makes each parameter its master, bit for bit; fp16 -> bf16 restarts it from the
  parameter (the remainder was over the fp16 value).
* **split8 master** (bfloat16 parameters; float16 ones keep ``"split"``): the split's 16-bit
  remainder rounded to its upper byte ``c`` (int8), so the master is the parameter's bit pattern plus
  ``256 c``: 24 significant bits, as FlashOptim's 24-bit master weights (Databricks, 2026, arXiv
  2602.23349). Unlike theirs, ``c`` is rounded **stochastically** in the step (8 more random bits per
  element, :func:`_master_bits`): rounded to nearest, an update below half the remainder's
  resolution (2**-9 of a bfloat16 ulp: 1.5e-5 at a weight of 1.0) never lands, and at lr 1e-5 more
  than half of such masters never move (measured: docs/research/small-state); stochastically rounded
  it lands in expectation. A
  ``c`` of 128 (the master at the midpoint above the parameter) moves the parameter one value away
  from zero with ``c = -128``, and ``c = -128`` decodes one float32 ulp above that midpoint (2**-16 of
  a bf16 ulp: the only bias, far below the remainder's resolution), so every decoded master rounds to
  its parameter (no tie byte). Writes to the parameter: the decoded master is the written value plus
  the old remainder, as for the split (:func:`_split8_decode`).
* **bfloat16 moments**: stochastic rounding (add 16 random bits to the fp32 pattern, truncate):
  unbiased in value. Nearest rounding would freeze ``exp_avg_sq``: its per-step decay
  ``1 - beta2`` is below half a bf16 step.
* **uint8 moments**: small floats over a power-of-two scale per block of 128 (block-wise, as
  Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR 2022, but with no code
  table): each block stores one uint8, its base exponent ``base = max(E - span, 1)`` for ``E`` the
  biased float32 exponent of its largest finite magnitude, and each element a code over ``unit =
  2**(base - 127)`` whose binade ``r`` (values in ``[unit * 2**r, unit * 2**(r + 1))``) has 1 to 4
  mantissa bits, more near the block's largest value, where most of a block's values are
  (:data:`_TIERS`: a tapered float, as posits are), and below ``unit`` linear subnormals.
  ``exp_avg``: a sign bit and 7 magnitude bits over 15 binades (4 mantissa bits in the top 4, 3 in
  the next 3, 2 in the lowest 8, subnormals to 2**-17 of the largest). ``exp_avg_sq``: 8 magnitude
  bits over 45 binades (4 bits in the top 8, 3 in the next 8, 1 in the lowest 29: a gradient 2**-22
  of its block's largest, beyond 1e6 below it, still has relative precision); a positive value
  never encodes to 0 (it would make ``m / sqrt(v)`` explode; below the range it takes the first
  code). Encoding is the float32 bits shifted right by ``23 - mantissa`` plus the tier's offset,
  with random bits added below the kept ones (stochastic rounding: an ``exp_avg_sq`` rounded to
  nearest would freeze, its per-step decay being below half a step, and a stochastically rounded
  ``exp_avg`` trained closer to fp32 than a nearest one); decoding is a shift and a subtraction
  (:func:`_encode_magnitude`). ``exp_avg`` rounds unbiased in value. ``exp_avg_sq`` rounds
  unbiased in ``v**(1/4)``: up with probability ``f + 5/16 2**-mantissa f (1 - f)`` for the
  remainder ``f`` (about ``f + 3/8 delta f (1 - f)``, ``delta`` the step's relative size), a shift,
  a multiply and an add more. Unbiased in value, v's stored noise (about 12% relative) made every
  step ``m / sqrt(v)`` about 0.5% too long (Jensen's inequality); this rule leaves +0.02%
  (``benchmarks/moment_bias.py``). So both are a few integer operations per
  element, with relative precision all the way down to the subnormals: no element's ``exp_avg_sq``
  decodes to 0 beside a nonzero ``exp_avg`` (as linear codes of ``sqrt(exp_avg_sq)`` do), and an
  element whose gradient is 1e-4 of its block's others' still moves as in fp32 after it stops.
  Chosen by measurement (2026-12-02, ``halfadam train --task digits`` seeds 0-4 against fp32, val
  loss and weight distance; and the small element, ``tests/test_state_modes.py``): one tier of 3
  bits (14 and 30 binades) trained 1.34e-2 from fp32 (the codes of 2026-12-01: 9.4e-3); 4 bits for
  both (7 and 15 binades) 7.7e-3 but clamped the small element to a third of its fp32 step; these
  tiers 9.0e-3 (val -0.01% of fp32, range -0.18% to +0.21%) and keep it. The codes of 2026-12-01 (a
  dynamic-tree ``exp_avg``, log2 ``exp_avg_sq`` levels over a float32 ``*_absmax``) are read from old
  checkpoints by :mod:`halfadam._codes_20261201` (:attr:`StateFormat.legacy`) and converted.
  The codes of 2026-12-02 (:attr:`StateFormat.codes`), those tiers with ``exp_avg_sq`` over 27
  binades (4 bits in the top 8, 3 in the next 11, 2 in the lowest 8) in ``exp_avg_sq_scale`` and
  rounded unbiased in value, are read by their own tiers and converted: beyond 29 binades below its
  block's largest a nonzero ``exp_avg_sq`` was clamped up to the first code, and an element whose
  gradient was 1e-4 of a large neighbour's took 0.14 of its fp32 movement
  (``benchmarks/moment_probe.py``). Those of 2026-12-07 (``exp_avg_sq`` over 46 binades, 4 bits in
  the top 8, 2 in the next 23, 1 in the lowest 15, in ``exp_avg_sq_base``) kept it but trained digits
  1.18x further from fp32 (2 bits where the first layer's v mostly lies, 8-20 binades below its
  block's largest); today's (3 bits there) 1.03x, and keep every element within 2% of its fp32
  movement up to a gradient ratio of 1e6 (``benchmarks/moment_probe.py``).

Random bits are a hash of the element's position in its parameter (its index in the flattened
parameter) and the step, one 32-bit hash per element and step: ``exp_avg`` rounds with its upper
16 bits, ``exp_avg_sq`` with its lower 16, a split8 master with 8 bits of one more round (no
generator state, nothing computed): every execution
draws the same bits, float32 values that differ by an ulp between two executions round with the
same bits, a resumed run continues bitwise, and a shard that knows its offset draws its elements'
bits. (Elements at the same position of two parameters of one step draw the same bits.)

Non-finite values (a nan or inf gradient, an overflowing ``g * g``): bfloat16 moments keep them
(stochastic rounding of nan is nan, of inf is inf). uint8 moments hold them in reserved codes that
no finite value takes (``exp_avg``: magnitude 126 is nan, 127 an infinity of the code's sign;
``exp_avg_sq``: 254 is +inf, 255 nan), and the block's scale is taken over its finite values, so
the rest of the block keeps its codes.

Layout: per-element keys have the parameter's shape. Blocks lie within rows (indices of dim 0):
each row of a parameter with rows (:func:`has_rows`: at least 2 dims) is cut into blocks of 128
consecutive elements, the last one shorter where the row's length is not a multiple of 128 (a conv
weight's rows of 576 elements: 4 blocks of 128 and one of 64; a depthwise conv's rows of 9: one
block each). Per-block keys (``*_scale``, ``master_tie``) have the shape ``(rows, blocks per row)``
(:func:`block_shape`), so FSDP2 shards them with the parameter's rows and a shard's state is exactly
the unsharded state's rows, on any number of ranks; no padding is stored. A 1-D parameter (a bias, a
norm's weight) has no rows and stores those fields in float32 (:func:`for_param`). The per-parameter
paths step a parameter with each row padded with zeros to whole blocks (:func:`_layout`); in flat
buckets each parameter starts at a multiple of 128 (:mod:`halfadam.buckets`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

from . import _codes_20261201
from ._dtensor import like_param, like_rows, zeros_like_rows
from .functional import ADAM, Rule, sync_master_, written

__all__ = ["BLOCK", "PRESETS", "StateFormat", "state_format", "element_keys", "block_keys", "new_state",
           "decode_state", "encode_state_", "encoded_update_", "update_param_", "bytes_per_element", "state_nbytes", "for_param",
           "has_rows", "row_length", "block_shape",
           "format_of", "convert_state"]

#: Elements per quantization block (per-block keys have one entry per block).
BLOCK = 128

MASTER_ENCODINGS = ("fp32", "split", "split8")
MOMENT_DTYPES = (torch.float32, torch.bfloat16, torch.uint8)
_HALF = (torch.float16, torch.bfloat16)
#: Today's uint8 codes (:attr:`StateFormat.codes`).
CODES = "2026-12-07b"


#: The moment kinds an update rule keeps (:attr:`halfadam.functional.Rule.moments`): a signed moment is
#: encoded as Adam's ``exp_avg`` (sign + magnitude codes), a square one as ``exp_avg_sq``.
SIGNED, SQUARE = "signed", "square"
#: The code tables (:data:`_TIERS`) and random bits (:func:`_moment_bits`) of each kind, by their first user's name.
_CODE = {SIGNED: "exp_avg", SQUARE: "exp_avg_sq"}


@dataclass(frozen=True)
class StateFormat:
    """The encoding of each kind of state: ``master`` ("fp32", "split" or "split8"); ``exp_avg``, the dtype
    of the rule's signed moment (Adam's ``exp_avg``, SGD's ``momentum_buffer``, Lion's ``exp_avg``), and
    ``exp_avg_sq``, of its square one (Adam's ``exp_avg_sq``): torch.float32, torch.bfloat16 or
    torch.uint8 (Megatron's names for the fields); ``moments``: the rule's moments, ``(key, kind)``
    (:attr:`halfadam.functional.Rule.moments`; :meth:`for_rule`)."""

    master: str = "fp32"
    exp_avg: torch.dtype = torch.float32
    exp_avg_sq: torch.dtype = torch.float32
    #: The release of the uint8 codes (:data:`CODES`): today's, or an earlier one read from old
    #: checkpoints (decoded by its own rules and encoded in today's codes; never stepped):
    #: ``"2026-12-01"`` (a dynamic-tree / log2 table over a float32 ``*_absmax`` per block,
    #: :mod:`halfadam._codes_20261201`), ``"2026-12-02"`` (``exp_avg_sq`` over 27 binades in
    #: ``exp_avg_sq_scale``, :data:`_TIERS`), ``"2026-12-07"`` (over 46 binades in ``exp_avg_sq_base``).
    codes: str = CODES
    moments: Tuple[Tuple[str, str], ...] = ADAM.moments

    def for_rule(self, moments: Tuple[Tuple[str, str], ...]) -> "StateFormat":
        """This format for a rule keeping ``moments``: the dtype of a kind the rule does not keep is float32
        (so SGD without momentum in ``"compact"`` is ``"split"``)."""
        kinds = {kind for _, kind in moments}
        return StateFormat(self.master, self.exp_avg if SIGNED in kinds else torch.float32,
                           self.exp_avg_sq if SQUARE in kinds else torch.float32, self.codes, tuple(moments))

    def dtype(self, kind: str) -> torch.dtype:
        """The dtype a moment of ``kind`` is stored in."""
        return self.exp_avg if kind == SIGNED else self.exp_avg_sq

    @property
    def moment_dtypes(self) -> Tuple[Tuple[str, str, torch.dtype], ...]:
        """``(key, kind, dtype)`` of each moment."""
        return tuple((key, kind, self.dtype(kind)) for key, kind in self.moments)

    @property
    def legacy(self) -> bool:
        """Whether the uint8 codes are an earlier release's (only loaded into, then converted)."""
        return self.codes != CODES

    @property
    def stochastic(self) -> bool:
        """Whether some field rounds stochastically (every bfloat16 or uint8 moment, a split8 master)."""
        return any(dt != torch.float32 for _, _, dt in self.moment_dtypes) or self.master == "split8"

    @property
    def blocked(self) -> bool:
        """Whether flat buffers start each parameter at a multiple of BLOCK: some key is per block, or
        the random bits need each element's position in its parameter (:func:`positions`)."""
        return self.master == "split" or self.stochastic

    @property
    def is_fp32(self) -> bool:
        return self == StateFormat().for_rule(self.moments)

    def describe(self) -> str:
        name = {v.for_rule(self.moments): k for k, v in reversed(PRESETS.items())}.get(self)
        dt = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.uint8: "uint8"}
        parts = ", ".join([f"master={self.master}"] + [f"{key}={dt[d]}" for key, _, d in self.moment_dtypes])
        if self.legacy:
            parts += f", the uint8 codes of {self.codes}"
        return f"{name!r} ({parts})" if name else parts


#: The state modes reachable with one argument (``state_mode=``).
PRESETS: Dict[str, StateFormat] = {
    "fp32": StateFormat(),
    "split": StateFormat("split"),
    "bf16": StateFormat("split", torch.bfloat16, torch.bfloat16),
    "compact": StateFormat("split", torch.uint8, torch.uint8),
    "tiny": StateFormat("split8", torch.uint8, torch.uint8),
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


def has_rows(shape: Tuple[int, ...]) -> bool:
    """Whether a parameter of ``shape`` keeps per-block state: it has a dim 0 (the dim FSDP2 shards)
    and its *rows* (the indices of dim 0) are not empty. Each row is cut into blocks of BLOCK elements,
    the last one shorter where the row's length (the product of the other dims) is not a multiple of
    BLOCK (:func:`block_shape`). Blocks then never straddle a row, so no shard of whole rows, on any
    number of ranks, cuts one: the encoded state does not depend on the sharding. (A shard of whole
    rows, even an empty one, gets the answer of its whole parameter.)"""
    return len(shape) >= 2 and math.prod(shape[1:]) > 0


def row_length(shape: Tuple[int, ...]) -> int:
    """The elements of one row of the per-block layout: the product of the dims after dim 0 where
    :func:`has_rows`, else the parameter's element count (one row: blocks over the flat parameter)."""
    return math.prod(shape[1:]) if has_rows(shape) else math.prod(shape)


def block_shape(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    """The shape of the per-block keys of a parameter of ``shape``: ``(rows, ceil(row_length / BLOCK))``
    where :func:`has_rows` (sharded with the parameter's rows), else ``(ceil(numel / BLOCK),)`` (the
    layout of checkpoints written before 2026-12-01, read for conversion)."""
    if has_rows(shape):
        return (shape[0], n_blocks(row_length(shape)))
    return (n_blocks(math.prod(shape)),)


def for_param(fmt: StateFormat, param: Tensor, use_master: bool) -> StateFormat:
    """The format that applies to ``param``: float64 keeps float32 -> float64 state (fp32 format);
    no master for float32 parameters or with master weights off (``master`` then means nothing).

    The per-block encodings (a split master, uint8 moments) apply to parameters with rows
    (:func:`has_rows`); a 1-D one (a bias, a norm's weight) stores those fields in float32 (an fp32
    master, float32 moments), as bitsandbytes keeps 32-bit state for small tensors. So a parameter's
    format depends on its shape, never on how it is sharded."""
    if param.dtype == torch.float64:
        return StateFormat().for_rule(fmt.moments)
    master = fmt.master if use_master and param.dtype in _HALF else "fp32"
    if master == "split8" and param.dtype != torch.bfloat16:
        master = "split"  # an 8-bit remainder is over bfloat16 parameters; float16 keeps 16 bits
    exp_avg, exp_avg_sq = fmt.exp_avg, fmt.exp_avg_sq
    if not has_rows(tuple(param.shape)):
        master = "fp32"
        exp_avg, exp_avg_sq = (torch.float32 if dt == torch.uint8 else dt for dt in (exp_avg, exp_avg_sq))
    return StateFormat(master, exp_avg, exp_avg_sq, fmt.codes, fmt.moments)


#: Every per-element state key of any encoding (besides ``step``), and every per-block one.
#: The moment keys of the rules halfadam ships and their kinds (Adam's; SGD's ``momentum_buffer``; Lion's
#: ``exp_avg``), for code that reads a state without its optimizer.
MOMENT_KINDS = {"exp_avg": SIGNED, "exp_avg_sq": SQUARE, "momentum_buffer": SIGNED}
ELEMENT_KEYS = ("master_weight", "master_hi", "master_lo", *MOMENT_KINDS)
BLOCK_KEYS = ("master_tie", "exp_avg_scale", "exp_avg_sq_exponent", "momentum_buffer_scale")
#: The per-block keys of earlier releases' uint8 codes (read from old checkpoints only), by release.
LEGACY_CODE_KEYS = {"2026-12-01": ("exp_avg_absmax", "exp_avg_sq_absmax"), "2026-12-02": ("exp_avg_sq_scale",),
                    "2026-12-07": ("exp_avg_sq_base",)}
LEGACY_BLOCK_KEYS = tuple(k for keys in LEGACY_CODE_KEYS.values() for k in keys)


def scale_key(name: str, codes: str = CODES, kind: Optional[str] = None) -> str:
    """The per-block key of moment ``name``'s uint8 codes of release ``codes`` (:data:`BLOCK_KEYS`, or
    :data:`LEGACY_CODE_KEYS`: each later release renamed only ``exp_avg_sq``'s): ``<name>_scale`` for a
    signed moment, ``<name>_exponent`` for a square one (``kind``; by default Adam's: ``exp_avg_sq`` square)."""
    if codes == "2026-12-01":
        return f"{name}_absmax"
    if (kind or _kind(name)) == SQUARE:
        return LEGACY_CODE_KEYS[codes][0] if codes in LEGACY_CODE_KEYS else f"{name}_exponent"
    return f"{name}_scale"


def slot(kind: str) -> str:
    """The kernels' slot for a moment of ``kind``: ``exp_avg`` (signed) or ``exp_avg_sq`` (square)."""
    return _CODE[kind]


def _kind(name: str) -> str:
    """Adam's moments' kinds (the default where a caller names no kind)."""
    return SQUARE if name == "exp_avg_sq" else SIGNED


@functools.lru_cache(maxsize=None)
def element_keys(fmt: StateFormat, has_master: bool) -> Dict[str, torch.dtype]:
    """The per-element state keys of ``fmt`` and their dtypes (the parameter's shape)."""
    keys: Dict[str, torch.dtype] = {}
    if has_master:
        keys.update({"master_weight": torch.float32} if fmt.master == "fp32"
                    else {"master_hi": torch.int8} if fmt.master == "split8"
                    else {"master_hi": torch.int8, "master_lo": torch.uint8})
    keys.update((key, dtype) for key, _, dtype in fmt.moment_dtypes)
    return keys


@functools.lru_cache(maxsize=None)
def block_keys(fmt: StateFormat, has_master: bool) -> Dict[str, torch.dtype]:
    """The per-block state keys of ``fmt`` and their dtypes (1-D, one entry per BLOCK elements)."""
    keys: Dict[str, torch.dtype] = {}
    if has_master and fmt.master == "split":
        keys["master_tie"] = torch.uint8
    for name, kind, dtype in fmt.moment_dtypes:
        if dtype == torch.uint8:
            keys[scale_key(name, fmt.codes, kind)] = torch.float32 if fmt.codes == "2026-12-01" else torch.uint8
    return keys


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def kernel_row_length(fmt: StateFormat, shape: Tuple[int, ...], has_master: bool = True) -> int:
    """The elements per row of blocks the kernels step a parameter of ``shape`` in ``fmt`` by:
    :func:`row_length` where ``fmt`` has per-block keys, else its numel (one row: blocks over the flat
    tensor, no per-block state to keep within rows)."""
    return row_length(shape) if block_keys(fmt, has_master) else math.prod(shape)


def has_short_blocks(numel: int, length: int) -> bool:
    """Whether rows of ``length`` elements (``numel`` in all) end in a short block: ``length`` is no
    multiple of BLOCK and not the whole tensor (whose last block is followed by padding)."""
    return length % BLOCK != 0 and length != numel


def bytes_per_element(fmt: StateFormat, has_master: bool = True) -> float:
    """State bytes per parameter element of rows of whole blocks (per-block keys spread over their
    BLOCK elements)."""
    return (sum(_size(dt) for dt in element_keys(fmt, has_master).values())
            + sum(_size(dt) for dt in block_keys(fmt, has_master).values()) / BLOCK)


def state_nbytes(fmt: StateFormat, shape: Tuple[int, ...], has_master: bool = True) -> int:
    """The bytes of a parameter's state tensors in ``fmt`` (the ``step`` count aside): per element, and
    per block of :func:`block_shape` (a row's short last block counts as one)."""
    return (math.prod(shape) * sum(_size(dt) for dt in element_keys(fmt, has_master).values())
            + math.prod(block_shape(shape)) * sum(_size(dt) for dt in block_keys(fmt, has_master).values()))


def n_blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def blocks_in_rows(numel: int, length: int) -> int:
    """The blocks of ``numel`` elements in rows of ``length`` (each row cut into blocks of BLOCK, its
    last one shorter; no rows, no blocks)."""
    return numel // length * n_blocks(length) if length else 0


# ---------------------------------------------------------------------------------- random bits
_MASK32 = 0xFFFFFFFF


def _random_bits(position: Tensor, seed: Tensor) -> Tensor:
    """32 pseudo-random bits (int64 in [0, 2**32)) per element: a hash of the element's ``position``
    in its parameter (int64, the index in the flattened parameter) and the 0-d int64 ``seed`` (the
    step); three xor-shift-multiply rounds (the "lowbias32" family) with multipliers below 2**31, so
    int64 products never overflow. One hash per element and step serves both moments: ``exp_avg``
    takes its upper 16 bits, ``exp_avg_sq`` its lower 16 (:func:`_moment_bits`).

    The bits depend on nothing computed: implementations whose float32 values differ by an ulp (an
    eager and a compiled ``sqrt``) draw the same bits, and so do a resumed run and a sharded one."""
    h = (position & _MASK32) ^ ((seed * 0x27D4EB2F + _SALT) & _MASK32)
    h = ((h ^ (h >> 16)) * 0x7FEB352D) & _MASK32
    h = ((h ^ (h >> 15)) * 0x2C1B3C6D) & _MASK32
    h = ((h ^ (h >> 16)) * 0x297A2D39) & _MASK32
    return h ^ (h >> 15)


_SALT = 0x1B873593


def _moment_bits(bits: Tensor, name: str) -> Tensor:
    """The 16 random bits (int64 in [0, 2**16)) of moment ``name`` in an element's 32 (:func:`_random_bits`)."""
    return bits >> 16 if name == "exp_avg" else bits & 0xFFFF


def _master_bits(bits: Tensor) -> Tensor:
    """The 8 random bits (int32 in [0, 256)) of a split8 master: one more xor-shift-multiply round of the
    element's 32 (:func:`_random_bits`), its upper byte (so not any of the moments' bits)."""
    return ((((bits ^ (bits >> 16)) * 0x7FEB352D) & _MASK32) >> 24).to(torch.int32)


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
    (both moments float32)."""
    if not fmt.stochastic:
        return None
    if isinstance(step, Tensor):
        return step.to(device=device, dtype=torch.int64)
    return torch.tensor(int(step), dtype=torch.int64, device=device)


# ---------------------------------------------------------------------------------- uint8 codes
# Each uint8 moment is a small tapered float over a power-of-two scale per block: no table, no
# search, no division; encoding and decoding are a few integer operations on float32 bits.
#: exp_avg: a sign bit and 7 magnitude bits; exp_avg_sq: 8 magnitude bits.
_MAGNITUDE_MASK = {"exp_avg": 127, "exp_avg_sq": 255}
#: Each moment's codes, tier by tier from the smallest values up: (mantissa bits, binades). The
#: lowest tier also holds subnormals below its first binade (``2**mantissa`` codes from 0, linear).
#: exp_avg: 15 binades (the largest magnitude in the top one), 4 bits in the top 4, 3 in the next 3,
#: 2 in the 8 below and the subnormals (to 2**-17 of the largest); codes 0..124 (124 is the value
#: rounded up from the top binade). exp_avg_sq: 45 binades (a gradient 2**-22 of its block's largest
#: still has relative precision), 4 bits in the top 8, 3 in the next 8, 1 in the lowest 29; codes
#: 0..252. Chosen by measurement (``benchmarks/moment_probe.py``, ``moment_bias.py``, ``halfadam train
#: --task digits``: see the module docstring). Decoded from old checkpoints: ``exp_avg_sq@2026-12-02``,
#: the 27 binades of 2026-12-02..06 (4 bits in the top 8, 3 in the next 11, 2 in the lowest 8), and
#: ``exp_avg_sq@2026-12-07``, the 46 of 2026-12-07 (4 bits in the top 8, 2 in the next 23, 1 in the lowest 15).
_TIERS = {"exp_avg": ((2, 8), (3, 3), (4, 4)), "exp_avg_sq": ((1, 29), (3, 8), (4, 8)),
          "exp_avg_sq@2026-12-02": ((2, 8), (3, 11), (4, 8)), "exp_avg_sq@2026-12-07": ((1, 15), (2, 23), (4, 8))}
#: Reserved magnitude codes, the two largest (never taken by a finite value): exp_avg 126 is nan and
#: 127 an infinity of the code's sign; exp_avg_sq 254 is +inf and 255 nan (a -inf exp_avg_sq is a nan).
_NAN_CODE = {"exp_avg": 126, **{name: 255 for name in _TIERS if name.startswith("exp_avg_sq")}}
_INF_CODE = {"exp_avg": 127, **{name: 254 for name in _TIERS if name.startswith("exp_avg_sq")}}
#: exp_avg_sq's rounding, unbiased in v**(1/4) rather than in v (:func:`_encode_magnitude`): with
#: ``f8`` the top 8 bits of the fraction below the kept ones and ``mantissa`` the tier's bits, the
#: 16 random bits get ``(_V_ROUNDING * f8 * (256 - f8)) >> max(mantissa + 4, _V_ROUNDING_MIN_SHIFT)``
#: added. The floor halves the term in the 1-bit tier: there a v decaying by under 1% a step (its
#: gradient stopped) sits near a code, where the term shortens its decay by its own share; at 5/32 the
#: element of ``test_small_element_beside_large_ones_moves_as_in_fp32`` 20-27 binades below its
#: block's largest took 0.93 of its fp32 movement, at 5/64 0.96-1.05 (0 : 0.99-1.10).
_V_ROUNDING = 5
_V_ROUNDING_MIN_SHIFT = 6


def _tiers_name(name: str, codes: str) -> str:
    """The key in :data:`_TIERS` of moment ``name``'s codes of release ``codes`` (an earlier release of them, or today's)."""
    return f"{name}@{codes}" if f"{name}@{codes}" in _TIERS else name


def _tier_table(tiers: Tuple[Tuple[int, int], ...]) -> Tuple[Tuple[Tuple[int, int, int], ...], int, int]:
    """Per tier (mantissa bits, its first binade over the block's base, its first code); the binades in
    all, and the code of the value just above them (``unit * 2**binades``, the largest one taken)."""
    out, r0, code = [], 0, 1 << tiers[0][0]
    for mantissa, binades in tiers:
        out.append((mantissa, r0, code))
        r0, code = r0 + binades, code + (binades << mantissa)
    return tuple(out), r0, code


_TIER_TABLE = {name: _tier_table(tiers) for name, tiers in _TIERS.items()}
#: A block's base exponent is its largest finite magnitude's biased exponent less this (its binade
#: is then the top one).
_SPAN = {name: _TIER_TABLE[name][1] - 1 for name in _TIERS}
assert all(_TIER_TABLE[name][2] < _NAN_CODE[name] - 1 for name in _TIERS)  # below the reserved codes
assert all(a[0] < b[0] for tiers in _TIERS.values() for a, b in zip(tiers, tiers[1:]))  # rising mantissas


def _block_base(blocks: Tensor, name: str) -> Tensor:
    """Each block's base exponent (int32, ``(blocks, 1)``): ``max(E - _SPAN[name], 1)`` for ``E`` the
    biased float32 exponent of the block's largest finite magnitude (0 for a block of zeros)."""
    magnitude = blocks.view(torch.int32) & 0x7FFFFFFF
    exponent = torch.where(magnitude < 0x7F800000, magnitude >> 23, 0).amax(dim=1, keepdim=True)
    return torch.clamp(exponent - _SPAN[name], min=1)


def _tier_of(select, base: Tensor, name: str):
    """Per element, its tier's mantissa bits and code offset (int32): the tiers above the lowest are
    taken where ``select(r0, first)`` (a bool tensor) holds for their first binade ``r0`` and first
    code ``first``. A tier's code is its float32 bits shifted right by ``23 - mantissa``, plus the
    offset ``first - ((base + r0) << mantissa)``."""
    tiers = _TIER_TABLE[name][0]
    m0 = tiers[0][0]
    mantissa, offset, below = m0, (1 << m0) - (base << m0), m0
    for m, r0, first in tiers[1:]:
        taken = select(r0, first)
        mantissa = mantissa + taken.to(torch.int32) * (m - below)  # the tiers' mantissas rise
        offset = torch.where(taken, first - ((base + r0) << m), offset)
        below = m
    return mantissa, offset


def _encode_magnitude(a: Tensor, base: Tensor, rounding: Tensor, name: str) -> Tensor:
    """The magnitude code (int32) of finite ``a`` >= 0 (float32, ``(blocks, BLOCK)``) over ``base``
    (:func:`_block_base`), rounded stochastically with ``rounding`` (16 random bits, int32).

    With ``unit = 2**(base - 127)``, binade ``r`` holds ``[unit * 2**r, unit * 2**(r + 1))`` and its
    tier's ``2**mantissa`` codes are linear in it; below ``unit`` the lowest tier's subnormals ``unit *
    k / 2**mantissa``. A code is the float32 bits of ``a`` shifted right by ``23 - mantissa`` plus its
    tier's offset (:func:`_tier_of`); a subnormal one's, those of ``a + unit`` (in ``[unit, 2 unit)``:
    the kept bits are ``a / unit * 2**mantissa``) less ``2**mantissa``. The random bits are added
    below the kept ones before the shift: rounding up with probability the remainder's share of a
    step, unbiased in value (a step is linear in value, also across a tier's edge: the value rounded
    up from a binade's top is the next binade's first).

    ``exp_avg_sq`` rounds up more often, by ``c = (5 f8 (256 - f8)) >> max(mantissa + 4, 6)`` added to
    the random bits (``f8``: the top 8 bits of the remainder), so that up has probability ``f + 5/16
    2**-mantissa f (1 - f)`` (half that in the 1-bit tier, :data:`_V_ROUNDING_MIN_SHIFT`) for a remainder
    ``f`` of a step: about ``f + 3/8 delta f (1 - f)`` for the step's relative size ``delta`` (its mean
    over a binade), the rounding unbiased in ``v**(1/4)``. By
    value it rounds v up (v's relative noise is about 12%); unbiased in value, the step ``m /
    sqrt(v)`` would be about ``3/8 * 0.12**2`` (+0.5%) too long on average (Jensen's inequality)."""
    r = (a.view(torch.int32) >> 23) - base
    mantissa, offset = _tier_of(lambda r0, first: r >= r0, base, name)
    unit = (base << 23).view(torch.float32)
    sub = a < unit
    y = torch.where(sub, a + unit, a).view(torch.int32)
    m0 = _TIER_TABLE[name][0][0][0]
    kept = y >> (7 - mantissa)  # the kept bits, then 16 bits of remainder
    if name == "exp_avg_sq":
        f8 = (kept >> 8) & 255
        rounding = rounding + ((_V_ROUNDING * f8 * (256 - f8)) >> torch.clamp(mantissa + 4, min=_V_ROUNDING_MIN_SHIFT))
    return ((kept + rounding) >> 16) + offset - (sub.to(torch.int32) << m0)


def _decode_magnitude(k: Tensor, base: Tensor, name: str) -> Tensor:
    """The float32 value of magnitude codes ``k`` (int32) over ``base``: :func:`_encode_magnitude`
    inverted (exact: the subtraction of ``unit`` is of two values of one binade)."""
    mantissa, offset = _tier_of(lambda r0, first: k >= first, base, name)
    m0 = _TIER_TABLE[name][0][0][0]
    sub = k < (1 << m0)
    value = ((k - offset + (sub.to(torch.int32) << m0)) << (23 - mantissa)).view(torch.float32)
    return torch.where(sub, value - (base << 23).view(torch.float32), value)


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


#: The largest finite bfloat16's float32 bit pattern (its magnitude).
_BF16_MAX_BITS = 0x7F7F0000


def _split8_decode(param: Tensor, hi: Tensor) -> Tensor:
    """The fp32 master from flat bfloat16 ``param`` and its 8-bit remainder ``hi`` (int8, ``c``): the
    bit pattern ``bits(param) + 256 c`` (one more where ``c = -128``: the master then lies just above
    the midpoint below ``param``, so that it rounds to it). Every such master rounds to ``param``, so a
    value written to the parameter decodes as itself plus the old remainder (within half an ulp); over
    a parameter of +-0, nan or +-inf the parameter's value is taken (no remainder is kept over them)."""
    c = hi.to(torch.int32)
    p32 = param.to(torch.float32)
    master = (_bits(param) + c * 256 + (c == -128).to(torch.int32)).view(torch.float32)
    return torch.where(p32.isfinite() & (p32 != 0), master, p32)


def _split8_encode_(master: Tensor, param: Tensor, hi: Tensor, rounding: Optional[Tensor]) -> None:
    """Store the flat fp32 ``master`` over bfloat16 ``param`` as an 8-bit remainder in ``hi`` (int8).

    The step (``rounding``: 8 random bits per element, :func:`_master_bits`) writes ``round(master)``
    (nearest even) into ``param`` and rounds the 16-bit remainder ``r`` (:func:`_split_remainder`, in
    [-2**15, 2**15]) stochastically, ``c = floor((r + rounding) / 256)``: unbiased in value, so updates
    below the remainder's resolution (2**-8 of an ulp) land in expectation. A ``c`` of 128 (the master
    at or just below the midpoint above ``param``) moves the parameter one bfloat16 value away from
    zero with ``c = -128`` (the same master but for the decode's one float32 ulp; at the largest finite
    bfloat16 it is 127). Without ``rounding`` (a checkpoint load, a format conversion: ``param`` holds
    ``round(master)`` and is not changed) the remainder is rounded to nearest, ``c = min(floor((r + 128) / 256), 127)``. ``c = 0``
    over a parameter of +-0, nan or +-inf."""
    rounded = param if rounding is None else master.to(param.dtype)
    p32 = rounded.to(torch.float32)
    valid = p32.isfinite() & (p32 != 0)
    c = (_split_remainder(master, rounded) + (128 if rounding is None else rounding)) >> 8
    if rounding is not None:  # one write of the parameter: round(master), or its next value where bumped
        bump = valid & (c == 128) & ((_bits(rounded) & 0x7FFFFFFF) != _BF16_MAX_BITS)
        param.copy_(torch.where(bump, (_bits(rounded) + 65536).view(torch.float32), p32).to(param.dtype))
        c = torch.where(bump, -128, c)
    hi.copy_(torch.where(valid, c.clamp(max=127), 0).to(torch.int8))


# ---------------------------------------------------------------------------------- moments
def _decode_moment(dtype: torch.dtype, name: str, stored: Dict[str, Tensor], codes: str = CODES,
                   kind: Optional[str] = None) -> Tensor:
    """Moment ``stored[name]`` (of ``kind``: by default Adam's for ``name``) as float32."""
    q = stored[name]
    if dtype == torch.float32:
        return q
    if dtype == torch.bfloat16:
        return q.to(torch.float32)
    kind = kind or _kind(name)
    key, name = name, _CODE[kind]  # the stored key; the codes' name
    if codes == "2026-12-01":
        return _codes_20261201.decode(name, q, stored[f"{key}_absmax"])
    base = stored[scale_key(key, codes, kind)].to(torch.int32).view(-1, 1)
    code = q.to(torch.int32).view(-1, BLOCK)
    k = code & _MAGNITUDE_MASK[name]
    value = _decode_magnitude(k, base, _tiers_name(name, codes))
    value = torch.where(k == _INF_CODE[name], math.inf, value)
    if name == "exp_avg":  # a sign bit
        value = torch.where(code > 127, -value, value)
    return torch.where(k == _NAN_CODE[name], math.nan, value).view(-1)


def _encode_moment_(dtype: torch.dtype, name: str, x: Tensor, stored: Dict[str, Tensor], bits: Optional[Tensor],
                    kind: Optional[str] = None) -> None:
    """Encode float32 ``x`` (flat; a multiple of BLOCK long for uint8) into ``stored[name]`` (and its
    scale), any float included: nan and +-inf decode as themselves (a square moment: -inf as nan).
    ``bits``: the elements' random bits (:func:`_random_bits`) when ``dtype`` rounds stochastically;
    ``kind``: the moment's (by default Adam's for ``name``)."""
    if dtype == torch.float32:
        return  # updated in place
    kind = kind or _kind(name)
    key, name = name, _CODE[kind]  # the stored key; the codes' name
    rounding = _moment_bits(bits, name)
    if dtype == torch.bfloat16:  # stochastic rounding: add 16 random bits below bf16's, truncate
        bits = x.view(torch.int32).to(torch.int64) + rounding
        truncated = ((bits >> 16) << 16).to(torch.int32).view(torch.float32)  # exactly a bf16 value (inf kept)
        # a nan whose mantissa is near all ones would carry into the sign bit (-0.0): stored as bf16's nan
        stored[key].copy_(torch.where(x.isnan(), math.nan, truncated).to(torch.bfloat16))
        return
    blocks = x.view(-1, BLOCK)
    base = _block_base(blocks, name)
    finite = blocks.isfinite()
    r = rounding.to(torch.int32).view(-1, BLOCK)  # 16 random bits, put below the kept ones
    k = _encode_magnitude(torch.where(finite, blocks.abs(), 0.0), base, r, name)
    if name == "exp_avg":  # the sign bit, a nan's aside (whatever pattern an execution writes)
        nan = blocks.isnan()
        code = torch.where(finite, k, torch.where(nan, _NAN_CODE[name], _INF_CODE[name]))
        code = torch.where((blocks.view(torch.int32) < 0) & ~nan, code + 128, code)
    else:  # nonzero never to 0: m / sqrt(v) must not explode
        code = torch.where(blocks > 0, torch.clamp(k, min=1), 0)
        code = torch.where(finite, code, torch.where(blocks == math.inf, _INF_CODE[name], _NAN_CODE[name]))
    stored[key].copy_(code.view(-1).to(torch.uint8))
    stored[scale_key(key, CODES, kind)].copy_(base.view(-1).to(torch.uint8))


# ---------------------------------------------------------------------------------- the step
def encoded_update_(stored: Dict[str, Tensor], param: Optional[Tensor], grad: Tensor,
                    coefficients: Tuple[Tensor, ...], seed: Optional[Tensor], *,
                    fmt: StateFormat, rule: Rule, flags: Tuple[bool, bool]) -> None:
    """One step of ``rule`` over flat, block-padded state in ``fmt``: decode, ``rule.elementwise``, encode.

    Args:
        stored: the state's flat tensors by key (:func:`element_keys`, :func:`block_keys`).
        param: the flat parameter values (fp16/bf16) when the parameter has a master: read (the
            master-sync rule), then written with the rounded new master. ``None``: ``stored`` has no
            master and the weight is ``stored["weight"]`` (float32, updated in place).
        grad: flat float32 gradient.
        coefficients, seed: ``rule.coefficients`` (0-d tensors, or numbers), and the step as a 0-d int64
            tensor (the random bits' seed; ``None`` when nothing rounds stochastically).
        fmt, rule, flags: the state's format (its moments are ``rule.moments``), the update rule
            (:class:`halfadam.functional.Rule`) and its flags (``rule.flags``).
    Every tensor is 1-D with a length that is a multiple of BLOCK when the format is blocked.
    """
    master = fmt.master
    if param is None:
        weight = stored["weight"]
    elif master == "fp32":
        weight = stored["master_weight"]
        sync_master_(weight, param)
    elif master == "split8":
        weight = _split8_decode(param, stored["master_hi"])
    else:
        weight = _split_decode(param, stored["master_hi"], stored["master_lo"], stored["master_tie"])
    moments = fmt.moment_dtypes
    values = [_decode_moment(dtype, key, stored, kind=kind) for key, kind, dtype in moments]
    rule.elementwise(weight, grad, values, coefficients, flags)
    bits = None if seed is None else _random_bits(positions(stored, grad.numel(), grad.device), seed)
    for (key, kind, dtype), x in zip(moments, values):
        _encode_moment_(dtype, key, x, stored, bits, kind)
    if param is not None:
        if master == "fp32":
            param.copy_(weight)
        elif master == "split8":
            _split8_encode_(weight, param, stored["master_hi"], _master_bits(bits))
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
    """Whether ``state`` (a parameter's state, or flat buffers) holds a master weight, fp32, split or split8."""
    return "master_weight" in state or "master_hi" in state


def has_remainder(state: Dict[str, Tensor]) -> bool:
    """Whether ``state``'s master is a remainder over the parameter (a split or split8 master), so it
    means a master only over the parameter's values in the dtype it was written for."""
    return "master_hi" in state


def present_element_keys(state: Dict) -> List[str]:
    """The per-element keys (:data:`ELEMENT_KEYS`, in its order) that a state holds."""
    return [k for k in ELEMENT_KEYS if k in state]


def is_block_key(key: str) -> bool:
    """Whether state entry ``key`` is per block of BLOCK elements (else per element)."""
    return key in BLOCK_KEYS or key in LEGACY_BLOCK_KEYS or key == BLOCK_INDEX


def slice_flat(stored: Dict[str, Tensor], a: int, b: int) -> Dict[str, Tensor]:
    """Elements ``a:b`` (multiples of BLOCK when some key is per block) of flat state buffers."""
    return {k: t[a // BLOCK:b // BLOCK] if is_block_key(k) else t[a:b] for k, t in stored.items()}


#: The layout the per-parameter paths step in: ``(rows, row length, padded row length)``, each row of
#: the per-block layout (:func:`row_length`) padded with zeros to whole blocks, so that every BLOCK
#: consecutive elements of the flat copy are one block (a row's short last block padded with zeros,
#: which change no block's scale and whose codes are dropped).
Layout = Tuple[int, int, int]


def _layout(shape: Tuple[int, ...], state: Optional[Dict[str, Tensor]] = None) -> Layout:
    """The padded layout of a parameter of ``shape``; one row (blocks over the flat parameter) where
    ``state``'s per-block keys are 1-D (as written before 2026-12-01)."""
    n = math.prod(shape)
    flat = state is not None and any(state[k].dim() == 1 for k in (*BLOCK_KEYS, *LEGACY_BLOCK_KEYS) if k in state)
    rows, length = (shape[0], row_length(shape)) if has_rows(shape) and not flat else (1, n)
    return rows, length, n_blocks(length) * BLOCK


def _pad(t: Tensor, layout: Layout, like: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """``t`` (a tensor of the parameter's elements) as a new flat tensor in ``layout`` on ``like``'s
    device, zero-padded."""
    rows, length, padded = layout
    src = t.detach().reshape(rows, length).to(device=like.device, dtype=dtype or t.dtype)
    if padded == length:
        return src.reshape(-1).clone()
    out = src.new_zeros(rows, padded)
    out[:, :length] = src
    return out.view(-1)


def _unpad(flat: Tensor, layout: Layout) -> Tensor:
    """The parameter's elements of ``flat`` (in ``layout``), as ``(rows, row length)``."""
    rows, length, padded = layout
    return flat.view(rows, padded)[:, :length]


def _positions(layout: Layout, offset: int, device: torch.device) -> Tensor:
    """Each element's position in its whole parameter (int64, flat in ``layout``): ``offset`` (the
    first element's, a shard's) plus its row times the row's length plus its column (padding
    included: its bits are never used)."""
    rows, length, padded = layout
    row = torch.arange(rows, dtype=torch.int64, device=device).view(-1, 1) * length
    return (row + torch.arange(padded, dtype=torch.int64, device=device) + offset).view(-1)


def _flat_copies(fmt: StateFormat, param: Tensor, state: Dict[str, Tensor]
                 ) -> Tuple[Dict[str, Tensor], Tensor, Layout]:
    """Flat copies of ``state``'s tensors and of the parameter's values in the padded layout, and the layout."""
    layout = _layout(tuple(param.shape), state)
    with_master = has_master(state)
    stored = {k: _pad(state[k], layout, param) for k in element_keys(fmt, with_master)}
    stored.update({k: state[k].reshape(-1).clone() for k in block_keys(fmt, with_master)})
    return stored, _pad(param, layout, param), layout


def _write_back(state: Dict[str, Tensor], stored: Dict[str, Tensor], param: Optional[Tensor],
                flat_param: Tensor, layout: Layout) -> None:
    for key, t in stored.items():
        if key in state:
            src = t if is_block_key(key) else _unpad(t, layout)
            state[key].copy_(src.reshape(state[key].shape))
    if param is not None:
        param.detach().copy_(_unpad(flat_param, layout).reshape(param.shape))


def _encode_master_(stored: Dict[str, Tensor], flat_param: Tensor, master: Tensor) -> None:
    """Store the flat float32 ``master`` (a tensor of its own, changed here): copied, or as a split
    remainder after the master-sync rule (where the parameter differs from ``round(master)`` the
    parameter wins), so the parameter keeps its value."""
    if "master_weight" in stored:
        stored["master_weight"].copy_(master)
        return
    sync_master_(master, flat_param)
    if "master_lo" in stored:
        _split_encode_(master, flat_param, stored["master_hi"], stored["master_lo"], stored["master_tie"])
    else:
        _split8_encode_(master, flat_param, stored["master_hi"], None)


def update_param_(fmt: StateFormat, param: Tensor, state: Dict[str, Tensor], grad: Tensor,
                  coefficients: tuple, step: int, *, rule: Rule, flags: Tuple[bool, bool], offset: int = 0) -> None:
    """:func:`encoded_update_` for one parameter and its own (not flat) state tensors; ``offset``: the
    position of its first element in the whole parameter (a shard's, :func:`halfadam._dtensor.flat_offset`)."""
    stored, flat_param, layout = _flat_copies(fmt, param, state)
    if fmt.stochastic:
        stored[POSITION] = _positions(layout, offset, param.device)
    with_master = has_master(state)
    if not with_master:
        stored["weight"] = flat_param.to(torch.float32)
    g = _pad(grad, layout, param, torch.float32)
    encoded_update_(stored, flat_param if with_master else None, g, coefficients, random_seed(fmt, step, param.device),
                    fmt=fmt, rule=rule, flags=flags)
    if not with_master:
        flat_param.copy_(stored.pop("weight"))
    _write_back(state, stored, param, flat_param, layout)


def decode_state(fmt: StateFormat, param: Tensor, state: Dict[str, Tensor],
                 names: Optional[Tuple[str, ...]] = None) -> Dict[str, Tensor]:
    """``state``'s master weight (when it has one) and moments (those of ``names``; all by default) as
    new float32 tensors of the parameter's shape (a split master synced with ``param``, see
    :func:`_split_decode`)."""
    if names is None:
        names = ("master_weight", *(key for key, _ in fmt.moments))
    stored, flat_param, layout = _flat_copies(fmt, param, state)
    out = {}
    if "master_weight" in names:
        if "master_weight" in stored:
            out["master_weight"] = stored["master_weight"]
        elif "master_lo" in stored and param.dtype in _HALF:
            out["master_weight"] = _split_decode(flat_param, stored["master_hi"], stored["master_lo"],
                                                 stored["master_tie"])
        elif "master_hi" in stored and param.dtype == torch.bfloat16:
            out["master_weight"] = _split8_decode(flat_param, stored["master_hi"])
    for name, kind, dtype in fmt.moment_dtypes:
        if name in names:
            out[name] = _decode_moment(dtype, name, stored, fmt.codes, kind)
    return {k: _unpad(v, layout).reshape(param.shape).to(torch.float32, copy=True) for k, v in out.items()}


def encode_state_(fmt: StateFormat, param: Tensor, state: Dict[str, Tensor], values: Dict[str, Tensor],
                  step: float, offset: int = 0) -> None:
    """Encode float32 ``values`` (``master_weight`` when ``state`` has a master, and ``fmt``'s moments;
    the parameter's shape) into ``state``'s tensors, in place. A split master keeps
    the master where the parameter equals its rounding and takes the parameter's value elsewhere
    (the master-sync rule), so the parameter is never changed. ``offset``: the position of the first
    element in the whole parameter (a shard's, as in :func:`update_param_`)."""
    stored, flat_param, layout = _flat_copies(fmt, param, state)
    if fmt.stochastic:
        stored[POSITION] = _positions(layout, offset, param.device)
    seed = random_seed(fmt, step, param.device)
    bits = None if seed is None else _random_bits(stored[POSITION], seed)
    for name, kind, dtype in fmt.moment_dtypes:
        x = _pad(values[name], layout, param, torch.float32)
        stored[name].copy_(x) if dtype == torch.float32 else _encode_moment_(dtype, name, x, stored, bits, kind)
    if has_master(stored):
        _encode_master_(stored, flat_param, _pad(values["master_weight"], layout, param, torch.float32))
    _write_back(state, stored, None, flat_param, layout)


def format_of(state: Dict[str, Tensor], moments: Tuple[Tuple[str, str], ...] = ADAM.moments) -> StateFormat:
    """The format a parameter's state was stored in, read off its keys and dtypes (checkpoints carry no
    other record), for a rule keeping ``moments``. Raises ValueError for a moment dtype that is not an
    encoding, and for uint8 codes without their per-block key (a uint8 tensor put in place of a float moment)."""
    dtypes = {}
    for name, kind in moments:
        dtype = state[name].dtype
        if dtype == torch.float64:
            dtype = torch.float32
        if dtype not in MOMENT_DTYPES:
            raise ValueError(f"{name} has dtype {dtype}, expected torch.float32 (or an encoding's dtype: "
                             f"torch.bfloat16, torch.uint8)")
        dtypes[kind] = dtype
    fmt = StateFormat(master_of(state), dtypes.get(SIGNED, torch.float32), dtypes.get(SQUARE, torch.float32),
                      codes=codes_of(state), moments=tuple(moments))
    for name, kind, dtype in fmt.moment_dtypes:
        if dtype == torch.uint8 and scale_key(name, fmt.codes, kind) not in state:
            raise ValueError(f"{name} has dtype torch.uint8 (8-bit codes) but the state holds no "
                             f"{scale_key(name, fmt.codes, kind)}, their per-block scale: give {name} in "
                             f"torch.float32 or torch.bfloat16, or the codes with their scale")
    return fmt


def codes_of(keys) -> str:
    """The release of the uint8 codes that state keys (a state dict, or a set of key names) are stored in."""
    return next((codes for codes, names in LEGACY_CODE_KEYS.items() if any(k in keys for k in names)), CODES)


def master_of(keys) -> str:
    """The master encoding that state keys (a state dict, or a set of key names) are stored in."""
    return "split" if "master_lo" in keys else "split8" if "master_hi" in keys else "fp32"


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
    values = decode_state(format_of(old, fmt.moments), param, old)
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
        stored, flat_param, layout = _flat_copies(format_of(state, _moments_in(state)), param, state)
        _encode_master_(stored, flat_param, _pad(master, layout, param, torch.float32))
        _write_back(state, stored, None, flat_param, layout)


# ---------------------------------------------------------------------------------- state_dict labels
#: The label of a state_dict entry whose moments are 8-bit codes (uint8): its ``step`` is a dict,
#: this version under :data:`CODES_KEY` and the step count under :data:`LABELLED_STEP`
#: (``{"halfadam_8bit_codes": 3, "halfadam_step": tensor(3.)}``), so the entry keeps the live state's
#: keys and holds tensors, numbers and dicts only, as ``torch.distributed.checkpoint.state_dict``'s
#: ``flatten_optimizer_state_dict=True`` needs. torch.optim reads ``step`` as a number: its
#: ``Adam``/``AdamW.load_state_dict`` raises ``TypeError: float() argument must be a string or a real
#: number, not 'dict'`` instead of taking the codes for moments (and stepping with them).
#: Version 3: the codes of 2026-12-07b (``exp_avg_sq_exponent``). Releases up to 673f2dc labelled
#: with bytes in ``step`` and the count beside it (:data:`OLDER_CODES_LABELS`: v3, v2, v1, written
#: with the codes of 2026-12-07b, 2026-12-07 and 2026-12-02; the keys say which codes an entry holds);
#: every label loads.
CODES_KEY = "halfadam_8bit_codes"
CODES_LABEL = {CODES_KEY: 3}
_LABEL = (b"halfadam 8-bit codes v%d: exp_avg/exp_avg_sq are uint8 codes, not moments; load with halfadam, "
          b"or convert with to_torch_state_dict()")
OLDER_CODES_LABELS = (_LABEL % 3, _LABEL % 2, _LABEL % 1)
#: The key of a labelled entry's step count (the 0-d float32 tensor that ``step`` holds elsewhere).
LABELLED_STEP = "halfadam_step"


def has_codes(state: Dict) -> bool:
    """Whether a parameter's state (or state_dict entry) stores a moment as 8-bit codes (uint8)."""
    return any(isinstance(state.get(k), Tensor) and state[k].dtype == torch.uint8 for k in MOMENT_KINDS)


def _moments_in(state: Dict) -> Tuple[Tuple[str, str], ...]:
    """The moments a state holds, of every rule halfadam ships (:data:`MOMENT_KINDS`)."""
    return tuple((k, kind) for k, kind in MOMENT_KINDS.items() if k in state)


def is_labelled(entry: Dict) -> bool:
    """Whether a state_dict entry (or a state a ``ZeroRedundancyOptimizer`` loaded as it was) holds a
    label in ``step``, or an older release's :data:`LABELLED_STEP` beside it."""
    return LABELLED_STEP in entry or isinstance(entry.get("step"), (bytes, str, dict))


def labelled(entry: Dict) -> Dict:
    """A state_dict entry as saved: where its moments are codes (:func:`has_codes`), a new dict whose
    ``step`` is :data:`CODES_LABEL` with the step count under :data:`LABELLED_STEP`; else ``entry``
    itself (one labelled already too)."""
    if "step" not in entry or not has_codes(entry) or is_labelled(entry):
        return entry
    return {**entry, "step": {**CODES_LABEL, LABELLED_STEP: entry["step"]}}


def unlabelled(entry: Dict, where: str) -> Dict:
    """A state_dict entry with its step count back in ``step``: a new dict where it was labelled
    (:func:`labelled`, or an older release's label), else ``entry`` itself (an entry saved before
    labels: loaded as it is).

    Raises:
        ValueError, naming ``where``: another label (a newer halfadam's format, or not halfadam's), a
            label without its step count or over moments that are not codes, a step count without a label.
    """
    if not is_labelled(entry):
        return entry
    step = entry.get("step")
    if isinstance(step, dict) and step.get(CODES_KEY) == CODES_LABEL[CODES_KEY] and set(step) <= {CODES_KEY, LABELLED_STEP}:
        count, rest = step.get(LABELLED_STEP), entry
    elif isinstance(step, bytes) and step in OLDER_CODES_LABELS:
        count, rest = entry.get(LABELLED_STEP), {k: v for k, v in entry.items() if k != LABELLED_STEP}
    elif isinstance(step, (bytes, str, dict)):
        raise ValueError(f"{where}: its state is labelled {step!r}, which this version of halfadam does not "
                         f"read (it reads {CODES_LABEL!r}); a newer halfadam wrote it? Load it with that one")
    else:
        raise ValueError(f"{where}: its state has a '{LABELLED_STEP}' but no label in 'step' (got {step!r})")
    if count is None:
        raise ValueError(f"{where}: its state is labelled as 8-bit codes but has no '{LABELLED_STEP}' (its step count)")
    if not has_codes(entry):
        raise ValueError(f"{where}: its state is labelled as 8-bit codes, but neither exp_avg nor exp_avg_sq is uint8")
    return {**rest, "step": count}


def unlabel_(state: Dict, where: str) -> None:
    """:func:`unlabelled`, in place: for a labelled state_dict entry put into an optimizer's state as
    it is (``torch.distributed.optim.ZeroRedundancyOptimizer.load_state_dict`` does)."""
    new = unlabelled(state, where)
    if new is not state:
        state.clear()
        state.update(new)
