"""A step that raises changes nothing, whatever was written into ``param_groups`` or wherever it runs.

Issue 33, items 4, 7, 8, 9, 13 and 16. The expected values are the optimizer's own state before the
failed call (it must be untouched) and torch.optim.AdamW for the steps that do run.
"""

import copy

import pytest
import torch

import halfadam

IMPLS = ["reference", "foreach", "cpp"]


def _two_groups(impl, state_mode="fp32", seed=0):
    torch.manual_seed(seed)
    a, b = torch.nn.Linear(8, 4).bfloat16(), torch.nn.Linear(8, 4).bfloat16()
    opt = halfadam.AdamW([{"params": a.parameters()}, {"params": b.parameters(), "lr": 2e-3}], lr=1e-3,
                         weight_decay=0.1, implementation=impl, state_mode=state_mode)
    params = list(a.parameters()) + list(b.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    for p in params:
        p.grad = torch.randn_like(p)
    return opt, params


def _snapshot(opt, params):
    return ([p.detach().clone() for p in params], copy.deepcopy(opt.state_dict()))


def _assert_unchanged(opt, params, snap):
    values, sd = snap
    for p, v in zip(params, values):
        assert torch.equal(p.detach().view(torch.int16), v.view(torch.int16))
    now = opt.state_dict()
    assert [g["global_step"] for g in now["param_groups"]] == [g["global_step"] for g in sd["param_groups"]]
    for k, st in sd["state"].items():
        for name, value in st.items():
            other = now["state"][k][name]
            assert torch.equal(other, value) if isinstance(value, torch.Tensor) else other == value, (k, name)


BAD_KEYS = [
    ("betas", (0.9, 1.5), ValueError, r"param_groups\[1\]\['betas'\]\[1\] must be in the range"),
    ("betas", (0.9, 1.0), ValueError, r"param_groups\[1\]\['betas'\]\[1\]"),
    ("betas", (0.9,), TypeError, r"param_groups\[1\]\['betas'\] must be a pair"),
    ("betas", (-0.1, 0.999), ValueError, r"param_groups\[1\]\['betas'\]\[0\]"),
    ("eps", 0.0, ValueError, r"param_groups\[1\]\['eps'\] must be > 0"),
    ("eps", float("nan"), ValueError, r"param_groups\[1\]\['eps'\]"),
    ("eps", 1e-50, ValueError, r"param_groups\[1\]\['eps'\]=1e-50 is 0.0 in float32"),
    ("eps", "1e-8", TypeError, r"param_groups\[1\]\['eps'\] must be a float"),
    ("optimized_update", 1, TypeError, r"param_groups\[1\]\['optimized_update'\] must be True or False"),
    ("optimized_update", None, TypeError, r"param_groups\[1\]\['optimized_update'\]"),
    ("decay", "L2", ValueError, r"param_groups\[1\]\['decay'\] must be one of"),
    ("master_weights", "yes", TypeError, r"param_groups\[1\]\['master_weights'\]"),
    ("global_step", -1, ValueError, r"param_groups\[1\]\['global_step'\] must be >= 0"),
    ("amsgrad", True, ValueError, r"param_groups\[1\]\['amsgrad'\]=True is not supported"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("key,value,exc,match", BAD_KEYS, ids=[f"{k}={v!r}" for k, v, *_ in BAD_KEYS])
def test_a_bad_group_key_written_after_construction_fails_before_any_group_steps(impl, key, value, exc, match):
    """Items 4, 7, 8: group 1's key is checked before group 0 steps; the error is the constructor's."""
    opt, params = _two_groups(impl)
    snap = _snapshot(opt, params)
    old = opt.param_groups[1][key] if key in opt.param_groups[1] else None
    opt.param_groups[1][key] = value
    with pytest.raises(exc, match=match):
        opt.step()
    opt.param_groups[1][key] = old  # the write itself is the user's; everything else must be as it was
    _assert_unchanged(opt, params, snap)


def test_a_deleted_group_key_is_named():
    opt, params = _two_groups("reference")
    snap = _snapshot(opt, params)
    del opt.param_groups[1]["eps"]
    with pytest.raises(ValueError, match=r"param_groups\[1\] has no 'eps' key"):
        opt.step()
    _assert_unchanged(opt, params, snap)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_fixed_group_steps_as_torch_again(impl):
    """After a refused step and a repaired key, the next step is torch.optim.AdamW's (float32 twins)."""
    torch.manual_seed(3)
    p = torch.nn.Parameter(torch.randn(4, 8))
    q = torch.nn.Parameter(p.detach().clone())
    opt = halfadam.AdamW([p], lr=1e-2, weight_decay=0.1, implementation=impl)
    ref = torch.optim.AdamW([q], lr=1e-2, weight_decay=0.1, betas=(0.8, 0.99))
    p.grad = torch.randn_like(p)
    q.grad = p.grad.clone()
    opt.param_groups[0]["betas"] = (0.8, 1.01)
    with pytest.raises(ValueError):
        opt.step()
    opt.param_groups[0]["betas"] = (0.8, 0.99)
    for _ in range(3):
        opt.step()
        ref.step()
    torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode", ["split", "compact", "tiny"])
def test_a_refused_step_leaves_packed_state_unchanged(mode):
    opt, params = _two_groups("cpp", state_mode=mode)
    snap = _snapshot(opt, params)
    opt.param_groups[1]["eps"] = -1e-8
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['eps'\]"):
        opt.step()
    _assert_unchanged(opt, params, snap)


# ---------------------------------------------------------------- item 9: overlapping parameters
def test_a_view_of_another_parameter_is_refused_naming_both():
    base = torch.nn.Parameter(torch.zeros(4, 6))
    view = base.detach()[1]  # a leaf sharing base's storage
    view.requires_grad_(True)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] shares memory with "
                                         r"param_groups\[0\]\['params'\]\[0\]"):
        halfadam.AdamW([base, view], lr=1e-3)
    opt = halfadam.AdamW([base], lr=1e-3)
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\] shares memory with "
                                         r"param_groups\[0\]\['params'\]\[0\]"):
        opt.add_param_group({"params": [view]})
    assert len(opt.param_groups) == 1


def test_disjoint_views_of_one_storage_are_accepted_and_step_once():
    """Two parameters over disjoint halves of one buffer (as some frameworks flatten parameters),
    and two interleaved strided views: accepted, and each element steps exactly as torch's."""
    flat = torch.zeros(24)
    a, b = flat[:12].view(3, 4), flat[12:].view(3, 4)
    even, odd = torch.zeros(4, 6)[:, 0::2], None
    odd = even._base[:, 1::2]
    params = [t.requires_grad_(True) for t in (a, b, even, odd)]
    twins = [torch.nn.Parameter(t.detach().clone()) for t in params]
    opt = halfadam.AdamW(params, lr=1e-2, implementation="reference")
    ref = torch.optim.AdamW(twins, lr=1e-2, weight_decay=0.0)
    torch.manual_seed(0)
    for p, q in zip(params, twins):
        p.grad = torch.randn(p.shape)
        q.grad = p.grad.clone()
    opt.step()
    ref.step()
    for p, q in zip(params, twins):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)


def test_a_parameter_overlapping_in_part_is_refused():
    buf = torch.zeros(20)
    a, b = buf[:12], buf[8:]
    with pytest.raises(ValueError, match="shares memory"):
        halfadam.AdamW([a.requires_grad_(True), b.requires_grad_(True)], lr=1e-3)


# ---------------------------------------------------------------- item 13: inference mode
@pytest.mark.parametrize("impl", IMPLS)
def test_a_step_inside_inference_mode_steps_as_outside(impl):
    """Item 13: a step inside torch.inference_mode() steps as one outside it, and later steps work."""
    torch.manual_seed(0)
    runs = []
    for inside in (False, True):
        p = torch.nn.Parameter(torch.arange(12.0).view(3, 4).bfloat16() / 7)
        opt = halfadam.AdamW([p], lr=1e-2, implementation=impl)
        for step in range(3):
            p.grad = torch.full_like(p, 0.5 - step)
            if inside and step == 0:
                with torch.inference_mode():
                    opt.step()
            else:
                opt.step()
        runs.append((p.detach().clone(), opt.master_weight(p)))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert not any(t.is_inference() for t in opt.state[p].values() if isinstance(t, torch.Tensor))


def test_an_inference_tensor_parameter_is_refused():
    with torch.inference_mode():
        p = torch.zeros(3, requires_grad=False)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] is an inference tensor"):
        halfadam.AdamW([p], lr=1e-3)


# ---------------------------------------------------------------- item 16: lr tensors of any real dtype
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                                   torch.float16, torch.bfloat16, torch.float64])
def test_lr_as_a_tensor_of_any_real_dtype(dtype):
    """The same bits as lr=1.0 given as a float; torch's AdamW to within an ulp (its eager float32 sqrt
    on the CPU is not correctly rounded, and which ulp it misses depends on the CPU)."""
    p, q, r = (torch.nn.Parameter(torch.ones(3)) for _ in range(3))
    opt = halfadam.AdamW([p], lr=torch.tensor(1, dtype=dtype), weight_decay=torch.tensor(0, dtype=dtype))
    same = halfadam.AdamW([q], lr=1.0, weight_decay=0.0)
    ref = torch.optim.AdamW([r], lr=1.0, weight_decay=0.0)
    for t in (p, q, r):
        t.grad = torch.tensor([1.0, -2.0, 3.0])
    for o in (opt, same, ref):
        o.step()
    assert torch.equal(p.detach(), q.detach())
    torch.testing.assert_close(p.detach(), r.detach(), rtol=0, atol=1.2e-7)


@pytest.mark.parametrize("value", [torch.tensor(True), torch.tensor(1j)])
def test_lr_as_a_bool_or_complex_tensor_is_a_type_error(value):
    with pytest.raises(TypeError, match="lr"):
        halfadam.AdamW([torch.nn.Parameter(torch.ones(3))], lr=value)
