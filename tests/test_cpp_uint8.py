"""The C++ kernel's 8-bit moments (``state_mode="compact"``, ``exp_avg_dtype``/``exp_avg_sq_dtype=torch.uint8``)
against the specification, :mod:`halfadam.encodings`: the encoder's bytes and the decoder's values for
values chosen to be hard (exact ties, code boundaries, zero, subnormal and huge block scales, nan and
inf), one kernel step against ``_encode_moment_`` of the fp32 state's values, and whole training runs
against the reference execution, bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch

import halfadam
from halfadam import executions
from halfadam.kernels import cpp as cpu_kernel
from halfadam import encodings as E
from conftest import assert_same_runs

CPU = torch.device("cpu")
TABLES = E.tables(E.PRESETS["compact"], CPU)
NAMES = ("exp_avg", "exp_avg_sq")


@pytest.fixture(autouse=True, scope="module")
def _kernel_and_one_thread(one_thread):
    assert cpu_kernel.load() is not None, cpu_kernel.unavailable_reason()
    yield


def _bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32) if t.element_size() == 4 else t


def _spec_encode(name, x, seed, dtype=torch.uint8):
    """``encodings._encode_moment_`` of float32 ``x`` (whole blocks) as ``name`` in ``dtype``."""
    stored = {name: torch.zeros(x.numel(), dtype=dtype), f"{name}_absmax": torch.zeros(x.numel() // 128)}
    E._encode_moment_(dtype, name, x.clone(), stored, TABLES, torch.tensor(seed))
    return stored


def _blocks(*parts):
    """Blocks of 128 (each part padded with zeros to a multiple of 128), concatenated."""
    out = []
    for p in parts:
        p = p.reshape(-1).float()
        out.append(torch.cat([p, p.new_zeros(-p.numel() % 128)]))
    return torch.cat(out)


def _hard_values(name):
    """Blocks whose codes sit where an estimate could go either way, and every kind of block scale."""
    g = torch.Generator().manual_seed(1)
    dyn, _, levels = TABLES
    one = torch.tensor([1.0])
    blocks = []
    if name == "exp_avg":
        # a block whose absmax is exactly 1: y is the value itself. The map's values, the float32
        # midpoints of neighbours and their neighbours one and two ulps away (exact ties among them)
        mids = (dyn[1:] + dyn[:-1]) / 2
        up1 = torch.nextafter(mids, torch.tensor(2.0))
        down1 = torch.nextafter(mids, torch.tensor(-2.0))
        near = torch.cat([dyn, mids, up1, down1, torch.nextafter(up1, torch.tensor(2.0)),
                          torch.nextafter(down1, torch.tensor(-2.0)), torch.nextafter(dyn, torch.tensor(2.0)),
                          torch.nextafter(dyn, torch.tensor(-2.0))]).clamp(-1, 1)
        # decade boundaries 10**-k and their neighbours, both signs
        bounds = torch.tensor([10.0 ** -k for k in range(8)])
        bounds = torch.cat([bounds, torch.nextafter(bounds, torch.tensor(2.0)),
                            torch.nextafter(bounds, torch.tensor(0.0))])
        bounds = torch.cat([bounds, -bounds]).clamp(-1, 1)
        for chunk in torch.cat([near, bounds]).split(127):
            blocks.append(torch.cat([one, chunk]))
        # ... and scaled by a power of two (y unchanged) and by 3 (y rounded)
        blocks += [b * 2.0 ** 20 for b in blocks[:4]] + [b * 3.0 for b in blocks[:4]]
        signed = torch.where(torch.rand(128 * 40, generator=g) < 0.5, -1.0, 1.0)
    else:
        # absmax 1: the levels themselves, one ulp either side, the midpoints between levels
        lv = levels[1:]
        near = torch.cat([lv, torch.nextafter(lv, torch.tensor(2.0)), torch.nextafter(lv, torch.tensor(0.0)),
                          (levels[1:-1] + levels[2:]) / 2, torch.tensor([2.0 ** -24, 2.0 ** -25, 2.0 ** -30, 1e-38,
                                                                         2.0 ** -149, 0.0, -0.0])]).clamp(0, 1)
        for chunk in near.split(127):
            blocks.append(torch.cat([one, chunk]))
        blocks += [b * 2.0 ** -60 for b in blocks[:4]] + [b * 7.0 for b in blocks[:4]]
        signed = torch.ones(128 * 40)
    # random blocks over 30 octaves, at block scales from 2**-140 (subnormal absmax) to 2**127 (huge)
    rand = torch.rand(128 * 40, generator=g) * torch.exp2(-torch.rand(128 * 40, generator=g) * 30) * signed
    scale = torch.exp2(torch.linspace(-140, 127, 40)).repeat_interleave(128)
    blocks.append(rand * scale)
    blocks.append(torch.zeros(128))  # absmax 0
    blocks.append(torch.full((128,), 3.0e38))  # the largest values
    tiny = torch.zeros(128)
    tiny[:5] = torch.tensor([2.0 ** -149, 2.0 ** -148, 3 * 2.0 ** -149, 2.0 ** -127, 0.0])
    blocks.append(tiny)
    # non-finite values: mixed with finite ones (some of which take a reserved code), a block of only
    # nan and inf, one with absmax 0, a subnormal and a huge one
    mixed = rand[:128].clone() / rand[:128].abs().max()
    mixed[:6] = torch.tensor([math.nan, math.inf, -math.inf, 0.55e-6, 3.25e-6, 2.0 ** -24])
    if name == "exp_avg":
        mixed[6:10] = torch.tensor([-0.55e-6, 1.0e-6, 5e-7, -3.3e-6])
    else:
        mixed[6:10] = torch.stack([levels[1], levels[2], levels[3], (levels[2] + levels[3]) / 2])
    only = torch.tensor([math.nan, math.inf, -math.inf, math.nan] * 32)
    zero = torch.zeros(128)
    zero[7] = math.nan
    sub = rand[:128] * 2.0 ** -140
    sub[3] = math.inf
    huge = rand[:128] * 2.0 ** 127
    huge[100] = -math.inf
    blocks += [mixed, only, zero, sub, huge, mixed * 2.0 ** -100]
    return _blocks(*blocks)


@pytest.mark.parametrize("name", NAMES)
def test_encoder_bytes_are_the_spec(name):
    """The kernel's block encoder (the code ``adam_step`` runs) writes ``_encode_moment_``'s codes and
    absmax bits: ties, code boundaries, decade boundaries, absmax 0 / subnormal / huge, nan and inf
    (flagged blocks), several seeds for the stochastic rounding; and decodes as ``_decode_moment``."""
    kernel = cpu_kernel.load()
    x = _hard_values(name)
    if name == "exp_avg":  # exact ties are among the values (both neighbours at the same float32 distance)
        dyn = TABLES[0]
        a = x.abs()[:, None]
        err = (dyn[127:][None, :] - a).abs()
        assert int(((err == err.min(1, keepdim=True).values).sum(1) > 1).sum()) > 20
    for seed in (1, 2, 977) if name == "exp_avg_sq" else (1,):
        want = _spec_encode(name, x, seed)
        codes, absmax = torch.full((x.numel(),), 77, dtype=torch.uint8), torch.full((x.numel() // 128,), 5.0)
        kernel.encode_uint8(x, codes, absmax, list(TABLES), name == "exp_avg", seed)
        assert torch.equal(_bits(absmax), _bits(want[f"{name}_absmax"]))
        bad = (codes != want[name]).nonzero().view(-1)
        assert bad.numel() == 0, (seed, bad[:10].tolist(), x[bad[:10]].tolist(), codes[bad[:10]].tolist(),
                                  want[name][bad[:10]].tolist())
        assert (absmax.view(torch.int32) < 0).sum() == 6  # the six blocks with nan or inf are flagged
        decoded = kernel.decode_uint8(codes, absmax, list(TABLES), name == "exp_avg")
        assert torch.equal(_bits(decoded), _bits(E._decode_moment(torch.uint8, name, want, TABLES)))


def test_dynamic_nearest_tie_rule():
    """The spec's rule: the nearest of the map's non-negative values to |y| in float32 distance, exact ties
    to the lower index (the smaller magnitude), mirrored for y < 0."""
    dyn = TABLES[0]
    y = _hard_values("exp_avg")
    y = y[y.isfinite()].clamp(-1, 1)
    index = E._dynamic_nearest(y, dyn, TABLES[1]).long()
    err = (dyn[127:][None, :] - y.abs()[:, None]).abs()
    j = err.argmin(1) + 127  # argmin: the first (lowest) index of the smallest distance
    assert torch.equal(index, torch.where(y < 0, (254 - j).clamp(min=0), j))


def test_exp_avg_sq_low_level_rule():
    """The spec's rule: stochastic rounding between the largest level <= y (codes 1..254, 1 below the
    range) and the next; y at a level encodes to it, whatever log2 gives there."""
    levels = TABLES[2]
    x = _blocks(torch.cat([torch.ones(1), levels[1:128]]), torch.cat([torch.ones(1), levels[128:]]))
    for seed in range(5):
        codes = _spec_encode("exp_avg_sq", x, seed)["exp_avg_sq"]
        assert torch.equal(codes[1:128].long(), torch.arange(1, 128))
        assert torch.equal(codes[129:257].long(), torch.arange(128, 256))


# ---------------------------------------------------------------------------------- one kernel step
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_one_kernel_step_encodes_the_fp32_state_values(dtype):
    """One C++ step from fresh state in compact and in fp32 state: the compact run's codes and absmax are
    ``_encode_moment_`` of the fp32 run's exp_avg and exp_avg_sq (seed = step 1), with gradients that
    make blocks of zeros, subnormal and huge moments, an overflowing g * g, nan and inf (rows of 1 to 3
    blocks; a 1-D parameter keeps float32 moments in both runs)."""
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
        g[512 + 9] = 1e30  # g * g overflows: exp_avg_sq inf, a flagged block
        g[640 + 3], g[768 + 100], g[896 + 127] = math.nan, math.inf, -math.inf
        g[-1] = math.nan  # the last block
        grads[params[1]].view(-1)[:128] = 2.0 ** -130
        opt.step(grads=grads)
        return params, opt
    (p32, o32), (p8, o8) = run("fp32"), run("compact")
    assert o8.state[p8[2]]["exp_avg"].dtype == torch.float32  # 1-D: no blocks
    for a, b in zip(p32[:2] + p32[3:], p8[:2] + p8[3:]):
        n = a.numel()
        s32, s8 = o32.state[a], o8.state[b]
        for name in NAMES:
            x = torch.zeros(-(-n // 128) * 128)
            x[:n] = s32[name].reshape(-1)
            want = _spec_encode(name, x, 1)
            assert torch.equal(s8[name].reshape(-1), want[name][:n]), name
            assert s8[f"{name}_absmax"].shape == (a.shape[0], a[0].numel() // 128)
            assert torch.equal(_bits(s8[f"{name}_absmax"].reshape(-1)), _bits(want[f"{name}_absmax"])), name
    flagged = o8.state[p8[0]]["exp_avg_sq_absmax"].view(torch.int32).view(-1) < 0
    assert flagged[4] and flagged[5] and flagged[-1] and not flagged[0]


# ---------------------------------------------------------------------------------- training
OPTIMIZERS = {
    "adamw": (halfadam.AdamW, dict(weight_decay=0.1)),
    "adam-l2": (halfadam.Adam, dict(weight_decay=0.1)),
    "adamfp16-absolute": (halfadam.AdamFP16, dict(weight_decay=halfadam.WeightDecay(1e-3, absolute=True))),
    "adamfp16-not-optimized": (halfadam.AdamFP16, dict(optimized_update=False)),
}
FORMATS = {
    "compact": dict(state_mode="compact"),
    "compact+fp32-master": dict(state_mode="compact", store_param_remainders=False),
    "compact+bf16-exp_avg": dict(state_mode="compact", exp_avg_dtype=torch.bfloat16),
    "split+uint8-exp_avg": dict(state_mode="split", exp_avg_dtype=torch.uint8),
    "fp32+uint8-exp_avg_sq": dict(state_mode="fp32", exp_avg_sq_dtype=torch.uint8),
}
#: two direct parameters (>= 65536 elements), a packed one, two 1-D ones (float32 moments: rows of one
#: element are not whole blocks), and a strided one (appended in _train)
SHAPES = [(300, 256), (547, 128), (5,), (3, 128), (129,)]


def _train(impl, dtype, cls, kw, steps=4, poison=False):
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]
    params.append(torch.nn.Parameter(torch.randn(256, 3, generator=g).to(dtype).t()))  # strided, rows of 256
    opt = cls(params, lr=1e-2, implementation=impl, **kw)
    for t in range(steps):
        grads = {p: torch.randn(p.shape[::-1], generator=g).t() if p.dim() == 2 and not p.is_contiguous()
                 else torch.randn(p.shape, generator=g).to(dtype) for p in params}
        if t == 1:
            del grads[params[3]]  # a parameter without a gradient this step
        if poison and t == 2:
            grads[params[0]].view(-1)[200] = math.nan
            grads[params[1]].view(-1)[-1] = math.inf  # the last block
        scale = torch.tensor([0.5]) if t == 3 else None
        opt.step(grads=grads, grad_scale=scale)
    return params, opt


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_training_is_the_reference_bit_for_bit(fmt, dtype):
    """cpp and reference, 4 steps (a partial step, a loss scale): every parameter's and state tensor's bytes."""
    cls, kw = OPTIMIZERS["adamw"]
    kw = dict(kw, **FORMATS[fmt])
    assert_same_runs(_train("reference", dtype, cls, kw), _train("cpp", dtype, cls, kw), fmt)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("opt_name", ["adam-l2", "adamfp16-absolute", "adamfp16-not-optimized"])
def test_training_every_optimizer_is_the_reference(opt_name, dtype):
    cls, kw = OPTIMIZERS[opt_name]
    kw = dict(kw, state_mode="compact")
    assert_same_runs(_train("reference", dtype, cls, kw), _train("cpp", dtype, cls, kw), opt_name)


@pytest.mark.parametrize("fmt", ["compact", "fp32+uint8-exp_avg_sq"])
def test_training_with_nonfinite_gradients_is_the_reference(fmt):
    """A nan and an inf gradient at step 3 of 4: flagged blocks are encoded, then decoded by the next
    step (reserved codes), as the reference does them; the other parameters' bytes are untouched."""
    cls, kw = OPTIMIZERS["adamw"]
    kw = dict(kw, **FORMATS[fmt])
    ref = _train("reference", torch.bfloat16, cls, kw, poison=True)
    cpp = _train("cpp", torch.bfloat16, cls, kw, poison=True)
    assert_same_runs(ref, cpp, fmt)
    params, opt = cpp
    assert int(params[0].isnan().sum()) == 1 and int(params[1].isnan().sum()) == 1
    assert (opt.state[params[0]]["exp_avg_sq_absmax"].view(torch.int32) < 0).sum() == 1
    assert (opt.state[params[1]]["exp_avg_sq_absmax"].view(torch.int32)[-1] < 0).all()


def test_threads_split_the_work_not_the_bytes():
    cls, kw = OPTIMIZERS["adamw"]
    one = _train("cpp", torch.bfloat16, cls, dict(kw, state_mode="compact"))
    torch.set_num_threads(2)
    try:
        two = _train("cpp", torch.bfloat16, cls, dict(kw, state_mode="compact"))
    finally:
        torch.set_num_threads(1)
    assert_same_runs(one, two, "threads")


def test_auto_runs_cpp_in_compact_on_cpu(monkeypatch):
    """``auto`` runs the C++ kernel in every state mode on the CPU: nothing is compiled by torch."""
    def no_compile(*a, **k):
        raise AssertionError("auto compiled a kernel although the C++ kernel applies")
    monkeypatch.setattr(executions, "_get_compiled", no_compile)
    cls, kw = OPTIMIZERS["adamw"]
    for fmt in ("compact", "fp32+uint8-exp_avg_sq"):
        kw2 = dict(kw, **FORMATS[fmt])
        ref = _train("reference", torch.bfloat16, cls, kw2, steps=2)
        assert_same_runs(ref, _train("auto", torch.bfloat16, cls, kw2, steps=2), fmt)
