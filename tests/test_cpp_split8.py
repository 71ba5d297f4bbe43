"""The C++ kernel (``implementation="cpp"``) with a split8 master (``state_mode="tiny"``: ``master_hi``
alone, an 8-bit remainder over a bfloat16 parameter) against the specification, bit for bit, at every
lane width compiled in (16: AVX-512, 8: AVX2, 1: the scalar path that also runs the tails):
``adam_step`` on flat state of random bytes (special parameters, nan and inf gradients) against
:func:`halfadam.encodings.encoded_update_` with every moment encoding beside it; masters built at and
near the midpoint above their parameter, so that the step's rounding reaches ``c = 128`` (the
parameter moves one bfloat16 value away from zero with ``c = -128``, decoded with the +1 nudge the
next step) and the largest finite bfloat16's clamp to 127 (both counted: they are hit); parameters
with rows ending in short blocks, in flat buffers with gaps, against ``update_param_``; the argument
checks; and whole optimizer runs (``state_mode="tiny"``, cpp against the reference) with user writes
to the parameters between steps.
"""

from __future__ import annotations

import math

import pytest
import torch

from halfadam.functional import ADAM

import halfadam
from halfadam import encodings as E
from halfadam.kernels import cpp as cpu_kernel
from conftest import assert_same_runs, same_bits
from test_cpp_rows import _layout, _random_flat, _views  # noqa: F401
from test_cpp_uint8 import _kernel, _kernel_and_one_thread  # noqa: F401 (the module's fixture)

LANES = (16, 8, 1)
#: The largest finite bfloat16's float32 pattern (its magnitude).
BF16_MAX = 0x7F7F0000


def _bits(t):
    """The float32 bit patterns (int32) of float values; a bfloat16's is its own followed by 16 zeros."""
    return t.to(torch.float32).view(torch.int32)


def _from_bits(b):
    return b.to(torch.int32).view(torch.float32)


def _differences(a, b) -> list:
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    if a.is_floating_point():
        ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
        nan = a.isnan()
        differ = (nan != b.isnan()) | (~nan & (a.view(ints) != b.view(ints)))
    else:
        differ = a != b
    return differ.nonzero().view(-1)[:5].tolist()


def _master_rounding(n, step, position=0):
    """The split8 master's 8 random bits (int32) of positions ``position ..`` at ``step``."""
    return E._master_bits(E._random_bits(torch.arange(position, position + n), torch.tensor(step)))


# ---------------------------------------------------------------------------------- adam_step, one row
def _coefficients(decay, optimized, **kw):
    args = dict(step=3.0, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    args.update(kw)
    return halfadam.functional.adam_coefficients(**args, decay=decay, optimized_update=optimized)


#: bfloat16 parameter values with +-0, nan, +-inf, subnormals, the largest finite magnitudes and the
#: smallest normal one among normal ones.
SPECIAL = [0.0, -0.0, math.nan, math.inf, -math.inf, 1e-40, -3e-39, 2.0 ** -126, 1e-7,
           _from_bits(torch.tensor(BF16_MAX)).item(), -_from_bits(torch.tensor(BF16_MAX)).item()]


def _random_state(fmt, n, gen):
    """Flat state for ``n`` elements of ``fmt`` of random bytes (test_cpp_rows' ``_random_flat``:
    ``master_hi`` every int8, -128 included; uint8 codes and scales anything; float moments random
    finite values) and bfloat16 parameters with the SPECIAL values among normal ones."""
    stored = _random_flat(fmt, True, n, -(-n // 128), gen)
    p = torch.randn(n, generator=gen)
    special = torch.tensor(SPECIAL)
    pick = torch.rand(n, generator=gen) < 0.06
    p = torch.where(pick, special[torch.randint(0, special.numel(), (n,), generator=gen)], p)
    return stored, p.to(torch.bfloat16)


def _grads(n, gen, dtype=torch.float32):
    """Gradients of many scales with nan, +-inf, nans of odd payloads, a block of zeros, tiny and huge
    blocks (g * g overflowing)."""
    g = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-20, 5, (n,), generator=gen).float())
    g[torch.rand(n, generator=gen) < 0.01] = math.nan
    g[torch.rand(n, generator=gen) < 0.01] = math.inf
    g[torch.rand(n, generator=gen) < 0.01] = -math.inf
    payloads = torch.tensor([-1, 0x7FFFFFFF, 0x7F800001, 0x7FBFFFFF], dtype=torch.int32).view(torch.float32)
    g = torch.where(torch.rand(n, generator=gen) < 0.02, payloads[torch.randint(0, 4, (n,), generator=gen)], g)
    if n >= 7 * 128:
        g[3 * 128:4 * 128] = 0.0
        g[5 * 128:6 * 128] *= 1e-30
        g[6 * 128:7 * 128] *= 1e30
    return g.to(dtype)


def _step_both(kernel, fmt, stored, p, g, coefficients, step, decay, optimized, position=0, grad_scale=None):
    """One ``adam_step`` (one row: blocks over the flat parameter) and ``encoded_update_`` on copies of
    the same flat state: (kernel's param, state), (reference's param, state)."""
    n = p.numel()
    ref, ref_p = {k: v.clone() for k, v in stored.items()}, p.clone()
    ref[E.POSITION] = torch.arange(position, position + n)
    gf = g.to(torch.float32)
    if grad_scale is not None:
        gf = gf * grad_scale
    assert fmt.stochastic  # a split8 master always draws random bits
    E.encoded_update_(ref, ref_p, gf, coefficients, torch.tensor(step), fmt=fmt, rule=ADAM,
                      flags=(decay == "l2", optimized))
    out, out_p = {k: v.clone() for k, v in stored.items()}, p.clone()
    kernel.adam_step([out_p], [g], out, [0], [0], [n], list(coefficients), grad_scale, decay == "l2", optimized,
                     step, [position])
    return (out_p, out), (ref_p, {k: v for k, v in ref.items() if k in out})


def _assert_same(got, want, what):
    (gp, gs), (wp, ws) = got, want
    assert same_bits(gp, wp), (what, "param", _differences(gp, wp))
    assert gs.keys() == ws.keys()
    for key in ws:
        assert same_bits(gs[key], ws[key]), (what, key, _differences(gs[key], ws[key]))


def _assert_no_remainder_over_specials(p, hi):
    """The stored remainder is 0 over every parameter of +-0, nan or +-inf (encodings._split8_encode_)."""
    p32 = p.float()
    special = ~p32.isfinite() | (p32 == 0)
    assert special.any()
    assert bool((hi[special] == 0).all())


FORMATS = {
    "tiny": E.PRESETS["tiny"],
    "split8, float32 moments": E.StateFormat("split8"),
    "split8, bf16 moments": E.StateFormat("split8", torch.bfloat16, torch.bfloat16),
    "split8, uint8 exp_avg, bf16 exp_avg_sq": E.StateFormat("split8", torch.uint8, torch.bfloat16),
    "split8, float32 exp_avg, uint8 exp_avg_sq": E.StateFormat("split8", torch.float32, torch.uint8),
}


def test_tiny_is_split8_over_uint8_moments():
    """The preset this kernel path serves: master_hi (int8) alone, uint8 moments, always stochastic."""
    fmt = E.PRESETS["tiny"]
    assert (fmt.master, fmt.exp_avg, fmt.exp_avg_sq) == ("split8", torch.uint8, torch.uint8)
    assert fmt.stochastic and fmt.blocked and E.StateFormat("split8").stochastic
    assert E.element_keys(fmt, True) == {"master_hi": torch.int8, "exp_avg": torch.uint8, "exp_avg_sq": torch.uint8}
    assert "master_tie" not in E.block_keys(fmt, True)


@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_adam_step_on_random_state_is_the_spec(fmt, lanes):
    """``adam_step`` over flat split8 state of random bytes and special parameter values (both decays,
    both updates, a gradient scale, float32 and bfloat16 gradients, a parameter that starts mid-way in
    its whole one) writes the bytes ``encoded_update_`` writes; two steps in a row (the second decodes
    the first's remainders, -128 included)."""
    kernel = _kernel(lanes)
    fmt = FORMATS[fmt]
    gen = torch.Generator().manual_seed(11)
    n = 128 * 24
    for decay, optimized, position, scale, gdtype in (("decoupled", False, 0, None, torch.float32),
                                                      ("l2", True, 128 * 40, 0.5, torch.bfloat16),
                                                      ("decoupled", True, 128 * 3, None, torch.bfloat16)):
        stored, p = _random_state(fmt, n, gen)
        scale = None if scale is None else torch.tensor(scale)
        for step in (5, 6):
            g = _grads(n, gen, gdtype)
            got, want = _step_both(kernel, fmt, stored, p, g, _coefficients(decay, optimized, step=float(step)),
                                   step, decay, optimized, position, scale)
            _assert_same(got, want, (decay, optimized, position, step))
            p, stored = got
            _assert_no_remainder_over_specials(p, stored["master_hi"])
        assert bool((stored["master_hi"] == -128).any()) and bool((stored["master_hi"] == 127).any())


@pytest.mark.parametrize("lanes", LANES)
def test_adam_step_partial_blocks_and_unaligned_positions(lanes):
    """A parameter that ends mid-block and mid-vector (split8 over float32 and bfloat16 moments: no
    per-block state), at positions that are no multiple of the lane width (the hash's shortcut does not
    apply): the spec's bytes."""
    kernel = _kernel(lanes)
    gen = torch.Generator().manual_seed(3)
    n = 128 * 7 + 37
    for fmt in (E.StateFormat("split8"), E.StateFormat("split8", torch.bfloat16, torch.bfloat16)):
        for position in (0, 5, 128 * 3 + 9, 2 ** 32 - 300):
            stored, p = _random_state(fmt, n, gen)
            got, want = _step_both(kernel, fmt, stored, p, _grads(n, gen), _coefficients("decoupled", False), 8,
                                   "decoupled", False, position)
            _assert_same(got, want, (fmt, position))


def test_lane_widths_write_the_same_bytes():
    """Every lane width compiled in writes the same bytes on the same state (lengths of whole and partial
    vectors and blocks), and those are the spec's."""
    gen = torch.Generator().manual_seed(21)
    fmt = E.PRESETS["tiny"]
    for n in (128 * 3, 128 * 5):
        stored, p = _random_state(fmt, n, gen)
        g = _grads(n, gen)
        results = {}
        for lanes in cpu_kernel.load().available_lanes():
            got, want = _step_both(_kernel(lanes), fmt, stored, p, g, _coefficients("decoupled", True), 9,
                                   "decoupled", True, 256)
            _assert_same(got, want, (n, lanes))
            results[lanes] = got
        first = results[1]
        for lanes, got in results.items():
            _assert_same(got, first, (n, lanes, "vs 1 lane"))


# ---------------------------------------------------------------------------------- c = 128: the bump, the clamp
#: Coefficients (decay_factor, l2, step_size, sqrt_bias_correction2, one_minus_beta1, beta2, one_minus_beta2,
#: eps) of an exact step with float32 moments, zero gradients and the optimized update: m and v kept,
#: d = sqrt(1) + 0 = 1, w = w - m. With exp_avg = w - target (exact: the two are close) the new master
#: is target exactly.
TO_TARGET = (1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0)
#: ... and a step that keeps every master (step size 0): a decode and an encode.
KEEP = (1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0)


def _midpoint_targets(n, step, position, gen):
    """bfloat16 parameters and float32 targets of their masters, at and near the midpoint above them:
    per element, remainders r (bits(target) - bits(param)) that with the element's 8 random bits at
    ``step`` make floor((r + bits) / 256) exactly 128 (the bump; over the largest finite magnitudes: the
    clamp), exactly 127 (just not), or anything in [-2**15, 2**15]. Parameters of both signs, normal,
    subnormal, at a binade's top (the bump crosses into the next binade), the largest finite ones."""
    rnd = _master_rounding(n, step, position)
    kind = torch.randint(0, 8, (n,), generator=gen)
    exponent = torch.randint(1, 254, (n,), generator=gen, dtype=torch.int32)
    mantissa = torch.randint(0, 128, (n,), generator=gen, dtype=torch.int32)
    pb = (exponent << 23) | (mantissa << 16)
    pb = torch.where(kind == 5, torch.randint(1, 128, (n,), generator=gen, dtype=torch.int32) << 16, pb)  # subnormal
    pb = torch.where(kind == 6, (exponent << 23) | (127 << 16), pb)  # a binade's top: the bump crosses it
    pb = torch.where(kind == 7, torch.full_like(pb, BF16_MAX), pb)  # the largest finite
    pb = torch.where(torch.rand(n, generator=gen) < 0.5, pb | torch.tensor(-2 ** 31, dtype=torch.int32), pb)
    # r + rnd in [32768, 32768 + min(rnd, 255 - ...)]: c = 128; r <= 32768 (at most the midpoint)
    bump = 32768 - rnd + (torch.rand(n, generator=gen) * (rnd + 1).float()).to(torch.int32).clamp(max=rnd)
    below = 32767 - rnd - torch.randint(0, 64, (n,), generator=gen, dtype=torch.int32)  # c = 127
    anything = torch.randint(-32768, 32769, (n,), generator=gen, dtype=torch.int32)
    pick = torch.rand(n, generator=gen)
    r = torch.where(pick < 0.6, bump, torch.where(pick < 0.8, below, anything))
    at_max = (pb & 0x7FFFFFFF) == BF16_MAX
    r = torch.where(at_max, r.clamp(max=32767), r)  # a master above the largest finite's midpoint is inf
    param = _from_bits(pb).to(torch.bfloat16)
    target = _from_bits(pb + r)
    return param, target


@pytest.mark.parametrize("lanes", LANES)
def test_the_bump_and_the_clamp_are_the_spec(lanes):
    """Masters at and just below the midpoint above their parameter: where the 8-bit remainder rounds
    to 128 the parameter moves one bfloat16 value away from zero and stores -128 (hundreds of elements,
    both signs, subnormals, across binades), at the largest finite bfloat16 it stores 127 (the parameter
    kept), elsewhere no bump; then two steps that keep the masters decode those remainders (the -128
    one with its +1) and keep every parameter: the spec's bytes each step."""
    kernel = _kernel(lanes)
    fmt = E.StateFormat("split8")
    gen = torch.Generator().manual_seed(7)
    n, step, position = 128 * 16 + 19, 4, 128 * 2
    param, target = _midpoint_targets(n, step, position, gen)
    stored = {"master_hi": torch.zeros(n, dtype=torch.int8),
              "exp_avg": param.float() - target,  # exact (Sterbenz): the step lands on target
              "exp_avg_sq": torch.ones(n)}
    assert torch.equal(param.float() - stored["exp_avg"], target)
    got, want = _step_both(kernel, fmt, stored, param, torch.zeros(n), TO_TARGET, step, "decoupled", True, position)
    _assert_same(got, want, "to target")
    p1, s1 = got
    hi = s1["master_hi"].to(torch.int32)
    # what the rounding did, from the targets and the random bits
    rounded = target.to(torch.bfloat16)
    r = _bits(target) - _bits(rounded)
    c = (r + _master_rounding(n, step, position)) >> 8
    top = (_bits(rounded) & 0x7FFFFFFF) == BF16_MAX
    bumped = (c == 128) & ~top
    clamped = (c == 128) & top
    assert int(bumped.sum()) > 500 and int(clamped.sum()) > 50, (int(bumped.sum()), int(clamped.sum()))
    assert bool(((rounded.float() < 0) & bumped).any()) and bool(((rounded.float().abs() < 2.0 ** -126) & bumped).any())
    assert torch.equal(_bits(p1)[bumped], _bits(rounded)[bumped] + 65536)  # one bfloat16 value away from zero
    assert bool((p1.float().abs()[bumped] > rounded.float().abs()[bumped]).all())
    assert bool((hi[bumped] == -128).all())
    assert torch.equal(_bits(p1)[~bumped], _bits(rounded)[~bumped]) and bool((hi[clamped] == 127).all())
    assert bool((hi[~bumped & ~clamped] == c[~bumped & ~clamped]).all())
    # the masters decode within 1/256 of an ulp of the targets; the bumped ones at + 1 of the midpoint below
    decoded = E._split8_decode(p1, s1["master_hi"])
    assert torch.equal(_bits(decoded)[bumped], _bits(p1)[bumped] - 32767)
    for k in range(2):  # decode and encode again, the masters kept: the parameters stay
        got, want = _step_both(kernel, fmt, s1, p1, torch.zeros(n), KEEP, step + 1 + k, "decoupled", True, position)
        _assert_same(got, want, ("keep", k))
        assert torch.equal(_bits(got[0]), _bits(p1))
        p1, s1 = got


@pytest.mark.parametrize("lanes", LANES)
def test_every_remainder_byte_decodes_as_the_spec(lanes):
    """Every int8 remainder (-128 .. 127) over odd and even parameters of both signs, subnormal, normal
    and the largest finite, and over +-0, nan and +-inf: one step that keeps the masters decodes each
    as ``_split8_decode`` does (the spec's bytes; the parameters kept where finite and nonzero)."""
    kernel = _kernel(lanes)
    fmt = E.StateFormat("split8")
    params = torch.tensor([1.0, 1.0078125, -3.0, -3.015625, 2.0 ** -130, -(2.0 ** -133), 2.0 ** -126] + SPECIAL[:5]
                          + SPECIAL[-2:], dtype=torch.bfloat16)
    hi = torch.arange(-128, 128, dtype=torch.int32).to(torch.int8)
    p = params.repeat_interleave(256)
    n = p.numel()
    stored = {"master_hi": hi.repeat(params.numel()), "exp_avg": torch.zeros(n), "exp_avg_sq": torch.ones(n)}
    got, want = _step_both(kernel, fmt, stored, p, torch.zeros(n), KEEP, 3, "decoupled", True)
    _assert_same(got, want, "decode")
    finite = p.float().isfinite() & (p.float() != 0)
    assert torch.equal(_bits(got[0])[finite], _bits(p)[finite])
    _assert_no_remainder_over_specials(got[0], got[1]["master_hi"])


# ---------------------------------------------------------------------------------- flat buckets with short blocks
FLAT_SHAPES = [(8, 3, 3, 3), (7, 9), (0, 7), (33, 129), (3, 256), (2, 130), (1, 200), (3, 64)]
FLAT_POSITIONS = [0, 9 * 4, 0, 0, 256 * 2, 0, 200 * 5, 0]


@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize("fmt", ["tiny", "split8, bf16 moments"])
def test_rows_with_short_blocks_in_flat_buffers_are_the_spec(fmt, lanes):
    """Parameters whose rows end in short blocks (a conv weight (8, 3, 3, 3): rows of 27), in flat
    buffers with gaps and per-block offsets that are not ``offsets // 128``, shards' positions: one
    ``adam_step`` writes what ``update_param_`` writes on each parameter's views (its rows padded to
    whole blocks), the gaps untouched; three steps in a row."""
    kernel = _kernel(lanes)
    fmt = FORMATS[fmt]
    gen = torch.Generator().manual_seed(5)
    offsets, block_offsets, lengths, counts, total, blocks = _layout(FLAT_SHAPES)
    stored, _ = _random_state(fmt, total, gen)
    for key in E.block_keys(fmt, True):
        stored[key] = torch.randint(0, 256, (blocks,), generator=gen, dtype=torch.uint8)
    params = [_random_state(fmt, math.prod(s), gen)[1].view(s) for s in FLAT_SHAPES]
    for step, decay, optimized in ((5, "decoupled", False), (6, "l2", True), (7, "decoupled", True)):
        grads = [_grads(math.prod(s), gen).view(s) for s in FLAT_SHAPES]
        coefficients = _coefficients(decay, optimized, step=float(step))
        ref, ref_params = {k: v.clone() for k, v in stored.items()}, [p.clone() for p in params]
        for k, (p, g) in enumerate(zip(ref_params, grads)):
            if p.numel():
                E.update_param_(fmt, p, _views(ref, offsets[k], block_offsets[k], tuple(p.shape), counts[k]), g,
                                coefficients, step, rule=ADAM, flags=(decay == "l2", optimized),
                                offset=FLAT_POSITIONS[k])
        out, out_params = {k: v.clone() for k, v in stored.items()}, [p.clone() for p in params]
        kernel.adam_step(out_params, grads, out, offsets, block_offsets, lengths, list(coefficients), None,
                         decay == "l2", optimized, step, FLAT_POSITIONS)
        for k, (a, b) in enumerate(zip(out_params, ref_params)):
            assert same_bits(a, b), (step, "param", FLAT_SHAPES[k], _differences(a, b))
        for key in ref:
            assert same_bits(out[key], ref[key]), (step, key, _differences(out[key], ref[key]))
        params, stored = out_params, out


# ---------------------------------------------------------------------------------- argument checks
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=lambda d: str(d)[6:])
def test_split8_needs_bfloat16_parameters(dtype):
    """A split8 master (master_hi without master_lo) over a float16 or float32 parameter: a clear error,
    nothing written (neither the bfloat16 parameter before it nor any state)."""
    kernel = _kernel(0)
    gen = torch.Generator().manual_seed(2)
    stored, p = _random_state(E.PRESETS["tiny"], 256, gen)
    params = [p[:128].clone(), torch.randn(128, generator=gen).to(dtype)]
    grads = [torch.randn(128, generator=gen) for _ in params]
    before = ([q.clone() for q in params], {k: v.clone() for k, v in stored.items()})
    with pytest.raises(RuntimeError, match=r"params\[1\] .*a split8 master \(master_hi without master_lo\) needs a "
                                           r"bfloat16 parameter"):
        kernel.adam_step(params, grads, stored, [0, 128], [0, 1], [128, 128], list(_coefficients("decoupled", False)),
                         None, False, False, 1, [])
    for q, r in zip(params, before[0]):
        assert same_bits(q, r)
    for key in stored:
        assert torch.equal(stored[key], before[1][key]), key


def test_a_split_master_without_master_lo_still_raises():
    """master_hi and master_tie without master_lo is a broken split master, not a split8 one."""
    kernel = _kernel(0)
    stored = {"master_hi": torch.zeros(128, dtype=torch.int8), "master_tie": torch.zeros(1, dtype=torch.uint8),
              "exp_avg": torch.zeros(128), "exp_avg_sq": torch.zeros(128)}
    with pytest.raises(RuntimeError, match="a split master needs master_hi, master_lo"):
        kernel.adam_step([torch.ones(128, dtype=torch.bfloat16)], [torch.ones(128)], stored, [0], [0], [128],
                         list(_coefficients("decoupled", False)), None, False, False, 1, [])


# ---------------------------------------------------------------------------------- whole optimizer runs
#: Rows of whole blocks and of short ones (a conv weight (8, 3, 3, 3): rows of 27; (33, 129): blocks of 128
#: and 1), a large one (its own kernel call), and 1-D (an fp32 master and float32 moments there).
SHAPES = [(8, 3, 3, 3), (300, 256), (7, 9), (33, 129), (64, 64), (5,), (2, 130)]


def _write(params, t, g):
    """User writes to the parameters between steps: zeros (a pruning mask, ``mul_(0)``), -0.0, nan and
    +-inf, new values (a rescale, a copy), the largest finite bfloat16, a subnormal."""
    with torch.no_grad():
        for p in params:
            flat = p.view(-1)
            n = flat.numel()
            if t == 1:
                flat[: n // 4].mul_(0)
                flat[n // 4: n // 4 + 3] = torch.tensor([-0.0, math.nan, math.inf], dtype=p.dtype)
                flat[-1] = -math.inf
            elif t == 2:
                flat[n // 3:].mul_(1.37)
                flat[n // 2] = _from_bits(torch.tensor(BF16_MAX)).item()
                flat[0] = 3e-39
            elif t == 3:
                flat.copy_(torch.randn(n, generator=g).to(p.dtype))  # fresh values over stale remainders


def _train(impl, lanes=None, steps=5, writes=False, shapes=SHAPES, threads=1, cls=halfadam.AdamW, **kw):
    """Parameters of ``shapes`` (bfloat16), ``steps`` steps in ``state_mode="tiny"`` (a step without some
    gradients, nan and inf gradients in short blocks, a loss scale; with ``writes``, user writes before
    steps 2 to 4): (params, optimizer)."""
    if lanes is not None:
        _kernel(lanes)
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(torch.bfloat16)) for s in shapes]
    kw = dict(dict(lr=1e-2, weight_decay=0.1, state_mode="tiny"), **kw)
    opt = cls(params, implementation=impl, **kw)
    torch.set_num_threads(threads)
    try:
        for t in range(steps):
            if writes:
                _write(params, t, g)
            grads = {p: torch.randn(p.shape, generator=g).to(torch.bfloat16) for p in params}
            if t == 1:
                for p in params:
                    if tuple(p.shape) in ((7, 9), (33, 129), (5,)):
                        del grads[p]
            if t == 2:
                for p in params:
                    gp, s = grads[p], tuple(p.shape)
                    if s == (8, 3, 3, 3):
                        gp[1, 2, 2, 2] = math.nan  # a row's last element
                        gp[3, 0, 0, 0] = math.inf
                    elif s == (33, 129):
                        gp[10, 128] = math.inf  # a block of one element
                        gp[11, 128] = math.nan
                    elif s == (300, 256):
                        gp[4, 17] = -math.inf
            opt.step(grads=grads, grad_scale=torch.tensor([0.5]) if t == 3 else None)
    finally:
        torch.set_num_threads(1)
    return params, opt


def _assert_same_runs(run_a, run_b, what):
    (pa, oa), (pb, ob) = run_a, run_b
    for p, q in zip(pa, pb):
        assert same_bits(p, q), (what, tuple(p.shape), "param", _differences(p, q))
        sa, sb = oa.state[p], ob.state[q]
        assert sa.keys() == sb.keys(), (what, tuple(p.shape))
        for key in sa:
            assert sa[key].shape == sb[key].shape, (what, tuple(p.shape), key)
            assert same_bits(sa[key], sb[key]), (what, tuple(p.shape), key, _differences(sa[key], sb[key]))


@pytest.fixture(scope="module")
def reference_runs():
    return {writes: _train("reference", writes=writes) for writes in (False, True)}


@pytest.mark.parametrize("writes", [False, True], ids=["plain", "user-writes"])
@pytest.mark.parametrize("lanes", LANES)
def test_training_tiny_is_the_reference(reference_runs, lanes, writes):
    """cpp and reference, 5 steps of ``state_mode="tiny"`` (a partial step, nan and inf gradients, a loss
    scale; user writes to the parameters between steps): every parameter's and state tensor's bytes.
    The state is split8's: master_hi (int8) without master_lo or master_tie, uint8 moments and scales."""
    run = _train("cpp", lanes, writes=writes)
    _assert_same_runs(reference_runs[writes], run, (lanes, writes))
    params, opt = run
    st = opt.state[params[0]]
    assert st["master_hi"].dtype == torch.int8 and st["master_hi"].shape == (8, 3, 3, 3)
    assert not {"master_lo", "master_tie", "master_weight"} & st.keys()
    assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.uint8 and st["exp_avg_scale"].shape == (8, 1)
    assert "master_weight" in opt.state[params[SHAPES.index((5,))]]  # 1-D: an fp32 master
    assert bool((st["master_hi"] != 0).any())


@pytest.mark.parametrize("kw", [dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16),
                                dict(exp_avg_dtype=torch.float32), dict(cls=halfadam.Adam)],
                         ids=["bf16-moments", "float32-exp_avg", "adam-l2"])
def test_training_split8_overrides_are_the_reference(kw):
    """``state_mode="tiny"`` with its moments overridden (split8 over bfloat16 moments, over a float32
    exp_avg beside a uint8 exp_avg_sq), and Adam (l2 decay): cpp and reference, the same bytes."""
    ref = _train("reference", steps=3, writes=True, **kw)
    run = _train("cpp", 0, steps=3, writes=True, **kw)
    _assert_same_runs(ref, run, kw)
    assert "master_hi" in run[1].state[run[0][0]] and "master_lo" not in run[1].state[run[0][0]]


def test_threads_split_the_work_not_the_bytes(reference_runs):
    """Two threads split the bucket at block boundaries (inside rows of short blocks): the same bytes."""
    _assert_same_runs(reference_runs[False], _train("cpp", 0, threads=2), "threads")
