"""The C++ kernel's SGD (rule 1) and Lion (rule 2) steps against the engine's spec, bit for bit, at every
lane width compiled in (16: AVX-512, 8: AVX2, 1: the scalar path that also runs the tails).

``adam_step(..., rule)`` is called directly on flat state built here (the rule's one signed moment in
the kernel's ``exp_avg`` slot, with ``exp_avg_scale`` when uint8; SGD without momentum: no moment key
at all) and compared with a reference written from the spec's Python statement of each rule on float32
tensors (:func:`_rule_math`), composed with :mod:`halfadam.encodings`' master and moment encodings as
``encodings.encoded_update_`` composes them for Adam (:func:`_reference_flat`): every master (none, fp32,
split, split8), every moment dtype (float32, bfloat16, uint8, none), float16/bfloat16/float32 parameters,
momentum on and off, nesterov, maximize, weight decay, a gradient scale; state of random bytes, special
parameter, moment and gradient values; parameters whose rows end in short blocks in flat buffers with
gaps; Lion's sign at +-0, nan and +-inf (+0: no move); and the argument checks per rule (nothing
written on an error).
"""

from __future__ import annotations

import math

import pytest
import torch

from halfadam import encodings as E
from halfadam.functional import sync_master_
from conftest import same_bits
from test_cpp_rows import _layout as _rows_layout
from test_cpp_split8 import _assert_same_runs, _differences, _grads
from test_cpp_uint8 import _kernel, _kernel_and_one_thread  # noqa: F401 (the module's fixture)

LANES = (16, 8, 1)
SGD, LION = 1, 2


def _f32(x: float) -> float:
    """``x`` rounded to float32 (the kernel takes its coefficients as float32)."""
    return torch.tensor(x, dtype=torch.float32).item()


def sgd_coefficients(lr=0.05, momentum=0.9, dampening=0.25, weight_decay=0.01, maximize=False):
    """The spec's 6 SGD coefficients: l2, momentum_a, momentum_b, nesterov_momentum, lr, sign."""
    return tuple(_f32(x) for x in (weight_decay, momentum, 1 - dampening, momentum, lr, -1.0 if maximize else 1.0))


def lion_coefficients(lr=0.03, betas=(0.9, 0.99), weight_decay=0.1):
    """The spec's 6 Lion coefficients: decay_factor, lr, beta1, one_minus_beta1, beta2, one_minus_beta2."""
    b1, b2 = betas
    return tuple(_f32(x) for x in (1 - lr * weight_decay, lr, b1, 1 - b1, b2, 1 - b2))


# ---------------------------------------------------------------------------------- the reference
def _rule_math(rule, w, g, m, c, flags):
    """The spec's Python statement of ``rule`` on float32 tensors, in place on ``w`` and ``m`` (the
    moment, or ``None``: SGD without momentum); ``c``: the 6 coefficients as 0-d float32 tensors;
    ``flags``: SGD's (l2, nesterov)."""
    if rule == SGD:
        l2, a, b, nm, lr, sign = c
        g = g * sign
        if flags[0]:
            g = g + l2 * w
        if m is None:
            d = g
        else:
            m.mul_(a).add_(g * b)
            d = g + m * nm if flags[1] else m
        w.sub_(d * lr)
    else:
        df, lr, b1, omb1, b2, omb2 = c
        w.mul_(df)
        u = m * b1 + g * omb1
        s = (u > 0).float() - (u < 0).float()
        w.sub_(s * lr)
        m.mul_(b2).add_(g * omb2)


def _reference_flat(rule, stored, param, grad, coefficients, flags, step, position, *, master, moment):
    """One step over flat state whose length is a multiple of 128 (rows padded with zeros to whole
    blocks): ``stored`` (the kernel's slot keys) and ``param`` (the weight itself for master "none")
    updated in place; ``position``: each element's position in its whole parameter (int64). The
    encodings as ``encodings.encoded_update_`` composes them."""
    c = [torch.tensor(x, dtype=torch.float32) for x in coefficients]
    if master == "none":
        weight = param
    elif master == "fp32":
        weight = stored["master_weight"]
        sync_master_(weight, param)
    elif master == "split8":
        weight = E._split8_decode(param, stored["master_hi"])
    else:
        weight = E._split_decode(param, stored["master_hi"], stored["master_lo"], stored["master_tie"])
    m = None if moment is None else E._decode_moment(moment, "exp_avg", stored)
    _rule_math(rule, weight, grad, m, c, flags)
    bits = E._random_bits(position, torch.tensor(step))
    if m is not None:
        E._encode_moment_(moment, "exp_avg", m, stored, bits)
    if master == "fp32":
        param.copy_(weight)
    elif master == "split8":
        E._split8_encode_(weight, param, stored["master_hi"], E._master_bits(bits))
    elif master == "split":
        E._split_encode_(weight, param, stored["master_hi"], stored["master_lo"], stored["master_tie"])


def _padded(t, rows, length, padded):
    out = t.new_zeros(rows, padded)
    out[:, :length] = t.reshape(rows, length)
    return out.view(-1)


def _reference_call(rule, params, grads, stored, offsets, block_offsets, row_lengths, coefficients, grad_scale,
                    flags, step, positions, *, master, moment):
    """``adam_step``'s arguments, stepped by the reference on copies: (params, state). Each parameter's
    rows are padded with zeros to whole blocks (encodings' layout), its per-block state taken from
    ``block_offsets``, its positions ``positions[k] + index``."""
    params = [p.clone() for p in params]
    stored = {k: v.clone() for k, v in stored.items()}
    for k, (p, g) in enumerate(zip(params, grads)):
        n, length = p.numel(), row_lengths[k]
        if n == 0:
            continue
        rows, padded = n // length, -(-length // 128) * 128
        nblocks = rows * padded // 128
        off, boff = offsets[k], block_offsets[k]
        flat = {}
        for key, t in stored.items():
            if E.is_block_key(key):
                flat[key] = t[boff:boff + nblocks].clone()
            else:
                flat[key] = _padded(t[off:off + n], rows, length, padded)
        gf = g.reshape(-1).to(torch.float32)
        if grad_scale is not None:
            gf = gf * grad_scale
        gf = _padded(gf, rows, length, padded)
        fp = _padded(p.reshape(-1), rows, length, padded)
        position = _padded(torch.arange(n, dtype=torch.int64) + (positions[k] if positions else 0), rows, length,
                           padded)
        _reference_flat(rule, flat, fp, gf, coefficients, flags, step, position, master=master, moment=moment)
        keep = fp.view(rows, padded)[:, :length].reshape(p.shape)
        p.copy_(keep)
        for key, t in flat.items():
            if E.is_block_key(key):
                stored[key][boff:boff + nblocks] = t
            else:
                stored[key][off:off + n] = t.view(rows, padded)[:, :length].reshape(-1)
    return params, stored


def _both(kernel, rule, params, grads, stored, offsets, block_offsets, row_lengths, coefficients, flags, step,
          positions=(), grad_scale=None, *, master, moment):
    """The kernel's step and the reference's on copies of the same arguments: (kernel's, reference's),
    each (params, state)."""
    out_p, out = [p.clone() for p in params], {k: v.clone() for k, v in stored.items()}
    kernel.adam_step(out_p, grads, out, list(offsets), list(block_offsets), list(row_lengths), list(coefficients),
                     grad_scale, flags[0], flags[1], step, list(positions), rule)
    want = _reference_call(rule, params, grads, stored, offsets, block_offsets, row_lengths, coefficients, grad_scale,
                           flags, step, list(positions), master=master, moment=moment)
    return (out_p, out), want


def _assert_same(got, want, what):
    (gp, gs), (wp, ws) = got, want
    for k, (a, b) in enumerate(zip(gp, wp)):
        assert same_bits(a, b), (what, "param", k, _differences(a, b))
    assert gs.keys() == ws.keys(), what
    for key in ws:
        assert same_bits(gs[key], ws[key]), (what, key, _differences(gs[key], ws[key]))


# ---------------------------------------------------------------------------------- state of random bytes
#: Parameter values with +-0, nan, +-inf, subnormals and large finite ones among normal ones.
SPECIAL = [0.0, -0.0, math.nan, math.inf, -math.inf, 1e-40, -3e-39, 2.0 ** -126, 1e-7, 65504.0, -3.3e38]


def _params(n, dtype, gen):
    p = torch.randn(n, generator=gen)
    special = torch.tensor(SPECIAL)
    pick = torch.rand(n, generator=gen) < 0.06
    p = torch.where(pick, special[torch.randint(0, special.numel(), (n,), generator=gen)], p)
    return p.to(dtype)


def _random_state(master, moment, param, total, blocks, gen):
    """Flat state of ``total`` elements and ``blocks`` blocks: a master of kind ``master`` over the flat
    ``param`` (fp32: near its values, some stale; split/split8: random remainder bytes, tie bytes in and
    past blocks) and the signed moment of dtype ``moment`` (random finite and special values; uint8:
    random codes and scales), or none."""
    stored = {}
    if master == "fp32":
        p32 = param.to(torch.float32)
        near = p32 * (1 + torch.randn(total, generator=gen) * 2.0 ** -12)
        stored["master_weight"] = torch.where(torch.rand(total, generator=gen) < 0.9, near,
                                              torch.randn(total, generator=gen))
    elif master in ("split", "split8"):
        stored["master_hi"] = torch.randint(-128, 128, (total,), generator=gen, dtype=torch.int8)
        if master == "split":
            stored["master_lo"] = torch.randint(0, 256, (total,), generator=gen, dtype=torch.uint8)
            tie = torch.randint(0, 140, (blocks,), generator=gen)
            stored["master_tie"] = torch.where(torch.rand(blocks, generator=gen) < 0.5, tie, 0).to(torch.uint8)
    if moment == torch.uint8:
        stored["exp_avg"] = torch.randint(0, 256, (total,), generator=gen, dtype=torch.uint8)
        stored["exp_avg_scale"] = torch.randint(0, 256, (blocks,), generator=gen, dtype=torch.uint8)
    elif moment is not None:
        m = torch.randn(total, generator=gen) * torch.exp2(torch.randint(-30, 10, (total,), generator=gen).float())
        special = torch.tensor([0.0, -0.0, math.nan, math.inf, -math.inf, 1e-40])
        pick = torch.rand(total, generator=gen) < 0.03
        m = torch.where(pick, special[torch.randint(0, special.numel(), (total,), generator=gen)], m)
        stored["exp_avg"] = m.to(moment)
    return stored


#: (parameter dtype, master) pairs the kernel runs: float32 parameters with no master or an fp32 one,
#: float16 with fp32 or split, bfloat16 with fp32, split or split8.
MASTERS = [(torch.float32, "none"), (torch.float32, "fp32"), (torch.float16, "fp32"), (torch.float16, "split"),
           (torch.bfloat16, "fp32"), (torch.bfloat16, "split"), (torch.bfloat16, "split8")]
MOMENTS = {"float32": torch.float32, "bf16": torch.bfloat16, "uint8": torch.uint8, "none": None}
#: SGD's flag and coefficient variants: (l2, nesterov), the coefficients.
SGD_CASES = [((False, False), sgd_coefficients(weight_decay=0.0)),
             ((True, False), sgd_coefficients(dampening=0.0)),
             ((True, True), sgd_coefficients(maximize=True)),
             ((False, True), sgd_coefficients(lr=0.5, momentum=0.5, dampening=0.5, maximize=True))]


def _flat_case(pdtype, master, moment, n, gen, *, position=0, gdtype=torch.float32):
    """One parameter of ``n`` elements (one row) in flat state: params, grads, state and its layout."""
    p = _params(n, pdtype, gen)
    if master == "none":
        p = torch.where(p.isnan(), 0.5, p)  # the weight itself: mostly finite (a few infinities)
    total, blocks = -(-n // 128) * 128, -(-n // 128)
    stored = _random_state(master, moment, torch.cat([p, p.new_zeros(total - n)]), total, blocks, gen)
    g = _grads(n, gen, gdtype)
    return [p], [g], stored, ([0], [0], [n], [position])


@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize("moment", list(MOMENTS))
@pytest.mark.parametrize("pdtype, master", MASTERS, ids=lambda x: str(x).replace("torch.", ""))
def test_sgd_is_the_spec(pdtype, master, moment, lanes):
    """SGD over flat state of random bytes and special values, every flag variant (weight decay,
    nesterov, maximize, dampening), a gradient scale and gradients of the parameter's dtype in one of
    them, at a position that is no multiple of the lane width in another; two steps in a row (the
    second from the first's state): the spec's bytes."""
    kernel = _kernel(lanes)
    gen = torch.Generator().manual_seed(5)
    n = 128 * 9 + 37
    dtype = MOMENTS[moment]
    for case, (flags, coefficients) in enumerate(SGD_CASES):
        position = (0, 128 * 40, 5, 2 ** 32 - 300)[case]
        gdtype = pdtype if case == 1 else torch.float32
        scale = torch.tensor(0.5) if case == 2 else None
        params, grads, stored, layout = _flat_case(pdtype, master, dtype, n, gen, position=position, gdtype=gdtype)
        for step in (3, 4):
            got, want = _both(kernel, SGD, params, grads, stored, *layout[:3], coefficients, flags, step, layout[3],
                              scale, master=master, moment=dtype)
            _assert_same(got, want, (flags, step))
            params, stored = got
            grads = [_grads(n, gen, gdtype)]


@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize("moment", ["float32", "bf16", "uint8"])
@pytest.mark.parametrize("pdtype, master", MASTERS, ids=lambda x: str(x).replace("torch.", ""))
def test_lion_is_the_spec(pdtype, master, moment, lanes):
    """Lion over flat state of random bytes and special values (weight decay on and off, a gradient scale,
    gradients of the parameter's dtype, an unaligned position); two steps in a row: the spec's bytes."""
    kernel = _kernel(lanes)
    gen = torch.Generator().manual_seed(6)
    n = 128 * 9 + 37
    dtype = MOMENTS[moment]
    cases = [(lion_coefficients(), None, torch.float32, 0), (lion_coefficients(weight_decay=0.0), 0.25, pdtype, 3),
             (lion_coefficients(lr=1e-4, betas=(0.95, 0.98)), None, torch.float32, 128 * 7)]
    for coefficients, scale, gdtype, position in cases:
        scale = None if scale is None else torch.tensor(scale)
        params, grads, stored, layout = _flat_case(pdtype, master, dtype, n, gen, position=position, gdtype=gdtype)
        for step in (7, 8):
            got, want = _both(kernel, LION, params, grads, stored, *layout[:3], coefficients, (False, False), step,
                              layout[3], scale, master=master, moment=dtype)
            _assert_same(got, want, (coefficients, step))
            params, stored = got
            grads = [_grads(n, gen, gdtype)]


def test_float32_state_is_the_plain_statement():
    """With no encoding in the way (float32 parameters, no master, float32 moments) the kernel is the
    spec's Python statement itself, on the tensors: checked against it written out here once more."""
    kernel = _kernel(0)
    gen = torch.Generator().manual_seed(8)
    n = 1000
    w0, g, m0 = torch.randn(n, generator=gen), torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    for (l2, nesterov), c in SGD_CASES:
        w, m = w0.clone(), m0.clone()
        kernel.adam_step([w], [g], {"exp_avg": m}, [0], [0], [n], list(c), None, l2, nesterov, 1, [], rule=SGD)
        t = [torch.tensor(x) for x in c]
        gg = g * t[5]
        if l2:
            gg = gg + t[0] * w0
        buf = m0 * t[1] + gg * t[2]
        d = gg + buf * t[3] if nesterov else buf
        assert same_bits(m, buf) and same_bits(w, w0 - d * t[4]), (l2, nesterov)
        w = w0.clone()
        kernel.adam_step([w], [g], {}, [0], [0], [n], list(c), None, l2, nesterov, 1, [], rule=SGD)
        assert same_bits(w, w0 - (gg if l2 else g * t[5]) * t[4]), ("no momentum", l2)
    c = lion_coefficients()
    t = [torch.tensor(x) for x in c]
    w, m = w0.clone(), m0.clone()
    kernel.adam_step([w], [g], {"exp_avg": m}, [0], [0], [n], list(c), None, False, False, 1, [], rule=LION)
    u = m0 * t[2] + g * t[3]
    assert same_bits(w, w0 * t[0] - torch.sign(u) * t[1])
    assert same_bits(m, m0 * t[4] + g * t[5])


# ---------------------------------------------------------------------------------- Lion's sign
@pytest.mark.parametrize("lanes", LANES)
def test_lion_sign_of_zero_nan_and_infinity(lanes):
    """Lion's sign is +1, -1, or +0 for +-0 and nan (no move: a weight of -0.0 stays -0.0, but for a
    negative lr, whose +0 * lr is -0.0): weights of 1.0 and -0.0, lr 0.5 and -0.5, no decay, beta1 = 0, so
    that u = the gradient itself (times 1.0)."""
    kernel = _kernel(lanes)
    c = [1.0, 0.5, 0.0, 1.0, 0.5, 0.5]
    grads = [0.0, -0.0, math.nan, math.inf, -math.inf, 1e-45, -1e-45, 3.0, -2.0 ** -149, 2.0 ** 127]
    want = [1.0, 1.0, 1.0, 0.5, 1.5, 0.5, 1.5, 0.5, 1.5, 0.5]  # from w = 1.0
    want0 = [-0.0, -0.0, -0.0, -0.5, 0.5, -0.5, 0.5, -0.5, 0.5, -0.5]  # from w = -0.0
    # lr = -0.5: s * lr = -0.0 for s = +0, and -0.0 - -0.0 = +0.0
    negative = [0.0, 0.0, 0.0, 0.5, -0.5, 0.5, -0.5, 0.5, -0.5, 0.5]  # from w = -0.0
    n = len(grads) * 4  # whole vectors and a tail
    g = torch.tensor(grads * 4)
    for w0, expected, lr in ((1.0, want, 0.5), (-0.0, want0, 0.5), (-0.0, negative, -0.5)):
        w = torch.full((n,), w0)
        m = torch.zeros(n)
        c[1] = lr
        kernel.adam_step([w], [g], {"exp_avg": m}, [0], [0], [n], c, None, False, False, 1, [], rule=LION)
        e = torch.tensor(expected * 4)
        assert torch.equal(w.view(torch.int32), e.view(torch.int32)), (w0, w.tolist()[:len(grads)])
        # m = 0 * 0.5 + g * 0.5: the gradient halved, nan as nan
        assert same_bits(m, torch.zeros(n) * 0.5 + g * 0.5)
    # a nan or +-0 from the moment's side: m = nan, +-0 with g = 0 (beta1 = 1)
    c = [1.0, 0.5, 1.0, 0.0, 1.0, 0.0]
    m = torch.tensor([math.nan, 0.0, -0.0, -1e-45, math.inf] * 4)
    w = torch.ones(m.numel())
    kernel.adam_step([w], [torch.zeros(m.numel())], {"exp_avg": m.clone()}, [0], [0], [m.numel()], c, None, False,
                     False, 1, [], rule=LION)
    assert w.tolist() == [1.0, 1.0, 1.0, 1.5, 0.5] * 4


# ---------------------------------------------------------------------------------- rows and gaps
#: Rows of whole blocks, rows ending in short blocks, one row, 1-D, an empty parameter.
SHAPES = [(5, 200), (7, 9), (0, 7), (4, 3, 3, 3), (33, 129), (3, 256), (2, 130), (1, 200), (3, 64), (300,)]


def _layout(shapes):
    """tests/test_cpp_rows.py's layout (offsets with a free block after every third parameter, per-block
    offsets in reverse order with gaps of 3, row lengths, the two buffers' lengths), with positions (a
    shard's row for every third parameter but the first)."""
    offsets, block_offsets, lengths, _, total, blocks = _rows_layout(shapes)
    positions = [(k % 3) * lengths[k] for k in range(len(shapes))]
    return offsets, block_offsets, lengths, positions, total, blocks


@pytest.mark.parametrize("lanes", [16, 1])
@pytest.mark.parametrize("rule, moment", [(SGD, "uint8"), (SGD, "none"), (LION, "uint8"), (LION, "bf16")])
@pytest.mark.parametrize("pdtype, master", [(torch.bfloat16, "split"), (torch.bfloat16, "split8"),
                                            (torch.float16, "split"), (torch.float32, "none")],
                         ids=lambda x: str(x).replace("torch.", ""))
def test_rows_with_short_blocks_and_gaps(pdtype, master, rule, moment, lanes):
    """Parameters whose rows end in short blocks (of 72, 9, 27, 1, 2, 64 elements) in one call, their
    per-element state at offsets with free blocks between, their per-block state (scales, ties) in
    reverse order with gaps, positions of shards: each row's blocks as the spec steps them (padded with
    zeros to whole blocks); the gaps untouched."""
    kernel = _kernel(lanes)
    gen = torch.Generator().manual_seed(9)
    dtype = MOMENTS[moment]
    offsets, block_offsets, lengths, positions, total, blocks = _layout(SHAPES)
    params = [_params(math.prod(s), pdtype, gen).view(s) for s in SHAPES]
    if master == "none":
        params = [torch.where(p.isnan(), 0.5, p) for p in params]
    flat_p = torch.zeros(total, dtype=pdtype)
    for p, off in zip(params, offsets):
        flat_p[off:off + p.numel()] = p.reshape(-1)
    stored = _random_state(master, dtype, flat_p, total, blocks, gen)
    flags, coefficients = ((True, True), sgd_coefficients()) if rule == SGD else ((False, False), lion_coefficients())
    for step in (1, 2):
        grads = [_grads(math.prod(s), gen).view(s) for s in SHAPES]
        got, want = _both(kernel, rule, params, grads, stored, offsets, block_offsets, lengths, coefficients, flags,
                          step, positions, master=master, moment=dtype)
        _assert_same(got, want, step)
        params, after = got
        for key, t in after.items():  # the gaps: as they were
            used = torch.zeros(t.numel(), dtype=torch.bool)
            for p, off, boff, length in zip(params, offsets, block_offsets, lengths):
                if E.is_block_key(key):
                    used[boff:boff + (p.numel() // length * -(-length // 128) if p.numel() else 0)] = True
                else:
                    used[off:off + p.numel()] = True
            assert torch.equal(t.view(torch.uint8)[..., None].reshape(t.numel(), -1)[~used],
                               stored[key].view(torch.uint8)[..., None].reshape(t.numel(), -1)[~used]), key
        stored = after


# ---------------------------------------------------------------------------------- lane widths, threads
def test_lane_widths_and_threads_write_the_same_bytes():
    """Every lane width compiled in, and two threads, write the same bytes for SGD and Lion in "tiny"-like
    state (split8 master, uint8 moment) and "bf16"-like state (split master, bfloat16 moment)."""
    gen = torch.Generator().manual_seed(12)
    n = 128 * 300 + 5
    for rule, master, moment in ((SGD, "split8", torch.uint8), (LION, "split", torch.bfloat16),
                                 (SGD, "split8", None)):
        params, grads, stored, layout = _flat_case(torch.bfloat16, master, moment, n, gen, position=77)
        flags, c = ((True, True), sgd_coefficients()) if rule == SGD else ((False, False), lion_coefficients())
        runs = []
        for lanes, threads in [(w, 1) for w in _kernel(0).available_lanes()] + [(0, 2)]:
            kernel = _kernel(lanes)
            torch.set_num_threads(threads)
            try:
                out_p, out = [p.clone() for p in params], {k: v.clone() for k, v in stored.items()}
                kernel.adam_step(out_p, grads, out, *layout[:3], list(c), None, *flags, 4, layout[3], rule)
            finally:
                torch.set_num_threads(1)
            runs.append((out_p, out))
        for run in runs[1:]:
            _assert_same(run, runs[0], (rule, master))
        want = _reference_call(rule, params, grads, stored, *layout[:3], c, None, flags, 4, layout[3], master=master,
                               moment=moment)
        _assert_same(runs[0], want, (rule, master, "spec"))


# ---------------------------------------------------------------------------------- argument checks
def _checked_call(rule, stored, coefficients, params=None):
    kernel = _kernel(0)
    params = params or [torch.ones(256, dtype=torch.bfloat16)]
    kernel.adam_step(params, [torch.ones(256)], stored, [0], [0], [256], coefficients, None, False, False, 1, [], rule)


@pytest.mark.parametrize("rule, change, message", [
    (SGD, dict(coefficients=8), r"rule 1 \(SGD\) expected 6 coefficients, got 8"),
    (LION, dict(coefficients=5), r"rule 2 \(Lion\) expected 6 coefficients, got 5"),
    (0, dict(coefficients=6), r"rule 0 \(Adam\) expected 8 coefficients, got 6"),
    (3, {}, r"rule 3 is none of 0 \(Adam\), 1 \(SGD\) and 2 \(Lion\)"),
    (-1, {}, r"rule -1 is none of"),
    (SGD, dict(exp_avg_sq=torch.float32), r"rule 1 \(SGD\) keeps no 'exp_avg_sq': state\['exp_avg_sq'\] must be absent"),
    (LION, dict(exp_avg_sq=torch.uint8), r"rule 2 \(Lion\) keeps no 'exp_avg_sq'"),
    (LION, dict(exp_avg=None), r"state\['exp_avg'\] must be float32, bfloat16 or uint8"),
    (LION, dict(exp_avg=torch.float16), r"state\['exp_avg'\] must be float32, bfloat16 or uint8"),
    (SGD, dict(exp_avg=None, scale=True), r"a uint8 moment needs its \*_scale"),
    (SGD, dict(exp_avg=torch.uint8, scale=False), r"a uint8 moment needs its \*_scale"),
    (SGD, dict(exp_avg=None, exp_avg_sq_exponent=True), r"a uint8 moment needs its \*_scale"),
    (SGD, dict(master_weight=255), r"master_weight's length"),
    (SGD, dict(exp_avg=None, master_weight=255), r"offsets\[0\] out of range"),
    (SGD, dict(exp_avg=None, master=None), r"float16/bfloat16 parameters need a master"),
    (LION, dict(extra="momentum_buffer"), r"unsupported state entry 'momentum_buffer'"),
])
def test_bad_arguments_raise_and_write_nothing(rule, change, message):
    """A rule's wrong coefficients count, an unknown rule, a moment slot the rule does not keep (or lacks),
    a scale without its uint8 moment, a master of the wrong length: the message names it, and nothing is
    written."""
    change = dict(change)
    n_coefficients = change.pop("coefficients", 8 if rule == 0 else 6)
    coefficients = [0.5] * n_coefficients
    stored = {}
    if change.get("master", "fp32") is not None:
        stored["master_weight"] = torch.full((change.get("master_weight", 256),), 2.0)
    exp_avg = change.get("exp_avg", torch.float32)
    if exp_avg is not None:
        stored["exp_avg"] = torch.full((256,), 3.0).to(exp_avg)
    if change.get("scale", exp_avg == torch.uint8):
        stored["exp_avg_scale"] = torch.full((2,), 100, dtype=torch.uint8)
    if "exp_avg_sq" in change:
        stored["exp_avg_sq"] = torch.ones(256, dtype=change["exp_avg_sq"])
        if change["exp_avg_sq"] == torch.uint8:
            stored["exp_avg_sq_exponent"] = torch.full((2,), 100, dtype=torch.uint8)
    if change.get("exp_avg_sq_exponent"):
        stored["exp_avg_sq_exponent"] = torch.full((2,), 100, dtype=torch.uint8)
    if "extra" in change:
        stored[change["extra"]] = torch.zeros(256)
    params = [torch.ones(256, dtype=torch.bfloat16)]
    before = ([p.clone() for p in params], {k: v.clone() for k, v in stored.items()})
    with pytest.raises(RuntimeError, match=message):
        _checked_call(rule, stored, coefficients, params)
    assert same_bits(params[0], before[0][0])
    for key in stored:
        assert torch.equal(stored[key].view(torch.uint8), before[1][key].view(torch.uint8)), key


def test_sgd_without_any_state_and_adam_by_default():
    """SGD without momentum over float32 parameters has no state at all (an empty map: the offsets index
    nothing); a call without ``rule`` is Adam's (rule 0), which still needs both moments."""
    kernel = _kernel(0)
    w = torch.tensor([1.0, -2.0, 0.0, math.inf])
    g = torch.tensor([0.5, 0.25, -1.0, 1.0])
    kernel.adam_step([w], [g], {}, [12345], [0], [4], [0.0, 0.0, 1.0, 0.0, 0.5, 1.0], None, False, False, 1, [], SGD)
    assert w.tolist() == [0.75, -2.125, 0.5, math.inf]
    with pytest.raises(RuntimeError, match=r"state\['exp_avg_sq'\] must be float32, bfloat16 or uint8"):
        kernel.adam_step([w], [g], {"exp_avg": torch.zeros(4)}, [0], [0], [4], [1.0] * 8, None, False, False, 1, [])
    m, v = torch.zeros(4), torch.zeros(4)
    kernel.adam_step([w], [g], {"exp_avg": m, "exp_avg_sq": v}, [0], [0], [4], [1.0, 0.0, 1.0, 1.0, 0.1, 0.999,
                                                                                   0.001, 1e-8], None, False, False, 1, [])
    assert torch.equal(m, g * 0.1) and bool((v > 0).all())


# ---------------------------------------------------------------------------------- whole optimizer runs
#: Rows of whole blocks, rows ending in short blocks (of 72, 9 and 1 elements), one row, 1-D.
RUN_SHAPES = [(5, 200), (7, 9), (33, 129), (3, 256), (300,)]
#: halfadam.SGD's variants: no momentum (no buffer), momentum with dampening and weight decay, nesterov
#: with maximize, momentum without weight decay; halfadam.Lion's: weight decay on and off.
OPTIMIZERS = {
    "sgd-plain": ("SGD", dict(lr=0.05, weight_decay=0.01)),
    "sgd-momentum": ("SGD", dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    "sgd-nesterov-maximize": ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True, maximize=True, weight_decay=0.02)),
    "sgd-momentum-no-decay": ("SGD", dict(lr=0.5, momentum=0.5)),
    "lion": ("Lion", dict(lr=1e-3, weight_decay=0.1)),
    "lion-no-decay": ("Lion", dict(lr=3e-3, betas=(0.95, 0.98))),
}


@pytest.fixture
def cpp_runs_the_rules(monkeypatch):
    """``implementation="cpp"`` runs SGD and Lion (the executions' table of what the kernel runs lists rules
    1 and 2), and counts the kernel's calls of each rule."""
    import halfadam
    from halfadam import executions
    from halfadam.kernels import cpp as cpu_kernel

    assert set(executions.KERNEL_RULES["cpp"]) == {0, 1, 2} and halfadam.SGD and halfadam.Lion
    kernel = cpu_kernel.load()
    calls = {}
    step = kernel.adam_step

    def counted(*args, **kwargs):
        rule = kwargs.get("rule", args[12] if len(args) > 12 else 0)
        calls[rule] = calls.get(rule, 0) + 1
        return step(*args, **kwargs)

    monkeypatch.setattr(kernel, "adam_step", counted)
    return calls


def _train(implementation, name, dtype, mode, steps=4, **extra):
    """The optimizer ``name`` (:data:`OPTIMIZERS`) over parameters of RUN_SHAPES, ``steps`` steps: step 2
    without gradients for two of them; step 3 with nan and +-inf gradients in short and whole blocks;
    step 4 with a loss scale. (params, optimizer)."""
    import halfadam

    cls, options = OPTIMIZERS[name]
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in RUN_SHAPES]
    opt = getattr(halfadam, cls)(params, state_mode=mode, implementation=implementation, **options, **extra)
    for t in range(steps):
        grads = {p: torch.randn(p.shape, generator=g).to(dtype) for p in params}
        if t == 1:
            for p in params[1:3]:
                del grads[p]
        if t == 2:
            grads[params[0]][2, 150] = math.nan  # a row's block of 72
            grads[params[0]][0, 3] = math.inf  # a whole block
            grads[params[2]][10, 128] = -math.inf  # a block of one element
            grads[params[4]][299] = math.nan
        opt.step(grads=grads, grad_scale=torch.tensor([0.5]) if t == 3 else None)
    return params, opt


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("mode", ["fp32", "split", "bf16", "compact", "tiny"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=lambda d: str(d)[6:])
def test_optimizer_runs_are_the_reference(dtype, mode, name, cpp_runs_the_rules):
    """``halfadam.SGD`` / ``halfadam.Lion`` with ``implementation="cpp"`` against ``"reference"``, 4 steps (a
    step without some gradients, nan and inf gradients in short blocks, a loss scale), at every lane width
    compiled in: every parameter's and state tensor's bytes; and the kernel ran the rule."""
    ref = _train("reference", name, dtype, mode)
    rule = SGD if OPTIMIZERS[name][0] == "SGD" else LION
    for lanes in _kernel(0).available_lanes():
        _kernel(lanes)
        calls = dict(cpp_runs_the_rules)
        _assert_same_runs(ref, _train("cpp", name, dtype, mode), (lanes,))
        assert cpp_runs_the_rules.get(rule, 0) - calls.get(rule, 0) >= 4, cpp_runs_the_rules
    params, opt = ref
    moment = "momentum_buffer" if rule == SGD else "exp_avg"
    assert (moment in opt.state[params[0]]) == (name != "sgd-plain")
    assert "exp_avg_sq" not in opt.state[params[0]]


@pytest.mark.parametrize("name", ["sgd-momentum", "sgd-plain", "lion"])
def test_float32_parameters_with_fp32_masters_are_the_reference(name, cpp_runs_the_rules):
    """float32 parameters with ``master_weights=True`` (an fp32 master over a float32 parameter)."""
    ref = _train("reference", name, torch.float32, "compact", master_weights=True)
    for lanes in sorted({1, max(_kernel(0).available_lanes())}):
        _kernel(lanes)
        _assert_same_runs(ref, _train("cpp", name, torch.float32, "compact", master_weights=True), lanes)
