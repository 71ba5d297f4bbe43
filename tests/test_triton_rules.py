"""The Triton kernel's SGD and Lion rules (``kernels/triton.py``, ``launch(rule=...)``) bit for bit against
the engine's rule specification: each rule's per-element math written here from the spec on float32
tensors (each operation rounded once, in the spec's order), composed with the encodings' master and
moment codecs of :mod:`halfadam.encodings` (the specification of the state's bytes, as its
``encoded_update_`` composes them), for every master kind (none, fp32, split, split8), the single signed
moment in float32, bfloat16 and uint8 and no moment at all (SGD without momentum), float32, float16 and
bfloat16 parameters, the bucket layout (flat state buffers) and the shard layout (each tensor's own state
in the table), with and without a gradient scale and ``found_inf``. Without a GPU the kernel runs under
Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set by conftest.py), so the sizes are small.
"""

from __future__ import annotations

import math

import pytest
import torch

from halfadam import encodings as E
from halfadam.functional import sync_master_
from halfadam.kernels import triton as K
from conftest import needs_triton, same_bits

pytestmark = [needs_triton, pytest.mark.usefixtures("one_thread"),
              # the interpreter's numpy reports the overflows the tests make on purpose (inf * 0 = nan)
              pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")]

#: where the kernel runs: the GPU if there is one, else the CPU under the interpreter
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK = E.BLOCK
MASTERS = {"none": K.MASTER_NONE, "fp32": K.MASTER_FP32, "split": K.MASTER_SPLIT, "split8": K.MASTER_SPLIT8}

#: the rules' cases: kernel rule, whether the signed moment exists, the flags, the coefficients (the spec's
#: order: SGD l2, momentum_a, momentum_b, nesterov_momentum, lr, sign; Lion decay_factor, lr, beta1,
#: one_minus_beta1, beta2, one_minus_beta2)
RULES = {
    "sgd-momentum": dict(rule=K.RULE_SGD, moment=True, l2=False, nesterov=False,
                         coefficients=(0.0, 0.9, 0.75, 0.9, 0.05, 1.0)),
    # weight decay, nesterov, maximize (sign -1)
    "sgd-nesterov-l2-maximize": dict(rule=K.RULE_SGD, moment=True, l2=True, nesterov=True,
                                     coefficients=(0.01, 0.9, 1.0, 0.9, 0.05, -1.0)),
    "sgd-plain-l2": dict(rule=K.RULE_SGD, moment=False, l2=True, nesterov=False,
                         coefficients=(0.01, 0.0, 0.0, 0.0, 0.05, 1.0)),
    "lion": dict(rule=K.RULE_LION, moment=True, l2=False, nesterov=False,
                 coefficients=(1.0 - 0.03 * 0.1, 0.03, 0.9, 0.1, 0.99, 0.01)),
}
#: (parameter dtype, master) pairs: float32 parameters have none; split8 masters are over bfloat16 ones
PARAMS = [(torch.float32, "none"), (torch.float16, "fp32"), (torch.float16, "split"), (torch.bfloat16, "fp32"),
          (torch.bfloat16, "split"), (torch.bfloat16, "split8")]
MOMENTS = [torch.float32, torch.bfloat16, torch.uint8]
#: rows of whole blocks, a row ending in a short block, a 1-D tensor with a short last block, single elements
SHAPES = [(3, 256), (2, 200), (300,), (5,), (1,)]


def f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32, device=DEVICE)


# --------------------------------------------------------------------------------- the reference
def _rule_math(case: dict, w, g, m, coefficients):
    """The spec's per-element math of ``case``'s rule on float32 tensors (one rounding per operation,
    in the spec's order): (new w, new m or None)."""
    c = [f32(x) for x in coefficients]
    if case["rule"] == K.RULE_SGD:
        l2, momentum_a, momentum_b, nesterov_momentum, lr, sign = c
        g = g * sign
        if case["l2"]:
            g = g + l2 * w
        if m is not None:
            m = m * momentum_a + g * momentum_b
            d = g + m * nesterov_momentum if case["nesterov"] else m
        else:
            d = g
        return w - d * lr, m
    decay_factor, lr, beta1, one_minus_beta1, beta2, one_minus_beta2 = c
    w = w * decay_factor
    u = m * beta1 + g * one_minus_beta1
    s = (u > 0).float() - (u < 0).float()
    w = w - s * lr
    return w, m * beta2 + g * one_minus_beta2


def _reference_step(case, master, mdtype, p, g, st, positions, step, coefficients, grad_scale=None):
    """One step of ``case``'s rule over one tensor's flat, block-padded copies: ``p`` (its parameter's
    dtype; float32 where ``master`` is "none"), ``g`` (float32), ``st`` (its state, the moment under the
    slot name ``exp_avg``); written in place. The master decode and encode, the moment codecs and the
    random bits are :mod:`halfadam.encodings`' (as ``encoded_update_`` composes them)."""
    if grad_scale is not None:
        g = g * grad_scale
    if master == "none":
        w = p.clone()
    elif master == "fp32":
        w = st["master_weight"]
        sync_master_(w, p)
        w = w.clone()
    elif master == "split8":
        w = E._split8_decode(p, st["master_hi"])
    else:
        w = E._split_decode(p, st["master_hi"], st["master_lo"], st["master_tie"])
    m = E._decode_moment(mdtype, "exp_avg", st).clone() if case["moment"] else None
    w, m = _rule_math(case, w, g, m, coefficients)
    stochastic = master == "split8" or (case["moment"] and mdtype != torch.float32)
    bits = E._random_bits(positions, torch.tensor(step, device=DEVICE)) if stochastic else None
    if m is not None:
        if mdtype == torch.float32:
            st["exp_avg"].copy_(m)
        else:
            E._encode_moment_(mdtype, "exp_avg", m, st, bits)
    if master == "none":
        p.copy_(w)
    elif master == "fp32":
        st["master_weight"].copy_(w)
        p.copy_(w)
    elif master == "split8":
        E._split8_encode_(w, p, st["master_hi"], E._master_bits(bits))
    else:
        E._split_encode_(w, p, st["master_hi"], st["master_lo"], st["master_tie"])


# --------------------------------------------------------------------------------- tensors and state
def _layout(shape, master, mdtype, moment=True):
    """(rows, row length, padded row length) the kernel steps a tensor of ``shape`` in: rows of
    :func:`halfadam.encodings.row_length` where the format has per-block keys, else the flat tensor,
    padded to whole blocks where the format is blocked (``encodings.kernel_row_length``, ``_work_size``)."""
    n = math.prod(shape)
    uint8 = moment and mdtype == torch.uint8
    blocked = master in ("split", "split8") or (moment and mdtype != torch.float32)
    if (master == "split" or uint8) and E.has_rows(shape):
        length = E.row_length(shape)
        return shape[0], length, E.n_blocks(length) * BLOCK
    return 1, n, (E.n_blocks(n) * BLOCK if blocked else n)


def _pad(t, layout):
    rows, length, padded = layout
    out = t.new_zeros(rows, padded)
    out[:, :length] = t.reshape(rows, length)
    return out.view(-1)


def _unpad(flat, layout, shape):
    rows, length, padded = layout
    return flat.view(rows, padded)[:, :length].reshape(shape)


def _positions(layout, offset):
    rows, length, padded = layout
    row = torch.arange(rows, dtype=torch.int64, device=DEVICE).view(-1, 1) * length
    return (row + torch.arange(padded, dtype=torch.int64, device=DEVICE) + offset).view(-1)


def _element_key(key):
    return key not in ("master_tie", "exp_avg_scale")


def _initial(shape, pdtype, master, mdtype, moment, gen):
    """A tensor's padded parameter and state (zeros in the padding): a random master, encoded; a random
    moment, encoded; for an fp32 master one parameter element written outside the optimizer (the
    master-sync rule then takes it)."""
    layout = _layout(shape, master, mdtype, moment)
    real = _pad(torch.ones(shape, device=DEVICE), layout) != 0
    size = real.numel()
    w0 = torch.randn(size, generator=gen).to(DEVICE) * real
    st = {}
    if master == "none":
        p = w0.clone()
    else:
        p = w0.to(pdtype)
    if master == "fp32":
        st["master_weight"] = w0.clone()
        p[0] = p[0] * 2 + 1  # written: the master takes it
    elif master == "split":
        st.update(master_hi=torch.zeros(size, dtype=torch.int8, device=DEVICE),
                  master_lo=torch.zeros(size, dtype=torch.uint8, device=DEVICE),
                  master_tie=torch.zeros(size // BLOCK, dtype=torch.uint8, device=DEVICE))
        E._split_encode_(w0, p, st["master_hi"], st["master_lo"], st["master_tie"])
    elif master == "split8":
        st["master_hi"] = torch.zeros(size, dtype=torch.int8, device=DEVICE)
        E._split8_encode_(w0, p, st["master_hi"], None)
    if moment:
        m0 = torch.randn(size, generator=gen).to(DEVICE) * 0.1 * real
        if mdtype == torch.uint8:
            st["exp_avg"] = torch.zeros(size, dtype=torch.uint8, device=DEVICE)
            st["exp_avg_scale"] = torch.zeros(size // BLOCK, dtype=torch.uint8, device=DEVICE)
            E._encode_moment_(torch.uint8, "exp_avg", m0, st,
                              E._random_bits(torch.arange(size, device=DEVICE), torch.tensor(7, device=DEVICE)))
        else:
            st["exp_avg"] = m0.to(mdtype)
    return layout, p, st


def _block_state(t, layout):
    """A per-block key's padded flat tensor as the shard's own tensor: (rows, blocks per row), or flat."""
    rows, length, padded = layout
    return t.view(rows, padded // BLOCK) if rows > 1 else t.clone()


def _own(key, t, layout, shape):
    """A state key's padded flat tensor as a shard's own state tensor (the parameter's shape, or the blocks'
    shape)."""
    return _unpad(t, layout, shape) if _element_key(key) else _block_state(t, layout)


def _in_bucket(key, t, layout, size):
    """A state key's padded flat tensor as its slice of a bucket's flat buffer: a per-element key holds
    the tensor's elements (not padded by rows) and zeros to ``size`` (its numel rounded up to whole
    blocks where the format is blocked: ``buckets.Bucket``); a per-block key its blocks, row after row."""
    if not _element_key(key):
        return t
    rows, length, _ = layout
    elements = _unpad(t, layout, (rows * length,))
    return torch.cat([elements, elements.new_zeros(size - elements.numel())])


class _Run:
    """Tensors of ``shapes`` with their state, stepped by the kernel (``kernel``) and by the reference
    (``reference``) from the same start, in the bucket layout (``shard=False``: flat state buffers, each
    tensor's at an offset, positions from 0) or the shard layout (each tensor's own state tensors in the
    table, its first element at position ``offsets[i]`` of its parameter, each state tensor inside a larger
    one whose other elements must keep their values)."""

    def __init__(self, case, pdtype, master, mdtype, shapes=SHAPES, shard=False, seed=0):
        self.case, self.pdtype, self.master, self.mdtype, self.shard = case, pdtype, master, mdtype, shard
        self.moment = case["moment"]
        gen = torch.Generator().manual_seed(seed)
        self.shapes = shapes
        self.layouts, self.pads, self.states = [], [], []
        for shape in shapes:
            layout, p, st = _initial(shape, pdtype, master, mdtype, self.moment, gen)
            self.layouts.append(layout)
            self.pads.append(p)
            self.states.append(st)
        self.offsets = [2 * math.prod(s) + 3 * k for k, s in enumerate(shapes)] if shard else [0] * len(shapes)
        # the kernel's tensors
        self.params = [_unpad(p, lay, s).clone() for p, lay, s in zip(self.pads, self.layouts, shapes)]
        self.sizes = [lay[0] * lay[2] for lay in self.layouts]  # the elements the kernel steps
        blocked = master in ("split", "split8") or (self.moment and mdtype != torch.float32)
        self.elements = [-(-math.prod(s) // BLOCK) * BLOCK if blocked else math.prod(s) for s in shapes]
        self.starts = [0 if shard else sum(self.elements[:k]) for k in range(len(shapes))]
        self.block_starts = [0 if shard else sum(self.sizes[:k]) // BLOCK for k in range(len(shapes))]
        self.surplus = []
        if shard:
            self.own = []
            for st, lay, shape in zip(self.states, self.layouts, shapes):
                own = {}
                for key, t in st.items():
                    t = _own(key, t, lay, shape)
                    n = t.numel()
                    outer = torch.full((16 + n + 144,), 0x55 if t.dtype == torch.uint8 else 7, dtype=t.dtype,
                                       device=DEVICE)
                    own[key] = outer[16:16 + n].view(t.shape).copy_(t)
                    self.surplus.append((outer, n, outer.clone()))
                self.own.append(own)
            self.stored = {}
        else:
            self.stored = self._bucket(self.states)

    def _bucket(self, states):
        """The bucket's flat buffers of the tensors' padded ``states``."""
        return {key: torch.cat([_in_bucket(key, st[key], lay, size)
                                for st, lay, size in zip(states, self.layouts, self.elements)])
                for key in states[0]}

    def kernel(self, grads, step, coefficients=None, grad_scale=None, found_inf=None, device_scalars=False):
        case = self.case
        coefficients = coefficients or case["coefficients"]
        table = K.tensor_table(self.params, grads, self.sizes, self.starts, self.offsets, DEVICE,
                               [lay[1] for lay in self.layouts], self.block_starts,
                               states=self.own if self.shard else None)
        if device_scalars:
            scalars = K.device_scalars(tuple(f32(c) for c in coefficients),
                                       torch.full((len(grads),), float(step), device=DEVICE))
        else:
            scalars = K.scalars(coefficients, step, DEVICE)
        K.launch(K.work_list(self.sizes, DEVICE), table, scalars, self.stored, param_dtype=self.params[0].dtype,
                 grad_dtype=grads[0].dtype, master=MASTERS[self.master],
                 exp_avg=self.mdtype if self.moment else None, exp_avg_sq=None, l2=case["l2"],
                 optimized_update=False, grad_scale=grad_scale, found_inf=found_inf, rule=case["rule"],
                 nesterov=case["nesterov"])

    def reference(self, grads, step, coefficients=None, grad_scale=None):
        coefficients = coefficients or self.case["coefficients"]
        for k, (g, lay) in enumerate(zip(grads, self.layouts)):  # (each tensor's padded copies: rows padded)
            _reference_step(self.case, self.master, self.mdtype, self.pads[k], _pad(g.float(), lay), self.states[k],
                            _positions(lay, self.offsets[k]), step, coefficients, grad_scale)

    def assert_same(self, what):
        """The kernel's parameters and state equal the reference's, bit for bit (a nan's payload aside),
        and no byte around a shard's state tensors changed."""
        for k, (p, lay, shape) in enumerate(zip(self.params, self.layouts, self.shapes)):
            assert same_bits(p, _unpad(self.pads[k], lay, shape)), (what, "param", shape)
            if self.shard:
                for key, t in self.own[k].items():
                    assert same_bits(t, _own(key, self.states[k][key], lay, shape)), (what, key, shape)
        if not self.shard:
            expected = self._bucket(self.states)
            assert self.stored.keys() == expected.keys()
            for key, t in self.stored.items():
                assert same_bits(t, expected[key]), (what, key)
        for outer, n, before in self.surplus:
            ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[outer.element_size()]
            assert torch.equal(outer[:16].view(ints), before[:16].view(ints)), what
            assert torch.equal(outer[16 + n:].view(ints), before[16 + n:].view(ints)), what


def _grads(shapes, dtype, gen, poison=False):
    grads = [torch.randn(s, generator=gen).to(DEVICE, dtype) for s in shapes]
    if poison:  # a nan, an inf and a -inf gradient
        grads[0].view(-1)[5] = math.nan
        grads[1].view(-1)[199] = math.inf
        grads[2].view(-1)[299] = -math.inf
    return grads


def _steps(run, steps=3, grad_dtype=None, poison_step=1, scale_step=2, **kw):
    """``steps`` steps of ``run`` by the kernel and the reference, compared after each: a nan and infinite
    gradients at ``poison_step``, a gradient scale at ``scale_step``."""
    gen = torch.Generator().manual_seed(1)
    for t in range(1, steps + 1):
        grads = _grads(run.shapes, grad_dtype or run.pdtype, gen, poison=t == poison_step)
        scale = torch.tensor([0.5], device=DEVICE) if t == scale_step else None
        run.kernel(grads, t, grad_scale=scale, **kw)
        run.reference(grads, t, grad_scale=scale)
        run.assert_same(f"step {t}")


def _cases():
    for rule, case in RULES.items():
        for pdtype, master in PARAMS:
            for mdtype in (MOMENTS if case["moment"] else [torch.float32]):
                yield pytest.param(rule, pdtype, master, mdtype,
                                   id=f"{rule}-{str(pdtype)[6:]}-{master}-"
                                      f"{str(mdtype)[6:] if case['moment'] else 'no-moment'}")


# --------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("rule, pdtype, master, mdtype", list(_cases()))
def test_bucket_layout_is_the_spec_bit_for_bit(rule, pdtype, master, mdtype):
    """Three steps in the bucket layout (flat state buffers, each tensor's from an offset; rows that end in
    a short block where the format keeps per-block state), a nan and infinite gradients at step 1, a
    gradient scale at step 2: every parameter and state byte is the spec's."""
    _steps(_Run(RULES[rule], pdtype, master, mdtype))


@pytest.mark.parametrize("rule, pdtype, master, mdtype",
                         [pytest.param(r, pd, ma, md, id=f"{r}-{str(pd)[6:]}-{ma}-{str(md)[6:]}")
                          for r, pd, ma, md in (("sgd-nesterov-l2-maximize", torch.bfloat16, "split", torch.uint8),
                                                ("sgd-momentum", torch.bfloat16, "split8", torch.bfloat16),
                                                ("sgd-plain-l2", torch.bfloat16, "split8", torch.float32),
                                                ("sgd-plain-l2", torch.float16, "split", torch.float32),
                                                ("lion", torch.bfloat16, "split8", torch.uint8),
                                                ("lion", torch.float16, "fp32", torch.bfloat16),
                                                ("lion", torch.float32, "none", torch.uint8),
                                                ("sgd-momentum", torch.float32, "none", torch.float32))])
def test_shard_layout_is_the_spec_bit_for_bit(rule, pdtype, master, mdtype):
    """The shard layout (FSDP2's local shards: each tensor's own state tensors in the table, absent slots
    0; the first element at a position other than 0), float32 gradients: the spec's bits, and no byte
    written around the state tensors."""
    _steps(_Run(RULES[rule], pdtype, master, mdtype, shard=True), grad_dtype=torch.float32)


@pytest.mark.parametrize("rule", ["sgd-nesterov-l2-maximize", "lion"])
def test_per_tensor_scalars_and_several_programs(rule):
    """Device scalars (a row per tensor, 6 coefficients padded to Adam's row) and a tensor of several
    programs (more than CHUNK elements, its last one partial) beside small ones."""
    shapes = [(2, K.CHUNK // 2 + 300), (5,), (3, 200)]
    _steps(_Run(RULES[rule], torch.bfloat16, "split", torch.uint8, shapes=shapes), steps=2, poison_step=0,
           device_scalars=True)


@pytest.mark.parametrize("flag", [0.0, 1.0])
@pytest.mark.parametrize("rule", ["sgd-momentum", "lion"])
def test_found_inf_skips_inside_the_kernel(rule, flag):
    """found_inf set: the launch writes nothing (every byte as before); 0: the ordinary step."""
    run = _Run(RULES[rule], torch.bfloat16, "split", torch.uint8, shapes=[(3, 200), (7,)])
    grads = _grads(run.shapes, torch.bfloat16, torch.Generator().manual_seed(3))
    before = ([p.clone() for p in run.params], {k: t.clone() for k, t in run.stored.items()})
    run.kernel(grads, 1, found_inf=torch.tensor([flag], device=DEVICE))
    if flag:
        assert all(torch.equal(p.view(torch.int16), q.view(torch.int16)) for p, q in zip(run.params, before[0]))
        assert all(torch.equal(run.stored[k], before[1][k]) for k in before[1])
    else:
        run.reference(grads, 1)
        run.assert_same("found_inf 0")
        assert not torch.equal(run.stored["exp_avg"], before[1]["exp_avg"])


def test_lion_sign_of_zero_and_nan_is_plus_zero():
    """Lion's update sign: +1 and -1 (infinities, a subnormal), and +0.0 where c = m * beta1 + g *
    (1 - beta1) is +0, -0 (both signs of zero, and exact cancellation) or nan: there the weight only decays
    (w * decay_factor, no nan), as the spec's (c > 0) - (c < 0)."""
    case = dict(RULES["lion"], coefficients=(0.75, 0.125, 0.5, 0.5, 0.75, 0.25))
    nan, inf = math.nan, math.inf
    tiny = 2.0 ** -148
    m = torch.tensor([0.0, -0.0, 0.0, -0.0, 1.0, -1.0, nan, 0.5, -inf, 0.0, tiny, 1.0, -3.0, 0.0, tiny / 2],
                     device=DEVICE)
    g = torch.tensor([0.0, -0.0, -0.0, 0.0, -1.0, 1.0, 1.0, nan, 1.0, inf, 0.0, 2.0, 3.0, -tiny, 0.0], device=DEVICE)
    # c:             +0    -0     +0    +0    +0    +0   nan   nan  -inf  inf  2**-149 >0  +0  -2**-149  +0 (2**-150
    # rounds to even: 0)
    sign = torch.tensor([0, 0, 0, 0, 0, 0, 0, 0, -1, 1, 1, 1, 0, -1, 0], dtype=torch.float32, device=DEVICE)
    w0 = torch.linspace(-2, 2, m.numel(), device=DEVICE)
    p, state = w0.clone(), m.clone()
    n = p.numel()
    table = K.tensor_table([p], [g], [n], [0], [0], DEVICE, [n], [0])
    K.launch(K.work_list([n], DEVICE), table, K.scalars(case["coefficients"], 1, DEVICE), {"exp_avg": state},
             param_dtype=torch.float32, grad_dtype=torch.float32, master=K.MASTER_NONE, exp_avg=torch.float32,
             exp_avg_sq=None, l2=False, rule=K.RULE_LION)
    expected = w0 * 0.75 - sign * 0.125
    assert same_bits(p, expected), (p, expected)
    assert not p.isnan().any()
    zero = sign == 0
    assert torch.equal(p[zero], (w0 * 0.75)[zero])
    w, mm = _rule_math(case, w0.clone(), g, m.clone(), case["coefficients"])
    assert same_bits(p, w) and same_bits(state, mm)
    assert bool(state[6].isnan()) and bool(state[7].isnan()) and state[8] == -inf and state[9] == inf


def test_sgd_float32_is_the_spec_written_out():
    """SGD with momentum, nesterov, weight decay and maximize on float32 parameters and a float32 buffer,
    against the spec's statement written out in Python floats per element (float32 each)."""
    import numpy as np

    gen = torch.Generator().manual_seed(5)
    n = 300
    w0, g, b0 = (torch.randn(n, generator=gen) for _ in range(3))
    p, buf = w0.clone().to(DEVICE), b0.clone().to(DEVICE)
    co = (0.01, 0.9, 0.75, 0.9, 0.05, -1.0)
    table = K.tensor_table([p], [g.to(DEVICE)], [n], [0], [0], DEVICE, [n], [0])
    K.launch(K.work_list([n], DEVICE), table, K.scalars(co, 4, DEVICE), {"exp_avg": buf}, param_dtype=torch.float32,
             grad_dtype=torch.float32, master=K.MASTER_NONE, exp_avg=torch.float32, exp_avg_sq=None, l2=True,
             rule=K.RULE_SGD, nesterov=True)
    l2, a, b, nm, lr, sign = (np.float32(c) for c in co)
    for i in range(n):
        w, gi, bi = np.float32(w0[i]), np.float32(g[i]), np.float32(b0[i])
        gi = gi * sign
        gi = gi + l2 * w
        bi = bi * a + gi * b
        d = gi + bi * nm
        w = w - d * lr
        assert np.float32(p[i].item()) == w and np.float32(buf[i].item()) == bi, i


def test_scalars_rows_are_padded_to_adams():
    """scalars() and device_scalars() of 6 coefficients: the row of 10 (the 6 float32 bit patterns, zeros,
    the step in column 9), as wide as Adam's 8; another count is a ValueError naming the argument."""
    co = (0.01, 0.9, 0.75, 0.9, 0.05, -1.0)
    row = K.scalars(co, 2 ** 32 + 5, DEVICE).cpu()
    assert row.shape == (10,)
    assert torch.equal(row[:6], torch.tensor(co, dtype=torch.float32).view(torch.int32))
    assert row[6:9].tolist() == [0, 0, 0] and int(row[9]) == 5
    rows = K.device_scalars(tuple(f32(c) for c in co), torch.tensor([3.0, 4.0], device=DEVICE)).cpu()
    assert rows.shape == (2, 10) and torch.equal(rows[0], K.scalars(co, 3, DEVICE).cpu())
    assert int(rows[1, 9]) == 4
    adam = K.scalars(tuple(range(8)), 1, DEVICE).cpu()
    assert torch.equal(adam[:8], torch.arange(8, dtype=torch.float32).view(torch.int32)) and int(adam[8]) == 0
    for bad in ((1.0,) * 5, (1.0,) * 7, (1.0,) * 9):
        with pytest.raises(ValueError, match="coefficients"):
            K.scalars(bad, 1, DEVICE)
        with pytest.raises(ValueError, match="coefficients"):
            K.device_scalars(tuple(f32(c) for c in bad), torch.tensor([1.0], device=DEVICE))


@pytest.mark.parametrize("kw, match", [
    (dict(rule=3), "rule must be"),
    (dict(rule=K.RULE_ADAM, exp_avg=None), "exp_avg and exp_avg_sq must be"),
    (dict(rule=K.RULE_ADAM, exp_avg_sq=None), "exp_avg and exp_avg_sq must be"),
    (dict(rule=K.RULE_SGD), "exp_avg_sq must be None"),
    (dict(rule=K.RULE_LION, exp_avg=None, exp_avg_sq=None), "exp_avg must be a dtype"),
    (dict(rule=K.RULE_LION, exp_avg_sq=None, l2=True), "l2 must be False"),
    (dict(rule=K.RULE_LION, exp_avg_sq=None, nesterov=True), "nesterov must be False"),
    (dict(rule=K.RULE_ADAM, nesterov=True), "nesterov must be False"),
    (dict(rule=K.RULE_SGD, exp_avg=torch.float16, exp_avg_sq=None), "exp_avg must be"),
])
def test_launch_refuses_what_the_rule_does_not_have(kw, match):
    """A rule id that is none, moment slots or flags the rule does not have: ValueError naming the
    argument, before anything is written."""
    p, g, m = torch.ones(8, device=DEVICE), torch.ones(8, device=DEVICE), torch.ones(8, device=DEVICE)
    table = K.tensor_table([p], [g], [8], [0], [0], DEVICE, [8], [0])
    args = dict(param_dtype=torch.float32, grad_dtype=torch.float32, master=K.MASTER_NONE, exp_avg=torch.float32,
                exp_avg_sq=torch.float32, l2=False, optimized_update=False)
    with pytest.raises(ValueError, match=match):
        K.launch(K.work_list([8], DEVICE), table, K.scalars((0.5,) * 8, 1, DEVICE), {"exp_avg": m, "exp_avg_sq": m},
                 **dict(args, **kw))
    assert torch.equal(p, torch.ones(8, device=DEVICE)) and torch.equal(m, torch.ones(8, device=DEVICE))


# --------------------------------------------------------------------------------- the optimizers
#: halfadam.SGD and halfadam.Lion configurations (each rule's flags: weight decay, nesterov, maximize,
#: dampening, no momentum buffer)
OPTIMIZERS = {
    "sgd-nesterov": ("SGD", dict(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True), K.RULE_SGD),
    "sgd-dampening-maximize": ("SGD", dict(lr=0.1, momentum=0.9, dampening=0.1, maximize=True), K.RULE_SGD),
    "sgd-plain": ("SGD", dict(lr=0.1, weight_decay=0.01), K.RULE_SGD),
    "lion": ("Lion", dict(lr=1e-2, weight_decay=0.1), K.RULE_LION),
}
OPTIMIZER_SHAPES = [(33, 128), (5,), (3, 200), (300,), (1,)]


def _optimizer(name):
    import halfadam

    cls_name, kw, rule = OPTIMIZERS[name]
    return getattr(halfadam, cls_name), kw, rule


def _train(impl, name, dtype, mode, steps=4, capturable=False, skip=False):
    """``steps`` steps of optimizer ``name``: a parameter without a gradient at step 1 (its count lags), a
    nan and an inf gradient at step 2, a loss scale at step 3 (``skip``: step 2 skipped by a found_inf
    tensor instead), a strided parameter with a strided gradient."""
    cls, kw, _ = _optimizer(name)
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(DEVICE, dtype)) for s in OPTIMIZER_SHAPES]
    params.append(torch.nn.Parameter(torch.randn(256, 3, generator=g).to(DEVICE, dtype).t()))  # rows of 256
    opt = cls(params, implementation=impl, state_mode=mode, capturable=capturable, **kw)
    for t in range(steps):
        grads = {p: (torch.randn(p.shape[::-1], generator=g).t() if not p.is_contiguous()
                     else torch.randn(p.shape, generator=g)).to(DEVICE, dtype) for p in params}
        if t == 1:
            del grads[params[2]]
        if t == 2 and not skip:
            grads[params[0]].view(-1)[200] = math.nan
            grads[params[3]].view(-1)[299] = math.inf
        if skip:
            opt.step(grads=grads, found_inf=torch.tensor([float(t == 2)], device=DEVICE))
        else:
            opt.step(grads=grads, grad_scale=torch.tensor([0.5], device=DEVICE) if t == 3 else None)
    return params, opt


@pytest.fixture
def triton_runs_the_rules(monkeypatch):
    """The launches of the Triton kernel (their rule arguments); the kernel runs every rule."""
    from halfadam import executions

    assert set(executions.KERNEL_RULES["triton"]) == {K.RULE_ADAM, K.RULE_SGD, K.RULE_LION}
    launches, real = [], K.launch
    monkeypatch.setattr(K, "launch", lambda *a, **k: launches.append(k) or real(*a, **k))
    return launches


def _same_runs(run_a, run_b, what):
    (pa, oa), (pb, ob) = run_a, run_b
    for p, q in zip(pa, pb):
        assert same_bits(p, q), what
        assert oa.state[p].keys() == ob.state[q].keys(), what
        for key in oa.state[p]:
            assert same_bits(oa.state[p][key], ob.state[q][key]), (what, key)


@pytest.mark.parametrize("mode, dtype", [(m, torch.bfloat16) for m in ("fp32", "split", "bf16", "compact", "tiny")]
                         + [(m, d) for m in ("compact", "tiny") for d in (torch.float16, torch.float32)],
                         ids=lambda v: v if isinstance(v, str) else str(v)[6:])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizers_triton_is_the_reference_bit_for_bit(name, mode, dtype, triton_runs_the_rules):
    """halfadam.SGD and halfadam.Lion with implementation="triton" in every state mode (bf16 parameters;
    float16 and float32 ones in compact and tiny): four steps (partial gradients, non-finite ones, a loss
    scale, a strided parameter) give the reference execution's bytes in every parameter and state
    tensor, and every launch ran the optimizer's rule."""
    pytest.importorskip("halfadam.sgd")
    _, _, rule = _optimizer(name)
    ref = _train("reference", name, dtype, mode)
    triton_runs_the_rules.clear()
    tri = _train("triton", name, dtype, mode)
    _same_runs(ref, tri, (name, mode))
    ours = [k for k in triton_runs_the_rules if k.get("rule", K.RULE_ADAM) == rule]
    assert ours and len(ours) == len(triton_runs_the_rules), [k.get("rule") for k in triton_runs_the_rules]
    assert all(k["exp_avg_sq"] is None for k in ours)
    momentum = name != "sgd-plain"
    assert all((k["exp_avg"] is not None) == momentum for k in ours)
    assert ("momentum_buffer" in tri[1].state[tri[0][0]]) == (momentum and rule == K.RULE_SGD)


@pytest.mark.parametrize("mode", ["fp32", "compact", "tiny"])
@pytest.mark.parametrize("name", ["sgd-nesterov", "sgd-plain", "lion"])
def test_optimizers_capturable_is_the_ordinary_step(name, mode, triton_runs_the_rules):
    """capturable=True (per-parameter coefficients computed on the device: 6 padded to Adam's row;
    found_inf read by the kernel) gives the bits of capturable=False, a skipped step and diverged step
    counts included."""
    pytest.importorskip("halfadam.sgd")
    ref = _train("triton", name, torch.bfloat16, mode, skip=True)
    triton_runs_the_rules.clear()
    cap = _train("triton", name, torch.bfloat16, mode, capturable=True, skip=True)
    _same_runs(ref, cap, (name, mode))
    assert any(k.get("found_inf") is not None for k in triton_runs_the_rules)
    assert [float(cap[1].state[p]["step"]) for p in cap[0]] == [3.0, 3.0, 2.0, 3.0, 3.0, 3.0]
