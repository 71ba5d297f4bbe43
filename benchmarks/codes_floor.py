"""What 8-bit moment codes cost on sm_90, piece by piece, and the floor of any such codes (issue 36 item 2).

The state-mode target asks compact and tiny for at most 110 SASS instructions per element (bf16 parameters,
float32 gradients). This compiles the compact launch (split master, uint8 ``exp_avg`` and ``exp_avg_sq``,
aligned, as ``triton_compile_check.py`` does and counting as it counts) with the kernel's uint8 decoder and
encoder (``kernels/triton.py``: ``_decode_uint8``, ``_encode_uint8``) changed, one row per change:

* today's codes with one piece taken out (the ``exp_avg_sq`` rounding term unbiased in v**(1/4), the
  subnormals, the reserved nan/inf codes of the decoder);
* the cheapest codes we could write that still scale by a block's largest value: a uniform small float
  (``exp_avg``: sign + 4 exponent + 3 mantissa bits over 16 binades, flushed to 0 below; ``exp_avg_sq``: 5 + 3
  over 32 binades), its shift and add the whole encoder, with and without reserved nan/inf codes, rounded
  stochastically or down (no random bits: the hash is dead code), and with the block's maximum replaced by
  a constant (what the reduction costs).

None of the changed codes is shipped or correct (they change the bits and drop what the module docstring
of ``encodings.py`` says they buy); each row only counts instructions. Needs the triton package (its
bundled ``ptxas`` and ``nvdisasm``), not a GPU; about 40 s.

    python benchmarks/codes_floor.py
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from typing import Dict, Optional, Tuple

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, not for the interpreter
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

KERNEL = ROOT / "src" / "halfadam" / "kernels" / "triton.py"

# ------------------------------------------------------------------------ the cheapest block codes
# A uniform small float over the block's base exponent (encodings' _block_base, its span 15 / 31): the
# code is the float32 bits' exponent and top 3 mantissa bits less the base's, clamped to the codes.
UNIFORM_DECODE = '''
    @triton.jit
    def _decode_uint8(code_ptr, scale_ptr, mask, bmask, IS_EXP_AVG: tl.constexpr):
        TOP: tl.constexpr = 126 if IS_EXP_AVG else 254  # today's reserved codes
        INF: tl.constexpr = 127 if IS_EXP_AVG else 254
        NAN: tl.constexpr = 126 if IS_EXP_AVG else 255
        base = tl.load(scale_ptr, mask=bmask, other=0).to(tl.int32)[:, None]
        if IS_EXP_AVG:
            code = tl.load(code_ptr.to(tl.pointer_type(tl.int8)), mask=mask, other=0).to(tl.int32)
            k = code & 127
        else:
            k = tl.load(code_ptr, mask=mask, other=0).to(tl.int32)
        value = tl.where(k == 0, 0, (k << 20) + (base << 23))
        if NONFINITE:
            value = tl.where(k >= TOP, 0x7F800000 + (k == NAN).to(tl.int32) * 0x400000, value)  # nan, inf
        if IS_EXP_AVG:
            value = value | (code & -2147483648)
        return value.to(tl.float32, bitcast=True)
'''
UNIFORM_ENCODE = '''
    @triton.jit
    def _encode_uint8(x, r16, IS_EXP_AVG: tl.constexpr):
        TOP: tl.constexpr = 126 if IS_EXP_AVG else 254  # today's reserved codes
        INF: tl.constexpr = 127 if IS_EXP_AVG else 254
        NAN: tl.constexpr = 126 if IS_EXP_AVG else 255
        bits = x.to(tl.int32, bitcast=True)
        a = bits & 0x7FFFFFFF
        if IS_EXP_AVG:
            SPAN: tl.constexpr = 15
        else:
            SPAN: tl.constexpr = 31
        if BLOCK_MAX:
            top = tl.max(((bits << 1) + (1 << 24)).to(tl.uint32, bitcast=True), axis=1)
            base1 = tl.maximum((top >> 24).to(tl.int32) - (SPAN + 1), 1)
        else:
            base1 = tl.zeros([x.shape[0]], tl.int32) + 100
        base = base1[:, None]
        if STOCHASTIC:
            k = ((a + (r16 << 4)) >> 20) - (base << 3)
        else:
            k = (a >> 20) - (base << 3)
        k = tl.minimum(tl.maximum(k, 0 if IS_EXP_AVG else 1), TOP - 1 if NONFINITE else (127 if IS_EXP_AVG else 255))
        code = k if IS_EXP_AVG else tl.where(bits > 0, k, 0)
        if NONFINITE:
            code = tl.where(a < 0x7F800000, code, tl.where(a == 0x7F800000, INF, NAN))
        if IS_EXP_AVG:
            code = code | ((bits >> 24) & 128)
        return code, base1
'''

# today's decoder and encoder, one piece out: (old, new) replacements of kernels/triton.py's source
PIECES = {
    "v**(1/4) rounding term": [(
        "k = ((kept + r16 + ((_V_ROUNDING * f8 * (256 - f8)) >> tl.maximum(mantissa + 4, _V_MIN_SHIFT))) >> 16) + offset",
        "k = ((kept + r16) >> 16) + offset")],
    "subnormals": [
        ("y = tl.maximum(a, shifted - (1 << 23))", "y = a"),
        ("value = (line + tl.where(sub, unit + (1 << 23), unit)).to(tl.float32, bitcast=True)\n"
         "        value = tl.where(sub, value - unit.to(tl.float32, bitcast=True), value)",
         "value = (line + unit).to(tl.float32, bitcast=True)")],
    "decoder's nan/inf codes": [
        ('            value = tl.where(k == _M_INF, float("inf"), value)\n', ""),
        ("            value = tl.where(k == _M_NAN, nan, value)\n", ""),
        ('            value = tl.where(k == _V_INF, float("inf"), value)\n'
         "            value = tl.where(k == _V_NAN, nan, value)\n", "            pass\n")],
}


def _function(src: str, name: str) -> Tuple[int, int]:
    """The span of kernels/triton.py's ``@triton.jit`` function ``name`` (its decorator to the next one)."""
    start = src.index(f"    @triton.jit\n    def {name}(")
    return start, src.index("    @triton.jit\n", start + 1)


def uniform_source(src: str, nonfinite: bool, stochastic: bool, block_max: bool) -> str:
    """kernels/triton.py's source with the uniform codes for the uint8 decoder and encoder (their switches
    as constexpr globals before the first)."""
    flags = (f"    NONFINITE = tl.constexpr({nonfinite})\n    STOCHASTIC = tl.constexpr({stochastic})\n"
             f"    BLOCK_MAX = tl.constexpr({block_max})\n")
    for name, body in (("_decode_uint8", flags + UNIFORM_DECODE), ("_encode_uint8", UNIFORM_ENCODE)):
        a, b = _function(src, name)
        src = src[:a] + body.lstrip("\n") + "\n" + src[b:]
    return src


def piece_source(src: str, piece: str) -> str:
    for old, new in PIECES[piece]:
        if old not in src:
            raise RuntimeError(f"codes_floor: kernels/triton.py no longer holds {old[:60]!r} ({piece}); update PIECES")
        src = src.replace(old, new)
    return src


def sources() -> Dict[str, Tuple[Optional[str], Tuple[int, int, int]]]:
    """Each row: (the kernel's source, None for today's; its (master, m, v) kinds)."""
    src = KERNEL.read_text()
    compact = (2, 2, 2)
    rows: Dict[str, Tuple[Optional[str], Tuple[int, int, int]]] = {
        "split master, float32 moments (no codes)": (None, (2, 0, 0)),
        "bfloat16 moments, stochastic rounding": (None, (2, 1, 1)),
        "today's codes: uint8 exp_avg only": (None, (2, 2, 0)),
        "today's codes: uint8 exp_avg_sq only": (None, (2, 0, 2)),
        "today's codes (compact)": (None, compact),
    }
    for piece in PIECES:
        rows[f"today's, without the {piece}"] = (piece_source(src, piece), compact)
    for label, flags in (("uniform, round down, no nan/inf codes", (False, False, True)),
                         ("uniform, stochastic, no nan/inf codes", (False, True, True)),
                         ("uniform, stochastic, nan/inf codes", (True, True, True)),
                         ("uniform, stochastic, no nan/inf codes, no block max", (False, True, False))):
        rows[label] = (uniform_source(src, *flags), compact)
    return rows


def _kernel_module(src: Optional[str], n: int):
    """kernels/triton.py, or a module of ``src`` in its package (its relative imports hold), with new
    JIT functions (their own cache keys)."""
    if src is None:
        from halfadam.kernels import triton as kernel
        return kernel
    path = Path(tempfile.mkdtemp()) / f"_codes_floor_{n}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"halfadam.kernels._codes_floor_{n}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def instructions(kernel, kinds: Tuple[int, int, int]) -> float:
    """SASS per element of the aligned bf16 launch of ``kinds`` (triton_compile_check's count)."""
    import triton.language as tl

    import triton_compile_check as tcc

    master, mk, vk = kinds
    const = dict(P_DTYPE=tl.bfloat16, G_DTYPE=tl.float32, MASTER=master, M_KIND=mk, V_KIND=vk, L2=False,
                 OPTIMIZED=False, HAS_SCALE=False, HAS_FOUND_INF=False, SCALARS_STRIDE=0, STATE_IN_TABLE=False,
                 ALIGNED=True, ROWS=False)
    return tcc.per_element(tcc.compile_variant(const, module=kernel).asm["cubin"])


def main() -> int:
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # nothing from an earlier compile of another source
    print("compact's launch on sm_90 (bf16 parameters, float32 gradients, aligned), SASS per element; target 110")
    print("codes (today's: those of 2026-12-07b)".ljust(56), f"{'SASS':>5s} {'over split':>10s}")
    split = None
    for n, (label, (src, kinds)) in enumerate(sources().items()):
        count = instructions(_kernel_module(src, n), kinds)
        split = count if split is None else split
        print(f"{label:56s} {count:5.1f} {count - split:+10.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
