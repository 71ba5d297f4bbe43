"""Non-finite values, failed calls, writes and dtype changes, implementations that agree bit for bit.

Each test compares against a value the library did not compute the same way: the fp32 state mode
(torch's semantics: a nan or inf poisons its element and nothing else), a run without the fault,
or numbers derived from the encodings' definitions.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

import halfadam
from halfadam import executions
from halfadam import encodings as E
from halfadam.checkpoint import CheckpointError

CPU = torch.device("cpu")
#: Direct (>= 65536 elements) and packed; the 2-D ones have rows of whole blocks (the per-block
#: encodings apply), the 1-D ones keep float32 fields in their place (and have padded blocks).
SHAPES = [(300, 256), (5,), (3, 128), (70000,)]


pytestmark = pytest.mark.usefixtures("one_thread")


def _params(dtype, shapes=SHAPES, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _grads(params, step, dtype=None):
    g = torch.Generator().manual_seed(100 + step)
    return {p: torch.randn(p.shape, generator=g).to(dtype or p.dtype) for p in params}


def _train(impl, dtype, mode="fp32", steps=4, cls=halfadam.AdamW, poison=None, grad_dtype=None, **kw):
    """``steps`` steps on :data:`SHAPES`; ``poison = (step, value)`` writes ``value`` into element 5 of the
    first gradient at that step. Returns (params, optimizer)."""
    params = _params(dtype)
    kw.setdefault("lr", 1e-2)
    opt = cls(params, implementation=impl, state_mode=mode, **kw)
    for t in range(steps):
        grads = _grads(params, t, grad_dtype)
        if poison is not None and t == poison[0]:
            grads[params[0]].view(-1)[5] = poison[1]
        opt.step(grads=grads)
    return params, opt


def _impls(mode):
    return ["reference", "foreach", "cpp"]


def _bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32) if t.element_size() == 4 else t


# ============================================================================ 1. non-finite values
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("mode", ["fp32", "split", "bf16", "compact", "tiny"])
def test_a_nonfinite_gradient_poisons_its_element_only(mode, bad):
    """bf16 parameters, no scaler: a nan/inf gradient element at step 2 of 5 makes that element's master
    nan (as torch.optim.AdamW: inf/inf), every implementation takes every step, and every other block
    is bit for bit the run without the fault (the random bits depend on positions, not values)."""
    clean = {impl: _train(impl, torch.bfloat16, mode, steps=5) for impl in _impls(mode)}
    fp32_params, fp32_opt = _train("reference", torch.bfloat16, "fp32", steps=5, poison=(2, bad))
    fp32_state = fp32_opt.state[fp32_params[0]]
    for impl in _impls(mode):
        params, opt = _train(impl, torch.bfloat16, mode, steps=5, poison=(2, bad))
        st = opt.state[params[0]]
        assert float(st["step"]) == 5.0 and opt.param_groups[0]["global_step"] == 5
        master = opt.master_weight(params[0]).view(-1)
        assert torch.isnan(master[5]) and torch.isnan(params[0].view(-1)[5])
        assert int(master.isnan().sum()) == 1 and int(params[0].isnan().sum()) == 1
        ref_params, ref_opt = clean[impl]
        ref_master = ref_opt.master_weight(ref_params[0]).view(-1)
        assert torch.equal(master[128:], ref_master[128:]), impl  # the other blocks: untouched
        assert (master[:128].isfinite().sum() == 127) and (master[:128] - ref_master[:128])[master[:128].isfinite()].abs().max() < 0.05
        for p, q in zip(params[1:], ref_params[1:]):
            assert torch.equal(p, q)
        decoded = E.decode_state(E.format_of(st), params[0], st)
        for name in ("exp_avg", "exp_avg_sq"):  # nan stays nan, inf stays inf: the fp32 state's values
            got, want = decoded[name].view(-1)[5], fp32_state[name].view(-1)[5]
            assert (got.isnan() and want.isnan()) or got == want, (name, got, want)


@pytest.mark.parametrize("mode", ["fp32", "compact"])
def test_an_overflowing_second_moment_stops_its_element(mode):
    """A finite fp32 gradient of 1e30 makes (1 - b2) g^2 overflow: exp_avg_sq is +inf there, the update
    m / sqrt(v) is 0 and (no weight decay) that element stops moving; the step never raises."""
    params = _params(torch.bfloat16)
    opt = halfadam.AdamW(params, lr=1e-2, state_mode=mode)
    opt.step(grads=_grads(params, 0, torch.float32))
    before = opt.master_weight(params[0]).view(-1)[5].item()
    grads = _grads(params, 1, torch.float32)
    grads[params[0]].view(-1)[5] = 1e30
    opt.step(grads=grads)
    opt.step(grads=_grads(params, 2, torch.float32))
    st = opt.state[params[0]]
    decoded = E.decode_state(E.format_of(st), params[0], st)
    assert decoded["exp_avg_sq"].view(-1)[5].item() == math.inf
    assert opt.master_weight(params[0]).view(-1)[5].item() == before
    assert int((~opt.master_weight(params[0]).isfinite()).sum()) == 0


@pytest.mark.parametrize("mode", ["fp32", "compact"])
def test_grad_scaler_takes_a_finite_1e30_gradient(mode):
    """With halfadam.GradScaler a finite 1e30 bf16 gradient is no overflow: the step is taken (as
    torch's scaler takes it), exp_avg_sq overflows to +inf in that element only, nothing raises."""
    w = torch.nn.Parameter(torch.randn(300).bfloat16())
    opt = halfadam.AdamW([w], lr=1e-2, state_mode=mode)
    scaler = halfadam.GradScaler(init_scale=1.0)
    coef = torch.ones(300)
    coef[7] = 1e30
    for _ in range(2):
        opt.zero_grad()
        scaler.scale((w.float() * coef).sum()).backward()
        scaler.step(opt)
        scaler.update()
    st = opt.state[w]
    assert float(st["step"]) == 2.0 and scaler.get_scale() == 1.0
    v = E.decode_state(E.format_of(st), w, st)["exp_avg_sq"]
    assert v[7].item() == math.inf and bool(v[torch.arange(300) != 7].isfinite().all())
    assert bool(opt.master_weight(w).isfinite().all())


def _moment_store(name, n):
    return {name: torch.zeros(n, dtype=torch.uint8), E.scale_key(name): torch.zeros(n // 128, dtype=torch.uint8)}


@pytest.mark.parametrize("name", ["exp_avg", "exp_avg_sq"])
def test_uint8_encoders_take_every_float(name):
    """nan, +-inf, a block of only non-finite values, blocks whose finite values are 0, subnormal or
    huge: the non-finite elements decode as themselves (exp_avg_sq: -inf, impossible for a second
    moment, as nan; reserved codes no finite value takes) and the finite ones exactly as in the same
    block with the non-finite values zeroed (the block's scale is taken over its finite values)."""
    g = torch.Generator().manual_seed(5)
    n = 128 * 6
    x = torch.rand(n, generator=g) * torch.exp2(-torch.rand(n, generator=g) * 30)
    if name == "exp_avg":
        x = x * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    x[3], x[4], x[5] = math.nan, math.inf, -math.inf  # block 0: mixed
    x[128:256] = torch.tensor([math.nan, math.inf] * 64)  # block 1: nothing finite
    x[256:384] = 0.0
    x[300] = math.nan  # block 2: zeros
    x[384:512] = x[384:512] * 1e-39  # block 3: subnormal
    x[400] = math.inf
    x[512:640] = x[512:640] * 1e30  # block 4: huge
    x[600] = math.nan
    # block 5: finite only
    clean = torch.where(x.isfinite(), x, 0.0)
    bits = E._random_bits(torch.arange(n), torch.tensor(7))
    stored, ref = _moment_store(name, n), _moment_store(name, n)
    E._encode_moment_(torch.uint8, name, x, stored, bits)
    E._encode_moment_(torch.uint8, name, clean, ref, bits)
    out = E._decode_moment(torch.uint8, name, stored)
    expect = E._decode_moment(torch.uint8, name, ref)
    nonfinite = ~x.isfinite()
    special = x.clone()
    if name == "exp_avg_sq":
        special[x == -math.inf] = math.nan
    assert torch.equal(out[nonfinite].isnan(), special[nonfinite].isnan())
    assert torch.equal(out[nonfinite & ~special.isnan()], special[nonfinite & ~special.isnan()])
    assert torch.equal(stored[E.scale_key(name)], ref[E.scale_key(name)])  # over the finite values
    finite = x.isfinite()
    assert torch.equal(out[finite], expect[finite])
    assert torch.equal(stored[name][finite], ref[name][finite])
    assert torch.equal(out[256:384][finite[256:384]], torch.zeros(int(finite[256:384].sum())))
    if name == "exp_avg_sq":
        assert torch.equal(out[finite] == 0, x[finite] == 0)  # subnormal, tiny beside huge: never 0


def test_compact_nan_step_does_not_switch_auto_to_foreach():
    params, opt = _train("auto", torch.bfloat16, "compact", steps=3, poison=(1, math.nan))
    assert executions.compile_available()
    assert float(opt.state[params[0]]["step"]) == 3.0


# ============================================================================ 2. a failed call changes nothing
def test_float64_gradients_run_on_every_implementation():
    """step(grads=...) with float64 gradients (any floating dtype): converted to float32, the same bits
    on every path, including the C++ kernel, which converted nothing before and raised after counting."""
    runs = {impl: _train(impl, torch.bfloat16, "split", steps=3, grad_dtype=torch.float64)
            for impl in ("reference", "foreach", "cpp")}
    f32 = _train("reference", torch.bfloat16, "split", steps=3, grad_dtype=torch.float32)
    for impl, (params, opt) in runs.items():
        assert float(opt.state[params[0]]["step"]) == 3.0
        for p, q in zip(params, f32[0]):
            assert torch.equal(p, q), impl


@pytest.mark.parametrize("impl", ["reference", "foreach", "cpp"])
def test_a_step_that_raises_counts_no_step(impl, monkeypatch):
    params, opt = _train(impl, torch.bfloat16, "bf16", steps=2)

    def broken(*args, **kwargs):
        raise RuntimeError("simulated kernel failure")
    target = {"reference": "update_param_", "foreach": "_run_kernel", "cpp": "_cpp_step"}[impl]
    monkeypatch.setattr(executions, target, broken)
    with pytest.raises(RuntimeError, match="simulated"):
        opt.step(grads=_grads(params, 2))
    assert [float(opt.state[p]["step"]) for p in params] == [2.0] * len(params)
    assert opt.param_groups[0]["global_step"] == 2
    monkeypatch.undo()
    opt.step(grads=_grads(params, 2))  # and the next step is step 3, from the same state
    again, _ = _train(impl, torch.bfloat16, "bf16", steps=3)
    for p, q in zip(params, again):
        assert torch.equal(p, q)


# ============================================================================ 3. writes and dtype changes
@pytest.mark.parametrize("impl", ["reference", "cpp"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_split_master_takes_a_written_nonfinite_value(value, impl):
    """p.data[i] = inf between steps, where the old remainder is negative: the split master is inf (not
    +-3.4e38), and the next step (weight decay on) is bit for bit the fp32 mode's: the parameter stays inf."""
    params, opt = _train(impl, torch.bfloat16, "split", steps=3, weight_decay=0.1)
    idx = (opt.state[params[0]]["master_hi"].view(-1)[:1000] < 0).nonzero().view(-1)[:20]
    assert idx.numel() == 20
    out = {}
    for mode in ("fp32", "split"):
        params, opt = _train(impl, torch.bfloat16, mode, steps=3, weight_decay=0.1)
        p = params[0]
        p.data.view(-1)[idx] = value
        m = opt.master_weight(p).view(-1)[idx]
        assert (m.isnan() if math.isnan(value) else m == value).all(), mode
        opt.step(grads=_grads(params, 3))
        out[mode] = [q.detach().clone() for q in params]
    for a, b in zip(out["fp32"], out["split"]):
        assert torch.equal(_bits(a), _bits(b))
    w = out["split"][0].view(-1)[idx]
    assert (w.isnan() if math.isnan(value) else w == value).all()


@pytest.mark.parametrize("impl", ["reference", "foreach", "cpp"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_written_zeros_keep_the_fp32_modes_signs(dtype, impl):
    """p.mul_(0) (zeros of the parameter's signs) and explicit +0.0 / -0.0, then an lr=0 step: the
    masters take the written zeros with their signs, and split masters come out of the step with the
    fp32 state mode's bits (the step's ``w - 0 * m / d`` decides a zero's sign the same way)."""
    out = {}
    for mode in ("fp32", "split", "bf16"):
        params, opt = _train(impl, dtype, mode, steps=3)
        p = params[0]
        p.data.mul_(0)
        p.data.view(-1)[:64] = 0.0
        p.data.view(-1)[64:128] = -0.0
        assert torch.equal(torch.signbit(opt.master_weight(p)), torch.signbit(p.detach())), mode
        opt.param_groups[0]["lr"] = 0.0
        opt.step(grads=_grads(params, 3))
        out[mode] = p.detach().clone()
    assert torch.equal(_bits(out["split"]), _bits(out["fp32"]))  # (bf16 moments: m has other roundings)


@pytest.mark.parametrize("which", ["weight", "bias"])
@pytest.mark.parametrize("mode", ["split", "bf16", "compact", "tiny"])
def test_float_after_half_steps_is_the_master(mode, which):
    """model.float() after bf16 steps: the fp32 parameter is the master the optimizer trained, bit for
    bit (bf16 -> fp32 is exact and the remainder is kept); for the weight (rows of whole blocks: a split
    master) and for the bias (1-D: an fp32 master, as in the fp32 state mode)."""
    lin = torch.nn.Linear(128, 48).to(torch.bfloat16)  # the weight's rows are one block: per-block state
    opt = halfadam.AdamW(lin.parameters(), lr=1e-3, state_mode=mode)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p in lin.parameters():
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()
    p = getattr(lin, which)
    assert ("master_hi" if which == "weight" else "master_weight") in opt.state[p]  # split(8); 1-D: fp32
    m = opt.master_weight(p).clone()
    assert not torch.equal(m, p.float())  # the master has bits the parameter lacks
    lin.float()
    assert torch.equal(opt.master_weight(p), m)
    assert torch.equal(p.detach(), m)
    lin.bfloat16()  # the float32 weight is rounded: the master restarts from the parameter, as in the fp32 mode
    assert torch.equal(p.detach(), m.bfloat16()) and torch.equal(opt.master_weight(p), p.float())


def test_split_checkpoint_of_float16_parameters_refuses_a_bfloat16_model():
    lin = torch.nn.Linear(128, 32).half()
    opt = halfadam.AdamW(lin.parameters(), lr=1e-3, state_mode="split")
    for p in lin.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    sd = opt.state_dict()
    assert sd["state"][0]["remainder_dtype"] == {"float16": 1}  # the weight (rows of one block): split
    assert "remainder_dtype" not in sd["state"][1] and "master_weight" in sd["state"][1]  # the bias: fp32
    assert "remainder_dtype" not in opt.state[lin.weight]  # only in the state_dict
    target = torch.nn.Linear(128, 32).bfloat16()
    target.load_state_dict({k: v.bfloat16() for k, v in lin.state_dict().items()})
    opt2 = halfadam.AdamW(target.parameters(), lr=1e-3, state_mode="split")
    with pytest.raises(CheckpointError, match="remainders over a float16 parameter.*bfloat16"):
        opt2.load_state_dict(sd)
    assert not opt2.state
    same = torch.nn.Linear(128, 32).half()
    same.load_state_dict(lin.state_dict())
    opt3 = halfadam.AdamW(same.parameters(), lr=1e-3, state_mode="split")
    opt3.load_state_dict(sd)
    assert torch.equal(opt3.master_weight(same.weight), opt.master_weight(lin.weight))
    for bad in ({"int8": 1}, {"float16": 1, "bfloat16": 1}, 16):
        with pytest.raises(CheckpointError, match=r"parameter 0 .*remainder_dtype must be \{'float16': 1\} or"):
            opt3.load_state_dict({**sd, "state": {**sd["state"], 0: {**sd["state"][0], "remainder_dtype": bad}}})
    sd["state"][0]["remainder_dtype"] = "float16"  # a str: releases up to 673f2dc
    opt3.load_state_dict(sd)
    del sd["state"][0]["remainder_dtype"]  # a checkpoint written before the key: taken as it is
    halfadam.AdamW(same.parameters(), lr=1e-3, state_mode="split").load_state_dict(sd)


def test_fresh_torch_state_dict_resets_with_a_warning():
    """Loading a torch.optim.AdamW state_dict that never stepped: the state is reset as torch resets it,
    the global step (which schedules read) goes back to 0, and a warning says which parameters."""
    lin = torch.nn.Linear(8, 8).bfloat16()
    opt = halfadam.AdamW(lin.parameters(), lr=1e-3)
    for _ in range(3):
        for p in lin.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    fresh = torch.optim.AdamW([torch.nn.Parameter(p.detach().float()) for p in lin.parameters()], lr=1e-3)
    with pytest.warns(UserWarning, match=r"parameter\(s\) \[0, 1\] have no state in the checkpoint"):
        opt.load_state_dict(fresh.state_dict())
    assert not opt.state and opt.param_groups[0]["global_step"] == 0


# ============================================================================ 4. groups, frozen parameters
def test_torch_flags_off_and_user_keys_in_groups():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = halfadam.AdamW([{"params": [p], "foreach": False, "fused": False, "lr_scale": 0.5, "layer_id": 3}])
    assert opt.param_groups[0]["lr_scale"] == 0.5 and opt.param_groups[0]["layer_id"] == 3
    halfadam.AdamW([{"params": [p], "foreach": None, "fused": None}])
    halfadam.AdamW([{"params": [p], "foreach": False, "fused": True}])
    with pytest.raises(ValueError, match=r"\['fused'\] and .*\['foreach'\] cannot be True together"):
        halfadam.AdamW([{"params": [p], "foreach": True, "fused": True}])
    with pytest.raises(ValueError, match=r"\['fused'\]=1 is not supported.*implementation="):
        halfadam.AdamW([{"params": [p], "fused": 1}])
    with pytest.raises(ValueError, match="amsgrad"):
        halfadam.AdamW([{"params": [p], "amsgrad": True}])
    p.grad = torch.ones(3)
    opt.step()
    sd = opt.state_dict()
    assert sd["param_groups"][0]["lr_scale"] == 0.5
    halfadam.AdamW([{"params": [p], "lr_scale": 1.0}]).load_state_dict(sd)


def test_torch_flags_as_constructor_arguments():
    p = torch.nn.Parameter(torch.zeros(3))
    for cls in (halfadam.AdamW, halfadam.Adam):
        cls([p], foreach=False, fused=False, amsgrad=False, maximize=False, capturable=False, differentiable=False)
        cls([p], foreach=None, fused=None)
        with pytest.raises(ValueError, match=rf"{cls.__name__}\(fused=...\) and .*cannot be True together"):
            cls([p], foreach=True, fused=True)
        with pytest.raises(ValueError, match=rf"{cls.__name__}\(fused=...\)='yes' is not supported.*implementation="):
            cls([p], fused="yes")
        with pytest.raises(ValueError, match="maximize"):
            cls([p], maximize=True)


@pytest.mark.parametrize("hints", [dict(fused=True, foreach=False), dict(foreach=True), dict(fused=True)])
def test_torch_kernel_hints_change_nothing(hints):
    """torch's foreach/fused hints (torchtitan's optimizer_kwargs pass fused=True, foreach=False) are
    accepted and step the same bits as the default, in a packed mode too; the hints are not stored."""
    torch.manual_seed(0)
    w = torch.randn(4, 256).bfloat16()
    runs = []
    for kw in ({}, hints):
        p = torch.nn.Parameter(w.clone())
        opt = halfadam.AdamW([p], lr=1e-2, weight_decay=0.1, state_mode="compact", **kw)
        for step in range(3):
            p.grad = torch.randn(4, 256, generator=torch.Generator().manual_seed(step)).bfloat16()
            opt.step()
        runs.append((p.detach().clone(), opt.state_dict()))
    assert torch.equal(runs[0][0].view(torch.int16), runs[1][0].view(torch.int16))
    for key, value in runs[0][1]["state"][0].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, runs[1][1]["state"][0][key]), key
    assert runs[0][1]["param_groups"] == runs[1][1]["param_groups"]


def test_fp16_to_bf16_restarts_split_masters_with_a_warning():
    """A split master is a remainder over the float16 value, which bfloat16 (3 bits fewer) does not
    hold: after model.bfloat16() the masters restart from the converted parameters, with one warning;
    the fp32 state keeps its masters. bf16 -> fp16 keeps them in fp16's normal range, exactly."""
    lin = torch.nn.Linear(128, 10).half()
    opt = halfadam.AdamW(lin.parameters(), lr=1e-3, state_mode="split")
    for p in lin.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    lin.bfloat16()
    with pytest.warns(UserWarning, match="float16 parameter with a split master .* restart from the converted"):
        m = opt.master_weight(lin.weight)
    assert torch.equal(m, lin.weight.float())
    lin = torch.nn.Linear(128, 10).bfloat16()
    opt = halfadam.AdamW(lin.parameters(), lr=1e-3, state_mode="split")
    for p in lin.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    old = opt.master_weight(lin.weight).clone()
    lin.half()
    normal = old.abs() >= 2.0 ** -14
    m = opt.master_weight(lin.weight)
    assert int(normal.sum()) > 900 and torch.equal(m[normal], old[normal])
    assert torch.equal(lin.weight.detach()[normal], old.half()[normal]) and torch.equal(m[~normal], lin.weight.float()[~normal])


def test_master_weight_of_a_frozen_parameter_makes_no_state():
    frozen = torch.nn.Parameter(torch.randn(1000).bfloat16(), requires_grad=False)
    live = torch.nn.Parameter(torch.randn(10).bfloat16())
    opt = halfadam.AdamW([frozen, live])
    m = opt.master_weight(frozen)
    assert m.dtype == torch.float32 and torch.equal(m, frozen.float()) and not opt.state.get(frozen)


# ============================================================================ 5. implementations agree
def _state_bits(opt, params):
    return [{k: v.clone() for k, v in opt.state[p].items()} for p in params]


OPTIMIZERS = {
    "adamw": (halfadam.AdamW, dict(weight_decay=0.1)),
    "adam-l2": (halfadam.Adam, dict(weight_decay=0.1)),
    "adamfp16-absolute": (halfadam.AdamFP16, dict(weight_decay=halfadam.WeightDecay(1e-3, absolute=True))),
    "adamfp16-not-optimized": (halfadam.AdamFP16, dict(optimized_update=False)),
}
FORMATS = {"fp32": {}, "split": {}, "bf16": {}, "compact": {},
           "split+bf16-exp_avg": dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.float32),
           "fp32+bf16-exp_avg_sq": dict(exp_avg_sq_dtype=torch.bfloat16)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_every_implementation_computes_the_same_bits(opt_name, fmt, dtype):
    """reference, foreach and cpp (where it runs the format): the same parameters and state bytes after 4
    steps, in every state format, dtype and decay mode (one spelling of the math, a correctly rounded sqrt,
    random bits from positions)."""
    cls, kw = OPTIMIZERS[opt_name]
    mode = fmt.split("+")[0]
    kw = dict(kw, **FORMATS[fmt])
    runs = {impl: _train(impl, dtype, mode, steps=4, cls=cls, **kw) for impl in ("reference", "foreach", "cpp")}
    params0, opt0 = runs["reference"]
    for impl, (params, opt) in runs.items():
        for p, q in zip(params, params0):
            assert torch.equal(_bits(p.detach()), _bits(q.detach())), impl
        for a, b in zip(_state_bits(opt, params), _state_bits(opt0, params0)):
            assert a.keys() == b.keys()
            for k in a:
                assert torch.equal(a[k], b[k]), (impl, k)


@pytest.mark.parametrize("mode", ["fp32", "compact"])
def test_fused_computes_the_reference_bits(mode):
    runs = {impl: _train(impl, torch.bfloat16, mode, steps=4, weight_decay=0.1) for impl in ("reference", "fused")}
    (pr, orf), (pf, of) = runs["reference"], runs["fused"]
    for p, q in zip(pr, pf):
        assert torch.equal(_bits(p.detach()), _bits(q.detach()))
    for a, b in zip(_state_bits(orf, pr), _state_bits(of, pf)):
        for k in a:
            assert torch.equal(a[k], b[k]), k


def test_fp32_steps_then_half_is_one_behaviour():
    """The issue's case: an fp32 Linear(300, 300) trained one step, then .half(), then 3 steps: every
    implementation holds the same parameters and masters, bit for bit."""
    out = {}
    for impl in ("reference", "foreach", "cpp"):
        torch.manual_seed(0)
        lin = torch.nn.Linear(300, 300)
        opt = halfadam.AdamW(lin.parameters(), lr=1e-2, implementation=impl)
        g = torch.Generator().manual_seed(1)
        for k in range(4):
            if k == 1:
                lin.half()
            for p in lin.parameters():
                p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
            opt.step()
        out[impl] = (lin.weight.detach().clone(), opt.master_weight(lin.weight).clone())
    for impl, (w, m) in out.items():
        assert torch.equal(_bits(w), _bits(out["reference"][0])) and torch.equal(m, out["reference"][1]), impl


@pytest.mark.parametrize("impl", ["reference", "auto"])
@pytest.mark.parametrize("mode", ["fp32", "compact"])
@pytest.mark.parametrize("new_shape", [(2, 128), (8, 128), (4, 64)], ids=["smaller", "larger", "reshaped"])
def test_a_resized_parameter_is_named_and_can_restart(impl, mode, new_shape):
    """``p.data = torch.randn(...)`` of another shape between steps: step, master_weight and state_dict raise
    a ValueError naming the parameter, both shapes and the way out, with nothing changed; after
    ``del opt.state[p]`` the parameter steps from fresh state, as a new optimizer's does, and the other
    parameter keeps its trajectory (its bucket is rebuilt around the new size)."""
    a, b = _params(torch.bfloat16, [(4, 128), (3, 128)])
    opt = halfadam.AdamW([a, b], lr=1e-2, weight_decay=0.1, state_mode=mode, implementation=impl)
    twin_b = torch.nn.Parameter(b.detach().clone())
    twin = halfadam.AdamW([twin_b], lr=1e-2, weight_decay=0.1, state_mode=mode, implementation="reference")
    for t in range(2):
        a.grad, b.grad = torch.ones_like(a), _grads([b], t)[b]
        twin_b.grad = b.grad.clone()
        opt.step()
        twin.step()
    a.data = torch.randn(new_shape).to(torch.bfloat16)
    a.grad, b.grad = torch.ones_like(a), _grads([b], 2)[b]
    b_before, state_before = b.detach().clone(), {k: v.clone() for k, v in opt.state[b].items()}
    message = (rf"param_groups\[0\]\['params'\]\[0\] has shape {re.escape(str(new_shape))}, but its optimizer state "
               rf".* was made for shape \(4, 128\).*del optimizer.state\[p\]")
    for call in (opt.step, lambda: opt.master_weight(a), opt.state_dict, opt.sync_master_weights):
        with pytest.raises(ValueError, match=message):
            call()
    assert torch.equal(b, b_before) and all(torch.equal(v, opt.state[b][k]) for k, v in state_before.items())
    assert float(opt.state[b]["step"]) == 2 and opt.param_groups[0]["global_step"] == 2
    del opt.state[a]
    fresh_a = torch.nn.Parameter(a.detach().clone())
    fresh = halfadam.AdamW([fresh_a], lr=1e-2, weight_decay=0.1, state_mode=mode, implementation="reference")
    fresh_a.grad, twin_b.grad = a.grad.clone(), b.grad.clone()
    opt.step()
    fresh.step()
    twin.step()
    assert torch.equal(a, fresh_a) and torch.equal(opt.master_weight(a), fresh.master_weight(fresh_a))
    assert torch.equal(b, twin_b) and torch.equal(opt.master_weight(b), twin.master_weight(twin_b))
    assert tuple(opt.state[a]["exp_avg"].shape) == new_shape


def test_a_checkpoint_of_the_new_shape_loads_over_stale_state():
    """A parameter resized between steps takes a checkpoint of its new shape (the stale state is replaced)."""
    a, = _params(torch.bfloat16, [(4, 128)])
    opt = halfadam.AdamW([a], lr=1e-2, state_mode="compact")
    a.grad = torch.ones_like(a)
    opt.step()
    source_a, = _params(torch.bfloat16, [(2, 128)], seed=1)
    source = halfadam.AdamW([source_a], lr=1e-2, state_mode="compact")
    source_a.grad = torch.ones_like(source_a)
    source.step()
    a.data = source_a.detach().clone()
    opt.load_state_dict(source.state_dict())
    assert torch.equal(opt.master_weight(a), source.master_weight(source_a))
    assert all(torch.equal(v, opt.state[a][k]) for k, v in source.state[source_a].items())


def test_bf16_moment_keeps_every_nan_pattern():
    """Stochastic rounding adds 16 random bits to the float32 pattern: a nan whose mantissa is near all
    ones (0x7FFFFFFF, what CUDA's arithmetic produces) would carry into the sign bit and store -0.0.
    Every nan is stored as bfloat16's nan instead, and infinities stay infinities."""
    patterns = torch.tensor([0x7FFFFFFF, -1, 0x7FC00000, 0x7F800001, -0x7FFFFF, 0x7F800000, -0x800000, 0],
                            dtype=torch.int32)
    x = patterns.repeat(16).view(torch.float32)
    for name in ("exp_avg", "exp_avg_sq"):
        stored = {name: torch.zeros(x.numel(), dtype=torch.bfloat16)}
        E._encode_moment_(torch.bfloat16, name, x, stored, torch.full((x.numel(),), 0xFFFFFFFF, dtype=torch.int64))
        out = stored[name].float()
        assert torch.equal(out.isnan(), x.isnan()), name
        assert torch.equal(out[~x.isnan()], x[~x.isnan()]), name
