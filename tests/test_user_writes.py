"""The next step starts from what the user did: master sync, dtype/device changes, all-or-nothing calls.

Every expected value comes from torch.optim.AdamW on float32 copies that were given the same writes.
"""

import itertools
import re

import pytest
import torch

import halfadam
from conftest import needs_gloo
from halfadam import executions

IMPLS = ["reference", "foreach", "fused"]
HALF = [torch.float16, torch.bfloat16]


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _pair(dtype, impl, lr=1e-3, seed=0):
    """A half Linear(4, 3) with halfadam, and a float32 twin with torch.optim.AdamW from the same values."""
    torch.manual_seed(seed)
    half = torch.nn.Linear(4, 3).to(dtype)
    ref = torch.nn.Linear(4, 3)
    ref.load_state_dict({k: v.float() for k, v in half.state_dict().items()})
    return (half, halfadam.AdamW(half.parameters(), lr=lr, weight_decay=0.01, implementation=impl),
            ref, torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.01))


def _step(half, opt, ref, ref_opt, seed):
    g = torch.Generator().manual_seed(seed)
    for p, q in zip(half.parameters(), ref.parameters()):
        grad = torch.randn(p.shape, generator=g)
        p.grad, q.grad = grad.to(p.dtype), grad.to(p.dtype).float()
    opt.step()
    ref_opt.step()


def _assert_follows(half, opt, ref):
    for p, q in zip(half.parameters(), ref.parameters()):
        assert _rel(opt.master_weight(p), q.detach()) <= 1e-6
        assert torch.equal(p.detach(), q.detach().to(p.dtype))


WRITES = {
    "load_state_dict": lambda m: m.load_state_dict({k: torch.full_like(v, 0.5) for k, v in m.state_dict().items()}),
    "copy_": lambda m: [p.copy_(torch.full_like(p, 3.0)) for p in m.parameters()],
    ".data": lambda m: [p.data.mul_(0) for p in m.parameters()],
    "one element": lambda m: m.weight.data.__setitem__((1, 2), 0.25),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("write", list(WRITES))
def test_write_between_steps_is_the_next_steps_start(write, dtype, impl):
    """fp16 Linear(4, 3), one step, a write, one more step: the step starts from the written values."""
    half, opt, ref, ref_opt = _pair(dtype, impl)
    _step(half, opt, ref, ref_opt, 0)
    with torch.no_grad():
        WRITES[write](half)
        WRITES[write](ref)  # values exact in every dtype: the fp32 twin gets the same weights
    _step(half, opt, ref, ref_opt, 1)
    _assert_follows(half, opt, ref)
    if write == "load_state_dict":  # the figure: the stale master brought back |w - 0.5| = 0.91
        assert (half.weight.detach().float() - 0.5).abs().max() < 2e-3


@pytest.mark.parametrize("impl", IMPLS)
def test_unchanged_elements_keep_the_masters_extra_bits(impl):
    """Only the elements the user wrote take the parameter's value; the others stay exact masters."""
    half, opt, ref, ref_opt = _pair(torch.bfloat16, impl, lr=1e-4)
    for k in range(5):
        _step(half, opt, ref, ref_opt, k)
    w = half.weight
    master = opt.master_weight(w).clone()
    assert not torch.equal(master, w.detach().float())  # the master holds bits the bf16 weight lacks
    with torch.no_grad():
        w[0, 0] = 7.0
        ref.weight[0, 0] = 7.0
    opt.sync_master_weights()
    after = opt.state[w]["master_weight"]
    assert after[0, 0].item() == 7.0
    assert torch.equal(after.flatten()[1:], master.flatten()[1:])
    _step(half, opt, ref, ref_opt, 9)
    _assert_follows(half, opt, ref)


@pytest.mark.parametrize("impl", IMPLS)
def test_pretrained_weights_loaded_after_master_weight_call(impl):
    """No step at all: master_weight(p) made the master, then pretrained weights were loaded."""
    half, opt, ref, ref_opt = _pair(torch.float16, impl)
    for p in half.parameters():
        opt.master_weight(p)
    pretrained = {k: torch.randn_like(v) for k, v in half.state_dict().items()}
    half.load_state_dict(pretrained)
    ref.load_state_dict({k: v.float() for k, v in half.state_dict().items()})
    for p in half.parameters():
        assert torch.equal(opt.master_weight(p), p.detach().float())
    _step(half, opt, ref, ref_opt, 0)
    _assert_follows(half, opt, ref)


@pytest.mark.parametrize("impl", IMPLS)
def test_state_dict_and_master_state_dict_see_the_written_values(impl):
    half, opt, ref, ref_opt = _pair(torch.bfloat16, impl)
    _step(half, opt, ref, ref_opt, 0)
    with torch.no_grad():
        half.weight.fill_(0.75)
    assert torch.equal(opt.state_dict()["state"][0]["master_weight"], torch.full((3, 4), 0.75))
    assert torch.equal(opt.master_state_dict(half)["weight"], torch.full((3, 4), 0.75))


def _stepped(mode, impl, **kw):
    """A (4, 256) bf16 parameter and its optimizer in state mode ``mode``, after one step."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4, 256).bfloat16())
    opt = halfadam.AdamW([p], state_mode=mode, implementation=impl, **kw)
    p.grad = torch.randn_like(p)
    opt.step()
    return p, opt


@pytest.mark.parametrize("impl", ["reference", "foreach", "cpp"])
@pytest.mark.parametrize("mode", ["fp32", "split", "bf16", "compact", "tiny"])
def test_a_state_tensor_replaced_between_steps_is_the_next_steps_start(mode, impl):
    """``opt.state[p][key] = new`` (a framework resetting a moment, a user setting a master) between steps:
    the next step starts from ``new``, as it does from ``opt.state[p][key].copy_(new)``, for every key
    of every state mode (the kernels step flat buffers: a replaced key is copied in, not ignored)."""
    torch.manual_seed(0)
    w = torch.randn(4, 256).bfloat16()

    def run(key, replace):
        other, p = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
        donor = halfadam.AdamW([other], lr=1e-2, state_mode=mode, implementation=impl)
        opt = halfadam.AdamW([p], lr=1e-2, weight_decay=0.1, state_mode=mode, implementation=impl)
        for step in range(3):
            g = torch.randn(4, 256, generator=torch.Generator().manual_seed(step)).bfloat16()
            p.grad, other.grad = g, (-3 * g if step == 0 else None)
            if step == 0:
                donor.step()  # valid values of every key (codes, remainders, a tie byte) that differ from opt's
            opt.step()
            if step == 1:
                new = donor.state[other][key].clone()
                if key == "master_tie":  # (no tie in either: the first element's remainder taken as the tie)
                    new += 1
                assert not torch.equal(new, opt.state[p][key]), key
                if replace:
                    opt.state[p][key] = new
                else:
                    opt.state[p][key].copy_(new)
        return p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}

    probe, opt = _stepped(mode, impl)
    keys = [k for k in opt.state[probe] if k != "step"]
    assert "exp_avg_sq" in keys and len(keys) >= 3
    for key in keys:
        (pa, sa), (pb, sb) = run(key, replace=False), run(key, replace=True)
        assert torch.equal(pa.view(torch.int16), pb.view(torch.int16)), key
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), key


@pytest.mark.parametrize("impl", ["reference", "foreach", "cpp"])
@pytest.mark.parametrize("mode, key, shape", [("fp32", "exp_avg_sq", (256,)), ("fp32", "master_weight", (1, 256)),
                                              ("split", "exp_avg", (2, 256)),
                                              ("compact", "exp_avg_scale", (4,)), ("compact", "exp_avg_sq", (4, 128))])
def test_a_state_tensor_replaced_with_another_shape_is_an_error_naming_it(mode, key, shape, impl):
    """A replaced state tensor of another shape (even one that broadcasts) is a ValueError naming the
    parameter, the key and both shapes, at the step, before anything changes."""
    p, opt = _stepped(mode, impl, lr=1e-2)
    own, weight = opt.state[p][key], p.detach().clone()
    opt.state[p][key] = torch.zeros(shape, dtype=own.dtype)
    with pytest.raises(ValueError, match=rf"param_groups\[0\]\['params'\]\[0\]: its state\['{key}'\] has shape "
                                         rf"{re.escape(str(shape))}, where this state mode keeps"):
        opt.step()
    assert torch.equal(p.detach(), weight) and int(opt.state[p]["step"]) == 1
    opt.state[p][key] = own  # a value of the right shape: the step goes on
    opt.step()
    assert int(opt.state[p]["step"]) == 2 and not torch.equal(p.detach(), weight)


@pytest.mark.parametrize("impl", ["foreach", "cpp"])
@pytest.mark.parametrize("value, match", [
    (torch.zeros(4, 256, dtype=torch.int32), r"exp_avg has dtype torch.int32, expected torch.float32"),
    (torch.zeros(4, 256, dtype=torch.uint8), r"exp_avg has dtype torch.uint8 \(8-bit codes\) but the state holds no "
                                             r"exp_avg_scale")])
def test_a_state_tensor_replaced_with_no_encodings_dtype_is_an_error_naming_it(value, match, impl):
    """A replaced moment of no encoding's form (int32; uint8 codes with no scale, in a mode of float
    moments) is a ValueError naming the parameter, before anything changes."""
    p, opt = _stepped("split", impl, lr=1e-2)
    weight = p.detach().clone()
    opt.state[p]["exp_avg"] = value
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\]: " + match):
        opt.step()
    assert torch.equal(p.detach(), weight) and int(opt.state[p]["step"]) == 1


@pytest.mark.parametrize("impl", ["foreach", "cpp"])
def test_a_float32_moment_put_into_a_compact_state_is_encoded(impl):
    """``opt.state[p]["exp_avg"] = x`` (float32) in "compact": the step reads x and stores
    beta1 * x (zero gradient) in the 8-bit codes, within one code step (stochastic rounding): at most
    1/16 of the block's largest (4 mantissa bits in its top binade, finer steps below)."""
    p, opt = _stepped("compact", impl, lr=1e-3, betas=(0.9, 0.999))
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(1)) * 1e-3
    opt.state[p]["exp_avg"] = x.clone()
    p.grad = torch.zeros_like(p)
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.uint8
    m = opt.to_torch_state_dict()["state"][0]["exp_avg"]
    blocks = (0.9 * x).view(4, 2, 128).abs().amax(-1, keepdim=True)
    assert ((m - 0.9 * x).view(4, 2, 128).abs() / blocks).max() <= 1 / 16


# ------------------------------------------------------------------- state written into other forms
REPLACING = ["reference", "foreach", "cpp"]  # the replaced-state tests' implementations
PLACE = r"param_groups\[0\]\['params'\]\[0\]"


def _bits(v):
    """``v`` as plain data that compares bitwise with ``==``: a tensor with values by its dtype, shape and
    bytes; anything else (a tensor without values: meta) by identity."""
    if isinstance(v, torch.Tensor) and not v.is_meta:
        return v.dtype, tuple(v.shape), v.detach().reshape(-1).view(torch.uint8).tolist()
    return "object", id(v)


def _exact(opt, params):
    """The bits of every parameter and every value of its state (the dict's identity too), and every
    group's ``global_step``."""
    return ([(_bits(p), id(opt.state[p]), {k: _bits(v) for k, v in opt.state[p].items()}) for p in params],
            [g["global_step"] for g in opt.param_groups])


def _refused(opt, params, match, *calls):
    """Each of ``calls`` (default: ``opt.step``) raises a ValueError matching ``match``, and changes nothing."""
    before = _exact(opt, params)
    for call in calls or (opt.step,):
        with pytest.raises(ValueError, match=match):
            call()
        assert _exact(opt, params) == before


@pytest.mark.parametrize("impl", REPLACING)
@pytest.mark.parametrize("mode", ["fp32", "compact"])
def test_a_state_tensor_on_the_meta_device_is_an_error_naming_it(mode, impl):
    """A tensor without values (the meta device) put in the state: a ValueError naming the parameter and
    the key at the step, before anything changes (it was torch's NotImplementedError mid-step)."""
    p, opt = _stepped(mode, impl)
    own = opt.state[p]["exp_avg_sq"]
    opt.state[p]["exp_avg_sq"] = torch.empty(own.shape, dtype=own.dtype, device="meta")
    _refused(opt, [p], PLACE + r": its state\['exp_avg_sq'\] is on the meta device")
    opt.state[p]["exp_avg_sq"] = own
    opt.step()
    assert int(opt.state[p]["step"]) == 2


@pytest.mark.parametrize("impl", REPLACING)
@pytest.mark.parametrize("number", [3, 3.0, torch.tensor(3), torch.tensor([3.0])], ids=str)
def test_a_python_number_step_is_taken_on_every_implementation(number, impl):
    """``opt.state[p]["step"] = 3`` (or an int64 or 1-element tensor of 3): every implementation steps from
    step 3, as from ``opt.state[p]["step"].fill_(3)``, and keeps a 0-d float32 tensor (torch's form)."""
    def run(write):
        p, opt = _stepped("fp32", impl, lr=1e-2)
        write(opt.state[p])
        p.grad = torch.full_like(p, 0.5)
        opt.step()
        return p, opt.state[p]

    (p, st), (q, ref) = run(lambda st: st.__setitem__("step", number)), run(lambda st: st["step"].fill_(3))
    assert isinstance(st["step"], torch.Tensor) and st["step"].dtype == torch.float32 and st["step"].shape == ()
    assert float(st["step"]) == 4.0 and torch.equal(p, q)
    assert st.keys() == ref.keys() and all(torch.equal(st[k], ref[k]) for k in st)


@pytest.mark.parametrize("impl", REPLACING)
@pytest.mark.parametrize("step", [-1, 2.5, float("nan"), True, None, torch.zeros(2), torch.tensor(float("nan")),
                                  torch.tensor(-1.0), torch.tensor(2.5), torch.tensor(-3)], ids=str)
def test_a_step_that_is_no_count_is_an_error_naming_it(step, impl):
    """A ``step`` no implementation can count from, a number or a tensor: a ValueError naming the parameter,
    before anything changes (a tensor of nan, -1 or 2.5 was taken: nan parameters, a ZeroDivisionError or
    an IndexError after the step had begun, the implementations disagreeing)."""
    p, opt = _stepped("fp32", impl)
    opt.state[p]["step"] = step
    _refused(opt, [p], PLACE + r": its state\['step'\] must be a 1-element tensor or a number holding a whole "
                              r"number >= 0")


@pytest.mark.parametrize("impl", REPLACING)
@pytest.mark.parametrize("mode, key, match", [
    ("fp32", "exp_avg_sq", r"missing \['exp_avg_sq'\]"), ("fp32", "step", r"missing \['step'\]"),
    ("split", "master_tie", r"missing \['master_tie'\]"),
    ("compact", "exp_avg_scale", r"the state holds no exp_avg_scale")])
def test_a_deleted_state_key_is_an_error_naming_it(mode, key, match, impl):
    """``del opt.state[p][key]``: a ValueError naming the parameter and the key at the step, before
    anything changes; no moment (nor step, nor block scale) restarts from zero silently."""
    p, opt = _stepped(mode, impl)
    del opt.state[p][key]
    _refused(opt, [p], PLACE + r": .*" + match)


@pytest.mark.parametrize("impl", REPLACING)
def test_a_key_of_the_users_in_the_state_is_an_error_at_the_step_and_state_dict(impl):
    """A key halfadam does not keep: refused by name at the step and by ``state_dict()`` (whose result
    ``load_state_dict`` would refuse), before anything changes; removed, both work again."""
    p, opt = _stepped("fp32", impl)
    opt.state[p]["mine"] = torch.ones(3)
    _refused(opt, [p], PLACE + r": its state's keys are not those of an encoding \(unexpected \['mine'\]\)",
             opt.step, opt.state_dict)
    del opt.state[p]["mine"]
    opt.load_state_dict(opt.state_dict())
    opt.step()
    assert int(opt.state[p]["step"]) == 2


@pytest.mark.parametrize("impl", REPLACING)
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_a_state_tensor_that_requires_grad_is_taken_as_its_values(mode, impl):
    """A leaf that requires grad, and a non-leaf with its graph, put in the state: every implementation
    steps from their values (as from ``copy_``), keeps no tensor that requires grad, and leaves the
    user's tensors and graph as they were."""
    def run(replace):
        p, opt = _stepped(mode, impl, lr=1e-2)
        leaf = (opt.state[p]["exp_avg"] * 2).requires_grad_()  # the moments' dtype: float32, or bfloat16
        graph = leaf * leaf  # a non-leaf (its grad_fn holds the graph), >= 0: a second moment
        if replace:
            opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"] = leaf, graph
        else:
            opt.state[p]["exp_avg"].copy_(leaf.detach())
            opt.state[p]["exp_avg_sq"].copy_(graph.detach())
        kept = leaf.detach().clone(), graph.detach().clone()
        p.grad = torch.full_like(p, 0.25)
        opt.step()
        assert not any(v.requires_grad for v in opt.state[p].values())
        assert torch.equal(leaf.detach(), kept[0]) and torch.equal(graph.detach(), kept[1])
        graph.sum().backward()
        assert torch.equal(leaf.grad, 2 * leaf.detach())
        return p, opt.state[p]

    (p, st), (q, ref) = run(True), run(False)
    assert torch.equal(p, q) and st.keys() == ref.keys() and all(torch.equal(st[k], ref[k]) for k in st)


@pytest.mark.parametrize("impl", REPLACING)
@pytest.mark.parametrize("shapes", [[(4, 256), (4, 256)], [(64,), (16,)]], ids=["one shape", "two shapes"])
def test_a_state_dict_shared_by_two_parameters_is_an_error_naming_both(shapes, impl):
    """``opt.state[p1] = opt.state[p2]``: a ValueError naming both parameters at the step (and at
    ``state_dict()``, ``sync_master_weights()``), before anything changes; for parameters of two shapes
    too (not "the parameter was resized since", whose advice would be wrong)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape).bfloat16()) for shape in shapes]
    opt = halfadam.AdamW(params, lr=1e-2, implementation=impl)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    opt.state[params[1]] = opt.state[params[0]]
    _refused(opt, params, r"param_groups\[0\]\['params'\]\[0\] and param_groups\[0\]\['params'\]\[1\] share one "
             r"state dict", opt.step, opt.state_dict, opt.sync_master_weights)


WRITTEN = {
    "a user's key": lambda opt, a, b: opt.state[a].__setitem__("mine", torch.ones(3)),
    "a deleted key": lambda opt, a, b: opt.state[a].pop("exp_avg_sq"),
    "the meta device": lambda opt, a, b: opt.state[a].__setitem__("exp_avg", torch.empty(4, 256, device="meta")),
    "a shared dict": lambda opt, a, b: opt.state.__setitem__(a, opt.state[b]),
}


@pytest.mark.parametrize("impl", REPLACING)
@pytest.mark.parametrize("written", list(WRITTEN))
def test_load_state_dict_replaces_a_state_written_into_another_form(written, impl):
    """``load_state_dict`` over a state that no rule reads replaces it (as torch's load replaces every
    state): the loaded values, and the next step, are those of a fresh optimizer loading the same dict."""
    def made():
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(4, 256).bfloat16()) for _ in range(2)]
        return params, halfadam.AdamW(params, lr=1e-2, implementation=impl)

    def stepped(params, opt, seed):
        for k, p in enumerate(params):
            p.grad = torch.randn(4, 256, generator=torch.Generator().manual_seed(seed + k)).bfloat16()
        opt.step()

    params, opt = made()
    stepped(params, opt, 0)
    saved = {"state": {k: {n: v.clone() for n, v in st.items()} for k, st in opt.state_dict()["state"].items()},
             "param_groups": opt.state_dict()["param_groups"]}
    stepped(params, opt, 2)
    WRITTEN[written](opt, *params)
    opt.load_state_dict(saved)
    fresh_params, fresh = made()
    fresh.load_state_dict(saved)
    with torch.no_grad():  # the model as the fresh one (the load restores the optimizer only)
        for p, q in zip(params, fresh_params):
            p.copy_(q)
    values = lambda o, ps: [(_bits(p), {k: _bits(v) for k, v in o.state[p].items()}) for p in ps]  # noqa: E731
    assert values(opt, params) == values(fresh, fresh_params)
    stepped(params, opt, 4)
    stepped(fresh_params, fresh, 4)
    assert values(opt, params) == values(fresh, fresh_params)


@pytest.mark.parametrize("impl", REPLACING)
def test_a_bad_state_in_a_later_group_changes_no_earlier_group(impl):
    """Every group's states are checked before any group steps: a state tensor of another shape in
    ``param_groups[1]`` leaves ``param_groups[0]`` as it was too."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 256).bfloat16()) for _ in range(2)]
    opt = halfadam.AdamW([{"params": [params[0]]}, {"params": [params[1]]}], lr=1e-2, implementation=impl)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    opt.state[params[1]]["exp_avg"] = torch.zeros(2, 256)
    _refused(opt, params, r"param_groups\[1\]\['params'\]\[0\]: its state\['exp_avg'\] has shape \(2, 256\)")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", HALF)
def test_model_half_after_steps_gets_a_master(dtype, impl):
    """fp32 model, steps, then model.to(half): the converted parameters get fp32 masters (from their
    converted values) and keep their moments; 50 steps of lr 1e-4 move a weight of 1.0."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = halfadam.AdamW(model.parameters(), lr=1e-4, implementation=impl)
    model.weight.grad, model.bias.grad = torch.ones(3, 4), torch.ones(3)
    opt.step()
    moments = {k: opt.state[model.weight][k].clone() for k in ("exp_avg", "exp_avg_sq")}
    model.to(dtype)
    with torch.no_grad():
        model.weight.fill_(1.0)
    # the reference: torch on an fp32 copy holding the converted values, with the same moments
    ref = torch.nn.Parameter(model.weight.detach().float())
    ref_opt = torch.optim.AdamW([ref], lr=1e-4, weight_decay=0.0)
    ref_opt.state[ref].update(step=torch.tensor(1.0), **{k: v.clone() for k, v in moments.items()})
    for _ in range(50):
        model.weight.grad, model.bias.grad = torch.ones(3, 4, dtype=dtype), torch.ones(3, dtype=dtype)
        ref.grad = torch.ones(3, 4)
        opt.step()
        ref_opt.step()
    st = opt.state[model.weight]
    assert st["master_weight"].dtype == torch.float32 and st["exp_avg"].dtype == torch.float32
    assert _rel(st["master_weight"], ref.detach()) <= 1e-6
    assert (model.weight.detach().float() < 1.0).all()  # naive half stays at exactly 1.0
    assert st["step"].item() == 51


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("new", [torch.float32, torch.float64])
def test_half_to_float_after_steps_keeps_the_masters_value(new, impl):
    """model.float() after half-precision steps: the parameter becomes its master (the fp32 weight it
    would have been from the start), the master is dropped, and training follows torch on fp32."""
    half, opt, ref, ref_opt = _pair(torch.bfloat16, impl)
    for k in range(3):
        _step(half, opt, ref, ref_opt, k)
    masters = [opt.master_weight(p).clone() for p in half.parameters()]
    half.to(new)
    with torch.no_grad():
        half.bias[0] = 0.5  # one element written after the conversion keeps its value
        ref.bias[0] = 0.5
    _step(half, opt, ref, ref_opt, 3)
    for p, q, m in zip(half.parameters(), ref.parameters(), masters):
        assert "master_weight" not in opt.state[p] and opt.state[p]["exp_avg"].dtype == _compute(new)
        assert _rel(p.detach(), q.detach()) <= 1e-6
    assert not torch.equal(masters[0], masters[0].bfloat16().float())  # the masters had bits bf16 lacks


def _compute(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("old, new", [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)])
def test_half_to_other_half_keeps_the_whole_master(old, new, impl):
    """bf16 -> fp16 (or back) after steps: the master is kept whole and the parameter becomes it,
    rounded to the new dtype; an element written after the conversion is adopted."""
    half, opt, ref, ref_opt = _pair(old, impl)
    for k in range(3):
        _step(half, opt, ref, ref_opt, k)
    masters = [opt.master_weight(p).clone() for p in half.parameters()]
    half.to(new)
    with torch.no_grad():
        half.weight[0, 0] = 0.25
        ref.weight[0, 0] = 0.25
    opt.sync_master_weights()
    for p, m in zip(half.parameters(), masters):
        master = opt.state[p]["master_weight"]
        written = torch.zeros_like(m, dtype=torch.bool)
        if p is half.weight:
            written[0, 0] = True
        assert torch.equal(master[~written], m[~written])
        assert torch.equal(p.detach(), master.to(new))
    _step(half, opt, ref, ref_opt, 3)
    for p, q in zip(half.parameters(), ref.parameters()):
        assert _rel(opt.master_weight(p), q.detach()) <= 1e-6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("impl", IMPLS)
def test_device_change_moves_the_state(impl):
    half, opt, ref, ref_opt = _pair(torch.float16, impl)
    _step(half, opt, ref, ref_opt, 0)
    half.cuda()
    g = torch.Generator().manual_seed(1)
    for p, q in zip(half.parameters(), ref.parameters()):
        grad = torch.randn(p.shape, generator=g)
        p.grad, q.grad = grad.half().cuda(), grad.half().float()
    opt.step()
    ref_opt.step()
    for p, q in zip(half.parameters(), ref.parameters()):
        st = opt.state[p]
        assert all(st[k].device.type == "cuda" for k in ("master_weight", "exp_avg", "exp_avg_sq"))
        assert _rel(st["master_weight"].cpu(), q.detach()) <= 1e-6


# ------------------------------------------------------------------------------------- all or nothing
def _snapshot(opt, params):
    return ([p.detach().clone() for p in params], [g["global_step"] for g in opt.param_groups],
            {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params if opt.state[p]})


def _assert_unchanged(opt, params, snap):
    values, steps, state = snap
    assert all(torch.equal(p.detach(), v) for p, v in zip(params, values))
    assert [g["global_step"] for g in opt.param_groups] == steps
    for p in params:
        for k, v in state.get(id(p), {}).items():
            assert torch.equal(opt.state[p][k], v), k


def _two_param_opt(impl):
    params = [torch.nn.Parameter(torch.randn(5).half()), torch.nn.Parameter(torch.randn(3).half())]
    opt = halfadam.AdamW(params, lr=1e-2, implementation=impl)
    opt.step(grads={params[0]: torch.ones(5), params[1]: torch.ones(3)})
    return params, opt


@pytest.mark.parametrize("impl", IMPLS)
def test_gradient_on_another_device_changes_nothing(impl):
    params, opt = _two_param_opt(impl)
    snap = _snapshot(opt, params)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\].* is on meta"):
        opt.step(grads={params[0]: torch.ones(5), params[1]: torch.ones(3, device="meta")})
    _assert_unchanged(opt, params, snap)
    opt.step(grads={params[0]: torch.ones(5), params[1]: torch.ones(3)})  # a retry works normally
    assert opt.param_groups[0]["global_step"] == 2


@pytest.mark.parametrize("impl", IMPLS)
def test_foreign_gradient_keys_are_an_error(impl):
    params, opt = _two_param_opt(impl)
    snap = _snapshot(opt, params)
    with pytest.raises(ValueError, match=r"not a parameter of this optimizer .*shape \(5,\)"):
        opt.step(grads={params[0].detach(): torch.ones(5)})
    _assert_unchanged(opt, params, snap)


def test_expanded_parameter_is_rejected_at_construction():
    p = torch.zeros(1).expand(3).requires_grad_()
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\].*share memory"):
        halfadam.AdamW([p])


# ----------------------------------------------------------------------------- no input is ignored
@pytest.mark.parametrize("group, exc, match", [
    ({"maximize": True}, ValueError, r"\['maximize'\]=True is not supported"),
    ({"amsgrad": True}, ValueError, r"\['amsgrad'\]=True is not supported"),
    ({"fused": "yes"}, ValueError, r"\['fused'\]='yes' .*implementation="),
    ({"fused": True, "foreach": True}, ValueError, r"\['fused'\] and .*cannot be True together"),
    ({"master_weights": "no"}, TypeError, r"\['master_weights'\] must be None, True or False"),
    ({"optimized_update": "no"}, TypeError, r"\['optimized_update'\] must be True or False"),
    ({"decay": "L2"}, ValueError, r"\['decay'\] must be one of"),
    ({"capturable": True}, ValueError, r"\['capturable'\]=True is not supported by halfadam"),
])
def test_bad_group_keys(group, exc, match):
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(exc, match=r"param_groups\[0\]" + match):
        halfadam.AdamW([{"params": [p], **group}])
    opt = halfadam.AdamW([p])
    with pytest.raises(exc, match=r"param_groups\[1\]"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], **group})
    assert len(opt.param_groups) == 1


def test_torch_flags_at_their_off_value_and_metadata_are_accepted():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = halfadam.AdamW([{"params": [p], "amsgrad": False, "maximize": False, "foreach": None, "name": "w",
                           "master_weights": False}])
    assert opt.param_groups[0]["name"] == "w" and opt.param_groups[0]["master_weights"] is False


def test_eps_that_is_zero_in_float32_is_rejected():
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match=r"eps=1e-46 is 0.0 in float32"):
        halfadam.AdamW([p], eps=1e-46)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['eps'\]"):
        halfadam.AdamW([{"params": [p], "eps": 1e-46}])
    halfadam.AdamW([p], eps=1e-45)  # the smallest float32 subnormal is fine


@pytest.mark.parametrize("params, match", [
    (lambda p: [{"params": [p, p]}], r"param_groups\[0\]\['params'\]\[1\] is the same tensor"),
    (lambda p: [p, p], r"param_groups\[0\]\['params'\]\[1\] is the same tensor"),
    (lambda p: [{"params": []}], r"holds no parameter"),
    (lambda p: [{"params": []}, {"params": []}], r"holds no parameter"),
])
def test_duplicate_or_no_parameters(params, match):
    with pytest.raises(ValueError, match=match):
        halfadam.AdamW(params(torch.nn.Parameter(torch.zeros(2))))


@pytest.mark.parametrize("lr, exc, match", [
    (itertools.repeat(1e-3), TypeError, r"lr as per-step values must be a finite sequence .*repeat"),
    ((x for x in [1e-3, 2e-3]), TypeError, r"lr as per-step values must be a finite sequence .*generator"),
    ({0: 1e-3, 1: 2e-3}, TypeError, r"lr must be .* got dict"),
    (lambda a, b: 1e-3, TypeError, r"lr schedule could not be called with the global step"),
    (torch.tensor(1e-3, device="meta"), ValueError, r"lr is a tensor on the meta device"),
    (1e39, ValueError, r"lr must be finite \(in float32"),
])
def test_bad_learning_rates_name_the_argument(lr, exc, match):
    with pytest.raises(exc, match=match):
        halfadam.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def test_finite_sequences_are_per_step_values():
    p = torch.nn.Parameter(torch.zeros(2))
    assert halfadam.AdamW([p], lr=range(0, 3)).param_groups[0]["lr"] == 0.0
    assert halfadam.AdamW([p], lr=(0.5, 0.25)).param_groups[0]["lr_schedule"](1) == 0.25


# ----------------------------------------------------------------------------------- drop-in for torch
def test_named_parameters_like_torch():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    ours = halfadam.AdamW(model.named_parameters(), lr=1e-2)
    theirs = torch.optim.AdamW(model.named_parameters(), lr=1e-2)
    assert ours.param_groups[0]["param_names"] == theirs.param_groups[0]["param_names"] == ["weight", "bias"]
    model.weight.grad, model.bias.grad = torch.ones(3, 4), torch.ones(3)
    ours.step()
    assert ours.state_dict()["param_groups"][0]["param_names"] == ["weight", "bias"]
    groups = [{"params": [("weight", model.weight)], "weight_decay": 0.1}, {"params": [("bias", model.bias)]}]
    opt = halfadam.AdamW(groups)
    assert [g["param_names"] for g in opt.param_groups] == [["weight"], ["bias"]]
    with pytest.raises(ValueError, match="mixes"):
        halfadam.AdamW([{"params": [("weight", model.weight), model.bias]}])


def test_state_dict_post_hooks_are_kept():
    p = torch.nn.Parameter(torch.zeros(2).half())
    opt = halfadam.AdamW([p])
    opt.step(grads={p: torch.ones(2)})
    opt.register_state_dict_post_hook(lambda o, sd: sd.__setitem__("extra", 42))
    assert opt.state_dict()["extra"] == 42
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "replaced": True})
    sd = opt.state_dict()
    assert sd["replaced"] is True and sd["extra"] == 42 and "master_weight" in sd["state"][0]


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_frozen_parameters_do_not_slow_or_cost_the_others(impl, monkeypatch):
    """A LoRA-like model: frozen parameters (no gradient) stay out of the buckets and the rest runs on
    the flat path, matching the reference."""
    calls = []
    real = executions.flat_step
    monkeypatch.setattr(halfadam.optimizer, "flat_step",
                        lambda b, items, *a, **k: (calls.append(len(items)), real(b, items, *a, **k)))
    monkeypatch.setattr(halfadam.optimizer, "reference_step", lambda *a, **k: pytest.fail("reference path taken"))
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8).half() for _ in range(3)]
    for layer in layers[::2]:
        layer.requires_grad_(False)
    params = [p for layer in layers for p in layer.parameters()]
    opt = halfadam.AdamW(params, lr=1e-2, implementation=impl)
    trained = list(layers[1].parameters())
    for k in range(3):
        for p in trained:
            p.grad = torch.full_like(p, 0.1 * (k + 1))
        opt.step()
    assert calls == [2, 2, 2]
    assert all(not opt.state[p] for layer in layers[::2] for p in layer.parameters())
    layout = opt._states.group_layout(opt.param_groups[0])
    assert sum(b.numel for b in layout.buckets) == sum(p.numel() for p in trained)


@pytest.mark.parametrize("dtype", HALF)
def test_outer_torch_compile_of_step(dtype):
    """torch.compile(opt.step)() (PyTorch's compiled-optimizer recipe) under the default implementation."""
    torch._dynamo.reset()
    half, opt, ref, ref_opt = _pair(dtype, "auto")
    compiled_step = torch.compile(opt.step)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        for p, q in zip(half.parameters(), ref.parameters()):
            grad = torch.randn(p.shape, generator=g)
            p.grad, q.grad = grad.to(dtype), grad.to(dtype).float()
        compiled_step()
        ref_opt.step()
    _assert_follows(half, opt, ref)


def test_group_added_later_shows_its_coming_steps_lr():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = halfadam.AdamW([a], lr=1e-3)
    for _ in range(3):
        opt.step(grads={a: torch.ones(2)})
    opt.add_param_group({"params": [b], "lr": lambda t: 0.1 * t})
    assert opt.param_groups[1]["global_step"] == 3 and opt.param_groups[1]["lr"] == pytest.approx(0.3)
    before = b.detach().clone()
    opt.step(grads={a: torch.ones(2), b: torch.ones(2)})
    assert (before - b.detach())[0].item() == pytest.approx(0.3, rel=1e-6)  # Adam's first step moves by lr
    assert opt.param_groups[1]["lr"] == pytest.approx(0.4)


def test_a_group_value_written_by_hand_is_checked_at_the_step():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = halfadam.AdamW([p])
    opt.param_groups[0]["lr"] = "abc"
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['lr'\] must be a number"):
        opt.step(grads={p: torch.ones(2)})
    assert opt.param_groups[0]["global_step"] == 0 and not opt.state[p]


@pytest.mark.parametrize("kw, exc, match", [
    (dict(device="tpu"), ValueError, "device must be"),
    (dict(enabled="yes"), TypeError, "enabled must be True or False"),
])
def test_scaler_device_and_enabled_are_checked(kw, exc, match):
    with pytest.raises(exc, match=match):
        halfadam.GradScaler(**kw)


# ------------------------------------------------------------------------ a DTensor parameter's state
def _local_bits(p, opt):
    """The bits of ``p``'s local shard and of every state value's (a DTensor's local shard)."""
    from halfadam.distributed import is_dtensor

    def bits(v):
        return _bits(v.to_local() if is_dtensor(v) else v)

    return [bits(p)] + [(k, type(v).__name__, bits(v)) for k, v in opt.state[p].items()]


def _shard_worker(rank, world, out):
    """On each rank: a bf16 (8, 256) DTensor parameter sharded by rows; its state key replaced by a plain
    tensor of the whole shape, a DTensor replicated, and a plain tensor of this rank's shard."""
    from pathlib import Path

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from halfadam.distributed import is_dtensor

    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for mode, key, impl in (("fp32", "exp_avg_sq", "cpp"), ("fp32", "exp_avg_sq", "reference"),
                            ("compact", "exp_avg_scale", "cpp")):
        def stepped():
            torch.manual_seed(0)
            p = torch.nn.Parameter(distribute_tensor(torch.randn(8, 256).bfloat16(), mesh, [Shard(0)]))
            opt = halfadam.AdamW([p], lr=1e-2, state_mode=mode, implementation=impl)
            p.grad = distribute_tensor(torch.randn(8, 256).bfloat16(), mesh, [Shard(0)])
            opt.step()
            return p, opt

        r = {}
        p, opt = stepped()
        own = opt.state[p][key]
        whole = torch.rand(own.shape).to(own.dtype)
        for case, value in (("whole", whole), ("replicated", distribute_tensor(whole, mesh, [Replicate()]))):
            opt.state[p][key] = value
            before = _local_bits(p, opt)
            try:
                opt.step()
                r[case] = "stepped"
            except Exception as exc:  # noqa: BLE001 - recorded: the test says what it was
                r[case] = f"{type(exc).__name__}: {exc}"
            r[case + " unchanged"] = _local_bits(p, opt) == before
            opt.state[p][key] = own
        (a, opt_a), (b, opt_b) = stepped(), stepped()
        shard = whole[rank * own.shape[0] // world:(rank + 1) * own.shape[0] // world]
        opt_a.state[a][key] = shard.clone()  # this rank's shard, as a plain tensor
        opt_b.state[b][key].to_local().copy_(shard)
        for q in (a, b):
            q.grad = distribute_tensor(torch.ones(8, 256).bfloat16(), mesh, [Shard(0)])
        opt_a.step()
        opt_b.step()
        r["shard kept sharded"] = is_dtensor(opt_a.state[a][key]) and opt_a.state[a][key].placements == a.placements
        r["shard as in place"] = _local_bits(a, opt_a) == _local_bits(b, opt_b)
        results[(mode, key, impl)] = r
    torch.save(results, Path(out) / f"rank{rank}.pt")


@needs_gloo
@pytest.mark.distributed
def test_a_dtensor_parameters_state_is_checked_against_its_shard(tmp_path):
    """FSDP2 (2 gloo ranks, rows sharded): a plain tensor of the parameter's whole shape in place of a
    state shard, or a DTensor placed otherwise, is a ValueError naming the parameter, the key and the
    shapes, before anything changes (it passed the shape check and the C++ kernel failed); a plain
    tensor of this rank's shard is taken as the shard, kept as a DTensor sharded like the parameter."""
    import halfadam.distributed as hd

    hd.launch(_shard_worker, 2, str(tmp_path), timeout_s=120)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for (mode, key, impl), r in results.items():
            shape, local = ((8, 256), (4, 256)) if key == "exp_avg_sq" else ((8, 2), (4, 2))
            where = "ValueError: param_groups[0]['params'][0]: its state"
            assert r["whole"] == (f"{where}['{key}'] has shape {shape}, where this state mode keeps {local} (this "
                                  f"rank's shard of the DTensor parameter; or a DTensor sharded like it)"), (mode, impl)
            assert r["replicated"].startswith(f"{where}['{key}'] is a DTensor of placements (Replicate(),), where "
                                              f"the parameter is a DTensor of placements (Shard(dim=0),)"), (mode, impl)
            assert r["whole unchanged"] and r["replicated unchanged"], (mode, impl)
            assert r["shard kept sharded"] and r["shard as in place"], (mode, impl)


@pytest.mark.parametrize("impl", REPLACING)
def test_a_rebuild_leaves_an_unreadable_state_for_the_step_that_reads_it(impl):
    """A group's buckets rebuilt (a parameter changed dtype) while another parameter, without a gradient this
    step, holds a state no rule reads: the step of the first goes on, the other's state is left as it is, and
    the step that reads it refuses it by name (the rebuild raised from its attach, partway through)."""
    torch.manual_seed(0)
    a, b = (torch.nn.Parameter(torch.randn(4, 256).bfloat16()) for _ in range(2))
    opt = halfadam.AdamW([a, b], lr=1e-2, implementation=impl)
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    opt.step()
    meta = torch.empty(4, 256, device="meta")
    opt.state[b]["exp_avg_sq"], b.grad = meta, None
    a.data = a.data.to(torch.float16)  # the next step rebuilds the group's buckets
    a.grad = torch.randn_like(a)
    opt.step()
    assert int(opt.state[a]["step"]) == 2 and opt.state[a]["exp_avg"].dtype == torch.float32
    assert opt.state[b]["exp_avg_sq"] is meta and int(opt.state[b]["step"]) == 1
    b.grad = torch.randn_like(b)
    _refused(opt, [a, b], r"param_groups\[0\]\['params'\]\[1\]: its state\['exp_avg_sq'\] is on the meta device")
