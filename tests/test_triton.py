"""The Triton kernel (``implementation="triton"``) against the reference execution and the encodings'
specification, bit for bit. Without a GPU the kernel runs under Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1``, set by conftest.py), so the sizes are small: a few programs of
``triton_kernel.CHUNK`` elements per step. With a GPU the same tests run on CUDA tensors
(``benchmarks/gpu_check.sh``), against the reference execution on the GPU.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

import halfadam
from halfadam import encodings as E
from halfadam import executions
from conftest import assert_same_runs, needs_triton, same_bits

pytestmark = [needs_triton, pytest.mark.usefixtures("one_thread"),
              # the interpreter's numpy reports the overflows the tests make on purpose (g * g = inf)
              pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")]

CPU = torch.device("cpu")
#: the optimizers the C++ kernel's tests train (test_cpp_uint8.py)
OPTIMIZERS = {
    "adamw": (halfadam.AdamW, dict(weight_decay=0.1)),
    "adam-l2": (halfadam.Adam, dict(weight_decay=0.1)),
    "adamfp16-absolute": (halfadam.AdamFP16, dict(weight_decay=halfadam.WeightDecay(1e-3, absolute=True))),
    "adamfp16-not-optimized": (halfadam.AdamFP16, dict(optimized_update=False)),
}
#: where the kernel runs: the GPU if there is one, else the CPU under the interpreter
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
#: rows of whole blocks (33 rows: several programs, the last partial), 1-D parameters (float32 fields
#: where the format has per-block ones: no blocks), one 1-element; _train appends a strided one
SHAPES = [(33, 128), (5,), (3, 256), (2100,), (1,)]
FORMATS = {
    "fp32": dict(state_mode="fp32"),
    "split": dict(state_mode="split"),
    "bf16": dict(state_mode="bf16"),
    "compact": dict(state_mode="compact"),
    "compact+fp32-master": dict(state_mode="compact", store_param_remainders=False),
    "split+uint8-exp_avg+bf16-exp_avg_sq": dict(state_mode="split", exp_avg_dtype=torch.uint8,
                                                exp_avg_sq_dtype=torch.bfloat16),
    "fp32+uint8-exp_avg_sq": dict(state_mode="fp32", exp_avg_sq_dtype=torch.uint8),
    # split8 masters (bfloat16 parameters; float16 ones keep "split") over every moment kind
    "tiny": dict(state_mode="tiny"),
    "tiny+fp32-moments": dict(state_mode="tiny", exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32),
    "tiny+bf16-moments": dict(state_mode="tiny", exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16),
    "tiny+uint8-exp_avg+fp32-exp_avg_sq": dict(state_mode="tiny", exp_avg_sq_dtype=torch.float32),
}


def _bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32) if t.element_size() == 4 else t


def _spec_encode(name, x, seed, dtype=torch.uint8):
    """``encodings._encode_moment_`` of float32 ``x`` (whole blocks, positions from 0) as ``name`` in ``dtype``,
    with the random bits of step ``seed``."""
    n = x.numel()
    stored = {name: torch.zeros(n, dtype=dtype), E.scale_key(name): torch.zeros(n // 128, dtype=torch.uint8)}
    E._encode_moment_(dtype, name, x.clone(), stored, E._random_bits(torch.arange(n), torch.tensor(seed)))
    return stored


def _blocks(*parts):
    """Blocks of 128 (each part padded with zeros to a multiple of 128), concatenated."""
    out = []
    for p in parts:
        p = p.reshape(-1).float()
        out.append(torch.cat([p, p.new_zeros(-p.numel() % 128)]))
    return torch.cat(out)


def _hard_values(name):
    """Blocks where a code could go either way: every code's value over a block whose largest magnitude
    is just below 2.0 (it rounds up into the next binade), one ulp either side, the midpoints, at block scales
    that put the base at 1 (float32 subnormals) and near the top of float32's range; random blocks
    over 30 octaves at scales from 2**-149 to 2**127; blocks of zeros, of the largest float32 values,
    of the smallest; -0.0, negative values (a negative exp_avg_sq), nan (of both signs) and
    +-inf mixed with finite values, alone, and in zero, subnormal and huge blocks."""
    g = torch.Generator().manual_seed(1)
    mask = E._MAGNITUDE_MASK[name]
    base = max(127 - E._SPAN[name], 1)  # a block of largest magnitude in [1, 2)
    top = torch.nextafter(torch.tensor(2.0), torch.tensor(0.0))  # rounds up to 2.0, the largest code
    codes = torch.arange(mask + 1, dtype=torch.uint8)
    codes = torch.cat([codes, codes.new_zeros(-codes.numel() % 128)])
    stored = {name: codes, E.scale_key(name): torch.full((codes.numel() // 128,), base, dtype=torch.uint8)}
    levels = E._decode_moment(torch.uint8, name, stored)
    levels = levels[levels.isfinite() & (levels <= top)]
    up, down = torch.nextafter(levels, torch.tensor(math.inf)), torch.nextafter(levels, torch.tensor(0.0))
    near = torch.cat([levels, up, down, (levels[1:] + levels[:-1]) / 2, torch.nextafter(up, torch.tensor(math.inf)),
                      torch.nextafter(down, torch.tensor(0.0))]).clamp(0, top)
    sign = -1.0 if name == "exp_avg" else 1.0
    signed = torch.where(torch.rand(near.numel(), generator=g) < 0.5, sign, 1.0)
    blocks = [torch.cat([top.view(1), chunk]) for chunk in (near * signed).split(127)]
    n_near = len(blocks)
    blocks += [b * 2.0 ** k for k in (-100, -126, -140, 20, 127) for b in blocks[:n_near]]
    # random blocks over 30 octaves at block scales from 2**-149 to 2**127, both signs for exp_avg
    rand = torch.rand(128 * 40, generator=g) * torch.exp2(-torch.rand(128 * 40, generator=g) * 30)
    rand = rand * torch.where(torch.rand(128 * 40, generator=g) < 0.5, sign, 1.0)
    blocks.append(rand * torch.exp2(torch.linspace(-149, 127, 40)).repeat_interleave(128))
    blocks.append(torch.zeros(128))
    blocks.append(torch.finfo(torch.float32).max * torch.linspace(0.5, 1.0, 128))  # the largest values
    tiny = torch.zeros(128)
    tiny[:6] = torch.tensor([2.0 ** -149, 2.0 ** -148, 3 * 2.0 ** -149, 2.0 ** -127, 2.0 ** -126, -0.0])
    blocks.append(tiny)
    zeros = torch.zeros(128)
    zeros[::3] = -0.0
    blocks.append(zeros)
    negative = rand[:128].abs() * -1.0  # a negative exp_avg_sq (never 0 code for a positive value)
    negative[::2] *= -1.0
    blocks.append(negative)
    # non-finite values
    nan, neg_nan = torch.tensor(math.nan), -torch.tensor(math.nan)
    mixed = rand[:128].clone() / rand[:128].abs().max()
    mixed[:5] = torch.stack([nan, torch.tensor(math.inf), torch.tensor(-math.inf), neg_nan, torch.tensor(-0.0)])
    only = torch.stack([nan, torch.tensor(math.inf), torch.tensor(-math.inf), neg_nan] * 32)
    zero = torch.zeros(128)
    zero[7] = math.nan
    sub = rand[:128] * 2.0 ** -140
    sub[3] = math.inf
    huge = rand[:128] * 2.0 ** 127
    huge[100] = -math.inf
    blocks += [mixed, only, zero, sub, huge, mixed * 2.0 ** -100]
    return _blocks(*blocks)


def _train(impl, dtype, cls=halfadam.AdamW, kw=None, steps=4, grad_dtype=None, poison=False, strided=True,
           shapes=SHAPES):
    """``steps`` steps: a parameter without a gradient at step 1 (its step count then lags: the later
    steps launch once per step count), a loss scale at step 3, a strided parameter with a strided
    gradient; ``poison``: a nan and an inf gradient at step 2 (True: those of :data:`SHAPES`; else
    ``(parameter, flat index, value)`` triples)."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(DEVICE, dtype)) for s in shapes]
    if strided:
        params.append(torch.nn.Parameter(torch.randn(256, 3, generator=g).to(DEVICE, dtype).t()))  # rows of 256
    opt = cls(params, lr=1e-2, implementation=impl, **(kw or {}))
    for t in range(steps):
        grads = {}
        for p in params:
            if not p.is_contiguous():
                grads[p] = torch.randn(p.shape[::-1], generator=g).t().to(DEVICE, grad_dtype or dtype)
            else:
                grads[p] = torch.randn(p.shape, generator=g).to(DEVICE, grad_dtype or dtype)
        if t == 1:
            del grads[params[2]]
        if poison and t == 2:
            triples = ((0, 200, math.nan), (2, -1, math.inf), (3, 2099, -math.inf)) if poison is True else poison
            for k, i, value in triples:
                grads[params[k]].view(-1)[i] = value  # (2, -1): the last block
        opt.step(grads=grads, grad_scale=torch.tensor([0.5], device=DEVICE) if t == 3 else None)
    return params, opt


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_format_is_the_reference_bit_for_bit(fmt, dtype):
    """4 steps in every state format and parameter dtype (partial gradients, a loss scale, a strided
    parameter): every parameter's and state tensor's bytes equal the reference execution's."""
    cls, kw = OPTIMIZERS["adamw"]
    kw = dict(kw, **FORMATS[fmt])
    assert_same_runs(_train("reference", dtype, cls, kw), _train("triton", dtype, cls, kw), fmt)


#: rows that end in a short block (200, 9, 27, 64, 130 and 129 elements: the last block of 72, 9, 27, 64, 2
#: and 1), beside rows of whole blocks, a single row of 200 (blocks over the flat tensor, a short last one)
#: and a 1-D one (_train: the third has no gradient at step 1)
ROW_SHAPES = [(5, 200), (7, 9), (4, 3, 3, 3), (3, 64), (1, 200), (2, 130), (33, 129), (3, 256), (10,)]
#: non-finite gradients in short blocks: in a row's last block of 72, the single element of one of (33, 129)'s,
#: a row of 9
ROW_POISON = ((0, 2 * 200 + 150, math.nan), (6, 10 * 129 + 128, math.inf), (1, 4 * 9 + 3, -math.inf))


@pytest.mark.parametrize("mode, dtype", [(m, d) for m in ("compact", "bf16", "split")
                                          for d in (torch.bfloat16, torch.float16)]
                         + [("compact", torch.float32), ("tiny", torch.bfloat16)],
                         ids=lambda v: v if isinstance(v, str) else str(v)[6:])
def test_rows_with_short_blocks_are_the_reference_bit_for_bit(mode, dtype):
    """Parameters whose rows end in a short block (the launch finds each block's row) beside rows of whole
    blocks, a parameter without a gradient at step 1, nan and inf gradients in short blocks, a loss scale,
    a strided parameter: every parameter's and state tensor's bytes equal the reference execution's
    (float32 parameters: compact's uint8 moments, no master)."""
    from halfadam.kernels import triton as triton_kernel

    cls, kw = OPTIMIZERS["adamw"]
    kw = dict(kw, state_mode=mode)
    ref = _train("reference", dtype, cls, kw, poison=ROW_POISON, shapes=ROW_SHAPES)
    tables, real = [], triton_kernel.tensor_table
    triton_kernel.tensor_table = lambda *a, **k: tables.append(real(*a, **k)) or tables[-1]
    try:
        tri = _train("triton", dtype, cls, kw, poison=ROW_POISON, shapes=ROW_SHAPES)
    finally:
        triton_kernel.tensor_table = real
    assert_same_runs(ref, tri, mode)
    assert any(t.rows for t in tables)
    params, opt = tri
    key = "master_tie" if dtype != torch.float32 and mode != "tiny" else "exp_avg_scale"  # (split8: no tie byte)
    for p, shape in zip(params, ROW_SHAPES[:-1]):  # per-block state: (rows, blocks per row)
        assert opt.state[p][key].shape == (shape[0], -(-math.prod(shape[1:]) // 128)), shape
    for k, i, _ in ROW_POISON:  # each non-finite gradient made its element nan, and only it
        assert bool(params[k].view(-1)[i].isnan()) and int(params[k].isnan().sum()) == 1, (k, i)


@pytest.mark.parametrize("mode", ["bf16", "compact", "tiny"])
def test_shards_write_only_their_own_state(mode):
    """executions.shard_step (FSDP2's local shards: each tensor's own state tensors in the table) for a
    (7, 9) shard (rows of one short block; its first element at position 18 of its parameter), a (1, 200)
    one (a short last block of the flat tensor) and a 1-D (100,) one (bf16 moments: blocked because
    stochastic, a short block with no per-block key): the reference's bits, and no byte written beyond the
    state tensors (each lies inside a larger tensor whose other elements must keep their values)."""
    fmt = E.state_format(mode)
    hp = executions.Hyperparameters(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decay="decoupled",
                                    optimized_update=True)
    g = torch.Generator().manual_seed(0)
    shapes, offsets = [(7, 9), (1, 200), (100,)], [18, 0, 0]
    params = [torch.randn(s, generator=g).to(DEVICE, torch.bfloat16) for s in shapes]
    grads = [[torch.randn(s, generator=g).to(DEVICE, torch.bfloat16) for s in shapes] for _ in range(3)]
    grads[1][0].view(-1)[4 * 9 + 8] = math.inf
    runs = {}
    for impl in ("reference", "triton"):
        ps = [p.clone() for p in params]
        states, surplus = {}, []
        for p in ps:
            st = {}
            for key, t in E.new_state(E.for_param(fmt, p, True), p, True).items():
                n = t.numel()  # inside 16 + n + 144 elements of a sentinel (16 before: the alignment kept)
                outer = torch.full((16 + n + 144,), 0x55 if t.dtype == torch.uint8 else 7, dtype=t.dtype, device=DEVICE)
                st[key] = outer[16:16 + n].view(t.shape).copy_(t)
                surplus.append((outer, n, outer.clone()))
            st["step"] = torch.tensor(0.0)
            states[p] = st
        for t in range(3):
            left = executions.shard_step(list(zip(ps, grads[t])), states, hp, impl, fmt=fmt, offsets=offsets)
            if impl == "triton":
                assert left == []
            else:
                executions.reference_step([list(zip(ps, grads[t]))[k] for k in left], states, hp, fmt=fmt,
                                          offsets=[offsets[k] for k in left])
        for outer, n, before in surplus:
            assert torch.equal(_bits(outer[:16]), _bits(before[:16])) and torch.equal(_bits(outer[16 + n:]),
                                                                                     _bits(before[16 + n:])), impl
        runs[impl] = ps, states
    for p, q in zip(runs["reference"][0], runs["triton"][0]):
        assert same_bits(p, q)
        sa, sb = runs["reference"][1][p], runs["triton"][1][q]
        assert sa.keys() == sb.keys()
        assert all(same_bits(sa[k], sb[k]) for k in sa), [k for k in sa if not same_bits(sa[k], sb[k])]
    keys = runs["triton"][1][runs["triton"][0][0]]
    assert ("master_tie" in keys) == (mode != "tiny") and ("master_lo" in keys) == (mode != "tiny"), keys.keys()
    assert bool(runs["triton"][0][0].view(-1)[4 * 9 + 8].isnan())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("opt_name", ["adam-l2", "adamfp16-absolute", "adamfp16-not-optimized"])
@pytest.mark.parametrize("mode", ["fp32", "compact", "tiny"])
def test_every_decay_mode_is_the_reference(mode, opt_name, dtype):
    cls, kw = OPTIMIZERS[opt_name]
    kw = dict(kw, state_mode=mode)
    assert_same_runs(_train("reference", dtype, cls, kw), _train("triton", dtype, cls, kw), opt_name)


@pytest.mark.parametrize("mode", ["fp32", "bf16", "compact", "tiny"])
def test_programs_and_the_gpus_tiles(mode, monkeypatch):
    """A parameter of more than a program's CHUNK elements (two programs, the second's from CHUNK on, its
    last tile partial) beside small ones, stepped in the GPU's tiles (BLOCKS_PER_TILE blocks; the
    interpreter's are larger): the reference's bits."""
    from halfadam.kernels import triton as triton_kernel

    monkeypatch.setattr(triton_kernel, "INTERPRETED_BLOCKS_PER_TILE", triton_kernel.BLOCKS_PER_TILE)
    shapes = [(triton_kernel.CHUNK // 128 + 5, 128), (3, 256), (5,)]
    assert shapes[0][0] * 128 > triton_kernel.CHUNK and triton_kernel.TILE < triton_kernel.CHUNK
    kw = dict(weight_decay=0.1, state_mode=mode)
    ref = _train("reference", torch.bfloat16, kw=kw, steps=2, shapes=shapes, strided=False)
    assert_same_runs(ref, _train("triton", torch.bfloat16, kw=kw, steps=2, shapes=shapes, strided=False), mode)


@pytest.mark.parametrize("mode", ["split", "compact"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16], ids=["fp32-grads", "fp16-grads"])
def test_gradient_dtypes(grad_dtype, mode):
    """bf16 parameters with float32 gradients (the scaler's hand-over) and float16 ones (converted):
    the reference's bits (on the CPU also the C++ kernel's)."""
    kw = dict(weight_decay=0.1, state_mode=mode)
    ref = _train("reference", torch.bfloat16, kw=kw, grad_dtype=grad_dtype)
    assert_same_runs(ref, _train("triton", torch.bfloat16, kw=kw, grad_dtype=grad_dtype), grad_dtype)
    if DEVICE.type == "cpu":
        assert_same_runs(ref, _train("cpp", torch.bfloat16, kw=kw, grad_dtype=grad_dtype), grad_dtype)


@pytest.mark.parametrize("mode", ["fp32", "bf16", "compact", "tiny"])
def test_nonfinite_gradients_are_the_reference(mode):
    """A nan and an inf gradient: the reference's bits (uint8 blocks holding them included), only those
    elements non-finite."""
    kw = dict(weight_decay=0.1, state_mode=mode)
    ref = _train("reference", torch.bfloat16, kw=kw, poison=True)
    tri = _train("triton", torch.bfloat16, kw=kw, poison=True)
    assert_same_runs(ref, tri, mode)
    params, opt = tri
    assert [int(params[k].isnan().sum()) for k in (0, 2, 3)] == [1, 1, 1]
    if mode in ("compact", "tiny"):  # the reserved codes: after the inf gradient exp_avg_sq +inf, exp_avg nan (inf - inf
        st = opt.state[params[2]]  # at the next step); after the nan gradient both nan
        assert int(st["exp_avg"].view(-1)[-1]) == E._NAN_CODE["exp_avg"]
        assert int(st["exp_avg_sq"].view(-1)[-1]) == E._INF_CODE["exp_avg_sq"]
        st = opt.state[params[0]]
        assert int(st["exp_avg"].view(-1)[200]) == E._NAN_CODE["exp_avg"]
        assert int(st["exp_avg_sq"].view(-1)[200]) == E._NAN_CODE["exp_avg_sq"]


def test_split_masters_at_the_bfloat16_overflow_edge():
    """Split masters stepped across 0x7F7F8000 (from there bfloat16's rounding is inf: no remainder is kept)
    on both signs, from exact masters: the reference's bits, some parameters inf."""
    runs = []
    for impl in ("reference", "triton"):
        pattern = torch.tensor([0x7F7F7000 - k * 0x40 for k in range(128)], dtype=torch.int64)
        pattern = torch.cat([pattern, pattern - (1 << 32) + (1 << 31)]).to(torch.int32)  # and the negatives
        master = pattern.view(torch.float32).reshape(2, 128).to(DEVICE)
        p = torch.nn.Parameter(master.to(torch.bfloat16))
        opt = halfadam.AdamW([p], lr=1e35, weight_decay=0.0, implementation=impl, state_mode="split")
        g = torch.where(master > 0, -1.0, 1.0).to(torch.bfloat16)  # Adam's first step: lr away from zero
        opt.step(grads={p: g})
        E.set_master_(p, opt.state[p], master)
        opt.step(grads={p: g})
        runs.append(([p], opt))
    assert_same_runs(*runs, "overflow")
    assert 0 < int(runs[1][0][0].isinf().sum()) < 256


# ------------------------------------------------------------------------- split8 masters ("tiny")
def _count_split8_paths(monkeypatch):
    """Wrap encodings._split8_encode_ (the reference's) to count, over the step's calls, the elements whose
    rounded remainder c is 128 over a finite nonzero parameter: ``bump`` (the parameter moves one bfloat16
    value away from zero, c = -128) and ``clamp`` (at the largest finite magnitude: c = 127)."""
    counts = {"bump": 0, "clamp": 0}
    real = E._split8_encode_

    def counting(master, param, hi, rounding):
        if rounding is not None:
            rounded = master.to(torch.bfloat16).float()
            r = master.view(torch.int32) - rounded.view(torch.int32)
            top = rounded.isfinite() & (rounded != 0) & (((r + rounding) >> 8) == 128)
            at_max = rounded.abs() == torch.finfo(torch.bfloat16).max
            counts["bump"] += int((top & ~at_max).sum())
            counts["clamp"] += int((top & at_max).sum())
        return real(master, param, hi, rounding)
    monkeypatch.setattr(E, "_split8_encode_", counting)
    return counts


def test_split8_bump_and_the_largest_finite_clamp(monkeypatch):
    """split8 masters stepped into the window below the midpoint above their parameter (c = 128): from
    remainders c = 120..127 over bfloat16 values in [1, 2) and the largest finite one, both signs, with
    steps away from zero of about 70-90 float32 ulps (a group's lr per binade), then one of about 350; the
    parameters move one value away from zero (c = -128), at the largest magnitude c clamps to 127, and
    masters crossing 0x7F7F8000 make the parameter inf: the reference's bits, each path taken."""
    g = torch.Generator().manual_seed(5)
    sign = torch.tensor([1.0, 1.0, -1.0, -1.0]).view(4, 1)
    values = {"small": (1.0 + torch.randint(0, 128, (4, 128), generator=g) / 128.0) * sign,
              "max": torch.finfo(torch.bfloat16).max * sign.expand(4, 128)}
    lrs = {"small": 96 * 2.0 ** -23, "max": 96 * 2.0 ** 104}  # ~96 float32 ulps of each binade per unit step
    hi = (127 - torch.arange(4 * 128) % 8).to(torch.int8).view(4, 128)
    runs, counts = [], None
    for impl in ("reference", "triton"):
        if impl == "reference":
            counts = _count_split8_paths(monkeypatch)
        params = {k: torch.nn.Parameter(v.to(DEVICE, torch.bfloat16)) for k, v in values.items()}
        opt = halfadam.AdamW([{"params": [params[k]], "lr": lrs[k]} for k in values], weight_decay=0.0,
                             implementation=impl, state_mode="tiny")
        opt.step(grads={p: torch.zeros_like(p) for p in params.values()})  # the state (a step of zero: no change)
        for p in params.values():
            assert torch.equal(opt.state[p]["master_hi"], torch.zeros_like(hi, device=DEVICE))
            opt.state[p]["master_hi"].copy_(hi)
        for t in range(4):
            if t == 3:  # steps of 4 times more (about 350 ulps): masters across 0x7F7F8000, to inf
                for group in opt.param_groups:
                    group["lr"] *= 4
            opt.step(grads={p: -p.detach().sign() for p in params.values()})  # away from zero
        monkeypatch.undo()
        runs.append((list(params.values()), opt))
    assert_same_runs(*runs, "split8 bump")
    assert counts["bump"] > 0 and counts["clamp"] > 0, counts
    small, top = runs[1][0]
    state = runs[1][1].state
    assert bool((state[small]["master_hi"] == -128).any())
    assert bool((small.detach().float().abs() >= 1.0).all())  # (moved away from zero only)
    assert bool(top.isinf().any()) and bool(top.isfinite().any())
    finite = top.isfinite()
    assert bool((state[top]["master_hi"][~finite] == 0).all())
    assert bool((state[top]["master_hi"][finite] == 127).any())


@pytest.mark.parametrize("mode", ["tiny", "tiny+fp32-moments"])
def test_split8_special_parameters_writes_and_nonfinite_gradients(mode):
    """split8 masters over parameters of +-0, nan, +-inf, the largest finite and the smallest bfloat16
    values, with stale remainders over them; nan and inf gradients; writes to the parameters between
    steps (values, a zero of the other sign, inf, nan, a scaled row); rows of short blocks (a (8, 3, 3, 3)
    conv weight, a (3, 5) one: unaligned) beside whole blocks: the reference's bits."""
    g = torch.Generator().manual_seed(11)
    shapes = [(4, 128), (8, 3, 3, 3), (3, 5)]
    big = torch.finfo(torch.bfloat16).max
    tiny = 2.0 ** -133  # bfloat16's smallest subnormal
    special = torch.tensor([0.0, -0.0, math.nan, math.inf, -math.inf, big, -big, tiny, -tiny, 2.0 ** -126,
                            -(2.0 ** -126), 1.0, -1.0])
    runs = []
    for impl in ("reference", "triton"):
        g.manual_seed(11)
        params = [torch.nn.Parameter(torch.randn(s, generator=g).to(DEVICE, torch.bfloat16)) for s in shapes]
        opt = halfadam.AdamW(params, lr=1e-2, weight_decay=0.1, implementation=impl, **FORMATS[mode])
        opt.step(grads={p: torch.randn(p.shape, generator=g).to(DEVICE, torch.bfloat16) for p in params})
        with torch.no_grad():
            for p in params:
                flat = p.view(-1)
                flat[:special.numel()] = special.to(DEVICE, torch.bfloat16)
                stale = torch.randint(-128, 128, p.shape, generator=g).to(DEVICE, torch.int8)
                opt.state[p]["master_hi"].copy_(stale)  # remainders over the special values too
        for t in range(3):
            grads = {p: torch.randn(p.shape, generator=g).to(DEVICE, torch.bfloat16) for p in params}
            for p, (i, value) in zip(params, ((20, math.nan), (30, math.inf), (14, -math.inf))):
                if t == 1:
                    grads[p].view(-1)[i] = value
            opt.step(grads=grads)
            if t == 2:
                break
            with torch.no_grad():  # writes between steps over live remainders
                for p in params:
                    flat = p.view(-1)
                    flat[40 % flat.numel()] = 0.5
                    flat[41 % flat.numel()] = -0.0
                    flat[(43 + t) % flat.numel()] = math.inf if t != 1 else math.nan
                    flat[: flat.numel() // 3] *= 2.0
        runs.append((params, opt))
    assert_same_runs(*runs, mode)
    params, opt = runs[1]
    for p in params:
        st = opt.state[p]
        assert "master_hi" in st and "master_lo" not in st and "master_tie" not in st
        nonfinite = ~p.isfinite() | (p == 0)
        assert bool(nonfinite.any()) and bool((st["master_hi"][nonfinite] == 0).all())


def test_master_sync_and_tied_parameters():
    """A tied weight (one parameter used twice) and writes between steps (p.data[...] = x, a zero of the
    other sign): the next step starts from them, as the reference's does, in fp32, split and split8 masters."""
    out = {}
    for impl in ("reference", "triton"):
        for mode in ("fp32", "split", "tiny"):
            torch.manual_seed(0)
            emb = torch.nn.Embedding(40, 16).to(DEVICE, torch.bfloat16)
            head = torch.nn.Linear(16, 40, bias=False).to(DEVICE, torch.bfloat16)
            head.weight = emb.weight  # tied
            opt = halfadam.AdamW(torch.nn.ModuleList([emb, head]).parameters(), lr=1e-2,
                                 implementation=impl, state_mode=mode)
            assert len(opt.param_groups[0]["params"]) == 1
            for t in range(3):
                x = torch.arange(8, device=DEVICE) + t
                loss = head(emb(x).float().bfloat16()).float().square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                with torch.no_grad():
                    emb.weight[t, :4] = 0.5
                    emb.weight[t + 1, 0] = -0.0
            out[impl, mode] = (emb.weight.detach().clone(), opt.master_weight(emb.weight).clone())
    for mode in ("fp32", "split", "tiny"):
        (w, m), (wr, mr) = out["triton", mode], out["reference", mode]
        assert torch.equal(_bits(w), _bits(wr)) and torch.equal(_bits(m), _bits(mr)), mode


def test_grad_scaler_hand_over_and_skip():
    """halfadam.GradScaler: unscaled float32 gradients reach the kernel; an overflowing step is skipped
    and changes no byte (parameters and state); the run equals the reference's bit for bit."""
    out = {}
    for impl in ("reference", "triton"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.Tanh(), torch.nn.Linear(30, 3))
        model.to(DEVICE, torch.bfloat16)
        opt = halfadam.AdamW(model.parameters(), lr=1e-2, implementation=impl, state_mode="compact")
        scaler = halfadam.GradScaler(init_scale=2.0 ** 10, device=DEVICE.type)
        for t in range(4):
            x = torch.randn(16, 20).to(DEVICE, torch.bfloat16)
            opt.zero_grad()
            loss = model(x).float().square().mean() * (1e38 if t == 2 else 1.0)  # step 2 overflows
            before = [p.detach().clone() for p in model.parameters()]
            state_before = {k: v.clone() for k, v in opt.state[model[0].weight].items()} if t else {}
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if t == 2:
                assert all(torch.equal(_bits(a), _bits(b.detach())) for a, b in zip(before, model.parameters()))
                for k, v in state_before.items():
                    assert torch.equal(_bits(v), _bits(opt.state[model[0].weight][k])), k
        out[impl] = [p.detach().clone() for p in model.parameters()]
    for a, b in zip(out["reference"], out["triton"]):
        assert torch.equal(_bits(a), _bits(b))


# ------------------------------------------------------------------------- the encodings, byte for byte
@pytest.mark.parametrize("name", ["exp_avg", "exp_avg_sq"])
def test_uint8_encoder_bytes_are_the_spec(name):
    """The kernel's uint8 encoder and decoder (the functions a step runs) on hard values (code and
    binade boundaries, rounding into the next binade, zero, subnormal and huge blocks, -0.0, negative
    exp_avg_sq, nan and inf; :func:`_hard_values`), for several steps' random bits:
    ``encodings._encode_moment_``'s codes and scales, ``_decode_moment``'s values."""
    from halfadam.kernels import triton as triton_kernel

    x = _hard_values(name)
    for seed in (1, 977, 2 ** 32 - 3):
        want = _spec_encode(name, x, seed)
        codes, scale = (t.cpu() for t in triton_kernel.encode_uint8(name, x.to(DEVICE), seed))
        assert torch.equal(scale, want[E.scale_key(name)])
        bad = (codes != want[name]).nonzero().view(-1)
        assert bad.numel() == 0, (seed, bad[:10].tolist(), x[bad[:10]].tolist(), codes[bad[:10]].tolist(),
                                  want[name][bad[:10]].tolist())
        decoded = triton_kernel.decode_uint8(name, codes.to(DEVICE), scale.to(DEVICE)).cpu()
        assert torch.equal(_bits(decoded), _bits(E._decode_moment(torch.uint8, name, want)))
    special = {E._NAN_CODE[name], E._INF_CODE[name]}
    assert special <= set((want[name] & E._MAGNITUDE_MASK[name]).tolist())  # the reserved codes were written


@pytest.mark.parametrize("name", ["exp_avg", "exp_avg_sq"])
def test_uint8_decoder_every_code_over_every_scale(name):
    """Every code over every scale byte (0: fresh state; 255: never written) decodes as ``_decode_moment``."""
    from halfadam.kernels import triton as triton_kernel

    codes = torch.arange(256, dtype=torch.uint8).repeat(256)
    scale = torch.arange(256, dtype=torch.int32).repeat_interleave(2).to(torch.uint8)
    want = E._decode_moment(torch.uint8, name, {name: codes, E.scale_key(name): scale})
    got = triton_kernel.decode_uint8(name, codes.to(DEVICE), scale.to(DEVICE)).cpu()
    assert torch.equal(_bits(got), _bits(want))


def test_division_by_the_bias_correction_is_ieee():
    """The kernel divides sqrt(v) by sqrt(1 - beta2**t) without a division per element (a reciprocal and
    two Markstein steps): IEEE's quotient, bit for bit, for the divisors of several betas and steps (and
    0, 1, 2**-27), over x from 2**-75 to 2**64 and x whose quotient lies next to a midpoint of two
    float32 values (where a rounding goes either way), 0, inf and nan."""
    from halfadam.kernels import triton as triton_kernel

    g = torch.Generator().manual_seed(3)
    divisors = {0.0, 1.0, 2.0 ** -27}
    for beta2 in (0.999, 0.95, 0.5, 1 - 2 ** -24):
        for t in (1, 2, 10, 10 ** 6):
            divisors.add(float(torch.tensor(math.sqrt(1 - beta2 ** t), dtype=torch.float32)))
    for c in sorted(divisors):
        x = torch.exp2(torch.rand(1 << 16, generator=g, dtype=torch.float64) * 139 - 75).float()
        q = torch.exp2(torch.rand(1 << 14, generator=g, dtype=torch.float64) * 100 - 60).float()
        mid = ((q.double() + torch.nextafter(q, torch.tensor(math.inf)).double()) / 2 * c).float()
        x = torch.cat([x, mid, torch.nextafter(mid, torch.tensor(math.inf)), torch.nextafter(mid, torch.tensor(0.0)),
                       torch.tensor([0.0, math.inf, math.nan, 2.0 ** -75, 2.0 ** 64, 1.0])])
        x = x[x.isnan() | (x == 0) | (x == math.inf) | ((x >= 2.0 ** -75) & (x <= 2.0 ** 64))]
        want = x / torch.tensor(c, dtype=torch.float32)
        got = triton_kernel.divide_by_coefficient(x.to(DEVICE), c).cpu()
        assert torch.equal(want.isnan(), got.isnan()), c
        assert torch.equal(_bits(want)[~want.isnan()], _bits(got)[~want.isnan()]), c


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
def test_one_step_encodes_the_fp32_state_values(dtype):
    """One step from fresh state in compact and in the fp32 state: the compact codes and scales are
    ``_encode_moment_`` of the fp32 run's moments, the bf16 moments of the bf16 mode are their
    stochastic rounding (``_encode_moment_``), and the split masters decode to the fp32 masters."""
    def run(mode):
        torch.manual_seed(0)
        params = [torch.randn(s).to(DEVICE, dtype).requires_grad_() for s in [(12, 128), (5,), (1, 256)]]
        opt = halfadam.AdamW(params, lr=1e-2, weight_decay=0.1, implementation="triton", state_mode=mode)
        torch.manual_seed(1)
        grads = {p: torch.randn(p.shape).to(DEVICE) for p in params}
        g = grads[params[0]].view(-1)
        g[128:256] = 0.0
        g[256:384] *= 1e-40
        g[384:512] *= 1e18
        g[512 + 9] = 1e30
        g[640 + 3], g[768 + 100], g[896 + 127] = math.nan, math.inf, -math.inf
        opt.step(grads=grads)
        return params, {id(p): {k: v.cpu() for k, v in opt.state[p].items()} for p in params}, opt
    (p32, o32, _), (p8, o8, _), (p16, o16, opt16) = run("fp32"), run("compact"), run("bf16")
    for a, b, c in zip(p32, p8, p16):
        n = a.numel()
        s32 = o32[id(a)]
        for name in ("exp_avg", "exp_avg_sq"):
            x = torch.zeros(-(-n // 128) * 128)
            x[:n] = s32[name].reshape(-1)
            want = _spec_encode(name, x, 1)
            if a.dim() == 1:  # no blocks: float32 moments in compact
                assert torch.equal(o8[id(b)][name], s32[name]), name
            else:
                assert torch.equal(o8[id(b)][name].reshape(-1), want[name][:n]), name
                assert torch.equal(o8[id(b)][E.scale_key(name)].reshape(-1), want[E.scale_key(name)]), name
            want16 = _spec_encode(name, x, 1, torch.bfloat16)[name][:n]
            got16 = o16[id(c)][name].reshape(-1)
            finite = want16.isfinite()
            assert torch.equal(_bits(got16)[finite], _bits(want16)[finite]) and torch.equal(got16.isnan(), want16.isnan())
        m16 = opt16.master_weight(c).cpu()
        finite = m16.isfinite()
        assert torch.equal(m16[finite], s32["master_weight"][finite]), name


# ------------------------------------------------------------------------- the launch and its tables
def test_one_launch_per_bucket_and_cached_tables(monkeypatch):
    """A step is one kernel launch per bucket (here two: the weights' split masters, rows of one short block,
    and the biases' fp32 masters, 1-D); the work list is kept while the same parameters step, the tensor
    table while the addresses stay (gradients kept by zero_grad(set_to_none=False))."""
    from halfadam.kernels import triton as triton_kernel

    launches, tables = [], []
    real_launch, real_table = triton_kernel.launch, triton_kernel.tensor_table
    monkeypatch.setattr(triton_kernel, "launch", lambda *a, **k: launches.append(1) or real_launch(*a, **k))
    monkeypatch.setattr(triton_kernel, "tensor_table", lambda *a, **k: tables.append(1) or real_table(*a, **k))
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(10)]).to(DEVICE, torch.bfloat16)
    opt = halfadam.AdamW(model.parameters(), lr=1e-2, implementation="triton", state_mode="split")
    for t in range(3):
        model(torch.randn(2, 8).to(DEVICE, torch.bfloat16)).float().sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    assert len(launches) == 3 * 2 and len(tables) == 2
    opt.zero_grad(set_to_none=True)
    model(torch.randn(2, 8).to(DEVICE, torch.bfloat16)).float().sum().backward()
    opt.step()
    assert len(launches) == 4 * 2 and len(tables) == 4


def test_triton_on_cpu_without_the_interpreter_is_a_clear_error():
    """implementation='triton' names the implementation; capturable=True (which runs the Triton kernel
    with implementation='auto') names capturable and says where it runs. Neither steps anything."""
    code = ("import torch, halfadam\n"
            "p = torch.nn.Parameter(torch.randn(4).bfloat16())\n"
            "for kw in (dict(implementation='triton'), dict(capturable=True)):\n"
            "    opt = halfadam.AdamW([p], **kw)\n"
            "    p.grad = torch.ones(4).bfloat16()\n"
            "    try:\n        opt.step()\n    except (RuntimeError, ValueError) as e:\n"
            "        print('ERR', type(e).__name__, e)\n"
            "    print('STEP', float(opt.state[p]['step']) if p in opt.state else 0.0)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(halfadam.__file__))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    lines = [line for line in out.stdout.splitlines() if line.startswith("ERR")]
    assert len(lines) == 2, out
    assert "ERR RuntimeError implementation='triton' cannot run" in lines[0] and "TRITON_INTERPRET=1" in lines[0], out
    assert lines[1].startswith("ERR ValueError capturable=True cannot step param_groups[0]['params'][0], a cpu "
                               "tensor") and "needs CUDA tensors" in lines[1] and "implementation" not in lines[1], out
    assert out.stdout.count("STEP 0.0") == 2, out.stdout


def test_auto_stays_cpp_on_cpu(monkeypatch):
    """``auto`` picks the Triton kernel on CUDA only: on the CPU it runs the C++ kernel, interpreter or not."""
    monkeypatch.setattr(executions, "_triton_step", lambda *a, **k: pytest.fail("auto ran Triton on the CPU"))
    p = torch.nn.Parameter(torch.randn(300).bfloat16())
    opt = halfadam.AdamW([p], lr=1e-2)
    p.grad = torch.ones(300).bfloat16()
    opt.step()
    assert float(opt.state[p]["step"]) == 1.0


@needs_cuda
@pytest.mark.parametrize("mode", ["fp32", "compact"])
def test_no_host_sync_in_a_cuda_step(mode):
    """implementation='auto' on CUDA runs the Triton kernel, and its step never waits for the GPU
    (torch.cuda.set_sync_debug_mode("error") raises on a synchronising call)."""
    params = [torch.nn.Parameter(torch.randn(s, device="cuda").bfloat16()) for s in SHAPES]
    opt = halfadam.AdamW(params, lr=1e-2, state_mode=mode)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # the first step allocates the state and compiles the kernel
    called = []
    real = executions._triton_step
    try:
        executions._triton_step = lambda *a, **k: called.append(1) or real(*a, **k)
        torch.cuda.set_sync_debug_mode("error")
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        executions._triton_step = real
    assert called


@pytest.mark.parametrize("flag", [0.0, 1.0])
def test_found_inf_on_the_device_skips_inside_the_kernel(flag, monkeypatch):
    """A launch given a device ``found_inf`` of 1 writes no byte (parameters and state), as torch's fused
    AdamW; of 0 it is the ordinary step."""
    from halfadam.kernels import triton as triton_kernel

    real = triton_kernel.launch
    found_inf = torch.tensor([flag], device=DEVICE)
    monkeypatch.setattr(triton_kernel, "launch", lambda *a, **k: real(*a, **dict(k, found_inf=found_inf)))
    params, opt = _train("triton", torch.bfloat16, kw=dict(state_mode="compact"), steps=2)
    monkeypatch.undo()
    ref_params, ref_opt = _train("reference", torch.bfloat16, kw=dict(state_mode="compact"), steps=2)
    if flag:
        for p in params:
            st = opt.state[p]
            assert all(not bool(st[k].view(torch.uint8).any()) for k in st if k not in ("step", "master_weight"))
            assert "master_weight" not in st or torch.equal(st["master_weight"], p.float())  # 1-D parameters
        fresh = [torch.randn(s, generator=torch.Generator().manual_seed(0)) for s in SHAPES[:1]]
        assert torch.equal(params[0].detach().cpu(), fresh[0].bfloat16())
    else:
        assert_same_runs((params, opt), (ref_params, ref_opt), "found_inf=0")


def test_a_launch_that_raises_counts_no_step(monkeypatch):
    """A failing launch leaves the step counts and global_step; the next step is the run's step 3."""
    from halfadam.kernels import triton as triton_kernel

    kw = dict(state_mode="bf16")
    params, opt = _train("triton", torch.bfloat16, kw=kw, steps=2, strided=False)

    def broken(*args, **kwargs):
        raise RuntimeError("simulated launch failure")
    monkeypatch.setattr(triton_kernel, "launch", broken)
    grads = {p: torch.randn(p.shape, generator=torch.Generator().manual_seed(7)).to(DEVICE, p.dtype) for p in params}
    counts = [float(opt.state[p]["step"]) for p in params]  # 1.0 for the one without a gradient at step 1
    with pytest.raises(RuntimeError, match="simulated"):
        opt.step(grads=grads)
    assert [float(opt.state[p]["step"]) for p in params] == counts
    assert opt.param_groups[0]["global_step"] == 2
    monkeypatch.undo()
    opt.step(grads=grads)
    ref_params, ref_opt = _train("reference", torch.bfloat16, kw=kw, steps=2, strided=False)
    ref_opt.step(grads={q: grads[p] for p, q in zip(params, ref_params)})
    assert_same_runs((params, opt), (ref_params, ref_opt), "after a failed launch")


# ------------------------------------------------------------------------- capturable=True
def _capturable_run(capturable, mode, skip_at=2, steps=4, scaler=False):
    """bf16 parameters, a parameter without a gradient at step 1 (its count lags), a skipped step
    (``found_inf`` = 1 at ``skip_at``, or an overflowing loss with ``scaler``)."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(DEVICE, torch.bfloat16)) for s in SHAPES]
    opt = halfadam.AdamW(params, lr=1e-2, weight_decay=0.1, implementation="triton", state_mode=mode,
                         capturable=capturable)
    amp = halfadam.GradScaler(init_scale=2.0 ** 8, device=DEVICE.type) if scaler else None
    for t in range(steps):
        grads = {p: torch.randn(p.shape, generator=g).to(DEVICE, torch.bfloat16) for p in params}
        if t == 1:
            del grads[params[1]]
        if amp is None:
            opt.step(grads=grads, found_inf=torch.tensor([float(t == skip_at)], device=DEVICE))
            continue
        for p in params:  # scaled as a backward of the scaled loss would give them
            p.grad = None if p not in grads else amp.scale(grads[p])
        if t == skip_at:
            params[0].grad.view(-1)[3] = math.inf
        amp.step(opt)
        amp.update()
    return params, opt


@pytest.mark.parametrize("mode", ["fp32", "bf16", "compact", "tiny"])
def test_capturable_is_the_ordinary_step_bit_for_bit(mode):
    """capturable=True (step counts on the device, per-parameter coefficients computed there, found_inf
    read by the kernel) gives the bits of capturable=False, diverged step counts and a skipped step
    included; the counts are the parameters' device tensors and skip the skipped step."""
    ref = _capturable_run(False, mode)
    cap = _capturable_run(True, mode)
    assert_same_runs(ref, cap, mode)
    params, opt = cap
    steps = [opt.state[p]["step"] for p in params]
    assert all(s.device == DEVICE for s in steps)
    assert [float(s) for s in steps] == [3.0, 2.0, 3.0, 3.0, 3.0]


def test_capturable_with_the_scaler_never_reads_found_inf_on_the_host(monkeypatch):
    """halfadam.GradScaler hands a capturable optimizer its found_inf as a device tensor: no .item() or
    bool() of a tensor inside scaler.step (the overflowing step is skipped by the kernel), and the run
    equals the same run with capturable=False. (The kernel's self-check reads the host once, in a
    configuration's first step, which a CUDA graph's warm-up takes: tests/test_selfcheck.py.)"""
    monkeypatch.setenv("HALFADAM_SELFCHECK", "0")
    ref = _capturable_run(False, "compact", scaler=True)
    reads = []
    real_step = halfadam.GradScaler.step

    def watched(self, optimizer, *args, **kwargs):
        item, boolean = torch.Tensor.item, torch.Tensor.__bool__
        monkeypatch.setattr(torch.Tensor, "item", lambda t: reads.append("item") or item(t))
        monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: reads.append("bool") or boolean(t))
        try:
            return real_step(self, optimizer, *args, **kwargs)
        finally:
            monkeypatch.setattr(torch.Tensor, "item", item)
            monkeypatch.setattr(torch.Tensor, "__bool__", boolean)
    monkeypatch.setattr(halfadam.GradScaler, "step", watched)
    cap = _capturable_run(True, "compact", scaler=True)
    assert reads == []
    assert_same_runs(ref, cap, "scaler")
    assert float(cap[1].state[cap[0][0]]["step"]) == 3.0


def test_capturable_refuses_what_it_cannot_step():
    p = torch.nn.Parameter(torch.randn(8, device=DEVICE).bfloat16())
    with pytest.raises(ValueError, match="capturable=True runs the Triton kernel"):
        halfadam.AdamW([p], implementation="cpp", capturable=True)
    with pytest.raises(TypeError, match="capturable must be True or False"):
        halfadam.AdamW([p], capturable=1)
    q = torch.nn.Parameter(torch.randn(8, device=DEVICE, dtype=torch.float64))
    opt = halfadam.AdamW([p, q], implementation="triton", capturable=True)
    p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] \(torch.float64\).*reference path"):
        opt.step()
    assert not opt.state.get(p) or float(opt.state[p]["step"]) == 0.0
    assert torch.equal(p.detach(), p.detach().clone())


@needs_cuda
@pytest.mark.parametrize("mode", ["fp32", "compact"])
def test_a_captured_step_replays_bitwise_equal_to_the_eager_step(mode):
    """capturable=True under torch.cuda.graph: after warm-up steps, replaying the captured step gives
    the bits of the same number of eager steps (same gradients, fixed lr)."""
    def build():
        g = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=g).cuda().bfloat16()) for s in SHAPES]
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).cuda().bfloat16()
        return params, halfadam.AdamW(params, lr=1e-2, weight_decay=0.1, state_mode=mode, capturable=True)
    eager_params, eager = build()
    for _ in range(5):
        eager.step()
    params, opt = build()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up: state, tensor table, compiled kernel
            opt.step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert_same_runs((eager_params, eager), (params, opt), "captured")


def test_every_variant_compiles_for_the_gpu_with_ieee_arithmetic():
    """Without a GPU: every kernel variant compiles to a cubin for sm_90 (H100/H200) with Triton's
    own ptxas, with IEEE divisions and square roots and no fused multiply-add but the division by
    sqrt(1 - beta2**t)'s Markstein steps (benchmarks/triton_compile_check.py)."""
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                          "triton_compile_check.py")
    out = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "triton_compile_check: 0 failure(s)" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    # 45 formats x dtypes and 9 split8 ones, 2 switches, 3 launches of unaligned tensors, 8 of rows that end
    # in a short block; + 22 of the SGD and Lion rules
    assert sum(line.startswith("ok   ") for line in out.stdout.splitlines()) == 89
    # the static speed of every variant, and per state mode: compact's 8-bit codes cost more instructions
    # than the fp32 state's plain loads (the low-memory-state issue's measure)
    assert all("instr/element" in line for line in out.stdout.splitlines() if line.startswith("ok   "))
    modes = {line.split()[0]: float(line.split()[1]) for line in out.stdout.split("time on an H200:\n")[1]
             .splitlines() if line.startswith("  ")}
    assert modes.keys() == {"fp32", "split", "bf16", "compact", "tiny"}
    assert 50 < modes["fp32"] < modes["split"] < modes["compact"] and modes["bf16"] < modes["compact"], modes


def test_auto_falls_back_to_fused_when_the_first_launch_fails(monkeypatch):
    """Under 'auto' (as on CUDA) a Triton kernel whose first launch fails (it does not compile for this
    GPU) is one RuntimeWarning, and the step runs 'fused' instead: the same bits, nothing half-written;
    under 'triton' the failure raises."""
    from halfadam.kernels import triton as triton_kernel

    monkeypatch.setattr(executions, "_triton_runs", lambda device, implementation, what: True)
    monkeypatch.setattr(executions, "_triton_launched", False)
    monkeypatch.setattr(executions, "_triton_failed", None)

    def broken(*args, **kwargs):
        raise RuntimeError("PTX compile error (simulated)")
    monkeypatch.setattr(triton_kernel, "launch", broken)
    kw = dict(state_mode="bf16")
    with pytest.raises(RuntimeError, match="simulated"):
        _train("triton", torch.bfloat16, kw=kw, steps=1, strided=False)
    with pytest.warns(RuntimeWarning, match="first launch failed; implementation='auto' runs 'fused'"):
        got = _train("auto", torch.bfloat16, kw=kw, steps=2, strided=False)
    assert executions._triton_failed.startswith("RuntimeError: PTX compile error")
    assert_same_runs(_train("reference", torch.bfloat16, kw=kw, steps=2, strided=False), got, "fallback")


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_bfloat16_subnormals_load_exactly(mode):
    """The interpreter's bfloat16 -> float32 conversion loses subnormals (2.9e-39 -> 0; found by
    halfadam.selfcheck): parameters, gradients and bfloat16 moments are loaded through their bits."""
    runs = []
    for impl in ("triton", "foreach"):
        p = torch.zeros(2, 128)
        p[1, :4] = torch.tensor([1e-39, -2e-39, 1e-40, 1.0])
        p = p.to(torch.bfloat16).requires_grad_()
        g = torch.zeros(2, 128)
        g[0, 1:4] = torch.tensor([2.9387e-39, 1e-38, 1e-30])
        p.grad = g.to(torch.bfloat16)
        opt = halfadam.AdamW([p], lr=1e-3, weight_decay=0.1, state_mode=mode, implementation=impl)
        opt.step()
        opt.step()
        runs.append(([p], opt))
    assert runs[0][1].state[runs[0][0][0]]["exp_avg"][0, 1] != 0  # the subnormal gradient reached exp_avg
    assert_same_runs(runs[0], runs[1], mode)


def test_codes_floor_counts_each_change():
    """benchmarks/codes_floor.py (issue 36 item 2): every row's changed codes reach the compiled kernel
    (a change the compiler never saw would count today's codes again): each piece taken out of today's
    codes costs fewer instructions than all of them, the uniform codes fewer still, and each of their
    parts (random bits, nan/inf codes, the block maximum) costs some."""
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "codes_floor.py")
    out = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {}
    for line in out.stdout.splitlines()[2:]:
        label, count, over = line.rsplit(None, 2)
        rows[label] = float(count)
        assert abs(float(over) - (rows[label] - rows["split master, float32 moments (no codes)"])) <= 0.11
    assert len(rows) == 12
    today = rows["today's codes (compact)"]
    split, bf16 = rows["split master, float32 moments (no codes)"], rows["bfloat16 moments, stochastic rounding"]
    assert split < bf16 < rows["uniform, round down, no nan/inf codes"]
    assert max(rows["today's codes: uint8 exp_avg only"], rows["today's codes: uint8 exp_avg_sq only"]) < today
    assert all(rows[label] < today for label in rows if label.startswith("today's, without"))
    down, stochastic = rows["uniform, round down, no nan/inf codes"], rows["uniform, stochastic, no nan/inf codes"]
    assert down < stochastic < rows["uniform, stochastic, nan/inf codes"] < today
    assert rows["uniform, stochastic, no nan/inf codes, no block max"] < stochastic
