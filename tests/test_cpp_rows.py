"""The C++ kernel (``implementation="cpp"``) on parameters whose rows end in short blocks, against the
specification bit for bit: a parameter of two or more dims is rows of ``L`` elements (the product of
the dims after dim 0), each cut into blocks of 128, the last one shorter where 128 does not divide
``L`` (:func:`halfadam.encodings.block_shape`); the reference steps it in its rows padded with zeros
to whole blocks (:func:`halfadam.encodings.update_param_`). The kernel's ``adam_step`` takes each
parameter's per-element ``offsets``, per-block ``block_offsets`` and ``row_lengths``; here on flat
state of random bytes laid out with gaps (block offsets that are not ``offsets // 128``), against
``update_param_`` on each parameter's views; its argument checks (nothing written on an error); and
whole optimizer runs that mix regular and tail parameters in one bucket, against the reference
execution, at lane widths 1 and the widest.
"""

from __future__ import annotations

import math

import pytest
import torch

from halfadam.functional import ADAM

import halfadam
from halfadam import encodings as E
from halfadam.kernels import cpp as cpu_kernel
from conftest import same_bits

#: Rows of whole blocks, rows ending in a short block (of 72, 9, 27, 64, 2 and 1 elements), one row, and
#: 1-D (float32 fields, one row over the flat parameter).
SHAPES = [(5, 200), (7, 9), (4, 3, 3, 3), (3, 64), (1, 200), (2, 130), (33, 129), (3, 256), (5,)]


@pytest.fixture(autouse=True, scope="module")
def _kernel_and_one_thread(one_thread):
    assert cpu_kernel.load() is not None, cpu_kernel.unavailable_reason()
    yield
    cpu_kernel.load().set_lanes(0)


def _widest() -> int:
    return max(cpu_kernel.load().available_lanes())


def _kernel(lanes: int):
    kernel = cpu_kernel.load()
    kernel.set_lanes(lanes)
    return kernel


def _differences(a, b) -> list:
    """The first flat indices where ``a`` and ``b`` differ (bit for bit, any nan as any nan)."""
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    if a.is_floating_point():
        ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
        nan = a.isnan()
        differ = (nan != b.isnan()) | (~nan & (a.view(ints) != b.view(ints)))
    else:
        differ = a != b
    return differ.nonzero().view(-1)[:5].tolist()


# ---------------------------------------------------------------------------------- adam_step on flat state
FORMATS = {
    "compact": E.PRESETS["compact"], "bf16": E.PRESETS["bf16"], "split": E.PRESETS["split"],
    "fp32 master, uint8 moments": E.StateFormat("fp32", torch.uint8, torch.uint8),
    "split, uint8 exp_avg, bf16 exp_avg_sq": E.StateFormat("split", torch.uint8, torch.bfloat16),
    "split, bf16 exp_avg, uint8 exp_avg_sq": E.StateFormat("split", torch.bfloat16, torch.uint8),
}
#: The parameters of one flat layout (an empty one among them: no blocks), each with its position in
#: its whole parameter (the random bits'): 0, or a shard's first row's first element.
FLAT_SHAPES = [(5, 200), (7, 9), (0, 7), (4, 3, 3, 3), (33, 129), (3, 256), (2, 130), (1, 200), (3, 64)]
FLAT_POSITIONS = [0, 9 * 4, 0, 27 * 11, 0, 256 * 2, 0, 200 * 5, 0]


def _layout(shapes):
    """Per-element offsets (multiples of 128, a free block after every third parameter), per-block
    offsets (the parameters' blocks in reverse order, a gap of 3 between them: none is ``offset // 128``),
    row lengths, and the two buffers' lengths."""
    numels = [math.prod(s) for s in shapes]
    lengths = [E.row_length(s) for s in shapes]
    counts = [n // length * E.n_blocks(length) if n else 0 for n, length in zip(numels, lengths)]
    offsets, total = [], 0
    for k, n in enumerate(numels):
        offsets.append(total)
        total += -(-n // 128) * 128 + (128 if k % 3 == 2 else 0)
    block_offsets, blocks = [0] * len(shapes), 3
    for k in reversed(range(len(shapes))):
        block_offsets[k] = blocks
        blocks += counts[k] + 3
    return offsets, block_offsets, lengths, counts, total, blocks


def _random_flat(fmt, has_master, total, blocks, gen):
    """Flat state of random bytes: uint8 codes and scales, remainder bytes, tie bytes (0, or a lane in or
    past a short block, or past any block), random finite float moments and masters."""
    stored = {}
    for key, dt in E.element_keys(fmt, has_master).items():
        if dt == torch.int8:
            stored[key] = torch.randint(-128, 128, (total,), generator=gen, dtype=dt)
        elif dt == torch.uint8:
            stored[key] = torch.randint(0, 256, (total,), generator=gen, dtype=dt)
        else:
            v = torch.randn(total, generator=gen) * torch.exp2(torch.randint(-30, 10, (total,), generator=gen).float())
            stored[key] = (v.abs() if key == "exp_avg_sq" else v).to(dt)
    for key, dt in E.block_keys(fmt, has_master).items():
        high = 140 if key == "master_tie" else 256
        values = torch.randint(0, high, (blocks,), generator=gen)
        if key == "master_tie":
            values = torch.where(torch.rand(blocks, generator=gen) < 0.5, values, 0)
        stored[key] = values.to(dt)
    return stored


def _values(shape, dtype, gen):
    """Parameter values with +-0, nan, +-inf, subnormals and fp16's largest among normal ones."""
    n = math.prod(shape)
    p = torch.randn(n, generator=gen)
    special = torch.tensor([0.0, -0.0, math.nan, math.inf, -math.inf, 1e-40, -3e-39, 2.0 ** -126, 65504.0, 1e-7])
    pick = torch.rand(n, generator=gen) < 0.05
    p = torch.where(pick, special[torch.randint(0, special.numel(), (n,), generator=gen)], p)
    if dtype == torch.float32:
        p = torch.where(p.isnan(), 0.5, p)  # the weight itself: a finite start
    return p.to(dtype).view(shape)


def _gradient(shape, gen):
    """float32 gradients of many scales, with nan, +-inf, and g * g overflowing, in every kind of block."""
    n = math.prod(shape)
    g = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-20, 5, (n,), generator=gen).float())
    g[torch.rand(n, generator=gen) < 0.02] = math.nan
    g[torch.rand(n, generator=gen) < 0.02] = math.inf
    g[torch.rand(n, generator=gen) < 0.02] = -math.inf
    g[torch.rand(n, generator=gen) < 0.02] = 1e30
    return g.view(shape)


def _views(stored, offset, block_offset, shape, count):
    """One parameter's views of flat buffers: per element of its shape, per block of its block shape."""
    n = math.prod(shape)
    return {key: t[block_offset:block_offset + count].view(E.block_shape(shape)) if E.is_block_key(key)
            else t[offset:offset + n].view(shape) for key, t in stored.items()}


def _step_both(kernel, fmt, stored, params, grads, layout, coefficients, step, decay, optimized):
    """One ``adam_step`` over the flat layout, and ``update_param_`` over each parameter's views of a copy
    of the same state: (kernel's params, state), (reference's params, state)."""
    offsets, block_offsets, lengths, counts, _, _ = layout
    ref, ref_params = {k: v.clone() for k, v in stored.items()}, [p.clone() for p in params]
    for k, (p, g) in enumerate(zip(ref_params, grads)):
        if p.numel():
            views = _views(ref, offsets[k], block_offsets[k], tuple(p.shape), counts[k])
            E.update_param_(fmt, p, views, g, coefficients, step, rule=ADAM, flags=(decay == "l2", optimized),
                            offset=FLAT_POSITIONS[k])
    out, out_params = {k: v.clone() for k, v in stored.items()}, [p.clone() for p in params]
    kernel.adam_step(out_params, grads, out, offsets, block_offsets, lengths, list(coefficients), None,
                     decay == "l2", optimized, step, FLAT_POSITIONS)
    return (out_params, out), (ref_params, ref)


def _assert_same(got, want, what):
    (gp, gs), (wp, ws) = got, want
    for k, (a, b) in enumerate(zip(gp, wp)):
        assert same_bits(a, b), (what, "param", FLAT_SHAPES[k], _differences(a, b))
    for key in ws:  # the whole buffers: the gaps and the padding untouched as well
        assert same_bits(gs[key], ws[key]), (what, key, _differences(gs[key], ws[key]))


@pytest.mark.parametrize("lanes", [16, 8, 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_adam_step_rows_with_short_blocks_is_the_spec(fmt, dtype, lanes):
    """``adam_step`` over parameters with short row tails, in flat buffers whose per-block offsets are
    not ``offsets // 128`` (random state bytes, garbage tie bytes, special values, nan and inf
    gradients; shards' positions), writes ``update_param_``'s bytes, two steps in a row (both decays);
    the gaps between the parameters' state are left as they were."""
    if lanes not in cpu_kernel.load().available_lanes():
        pytest.skip(f"{lanes} lanes are not compiled in on this CPU")
    kernel = _kernel(lanes)
    fmt, has_master = FORMATS[fmt], dtype != torch.float32
    if not has_master:
        fmt = E.StateFormat("fp32", fmt.exp_avg, fmt.exp_avg_sq)
    gen = torch.Generator().manual_seed(5)
    layout = _layout(FLAT_SHAPES)
    stored = _random_flat(fmt, has_master, layout[4], layout[5], gen)
    params = [_values(s, dtype, gen) for s in FLAT_SHAPES]
    if "master_weight" in stored:  # mostly masters that round to their parameters (the others written over)
        for p, offset in zip(params, layout[0]):
            m = stored["master_weight"][offset:offset + p.numel()]
            near = p.reshape(-1).float() * (1 + torch.randn(p.numel(), generator=gen) * 2.0 ** -10)
            m.copy_(torch.where(torch.rand(p.numel(), generator=gen) < 0.9, near, m))
    for step, decay, optimized in ((5, "decoupled", False), (6, "l2", True)):
        grads = [_gradient(s, gen) for s in FLAT_SHAPES]
        coefficients = halfadam.functional.adam_coefficients(step=float(step), lr=1e-2, beta1=0.9, beta2=0.999,
                                                             eps=1e-8, weight_decay=0.1, decay=decay,
                                                             optimized_update=optimized)
        got, want = _step_both(kernel, fmt, stored, params, grads, layout, coefficients, step, decay, optimized)
        _assert_same(got, want, (step, decay))
        params, stored = got


@pytest.mark.parametrize("lanes", [1, 0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
def test_split_ties_in_short_blocks(dtype, lanes):
    """Masters exactly halfway above an even parameter in every lane (1.0 times 1 + ulp / 2, step size 0):
    each block's first tie is flagged by its tie byte (short blocks included, whose byte the padding
    never takes), the others clamped; and decoded back as the spec does, the next steps."""
    kernel = _kernel(lanes)
    fmt = E.PRESETS["split"]
    layout = _layout(FLAT_SHAPES)
    offsets, block_offsets, _, counts, total, blocks = layout
    stored = {"master_hi": torch.zeros(total, dtype=torch.int8), "master_lo": torch.zeros(total, dtype=torch.uint8),
              "master_tie": torch.zeros(blocks, dtype=torch.uint8), "exp_avg": torch.zeros(total),
              "exp_avg_sq": torch.zeros(total)}
    params = [torch.ones(s, dtype=dtype) for s in FLAT_SHAPES]
    params[1].view(7, 9)[2, :4] = 3.0  # an odd bf16 pattern before the ties of a 9-element block
    factor = 1 + (2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11)
    coefficients = (factor, 0.0, 0.0, 1.0, 0.1, 0.999, 0.001, 1e-8)
    grads = [torch.zeros(s) for s in FLAT_SHAPES]
    for step in range(3):
        got, want = _step_both(kernel, fmt, stored, params, grads, layout, coefficients, step + 1, "decoupled", False)
        _assert_same(got, want, step)
        params, stored = got
        if step == 0:
            ties = stored["master_tie"][block_offsets[1]:block_offsets[1] + counts[1]]
            assert ties.tolist() == [1, 1, 5, 1, 1, 1, 1]  # rows of one 9-element block each
            tails = stored["master_tie"][block_offsets[4]:block_offsets[4] + counts[4]].view(33, 2)
            assert bool((tails == 1).all())  # blocks of 128 and of 1


def _call(kernel, params, grads, stored, offsets, block_offsets, row_lengths):
    coefficients = [1.0, 0.0, 1e-2, 1.0, 0.1, 0.999, 0.001, 1e-8]
    kernel.adam_step(params, grads, stored, offsets, block_offsets, row_lengths, coefficients, None, False, False, 1, [])


@pytest.mark.parametrize("change, message", [
    (dict(block_offsets=[0]), r"block_offsets \(1\) and row_lengths \(2\) must have one entry per parameter \(2\)"),
    (dict(row_lengths=[200, 63, 9]), r"block_offsets \(2\) and row_lengths \(3\)"),
    (dict(row_lengths=[200, 0]), r"row_lengths\[1\] = 0 does not divide params\[1\]'s 63 elements"),
    (dict(row_lengths=[200, 8]), r"row_lengths\[1\] = 8 does not divide params\[1\]'s 63 elements"),
    (dict(row_lengths=[200, -9]), r"row_lengths\[1\] = -9"),
    (dict(block_offsets=[0, 11]), r"block_offsets\[1\] = 11: params\[1\]'s 7 blocks do not fit the per-block buffers "
                                  r"\(17 entries\)"),
    (dict(block_offsets=[0, -1]), r"block_offsets\[1\] = -1"),
    (dict(row_lengths=[200, 1]), r"block_offsets\[1\] = 10: params\[1\]'s 63 blocks do not fit"),
    (dict(offsets=[0, 1000]), r"offsets\[1\] out of range"),
    (dict(scale_blocks=16), r"master_tie, exp_avg_scale and exp_avg_sq_exponent differ in length"),
])
def test_adam_step_bad_layout_raises_and_writes_nothing(change, message):
    """A layout argument that does not fit (the message names it), even of a later parameter: nothing
    written, neither the first parameter nor any state."""
    kernel = _kernel(0)
    fmt = E.PRESETS["compact"]
    shapes = [(5, 200), (7, 9)]  # 10 and 7 blocks
    gen = torch.Generator().manual_seed(2)
    args = dict(offsets=[0, 1024], block_offsets=[0, 10], row_lengths=[200, 9])
    change = dict(change)
    scale_blocks = change.pop("scale_blocks", 17)
    args.update(change)
    stored = _random_flat(fmt, True, 1024 + 128, 17, gen)
    stored["exp_avg_sq_exponent"] = stored["exp_avg_sq_exponent"][:scale_blocks].clone()
    params = [_values(s, torch.bfloat16, gen) for s in shapes]
    grads = [_gradient(s, gen) for s in shapes]
    before = ([p.clone() for p in params], {k: v.clone() for k, v in stored.items()})
    with pytest.raises(RuntimeError, match=message):
        _call(kernel, params, grads, stored, **args)
    for p, q in zip(params, before[0]):
        assert same_bits(p, q)
    for key in stored:
        assert torch.equal(stored[key].view(torch.uint8), before[1][key].view(torch.uint8)), key


def test_adam_step_empty_parameter_any_row_length():
    """A parameter of no elements has no blocks, whatever its row length (0 included: a shape (4, 0)'s)."""
    kernel = _kernel(0)
    fmt = E.PRESETS["compact"]
    stored = _random_flat(fmt, True, 128, 1, torch.Generator().manual_seed(3))
    before = {k: v.clone() for k, v in stored.items()}
    empty = torch.zeros(4, 0, dtype=torch.bfloat16)
    for length in (0, 7):
        _call(kernel, [empty], [torch.zeros(4, 0)], stored, [0], [1], [length])
    assert all(torch.equal(stored[k], before[k]) for k in stored)


# ---------------------------------------------------------------------------------- whole optimizer runs
def _train(impl, dtype, mode, lanes=None, shapes=SHAPES, steps=4, cls=halfadam.AdamW):
    """Parameters of ``shapes``, ``steps`` steps: step 2 without gradients for (7, 9), (33, 129) and the 1-D
    one; step 3 with nan and +-inf gradients in short blocks (and one in a whole block); step 4 with a
    loss scale. (params, optimizer)."""
    if lanes is not None:
        _kernel(lanes)
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]
    opt = cls(params, lr=1e-2, weight_decay=0.1, state_mode=mode, implementation=impl)
    for t in range(steps):
        grads = {p: torch.randn(p.shape, generator=g).to(dtype) for p in params}
        if t == 1:
            for p in params:
                if tuple(p.shape) in ((7, 9), (33, 129), (5,)):
                    del grads[p]
        if t == 2:
            for p in params:
                s, gp = tuple(p.shape), grads[p]
                if s == (5, 200):
                    gp[2, 150] = math.nan  # the row's block of 72
                    gp[0, 3] = math.inf  # a whole block
                elif s == (33, 129):
                    gp[10, 128] = math.inf  # a block of one element
                    gp[11, 128] = math.nan
                elif s == (7, 9):
                    gp[3, 8] = -math.inf
                elif s == (4, 3, 3, 3):
                    gp[1, 2, 2, 2] = math.nan  # a row's last element
        opt.step(grads=grads, grad_scale=torch.tensor([0.5]) if t == 3 else None)
    return params, opt


def _assert_same_runs(run_a, run_b, what):
    """Every parameter and state tensor of two runs, bit for bit (a nan as any nan: eager torch and the
    kernel write different nan patterns)."""
    (pa, oa), (pb, ob) = run_a, run_b
    for p, q in zip(pa, pb):
        assert same_bits(p, q), (what, tuple(p.shape), "param", _differences(p, q))
        sa, sb = oa.state[p], ob.state[q]
        assert sa.keys() == sb.keys(), (what, tuple(p.shape))
        for key in sa:
            assert sa[key].shape == sb[key].shape, (what, tuple(p.shape), key)
            assert same_bits(sa[key], sb[key]), (what, tuple(p.shape), key, _differences(sa[key], sb[key]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("mode", ["compact", "bf16", "split"])
def test_training_with_short_blocks_is_the_reference(mode, dtype):
    """cpp and reference, 4 steps over one bucket of regular and tail parameters (a step without some
    gradients, nan and inf gradients in short blocks, a loss scale), at lane widths 1 and the widest:
    every parameter's and state tensor's bytes; per-block state of the block shape."""
    ref = _train("reference", dtype, mode)
    for lanes in sorted({1, _widest()}):
        run = _train("cpp", dtype, mode, lanes)
        _assert_same_runs(ref, run, (mode, lanes))
    params, opt = run
    st = opt.state[params[SHAPES.index((33, 129))]]
    assert st["master_tie"].shape == (33, 2)
    if mode == "compact":
        assert st["exp_avg_scale"].shape == st["exp_avg_sq_exponent"].shape == (33, 2)


@pytest.mark.parametrize("mode", ["compact", "bf16"])
def test_float32_parameters_with_short_blocks_are_the_reference(mode):
    """float32 parameters (no master: uint8 or bfloat16 moments over the parameter itself)."""
    ref = _train("reference", torch.float32, mode)
    for lanes in sorted({1, _widest()}):
        _assert_same_runs(ref, _train("cpp", torch.float32, mode, lanes), (mode, lanes))


def test_adam_l2_with_short_blocks_is_the_reference():
    ref = _train("reference", torch.bfloat16, "compact", cls=halfadam.Adam)
    _assert_same_runs(ref, _train("cpp", torch.bfloat16, "compact", 0, cls=halfadam.Adam), "l2")


def test_threads_split_short_blocks_not_the_bytes():
    """Two threads split a bucket of 813 blocks (rows of 129: blocks of 128 and 1) at block boundaries
    inside rows: the bytes of one thread."""
    shapes = [(300, 129), (7, 9), (3, 256), (100, 200)]
    one = _train("cpp", torch.bfloat16, "compact", 0, shapes=shapes, steps=2)
    torch.set_num_threads(2)
    try:
        two = _train("cpp", torch.bfloat16, "compact", 0, shapes=shapes, steps=2)
    finally:
        torch.set_num_threads(1)
    _assert_same_runs(one, two, "threads")
    _assert_same_runs(_train("reference", torch.bfloat16, "compact", shapes=shapes, steps=2), two, "reference")
