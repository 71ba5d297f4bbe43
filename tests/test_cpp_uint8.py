"""The C++ kernel (``implementation="cpp"``) against the specification, :mod:`halfadam.encodings`, bit
for bit, at every lane width compiled in (16: AVX-512, 8: AVX2, 1: the scalar path that also runs the
tails): its uint8 moment encoder and decoder (``encode_uint8``/``decode_uint8``) on values chosen to be
hard (every code's value and its neighbours, the random bits' rounding boundaries, subnormal tiers and
float32 subnormals, zero blocks, blocks at 2**127, nan and inf, -0.0, negative exp_avg_sq), every code
under every scale byte, ``adam_step`` on flat state of random bytes against
``encodings.encoded_update_``, and whole optimizer runs in every state mode against the reference
execution.
"""

from __future__ import annotations

import math

import pytest
import torch

from halfadam.functional import ADAM

import halfadam
from halfadam import encodings as E
from halfadam import executions
from halfadam.kernels import cpp as cpu_kernel
from conftest import assert_same_runs, same_bits

NAMES = ("exp_avg", "exp_avg_sq")
LANES = (16, 8, 1)
MODES = ("fp32", "split", "bf16", "compact")


@pytest.fixture(autouse=True, scope="module")
def _kernel_and_one_thread(one_thread):
    assert cpu_kernel.load() is not None, cpu_kernel.unavailable_reason()
    yield
    cpu_kernel.load().set_lanes(0)


def _kernel(lanes: int):
    """The kernel, running ``lanes`` lanes (0: the widest; skips a width this machine's build does not have)."""
    kernel = cpu_kernel.load()
    if lanes and lanes not in kernel.available_lanes():
        pytest.skip(f"{lanes} lanes are not compiled in on this CPU")
    kernel.set_lanes(lanes)
    return kernel


def _bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32) if t.element_size() == 4 else t


def _f(bits):
    """float32 values of int32 (or int64) bit patterns."""
    return torch.as_tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _rounding(name, n, step):
    """The 16 random bits of each of n positions (from 0) at ``step``."""
    return E._moment_bits(E._random_bits(torch.arange(n), torch.tensor(step)), name)


def _spec_encode(name, x, step):
    stored = {name: torch.zeros(x.numel(), dtype=torch.uint8), E.scale_key(name): torch.zeros(x.numel() // 128, dtype=torch.uint8)}
    E._encode_moment_(torch.uint8, name, x.clone(), stored, E._random_bits(torch.arange(x.numel()), torch.tensor(step)))
    return stored


def _spec_decode(name, codes, scale):
    return E._decode_moment(torch.uint8, name, {name: codes, E.scale_key(name): scale})


def test_the_codes_compiled_in_are_the_spec():
    """The kernel's constants (the top of adam_cpu.cpp: ``Codes<...>::kTiers``, ``kNan``, ``kInf``, ``kMask``,
    ``kSalt``) are encodings.py's: edit them there when the spec's change."""
    codes, salt = cpu_kernel.load().uint8_codes()
    assert salt == E._SALT
    for name in NAMES:
        tiers, nan, inf, mask = codes[name]
        assert [tuple(t) for t in tiers] == [tuple(t) for t in E._TIERS[name]], (name, "_TIERS")
        assert (nan, inf, mask) == (E._NAN_CODE[name], E._INF_CODE[name], E._MAGNITUDE_MASK[name]), name


# ---------------------------------------------------------------------------------- hard values
def _top(name, base):
    """A magnitude in the top binade of a block of base ``base`` (the block's base is then ``base``)."""
    return 1.5 * 2.0 ** (base + E._SPAN[name] - 127)


def _block_with_base(name, base, values):
    """Blocks of base ``base``: each starts with a magnitude of its top binade, then 127 of ``values``."""
    values = values.reshape(-1)
    values = torch.cat([values, values.new_zeros(-values.numel() % 127)]).view(-1, 127)
    head = torch.full((values.shape[0], 1), _top(name, base))
    return torch.cat([head, values], dim=1).reshape(-1)


def _code_values(name, base):
    """Every magnitude code's value over ``base`` (below the reserved ones), and its float32 neighbours."""
    top = E._TIER_TABLE[name][2]
    k = torch.arange(top + 1, dtype=torch.int32).view(1, -1)
    v = E._decode_magnitude(k, torch.tensor([[base]], dtype=torch.int32), name).view(-1)
    up, down = torch.nextafter(v, torch.tensor(math.inf)), torch.nextafter(v, torch.tensor(0.0))
    return torch.cat([v, up, down, (v[1:] + v[:-1]) / 2])


def _boundary_values(name, base, step, n_blocks, gen):
    """Blocks of base ``base`` whose elements sit exactly at the random bits' rounding boundary of their
    position (at ``step``) or one below it: a code's value plus the share of a step that, with the
    element's own 16 random bits, just rounds up (and the next smaller float32, which does not)."""
    tiers, _, top = E._TIER_TABLE[name]
    n = n_blocks * 128
    rnd = _rounding(name, n, step)
    k = torch.randint(0, top, (n,), generator=gen, dtype=torch.int32)
    v0 = E._decode_magnitude(k.view(-1, 1), torch.full((n, 1), base, dtype=torch.int32), name).view(-1)
    mantissa = torch.full((n,), tiers[0][0])
    for m, r0, first in tiers[1:]:
        mantissa = torch.where(k >= first, m, mantissa)
    unit = 2.0 ** (base - 127)
    sub = k < (1 << tiers[0][0])
    shift = (7 - mantissa).long()
    up = (1 << 16) - rnd  # the remainder (16 bits) that rounds up with these random bits...
    if name == "exp_avg_sq":  # ... with exp_avg_sq's extra (5 f8 (256 - f8)) >> max(mantissa + 4, 6): the least one
        cand = up.view(-1, 1) - torch.arange(3000).view(1, -1)  # remainder + extra rises with the remainder
        f8 = (cand >> 8) & 255
        by = (mantissa.view(-1, 1).long() + 4).clamp(min=E._V_ROUNDING_MIN_SHIFT)
        ok = (cand >= 0) & (cand + rnd.view(-1, 1) + ((5 * f8 * (256 - f8)) >> by) >= 1 << 16)
        up = torch.where(ok, cand, 1 << 17).amin(dim=1)
    d = up << shift
    d = torch.where(torch.rand(n, generator=gen) < 0.5, d, d - 1)  # ... or just not
    normal = _f(v0.view(torch.int32).long() + d)
    subnormal = _f(torch.tensor(unit).view(torch.int32).long() + (k.long() << (23 - tiers[0][0])) + d) - unit
    x = torch.where(sub, subnormal, normal).view(-1, 128)
    x[:, 0] = _top(name, base)  # the block's base
    return x.reshape(-1)


def _hard_values(name, step):
    g = torch.Generator().manual_seed(7)
    span = E._SPAN[name]
    blocks = []
    for base in (1, 2, 60, 127, 200, 254 - span - 1):
        blocks.append(_block_with_base(name, base, _code_values(name, base)))
        blocks.append(_boundary_values(name, base, step, 3, g))
    # random blocks over 40 binades at block scales from 2**-149 (subnormal) to 2**127
    rand = torch.rand(128 * 64, generator=g) * torch.exp2(-torch.rand(128 * 64, generator=g) * 40)
    blocks.append(rand * torch.exp2(torch.linspace(-149, 127, 64)).repeat_interleave(128))
    blocks.append(torch.zeros(128))
    blocks.append(torch.full((128,), 3.4028234663852886e38))  # float32's largest: rounds up to the top code
    tiny = torch.zeros(128)
    tiny[:6] = torch.tensor([2.0 ** -149, 2.0 ** -148, 3 * 2.0 ** -149, 2.0 ** -127, 2.0 ** -126, 0.0])
    blocks.append(tiny)
    zeros = torch.zeros(128)
    zeros[::3] = -0.0
    blocks.append(zeros)
    # non-finite values with finite ones, a block of only nan and inf, one with nothing else finite than 0
    mixed = rand[:128].clone()
    mixed[:5] = torch.tensor([math.nan, math.inf, -math.inf, -math.nan, 0.0])
    blocks += [mixed, torch.tensor([math.nan, math.inf, -math.inf, -math.nan] * 32)]
    nan_zero = torch.zeros(128)
    nan_zero[7] = math.nan
    blocks.append(nan_zero)
    x = torch.cat(blocks)
    if name == "exp_avg":
        return x * torch.where(torch.rand(x.numel(), generator=g) < 0.5, -1.0, 1.0)
    neg = x.clone()
    neg[::5] = -neg[::5]  # negative exp_avg_sq values (loaded states): code 0
    return torch.cat([x, neg])


@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize("name", NAMES)
def test_encoder_is_the_spec(name, lanes):
    """``encode_uint8`` (the block encoder ``adam_step`` runs) writes ``_encode_moment_``'s codes and
    scales, and ``decode_uint8`` gives ``_decode_moment``'s values, on the hard values, for three steps
    (the random bits)."""
    kernel = _kernel(lanes)
    for step in (1, 2, 977):
        x = _hard_values(name, step)
        want = _spec_encode(name, x, step)
        codes = torch.full((x.numel(),), 77, dtype=torch.uint8)
        scale = torch.full((x.numel() // 128,), 99, dtype=torch.uint8)
        kernel.encode_uint8(x, codes, scale, name == "exp_avg", step)
        assert torch.equal(scale, want[E.scale_key(name)]), (step, (scale != want[E.scale_key(name)]).nonzero()[:5])
        bad = (codes != want[name]).nonzero().view(-1)
        assert bad.numel() == 0, (step, bad[:8].tolist(), x[bad[:8]].tolist(), codes[bad[:8]].tolist(),
                                  want[name][bad[:8]].tolist())
        assert same_bits(kernel.decode_uint8(codes, scale, name == "exp_avg"), _spec_decode(name, codes, scale))


def test_hard_values_are_hard():
    """The boundary values round both ways, subnormal codes and every tier are among the codes."""
    for name in NAMES:
        x = _hard_values(name, 2)
        codes = _spec_encode(name, x, 2)[name].long() & E._MAGNITUDE_MASK[name]
        firsts = [first for _, _, first in E._TIER_TABLE[name][0]]
        assert all(bool(((codes >= f) & (codes < f + 4)).any()) for f in firsts)
        assert bool(((codes > 0) & (codes < firsts[0])).any())
        # at a boundary the element rounds up to the next code; one float32 below, it stays
        b = _boundary_values(name, 60, 2, 3, torch.Generator().manual_seed(7)).view(-1, 128)[:, 1:]
        stored = _spec_encode(name, _boundary_values(name, 60, 2, 3, torch.Generator().manual_seed(7)), 2)
        k = stored[name].view(-1, 128)[:, 1:].long() & E._MAGNITUDE_MASK[name]
        v = E._decode_magnitude(k.int(), torch.full((3, 1), 60, dtype=torch.int32), name)
        above = v > b.abs()
        assert 0.3 < float(above.float().mean()) < 0.7, float(above.float().mean())


@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize("name", NAMES)
def test_decoder_every_code_and_scale(name, lanes):
    """Every code under every scale byte (garbage ones included: a state written by hand) decodes as the spec."""
    kernel = _kernel(lanes)
    codes = torch.arange(256, dtype=torch.uint8).repeat(256)  # each scale over two blocks: every code
    scale = torch.arange(256, dtype=torch.uint8).repeat_interleave(2)
    assert same_bits(kernel.decode_uint8(codes, scale, name == "exp_avg"), _spec_decode(name, codes, scale))


# ---------------------------------------------------------------------------------- adam_step on flat state
COEFFICIENTS = dict(step=3.0, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


def _coefficients(decay, optimized):
    return halfadam.functional.adam_coefficients(**COEFFICIENTS, decay=decay, optimized_update=optimized)


def _random_state(fmt, dtype, n, gen, has_master=True):
    """Flat state for ``n`` elements of ``fmt`` of random bytes (uint8 moments: random codes and scales;
    float moments: random finite values; remainders and tie bytes anything), and parameter values with
    +-0, nan, +-inf, subnormals, odd and even bf16 patterns."""
    stored = {}
    for key, dt in E.element_keys(fmt, has_master).items():
        if dt == torch.uint8 or dt == torch.int8:
            stored[key] = torch.randint(-128 if dt == torch.int8 else 0, 128 if dt == torch.int8 else 256, (n,),
                                        generator=gen, dtype=dt)
        elif key == "master_weight":
            stored[key] = torch.randn(n, generator=gen)
        else:
            v = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-30, 10, (n,), generator=gen).float())
            stored[key] = (v.abs() if key == "exp_avg_sq" else v).to(dt)
    for key, dt in E.block_keys(fmt, has_master).items():
        if key == "master_tie":
            tie = torch.randint(0, 129, (n // 128,), generator=gen)
            stored[key] = torch.where(torch.rand(n // 128, generator=gen) < 0.5, tie, 0).to(dt)
        else:
            stored[key] = torch.randint(0, 256, (n // 128,), generator=gen, dtype=dt)
    p = torch.randn(n, generator=gen)
    special = torch.tensor([0.0, -0.0, math.nan, math.inf, -math.inf, 1e-40, -3e-39, 2.0 ** -126, 65504.0, 1e-7])
    pick = torch.rand(n, generator=gen) < 0.05
    p = torch.where(pick, special[torch.randint(0, special.numel(), (n,), generator=gen)], p).to(dtype)
    if "master_weight" in stored:  # mostly a master that rounds to the parameter (some written over)
        near = p.float() + torch.randn(n, generator=gen) * p.float().abs() * 2.0 ** -10
        stored["master_weight"] = torch.where(torch.rand(n, generator=gen) < 0.9, near, stored["master_weight"])
    return stored, p


def _grads(n, gen, dtype):
    g = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-20, 5, (n,), generator=gen).float())
    g[torch.rand(n, generator=gen) < 0.01] = math.nan
    g[torch.rand(n, generator=gen) < 0.01] = math.inf
    # nans whose payloads, truncated to bfloat16 with random bits added, would carry into the sign bit
    # (0xFFFFFFFF: +0) or leave an infinity (0x7F800001): a bfloat16 moment stores them as nan
    payloads = torch.tensor([-1, 0x7FFFFFFF, 0x7F800001, 0x7FBFFFFF], dtype=torch.int32).view(torch.float32)
    g = torch.where(torch.rand(n, generator=gen) < 0.02, payloads[torch.randint(0, 4, (n,), generator=gen)], g)
    g.view(-1, 128)[3] = 0.0  # a block of zero gradients
    g.view(-1, 128)[5] *= 1e-30
    g.view(-1, 128)[6] *= 1e30  # g * g overflows
    return g.to(dtype)


def _step_both(kernel, fmt, stored, p, g, coefficients, step, decay, optimized, position=0, grad_scale=None):
    """One adam_step of the kernel and encoded_update_ on copies of the same flat state: their results."""
    n = p.numel()
    has_master = p.dtype != torch.float32
    ref = {k: v.clone() for k, v in stored.items()}
    ref_p = p.clone()
    if not has_master:
        ref["weight"] = ref_p
    ref[E.POSITION] = torch.arange(position, position + n)
    gf = g.to(torch.float32)
    if grad_scale is not None:
        gf = gf * grad_scale
    seed = torch.tensor(step) if fmt.stochastic or torch.uint8 in (fmt.exp_avg, fmt.exp_avg_sq) else None
    E.encoded_update_(ref, ref_p if has_master else None, gf, coefficients, seed, fmt=fmt,
                      rule=ADAM, flags=(decay == "l2", optimized))
    out = {k: v.clone() for k, v in stored.items()}
    out_p = p.clone()
    kernel.adam_step([out_p], [g], out, [0], [0], [n], list(coefficients), grad_scale, decay == "l2", optimized,
                     step, [position])  # one row: blocks over the flat parameter
    return (out_p, out), (ref_p, {k: v for k, v in ref.items() if k in out})


def _assert_same(got, want, what):
    (gp, gs), (wp, ws) = got, want
    assert same_bits(gp, wp), (what, "param", (_bits(gp) != _bits(wp)).nonzero()[:5].view(-1).tolist())
    for key in ws:
        assert same_bits(gs[key], ws[key]), (what, key, (_bits(gs[key]) != _bits(ws[key])).nonzero()[:5].view(-1).tolist())


FORMATS = {
    "fp32": E.PRESETS["fp32"], "split": E.PRESETS["split"], "bf16": E.PRESETS["bf16"], "compact": E.PRESETS["compact"],
    "fp32 master, uint8 moments": E.StateFormat("fp32", torch.uint8, torch.uint8),
    "split, bf16 exp_avg, uint8 exp_avg_sq": E.StateFormat("split", torch.bfloat16, torch.uint8),
    "split, uint8 exp_avg, bf16 exp_avg_sq": E.StateFormat("split", torch.uint8, torch.bfloat16),
    "fp32 master, float32 exp_avg, uint8 exp_avg_sq": E.StateFormat("fp32", torch.float32, torch.uint8),
}


@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_adam_step_on_random_state_is_the_spec(fmt, dtype, lanes):
    """``adam_step`` over flat state of random bytes and special parameter values (both decays, both
    updates, a gradient scale, and a parameter that starts mid-way in its whole one) writes the bytes
    ``encoded_update_`` writes."""
    kernel = _kernel(lanes)
    fmt = FORMATS[fmt]
    if dtype == torch.float32:
        fmt = E.StateFormat("fp32", fmt.exp_avg, fmt.exp_avg_sq)
    gen = torch.Generator().manual_seed(11)
    n = 128 * 24
    for decay, optimized, position, scale in (("decoupled", False, 0, None), ("l2", True, 128 * 40, 0.5),
                                              ("decoupled", True, 128 * 3, None)):
        stored, p = _random_state(fmt, dtype, n, gen, has_master=dtype != torch.float32)
        if dtype == torch.float32:
            p = torch.where(p.isnan(), 0.5, p)  # a float32 weight is the master itself
        g = _grads(n, gen, dtype if dtype != torch.float16 else torch.float32)
        scale = None if scale is None else torch.tensor(scale)
        got, want = _step_both(kernel, fmt, stored, p, g, _coefficients(decay, optimized), 5, decay, optimized,
                               position, scale)
        _assert_same(got, want, (decay, optimized, position))


@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "split, uint8 exp_avg, bf16 exp_avg_sq"])
def test_adam_step_partial_blocks_and_unaligned_positions(fmt, lanes):
    """Parameters that end mid-block and mid-vector (fp32 masters; bfloat16 moments), at positions that
    are no multiple of the lane width (the hash's shortcut does not apply)."""
    kernel = _kernel(lanes)
    fmt = FORMATS[fmt]
    gen = torch.Generator().manual_seed(3)
    n = 128 * 7 + 37 if fmt.master == "fp32" and torch.uint8 not in (fmt.exp_avg, fmt.exp_avg_sq) else 128 * 9
    for position in (0, 5, 128 * 3 + 9):
        if position % 128 and (fmt.master == "split" or torch.uint8 in (fmt.exp_avg, fmt.exp_avg_sq)):
            continue  # blocks start at multiples of 128 there
        stored, p = _random_state(fmt, torch.bfloat16, n, gen)
        got, want = _step_both(kernel, fmt, stored, p, _grads(n + (-n % 128), gen, torch.bfloat16)[:n],
                               _coefficients("decoupled", False), 8, "decoupled", False, position)
        _assert_same(got, want, position)


@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
def test_split_master_ties(dtype, lanes):
    """Masters exactly halfway above an even parameter (remainder +2**15) in whole blocks: the first of
    each block is flagged by its tie byte, the others clamped (encodings._split_encode_), and decoded back
    as the spec does: a multiplication by 1 + 2**-8 of 1.0 (step size 0) makes every lane a tie."""
    kernel = _kernel(lanes)
    fmt = E.PRESETS["split"]
    n = 128 * 4
    stored = {"master_hi": torch.zeros(n, dtype=torch.int8), "master_lo": torch.zeros(n, dtype=torch.uint8),
              "master_tie": torch.zeros(n // 128, dtype=torch.uint8), "exp_avg": torch.zeros(n),
              "exp_avg_sq": torch.zeros(n)}
    p = torch.ones(n, dtype=dtype)
    p.view(-1, 128)[1, :17] = 3.0  # an odd bf16 pattern before the ties
    factor = 1 + (2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11)
    coefficients = (factor, 0.0, 0.0, 1.0, 0.1, 0.999, 0.001, 1e-8)
    g = torch.zeros(n, dtype=torch.float32)
    for step in range(3):
        got, want = _step_both(kernel, fmt, stored, p, g, coefficients, step + 1, "decoupled", False)
        _assert_same(got, want, step)
        p, stored = got
        if step == 0:  # every block had ties (the one with odd parameters after them); decoded next step
            assert stored["master_tie"].tolist() == [1, 18, 1, 1]


# ---------------------------------------------------------------------------------- the uint8 encoding of a step
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=lambda d: str(d)[6:])
def test_one_kernel_step_encodes_the_fp32_state_values(dtype):
    """One C++ step from fresh state in compact and in fp32 state: the compact run's codes and scales are
    ``_encode_moment_`` of the fp32 run's exp_avg and exp_avg_sq (step 1's random bits), with gradients
    that make blocks of zeros, subnormal and huge moments, an overflowing g * g, nan and inf (rows of 1
    to 3 blocks; a 1-D parameter keeps float32 moments in both runs)."""
    def run(mode):
        torch.manual_seed(0)
        shapes = [(547, 128), (300, 384), (5,), (1, 256)]
        params = [torch.randn(s).to(dtype).requires_grad_() for s in shapes]
        opt = halfadam.AdamW(params, lr=1e-2, weight_decay=0.1, implementation="cpp", state_mode=mode)
        torch.manual_seed(1)
        grads = {p: torch.randn(p.shape) for p in params}
        g = grads[params[0]].view(-1)
        g[128:256] = 0.0
        g[256:384] *= 1e-40  # subnormal exp_avg, exp_avg_sq underflows to 0
        g[384:512] *= 1e18  # exp_avg_sq ~1e33
        g[512 + 9] = 1e30  # g * g overflows: exp_avg_sq inf
        g[640 + 3], g[768 + 100], g[896 + 127] = math.nan, math.inf, -math.inf
        g[-1] = math.nan  # the last block
        grads[params[1]].view(-1)[:128] = 2.0 ** -130
        opt.step(grads=grads)
        return params, opt
    _kernel(16 if 16 in cpu_kernel.load().available_lanes() else 8)
    (p32, o32), (p8, o8) = run("fp32"), run("compact")
    assert o8.state[p8[2]]["exp_avg"].dtype == torch.float32  # 1-D: no blocks
    for a, b in zip(p32[:2] + p32[3:], p8[:2] + p8[3:]):
        n = a.numel()
        s32, s8 = o32.state[a], o8.state[b]
        for name in NAMES:
            want = _spec_encode(name, s32[name].reshape(-1).clone(), 1)
            assert torch.equal(s8[name].reshape(-1), want[name]), name
            assert s8[E.scale_key(name)].shape == (a.shape[0], a[0].numel() // 128)
            assert torch.equal(s8[E.scale_key(name)].reshape(-1), want[E.scale_key(name)]), name


# ---------------------------------------------------------------------------------- training
SHAPES = [(300, 256), (547, 128), (5,), (3, 256), (129,)]
OVERRIDES = {
    "compact+fp32-master": dict(state_mode="compact", store_param_remainders=False),
    "compact+bf16-exp_avg": dict(state_mode="compact", exp_avg_dtype=torch.bfloat16),
    "bf16+uint8-exp_avg_sq": dict(state_mode="bf16", exp_avg_sq_dtype=torch.uint8),
    "fp32+uint8-exp_avg_sq": dict(state_mode="fp32", exp_avg_sq_dtype=torch.uint8),
}


def _train(impl, dtype, cls, kw, steps=4, poison=False, lanes=None):
    """Parameters of SHAPES and a strided one, ``steps`` steps (a parameter without a gradient at step 2,
    a loss scale at step 4; with ``poison`` a nan and an inf gradient at step 3): (params, optimizer)."""
    if lanes is not None:
        _kernel(lanes)
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]
    params.append(torch.nn.Parameter(torch.randn(256, 3, generator=g).to(dtype).t()))  # strided, rows of 256
    opt = cls(params, lr=1e-2, implementation=impl, **kw)
    for t in range(steps):
        grads = {p: torch.randn(p.shape[::-1], generator=g).t() if p.dim() == 2 and not p.is_contiguous()
                 else torch.randn(p.shape, generator=g).to(dtype) for p in params}
        if t == 1:
            del grads[params[3]]
        if poison and t == 2:
            grads[params[0]].view(-1)[200] = math.nan
            grads[params[1]].view(-1)[-1] = math.inf  # the last block
        scale = torch.tensor([0.5]) if t == 3 else None
        opt.step(grads=grads, grad_scale=scale)
    return params, opt


@pytest.mark.parametrize("decay", ["decoupled", "l2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("mode", MODES)
def test_training_is_the_reference_bit_for_bit(mode, dtype, decay):
    """cpp and reference, 4 steps (a partial step, a loss scale, nan and inf gradients), every state mode,
    AdamW (decoupled decay) and Adam (l2): every parameter's and state tensor's bytes, at every lane width."""
    cls = halfadam.AdamW if decay == "decoupled" else halfadam.Adam
    kw = dict(weight_decay=0.1, state_mode=mode)
    ref = _train("reference", dtype, cls, kw, poison=True)
    for lanes in LANES:
        if lanes in cpu_kernel.load().available_lanes():
            assert_same_runs(ref, _train("cpp", dtype, cls, kw, poison=True, lanes=lanes), (mode, lanes))


@pytest.mark.parametrize("fmt", list(OVERRIDES))
def test_training_overrides_are_the_reference(fmt):
    kw = dict(weight_decay=0.1, **OVERRIDES[fmt])
    ref = _train("reference", torch.bfloat16, halfadam.AdamW, kw, poison=True)
    assert_same_runs(ref, _train("cpp", torch.bfloat16, halfadam.AdamW, kw, poison=True, lanes=0), fmt)


def test_adamfp16_is_the_reference():
    for kw in (dict(weight_decay=halfadam.WeightDecay(1e-3, absolute=True)), dict(optimized_update=False)):
        kw = dict(kw, state_mode="compact")
        assert_same_runs(_train("reference", torch.float16, halfadam.AdamFP16, kw),
                         _train("cpp", torch.float16, halfadam.AdamFP16, kw, lanes=0), kw)


def test_threads_split_the_work_not_the_bytes():
    kw = dict(weight_decay=0.1, state_mode="compact")
    one = _train("cpp", torch.bfloat16, halfadam.AdamW, kw, lanes=0)
    torch.set_num_threads(2)
    try:
        two = _train("cpp", torch.bfloat16, halfadam.AdamW, kw, lanes=0)
    finally:
        torch.set_num_threads(1)
    assert_same_runs(one, two, "threads")


def test_auto_runs_cpp_in_compact_on_cpu(monkeypatch):
    """``auto`` runs the C++ kernel in every state mode on the CPU: nothing is compiled by torch."""
    def no_compile(*a, **k):
        raise AssertionError("auto compiled a kernel although the C++ kernel applies")
    monkeypatch.setattr(executions, "_get_compiled", no_compile)
    for mode in ("compact", "bf16"):
        kw = dict(weight_decay=0.1, state_mode=mode)
        ref = _train("reference", torch.bfloat16, halfadam.AdamW, kw, steps=2)
        assert_same_runs(ref, _train("auto", torch.bfloat16, halfadam.AdamW, kw, steps=2, lanes=0), mode)
