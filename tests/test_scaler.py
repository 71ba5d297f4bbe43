"""halfadam.GradScaler on CPU: skip on inf/nan, backoff and growth, fp32 hand-over, torch interop."""

import copy
import warnings

import pytest
import torch

import halfadam


def _snapshot(opt, params):
    return copy.deepcopy(([p.detach().clone() for p in params], opt.state_dict()))


def _same(a, b):
    (pa, sa), (pb, sb) = a, b
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    assert sa["param_groups"] == sb["param_groups"]
    for k in sa["state"]:
        for name, t in sa["state"][k].items():
            assert torch.equal(t, sb["state"][k][name]), name


@pytest.mark.parametrize("recipe", ["fused", "unscale_then_torch_clip"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_skip_leaves_everything_bitwise(bad, recipe):
    w = torch.nn.Parameter(torch.randn(4, 3).half())
    b = torch.nn.Parameter(torch.randn(3).half())
    opt = halfadam.AdamW([w, b], lr=1e-2, weight_decay=0.1)
    scaler = halfadam.GradScaler(init_scale=1024.0, growth_interval=3)
    x = torch.randn(5, 4)

    def loss_fn():
        return ((x @ w.float() + b.float()) ** 2).mean()

    for _ in range(2):  # some state first
        opt.zero_grad()
        scaler.scale(loss_fn()).backward()
        scaler.step(opt)
        scaler.update()
    before = _snapshot(opt, [w, b])
    scale_before = scaler.get_scale()

    opt.zero_grad()
    scaler.scale(loss_fn()).backward()
    w.grad[1, 2] = bad
    if recipe != "fused":  # the inf check of unscale_ decides, whatever the clip then writes into .grad
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_([w, b], 1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and a skipped step says nothing about float16 precision
        assert scaler.step(opt) is None
    scaler.update()
    _same(before, _snapshot(opt, [w, b]))
    assert scaler.get_scale() == scale_before * 0.5


def test_backoff_and_growth():
    p = torch.nn.Parameter(torch.ones(2).half())
    opt = halfadam.AdamW([p], lr=1e-3)
    scaler = halfadam.GradScaler(init_scale=8.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=2)
    scales = []
    for grad in [1.0, 1.0, 1.0, float("inf"), 1.0, 1.0]:
        scaler.scale(torch.ones(()))  # creates the scale on CPU
        p.grad = torch.full((2,), grad).half()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    # 2 clean steps -> x4; inf -> x0.25 and the tracker resets
    assert scales == [8.0, 32.0, 32.0, 8.0, 8.0, 32.0]
    assert opt.state[p]["step"].item() == 5


def test_small_gradients_survive_unscaling():
    """A gradient of 1e-8 is zero in fp16; scaled by 2**16 it is representable, and the optimizer
    receives the unscaled fp32 value rather than an fp16 one."""
    p = torch.nn.Parameter(torch.zeros(4).half())
    opt = halfadam.AdamW([p], lr=1e-3, eps=1e-14)  # eps well below |g|
    scaler = halfadam.GradScaler(init_scale=2.0**16)
    assert torch.tensor(1e-8).half().item() == 0.0
    target = torch.full((4,), 1e-8)
    loss = (p.float() * target).sum()
    scaler.scale(loss).backward()
    assert p.grad.dtype == torch.float16 and p.grad.abs().min() > 0  # scaled, so it survived fp16
    scaler.unscale_(opt)
    # .grad shows the unscaled gradient, as torch's scaler; 1e-8 is 0 in float16, the step uses the fp32 copy
    assert p.grad.dtype == torch.float16 and torch.equal(p.grad, torch.zeros(4).half())
    scaler.step(opt)
    scaler.update()
    # Adam's first step moves by lr * g / (|g| + eps) = lr: a zero gradient would not move at all
    assert opt.master_weight(p) == pytest.approx(torch.full((4,), -1e-3), rel=1e-5)
    assert opt.state[p]["exp_avg"][0].item() == pytest.approx(0.1 * 1e-8, rel=1e-3)


def test_clip_grad_norm_on_unscaled_fp32_grads():
    p = torch.nn.Parameter(torch.zeros(2).half())
    opt = halfadam.AdamW([p], lr=1.0)
    scaler = halfadam.GradScaler(init_scale=4.0)
    loss = (p.float() * torch.tensor([3.0, 4.0])).sum()
    scaler.scale(loss).backward()
    norm = scaler.clip_grad_norm_(opt, max_norm=1.0)
    assert norm.item() == pytest.approx(5.0)
    scaler.step(opt)
    assert opt.state[p]["exp_avg"] == pytest.approx(torch.tensor([0.06, 0.08]), rel=1e-4)


def test_other_optimizers_unscale_in_place():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.5)
    scaler = halfadam.GradScaler(init_scale=16.0)
    scaler.scale((p * 2).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(p.detach(), torch.zeros(3))  # 1 - 0.5 * 2

    h = torch.nn.Parameter(torch.ones(3).half())
    opt16 = torch.optim.SGD([h], lr=0.5)
    scaler.scale((h.float() * 2).sum()).backward()
    with pytest.raises(ValueError, match="float16"):
        scaler.step(opt16)


def test_call_order_errors_and_disabled():
    p = torch.nn.Parameter(torch.ones(2).half())
    opt = halfadam.AdamW([p])
    scaler = halfadam.GradScaler()
    scaler.scale((p.float()).sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="step"):
        scaler.step(opt)
    scaler.update()

    off = halfadam.GradScaler(enabled=False)
    loss = torch.ones(())
    assert off.scale(loss) is loss and off.get_scale() == 1.0 and off.state_dict() == {}


@pytest.mark.parametrize(
    "kwargs, name",
    [(dict(init_scale=0.0), "init_scale"), (dict(growth_factor=1.0), "growth_factor"),
     (dict(backoff_factor=1.5), "backoff_factor"), (dict(growth_interval=0), "growth_interval")],
)
def test_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        halfadam.GradScaler(**kwargs)


def test_state_dict_round_trip_and_torch_interop():
    scaler = halfadam.GradScaler(init_scale=256.0, growth_interval=5)
    p = torch.nn.Parameter(torch.ones(1).half())
    opt = halfadam.AdamW([p])
    for _ in range(3):
        scaler.scale(p.float().sum()).backward()
        scaler.step(opt)
        scaler.update()
    sd = scaler.state_dict()
    assert sd == {"scale": 256.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 5,
                  "_growth_tracker": 3}
    torch_scaler = torch.amp.GradScaler("cpu")
    torch_scaler.load_state_dict(sd)
    assert torch_scaler.state_dict() == sd
    fresh = halfadam.GradScaler()
    fresh.load_state_dict(torch_scaler.state_dict())
    assert fresh.state_dict() == sd
    with pytest.raises(KeyError, match="_growth_tracker"):
        fresh.load_state_dict({"scale": 1.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 5})
    assert fresh.state_dict() == sd


def test_fp16_training_with_scaler_matches_fp32_reference():
    """A small regression trained in fp16 with halfadam+GradScaler tracks the fp32 run."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    w32 = torch.nn.Parameter(torch.randn(8, 1) * 0.1)
    w16 = torch.nn.Parameter(w32.detach().half())
    with torch.no_grad():
        w32.copy_(w16.float())
    ref = torch.optim.AdamW([w32], lr=1e-3, weight_decay=0.0)
    opt = halfadam.AdamW([w16], lr=1e-3)
    scaler = halfadam.GradScaler()
    for _ in range(200):
        ref.zero_grad()
        ((x @ w32 - y) ** 2).mean().backward()
        ref.step()
        opt.zero_grad()
        scaler.scale(((x @ w16.float() - y) ** 2).mean()).backward()
        scaler.step(opt)
        scaler.update()
    rel = ((opt.master_weight(w16) - w32.detach()).norm() / w32.detach().norm()).item()
    assert rel < 1e-3


# ---------------------------------------------------------------------------------- overflow check
def _skips(make_opt, scaler, model, x, y, steps):
    """(skipped steps, steps with a non-finite gradient, scales) of ``steps`` fused steps."""
    opt = make_opt(model.parameters())
    skipped, nonfinite, scales = 0, 0, []
    for _ in range(steps):
        opt.zero_grad()
        scaler.scale(((model(x) - y) ** 2).mean()).backward()
        nonfinite += any(not torch.isfinite(p.grad).all() for p in model.parameters())
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < before
        scales.append(scaler.get_scale())
    return skipped, nonfinite, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_overflow_check_skips_only_nonfinite_gradients_like_torch(dtype):
    """Linear(5, 1) with targets of 1e-4 and growth every step: the scale climbs to ~2**127, where the
    float32 sum of squares of the finite scaled gradients overflowed (76 skipped steps before the fix).
    torch.amp.GradScaler skips none; neither may the fused hand-over."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1).to(dtype)
    twin = copy.deepcopy(model)
    x, y = torch.randn(8, 5).to(dtype), torch.full((8, 1), 1e-4).to(dtype)
    ours = _skips(lambda ps: halfadam.AdamW(ps, lr=1e-3), halfadam.GradScaler(growth_interval=1), model, x, y, 200)
    theirs = _skips(lambda ps: torch.optim.AdamW(ps, lr=1e-3), torch.amp.GradScaler("cpu", growth_interval=1),
                    twin, x, y, 200)
    assert theirs[:2] == (0, 0)  # the reference: no step skipped, no gradient non-finite
    assert ours[:2] == (0, 0)
    assert ours[2] == theirs[2]  # the same scales, up to torch's cap of 2**127
    assert ours[2][-1] == 2.0**127


@pytest.mark.parametrize("dtype, scale, big", [
    (torch.float16, 2.0**12, 1.0),        # 4 * 2**12 * 1.0 fits float16
    (torch.bfloat16, 2.0**100, 1.0),      # scaled squares ~1e61: overflow a float32 sum
    (torch.float32, 2.0**100, 1.0),
    (torch.float64, 2.0**100, 1.0),
    (torch.float64, 1.0, 1e200),          # squares overflow even float64: the max-norm decides
])
def test_fused_check_is_exactly_nonfinite_and_clip_norm_does_not_overflow(dtype, scale, big):
    p = torch.nn.Parameter(torch.zeros(2, dtype=dtype))
    opt = halfadam.AdamW([p], lr=1.0)
    scaler = halfadam.GradScaler(init_scale=scale, max_grad_norm=1.0, min_scale=2.0**-126)
    scaler.scale(torch.ones(()))
    p.grad = torch.tensor([3.0 * big * scale, 4.0 * big * scale], dtype=torch.float64).to(dtype)
    assert torch.isfinite(p.grad).all()
    scaler.step(opt)
    scaler.update()
    assert opt.state[p]["step"].item() == 1 and scaler.get_scale() == scale  # not skipped
    if big == 1.0:  # hand-derived: unscaled norm 5, clipped to 1, exp_avg = 0.1 * [0.6, 0.8]
        assert scaler.last_grad_norm.item() == pytest.approx(5.0, rel=1e-6)
        assert opt.state[p]["exp_avg"].double() == pytest.approx(torch.tensor([0.06, 0.08]).double(), rel=1e-3)
    for bad in (float("inf"), float("-inf"), float("nan")):
        scaler.scale(torch.ones(()))
        p.grad = torch.tensor([3.0 * big * scale, bad], dtype=torch.float64).to(dtype)
        before = scaler.get_scale()
        assert scaler.step(opt) is None
        scaler.update()
        assert opt.state[p]["step"].item() == 1 and scaler.get_scale() == before * 0.5  # skipped


def test_clip_grad_norm_of_large_finite_gradients_does_not_overflow():
    """Unscaled float32 gradients [3e19, 4e19]: the norm 5e19 is a float32, the float32 sum of squares
    (2.5e39) is not; before, the norm was inf and the gradients were multiplied by 0."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = halfadam.AdamW([p], lr=1.0)
    scaler = halfadam.GradScaler(init_scale=1.0)
    scaler.scale((p * torch.tensor([3e19, 4e19])).sum()).backward()
    norm = scaler.clip_grad_norm_(opt, max_norm=1.0)
    assert norm.dtype == torch.float32 and norm.item() == pytest.approx(5e19, rel=1e-6)
    scaler.step(opt)
    assert opt.state[p]["exp_avg"] == pytest.approx(torch.tensor([0.06, 0.08]), rel=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("scale", [3.0, 0.5])
def test_unscale_fallback_matches_torch_fused_op(monkeypatch, dtype, scale):
    """Without torch's ``_amp_foreach_non_finite_check_and_unscale_`` the plain-op path gives the same
    values (unscaled in float32, rounded once) and the same flag (read before unscaling)."""
    from halfadam.handover import unscale_and_check_ as _unscale_and_check_

    torch.manual_seed(0)
    big = torch.finfo(dtype).max / 1.5  # finite, but not once divided by 0.5
    cases = [[torch.randn(100).mul(100).to(dtype), torch.tensor(2.5, dtype=dtype)],
             [torch.tensor([1.0, big], dtype=torch.float64).to(dtype)],
             [torch.randn(3).to(dtype), torch.tensor([1.0, float("nan")]).to(dtype)]]
    inv = torch.full((1,), 1.0 / scale)
    op = torch._amp_foreach_non_finite_check_and_unscale_
    expected = []
    for ts in cases:
        ref, flag = [t.clone() for t in ts], torch.zeros(1)
        op(ref, flag, inv)
        expected.append((ref, flag))
    monkeypatch.delattr(torch, "_amp_foreach_non_finite_check_and_unscale_")
    for ts, (ref, flag) in zip(cases, expected):
        got, found = [t.clone() for t in ts], torch.zeros(1)
        _unscale_and_check_(got, inv, found)
        assert torch.equal(found, flag)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)  # bitwise, nan where nan
    assert [f.item() for _, f in expected] == [0.0, 0.0, 1.0]


# ---------------------------------------------------------------------------------- scale floor
def _overflow_steps(scaler, opt, p, n):
    """``n`` steps with an inf gradient; returns the scales and the step indices (1-based) that warned."""
    scales, warned = [], []
    for k in range(1, n + 1):
        scaler.scale(torch.ones(()))
        p.grad = torch.full_like(p, float("inf"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scaler.step(opt)
            scaler.update()
        warned += [(k, str(w.message)) for w in caught if str(w.message).startswith("GradScaler")]
        scales.append(scaler.get_scale())
    return scales, warned


def test_scale_stops_at_its_floor_warns_once_and_training_resumes():
    p = torch.nn.Parameter(torch.zeros(2))  # float32: a gradient of 1 scaled by 2**-126 is representable
    opt = halfadam.AdamW([p], lr=1e-3)
    scaler = halfadam.GradScaler(growth_interval=2, min_scale=2.0**-126)  # the lowest floor there is
    scales, warned = _overflow_steps(scaler, opt, p, 200)
    # Hand-derived: 2**16 * 0.5**k, down to the floor 2**-126 (the smallest normal float32) after
    # k = 142, and there it stays; before, it reached 0.0 after 166 and stayed (every step skipped).
    assert scales == [max(2.0 ** (16 - k), 2.0**-126) for k in range(1, 201)]
    assert [k for k, _ in warned] == [32]  # once in the run, at 32 consecutive overflows
    assert "32 consecutive" in warned[0][1]

    scaler.scale(torch.ones(()))
    p.grad = torch.full_like(p, 2.0**-126)  # finite again (a gradient of 1, scaled): the step is taken
    scaler.step(opt)
    scaler.update()
    assert opt.state[p]["step"].item() == 1
    assert p.detach() == pytest.approx(torch.full((2,), -1e-3), rel=1e-5)  # Adam's first step: -lr * sign(g)
    scaler.scale(torch.ones(()))  # and after growth_interval clean steps the scale grows
    p.grad = torch.full_like(p, 2.0**-126)
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**-125

    _, warned = _overflow_steps(scaler, opt, p, 40)  # a new run warns again, once: at the floor at once
    assert [k for k, _ in warned] == [1] and "floor" in warned[0][1]


def test_scale_floor_warns_when_reached_first():
    p = torch.nn.Parameter(torch.zeros(2).half())
    opt = halfadam.AdamW([p])
    scaler = halfadam.GradScaler(backoff_factor=1e-10, min_scale=2.0**-126)  # 2**16 * 1e-50 < 2**-126 < 2**16 * 1e-40
    scales, warned = _overflow_steps(scaler, opt, p, 40)
    assert scales[3] == pytest.approx(2.0**16 * 1e-40, rel=1e-6) and scales[4:] == [2.0**-126] * 36
    assert [k for k, _ in warned] == [5] and "floor" in warned[0][1]


def test_scale_matches_torch_until_the_floor():
    p = torch.nn.Parameter(torch.zeros(2).half())
    ours, opt = halfadam.GradScaler(min_scale=2.0**-126), halfadam.AdamW([p])
    theirs, ref_opt = torch.amp.GradScaler("cpu"), torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    ref_p = ref_opt.param_groups[0]["params"][0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(142):
            theirs.scale(torch.ones(()))
            ref_p.grad = torch.full_like(ref_p, float("inf"))
            theirs.step(ref_opt)
            theirs.update()
        scales, _ = _overflow_steps(ours, opt, p, 142)
    assert theirs.get_scale() == scales[-1] == 2.0**-126


def test_default_floor_keeps_training_after_a_long_run_of_overflows():
    """Issue 33 item 12: 100 overflowing fp16 steps, then 300 finite ones. Without a floor (torch's
    rule, which min_scale=2**-126 follows down to 2**-126: test_scale_matches_torch_until_the_floor)
    the scale is 2**16 * 2**-100 ~ 5e-26, the scaled float16 gradients flush to 0 and the 300 steps
    change nothing; with the default min_scale=1.0 the weights move."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).half()
    x, y = torch.randn(16, 4).half(), torch.randn(16, 1).half()
    start = copy.deepcopy(model.state_dict())
    results = {}
    for name, scaler in (("torch", halfadam.GradScaler(min_scale=2.0**-126)), ("halfadam", halfadam.GradScaler())):
        model.load_state_dict(start)
        opt = halfadam.AdamW(model.parameters(), lr=1e-3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(100):
                scaler.scale(torch.ones((), requires_grad=True).half()).backward()
                for p in model.parameters():
                    p.grad = torch.full_like(p, float("inf"))
                scaler.step(opt)
                scaler.update()
        scale_after_overflows = scaler.get_scale()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(300):
                opt.zero_grad()
                scaler.scale(torch.nn.functional.mse_loss(model(x).float(), y.float())).backward()
                scaler.step(opt)
                scaler.update()
        zeros = sum("every gradient was 0 in 100 consecutive steps" in str(w.message) for w in caught)
        results[name] = (scale_after_overflows, model.weight.detach().clone(), zeros)
    assert results["torch"][0] == 2.0 ** -84 and results["halfadam"][0] == 1.0
    assert results["torch"][2] == 1 and results["halfadam"][2] == 0  # said once, where nothing trains
    moved = lambda w: (w.float() - start["weight"].float()).abs().max().item()
    assert moved(results["torch"][1]) == 0.0  # torch's scaler: every gradient was 0 (the fault)
    assert moved(results["halfadam"][1]) > 0.1  # 300 Adam steps of lr 1e-3 move a weight ~0.3


def test_all_zero_gradients_warn_once_after_100_steps():
    p = torch.nn.Parameter(torch.ones(3).half())
    opt = halfadam.AdamW([p], lr=1e-3)
    scaler = halfadam.GradScaler(init_scale=2.0**-80, min_scale=2.0**-100)
    warned = []
    for k in range(1, 151):
        scaler.scale(torch.ones(()))
        p.grad = torch.zeros_like(p)  # what a scale of 2**-80 leaves of a float16 gradient
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scaler.step(opt)
            scaler.update()
        warned += [(k, str(w.message)) for w in caught if "every gradient was 0" in str(w.message)]
    assert [k for k, _ in warned] == [100]
    assert "raise min_scale" in warned[0][1]


def test_min_scale_is_checked():
    with pytest.raises(ValueError, match="init_scale=0.5 is below min_scale=1.0"):
        halfadam.GradScaler(init_scale=0.5)
    for bad, exc in ((0.0, ValueError), (float("inf"), ValueError), ("1", TypeError), (True, TypeError)):
        with pytest.raises(exc, match="min_scale"):
            halfadam.GradScaler(min_scale=bad)
    assert halfadam.GradScaler(init_scale=0.5, min_scale=0.25).get_scale() == 0.5


def test_a_collapsed_torch_scale_loads_at_the_floor():
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**-84)
    theirs.scale(torch.ones(()))
    ours = halfadam.GradScaler()
    with pytest.warns(UserWarning, match="below this scaler's min_scale"):
        ours.load_state_dict(theirs.state_dict())
    assert ours.get_scale() == 1.0
    assert torch.amp.GradScaler("cpu").load_state_dict(ours.state_dict()) is None  # and torch loads ours


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_disabled_scaler_clips_with_max_grad_norm(dtype):
    """Issue 33 item 6: GradScaler(enabled=False, max_grad_norm=1.0) clips as torch's clip_grad_norm_
    on a float32 twin; last_grad_norm is the norm before clipping (hand-derived: 5)."""
    p = torch.nn.Parameter(torch.zeros(2, dtype=dtype))
    q = torch.nn.Parameter(torch.zeros(2))
    opt = halfadam.AdamW([p], lr=0.1, betas=(0.5, 0.5))
    ref = torch.optim.AdamW([q], lr=0.1, betas=(0.5, 0.5), weight_decay=0.0)
    scaler = halfadam.GradScaler(enabled=False, max_grad_norm=1.0)
    for grad in ([3.0, 4.0], [0.3, -0.4]):
        p.grad = torch.tensor(grad, dtype=dtype)
        q.grad = p.grad.float()
        norm = q.grad.norm().item()
        scaler.step(opt)
        torch.nn.utils.clip_grad_norm_([q], 1.0)
        ref.step()
        torch.testing.assert_close(opt.master_weight(p), q.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(opt.state[p]["exp_avg"], ref.state[q]["exp_avg"], rtol=1e-6, atol=1e-7)
        assert scaler.last_grad_norm.item() == pytest.approx(norm, rel=1e-6)
    assert opt.state[p]["exp_avg"][0].item() == pytest.approx(0.3, rel=1e-2)  # hand-derived: 0.5 * 0.6


def test_a_disabled_scaler_clips_a_torch_optimizer_too():
    q = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([q], lr=1.0)
    scaler = halfadam.GradScaler(enabled=False, max_grad_norm=1.0)
    q.grad = torch.tensor([3.0, 4.0])
    scaler.step(opt)
    assert q.detach().tolist() == pytest.approx([-0.6, -0.8], rel=1e-6)
    assert scaler.last_grad_norm.item() == pytest.approx(5.0)


# ---------------------------------------------------------------------------------- scale()
@pytest.mark.parametrize("loss", [
    torch.tensor([1.0, -2.5, 3e-3]).half(), torch.tensor(0.75), torch.tensor(0.75).half(),
    torch.randn(2, 2).bfloat16(), torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([4.0, 1e-4]).half(),
])
@pytest.mark.parametrize("init_scale", [2.0**10, 3.0, 2.0**20])  # 2**20: a float16 loss of 1 overflows
def test_scale_keeps_dtype_and_shape_like_torch(loss, init_scale):
    ours = halfadam.GradScaler(init_scale=init_scale).scale(loss)
    theirs = torch.amp.GradScaler("cpu", init_scale=init_scale).scale(loss)
    assert ours.shape == theirs.shape == loss.shape and ours.dtype == theirs.dtype
    # the loss's dtype, except a 0-d half loss: two 0-d tensors promote to float32 (so does torch)
    assert ours.dtype == (torch.float32 if loss.dim() == 0 and loss.dtype == torch.float16 else loss.dtype)
    assert torch.equal(ours, theirs)
    pair = halfadam.GradScaler(init_scale=init_scale).scale([loss, (loss,)])
    assert torch.equal(pair[0], theirs) and torch.equal(pair[1][0], theirs) and pair[1][0].shape == loss.shape


# ---------------------------------------------------------------------------------- argument types
@pytest.mark.parametrize("name", ["init_scale", "growth_factor", "backoff_factor", "growth_interval", "max_grad_norm"])
@pytest.mark.parametrize("value", [True, False, "2", None, torch.tensor(2.0)])
def test_numeric_arguments_reject_bools_and_non_numbers(name, value):
    if value is None and name == "max_grad_norm":
        return  # None: no clipping
    with pytest.raises(TypeError, match=name):
        halfadam.GradScaler(**{name: value})


@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(growth_interval=2.0), TypeError, "growth_interval"), (dict(growth_interval=2.5), TypeError, "growth_interval"),
    (dict(init_scale=1e-40), ValueError, "init_scale"),  # 0.0 as a float32 after backoff / subnormal
    (dict(init_scale=1e39), ValueError, "init_scale"),  # inf as a float32
    (dict(init_scale=float("nan")), ValueError, "init_scale"), (dict(growth_factor=float("inf")), ValueError, "growth_factor"),
    (dict(max_grad_norm=0.0), ValueError, "max_grad_norm"), (dict(max_grad_norm=float("nan")), ValueError, "max_grad_norm"),
])
def test_arguments_out_of_type_or_range(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        halfadam.GradScaler(**kwargs)


def test_accepted_numbers():
    import numpy as np
    scaler = halfadam.GradScaler(init_scale=np.float32(8.0), growth_factor=3, backoff_factor=np.float64(0.25),
                                 growth_interval=np.int64(7), max_grad_norm=1)
    assert scaler.state_dict() == {"scale": 8.0, "growth_factor": 3.0, "backoff_factor": 0.25, "growth_interval": 7,
                                   "_growth_tracker": 0}
    assert type(scaler.get_growth_interval()) is int
    assert halfadam.GradScaler(init_scale=2.0**-126, min_scale=2.0**-126).get_scale() == 2.0**-126


def test_update_new_scale_and_clip_arguments_are_checked():
    p = torch.nn.Parameter(torch.ones(2).half())
    opt = halfadam.AdamW([p])
    scaler = halfadam.GradScaler(init_scale=4.0)
    scaler.scale(p.float().sum()).backward()
    with pytest.raises(TypeError, match="max_norm"):
        scaler.clip_grad_norm_(opt, True)
    with pytest.raises(ValueError, match="max_norm"):
        scaler.clip_grad_norm_(opt, -1.0)
    with pytest.raises(TypeError, match="norm_type"):
        scaler.clip_grad_norm_(opt, 1.0, norm_type=True)
    scaler.step(opt)
    for bad, exc in [(True, TypeError), (torch.tensor(True), TypeError), ("8", TypeError), (0.0, ValueError),
                     (1e-40, ValueError), (float("inf"), ValueError)]:
        with pytest.raises(exc, match="new_scale"):
            scaler.update(new_scale=bad)
    assert scaler.get_scale() == 4.0
    scaler.update(new_scale=torch.tensor([8.0]))
    assert scaler.get_scale() == 8.0


# ---------------------------------------------------------------------------------- load_state_dict
@pytest.mark.parametrize("key, value, exc", [
    ("growth_interval", 2.5, TypeError), ("growth_interval", 2.0, TypeError), ("growth_interval", True, TypeError),
    ("growth_interval", 0, ValueError), ("_growth_tracker", 2.7, TypeError), ("_growth_tracker", True, TypeError),
    ("_growth_tracker", "3", TypeError), ("_growth_tracker", -1, ValueError), ("scale", True, TypeError),
    ("scale", "1024", TypeError), ("scale", torch.tensor(8.0), TypeError), ("scale", 0.0, ValueError),
    ("scale", 1e-40, ValueError), ("scale", float("inf"), ValueError), ("growth_factor", True, TypeError),
    ("growth_factor", 1.0, ValueError), ("backoff_factor", False, TypeError), ("backoff_factor", 1.0, ValueError),
])
def test_load_state_dict_rejects_bad_entries_and_changes_nothing(key, value, exc):
    scaler = halfadam.GradScaler(init_scale=256.0, growth_interval=5)
    p = torch.nn.Parameter(torch.ones(1).half())
    opt = halfadam.AdamW([p])
    for _ in range(3):  # a live scale tensor and tracker
        scaler.scale(p.float().sum()).backward()
        scaler.step(opt)
        scaler.update()
    before = scaler.state_dict()
    # every other entry valid and different from the current state: none of them may land either
    other = {"scale": 8.0, "growth_factor": 3.0, "backoff_factor": 0.25, "growth_interval": 9, "_growth_tracker": 1}
    with pytest.raises(exc, match=key):
        scaler.load_state_dict({**other, key: value})
    assert scaler.state_dict() == before
    assert scaler.get_growth_factor() == 2.0 and scaler.get_backoff_factor() == 0.5
    torch.amp.GradScaler("cpu").load_state_dict(other)  # the valid entries are valid for torch too
    scaler.load_state_dict(other)
    assert scaler.state_dict() == other


# ---------------------------------------------------------------------------------- .grad between unscale_ and step
# torch's AMP recipe (nanoGPT's train.py): scale(loss).backward(); unscale_(opt); <user code on .grad>; step(opt).
# What the user code does to .grad must take effect exactly; untouched gradients keep their fp32 copies.
from halfadam.scaler import Float16GradWarning  # noqa: E402

SCALE = 2.0**12  # a power of two: unscaling is exact, so the unscaled fp32 gradients below are exact too
HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-5, weight_decay=0.1)  # eps near |g|: the step depends on |g|


def _recipe(dtype, edit=None, *, before_unscale=None, scaler_kwargs=None, clip=None):
    """One step of the recipe on a small MLP with ``dtype`` parameters; ``edit(model)`` runs between
    ``unscale_`` and ``step`` (``clip``: ``scaler.clip_grad_norm_(opt, clip)`` after it).

    Returns a dict: model, opt, init (fp32 copies of the parameters before the step), scaled (the
    gradients before unscale_), unscaled (what .grad held after unscale_), seen (.grad as the step
    found it, ``None`` where ``None``), norm (scaler.clip_grad_norm_'s), warned (Float16GradWarnings).
    """
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(dtype)
    x, y = torch.randn(32, 8).to(dtype), torch.randn(32, 4)
    init = [p.detach().float().clone() for p in model.parameters()]
    opt = halfadam.AdamW(model.parameters(), **HP)
    scaler = halfadam.GradScaler(init_scale=SCALE, **(scaler_kwargs or {}))
    out = dict(model=model, opt=opt, init=init, norm=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler.scale(((model(x).float() - y) ** 2).mean()).backward()
        if before_unscale is not None:
            before_unscale(model)
        out["scaled"] = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        scaler.unscale_(opt)
        out["unscaled"] = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        if edit is not None:
            edit(model)
        if clip is not None:
            out["norm"] = scaler.clip_grad_norm_(opt, clip)
        out["seen"] = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
    out["warned"] = [w for w in caught if issubclass(w.category, Float16GradWarning)]
    return out


def _torch_adamw(init, grads):
    """One torch.optim.AdamW step (HP) on fp32 copies ``init`` with fp32 ``grads`` (``None``: no step):
    [(param, exp_avg, exp_avg_sq)], the moments ``None`` where the gradient is."""
    params = [torch.nn.Parameter(w.clone()) for w in init]
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.float().clone()
    opt = torch.optim.AdamW(params, foreach=False, **HP)
    opt.step()
    return [(p.detach(), opt.state[p].get("exp_avg"), opt.state[p].get("exp_avg_sq")) for p in params]


def _assert_matches_fp32(opt, params, ref, rtol=1e-6):
    """halfadam's state equals torch's fp32 AdamW step ``ref`` to fp32 rounding."""
    for p, (w, m, v) in zip(params, ref):
        st = opt.state[p]
        torch.testing.assert_close(st["exp_avg"], m, rtol=rtol, atol=0)
        torch.testing.assert_close(st["exp_avg_sq"], v, rtol=rtol, atol=0)
        torch.testing.assert_close(opt.master_weight(p), w, rtol=rtol, atol=1e-9)


def _same_step(a, b, params_a, params_b):
    """Two optimizers' masters and moments are bitwise equal, parameter by parameter."""
    for pa, pb in zip(params_a, params_b):
        assert torch.equal(a.master_weight(pa), b.master_weight(pb))
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(a.state[pa][key], b.state[pb][key]), key


@pytest.mark.parametrize("max_norm", [1e-2, 1e-3])
def test_torch_clip_grad_norm_after_unscale_clips_fp16_params(max_norm):
    """nanoGPT's recipe with fp16 parameters and torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm):
    the first step equals the same recipe by hand (unscaled fp32 gradient times the clip coefficient,
    then torch.optim.AdamW on an fp32 copy) within float16 rounding of the gradient: the step uses the
    clipped float16 .grad as written (before, the clip had no effect: exp_avg was 0.1 * g)."""
    r = _recipe(torch.float16, lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm))
    params = list(r["model"].parameters())
    g32 = [g.float() / SCALE for g in r["scaled"]]  # the unscaled gradients, exact
    norm = torch.linalg.vector_norm(torch.cat([g.double().flatten() for g in g32])).item()
    coef = max_norm / (norm + 1e-6)
    assert coef < 0.02  # the clip matters: 50x and more
    ref = _torch_adamw(r["init"], [g * coef for g in g32])
    lr, eps = HP["lr"], HP["eps"]
    for p, (w, m, v), g in zip(params, ref, g32):
        st, gc = r["opt"].state[p], g * coef
        # torch's clip works in float16 (norm, coefficient, product) on the rounded unscaled .grad:
        # a few float16 roundings (2**-11 each) of each gradient, or half a float16 subnormal step.
        tol = 4e-3 * gc.abs() + 2.0**-24
        assert ((st["exp_avg"] - 0.1 * gc).abs() <= 0.1 * tol).all()
        assert ((st["exp_avg"] - m).abs() <= 0.1 * tol + 1e-12).all()
        assert ((st["exp_avg_sq"] - v).abs() <= 1e-3 * tol * (2 * gc.abs() + tol) + 1e-18).all()
        # the first step moves by lr * (g/|g| adjusted by eps) + decay: d/dg = lr * eps / (|g| + eps)**2
        step_tol = lr * eps * tol / (gc.abs() + eps) ** 2 + 4 * 2.0**-23 * w.abs()
        assert ((r["opt"].master_weight(p) - w).abs() <= step_tol).all()
    # exactly what the user's code wrote: the same step from the clipped float16 .grad, to fp32 rounding
    _assert_matches_fp32(r["opt"], params, _torch_adamw(r["init"], r["seen"]))
    assert len(r["warned"]) == 1 and "scaler.clip_grad_norm_" in str(r["warned"][0].message)
    assert issubclass(Float16GradWarning, UserWarning)


def _mul_(m):
    for p in m.parameters():
        p.grad.mul_(0.5)


def _data_mul_(m):  # .data bypasses the version counter: found by comparing values
    for p in m.parameters():
        p.grad.data.mul_(0.5)


def _replace(m):
    for p in m.parameters():
        p.grad = p.grad * 0.5


def _rescale_one_element(m):  # a change anywhere in a tensor counts, even in its last element
    g = m[0].weight.grad
    g.view(-1)[-1] = g.view(-1)[-1] * 0.5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("edit", [_mul_, _data_mul_, _replace, _rescale_one_element])
def test_rescaling_grad_after_unscale_takes_effect(dtype, edit):
    r = _recipe(dtype, edit)
    params = list(r["model"].parameters())
    # the step used .grad as the user's code left it, exactly (fp32 copies of its values)
    _assert_matches_fp32(r["opt"], params, _torch_adamw(r["init"], r["seen"]))
    if edit is not _rescale_one_element:  # and that is half the unscaled gradient, to .grad's rounding
        g32 = [g.float() / SCALE for g in r["scaled"]]
        rel = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 0.0}[dtype]
        for s, g in zip(r["seen"], g32):
            assert ((s.float() - 0.5 * g).abs() <= rel * 0.5 * g.abs() + 2.0**-24).all()
    assert len(r["warned"]) == (dtype == torch.float16)  # float16 precision, said once; bf16/fp32 quiet


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_untouched_or_read_only_grads_give_todays_step_bitwise(dtype):
    """No change to .grad (nothing, reading it, a torch clip whose coefficient is exactly 1.0) keeps
    the exact fp32 copies: bitwise the step from the unscaled fp32 gradients handed over directly."""
    def read(m):
        torch.nn.utils.get_total_norm([p.grad for p in m.parameters()])

    def clip_no_op(m):
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9)

    for edit in (None, read, clip_no_op):
        r = _recipe(dtype, edit)
        params = list(r["model"].parameters())
        g32 = [g.float() * (1.0 / SCALE) for g in r["scaled"]]
        # .grad showed the unscaled gradients, rounded to its dtype
        assert all(torch.equal(u, g.to(dtype)) for u, g in zip(r["unscaled"], g32))
        torch.manual_seed(0)
        twin = [torch.nn.Parameter(w.to(dtype)) for w in r["init"]]
        ref = halfadam.AdamW(twin, **HP)
        ref.step(grads=dict(zip(twin, g32)))
        _same_step(r["opt"], ref, params, twin)
        assert r["warned"] == []


def test_zeroing_a_layer_and_none_after_unscale_take_effect():
    base = _recipe(torch.float16)
    params_base = list(base["model"].parameters())

    def zero_first(m):
        m[0].weight.grad.zero_()

    r = _recipe(torch.float16, zero_first)
    params = list(r["model"].parameters())
    assert r["warned"] == []  # zeros are exact in float16: nothing to warn about
    w, m, v = _torch_adamw(r["init"][:1], [torch.zeros_like(r["init"][0])])[0]  # decay only
    assert torch.equal(r["opt"].state[params[0]]["exp_avg"], torch.zeros_like(m))
    assert torch.equal(r["opt"].state[params[0]]["exp_avg_sq"], torch.zeros_like(v))
    torch.testing.assert_close(r["opt"].master_weight(params[0]), w, rtol=1e-6, atol=0)
    _same_step(r["opt"], base["opt"], params[1:], params_base[1:])  # the rest: their exact fp32 copies

    def none_last(m):
        m[2].bias.grad = None

    r = _recipe(torch.float16, none_last)
    params = list(r["model"].parameters())
    assert not r["opt"].state[params[3]] or "exp_avg" not in r["opt"].state[params[3]]  # skipped, like torch
    assert torch.equal(params[3].detach().float(), r["init"][3])
    _same_step(r["opt"], base["opt"], params[:3], params_base[:3])


def test_grad_set_after_unscale_is_used():
    """A parameter without a gradient at unscale_ that gets one before step is updated with it (as
    torch's optimizers read whatever .grad holds at step)."""
    new = torch.full((4,), 1e-3).half()

    def drop(m):
        m[2].bias.grad = None

    def give(m):
        m[2].bias.grad = new.clone()

    r = _recipe(torch.float16, give, before_unscale=drop)
    params = list(r["model"].parameters())
    assert r["unscaled"][3] is None
    _assert_matches_fp32(r["opt"], params, _torch_adamw(r["init"], r["seen"]))
    assert r["opt"].state[params[3]]["exp_avg"] == pytest.approx(0.1 * new.float(), rel=1e-6)


@pytest.mark.parametrize("how", ["call", "max_grad_norm"])
def test_scaler_clip_sees_user_edits_and_writes_grad(how):
    """User code zeroes a layer, then scaler.clip_grad_norm_ (or max_grad_norm in step) clips: the norm
    leaves that layer out, the others are clipped in fp32 (exact copies), .grad shows the clipped values."""
    def zero_first(m):
        m[0].weight.grad.zero_()

    max_norm = 1e-3
    kwargs = dict(clip=max_norm) if how == "call" else dict(scaler_kwargs=dict(max_grad_norm=max_norm))
    r = _recipe(torch.float16, zero_first, **kwargs)
    params = list(r["model"].parameters())
    g32 = [g.float() / SCALE for g in r["scaled"]]
    g32[0] = torch.zeros_like(g32[0])
    norm = torch.linalg.vector_norm(torch.cat([g.double().flatten() for g in g32])).item()
    coef = max_norm / (norm + 1e-6)
    if how == "call":
        assert r["norm"].item() == pytest.approx(norm, rel=1e-6)
        for s, g in zip(r["seen"], g32):  # .grad: the clipped fp32 values, rounded once to float16
            assert torch.equal(s, (g * coef).half()) or torch.allclose(s.float(), g * coef, rtol=2**-10, atol=2**-24)
    _assert_matches_fp32(r["opt"], params, _torch_adamw(r["init"], [g * coef for g in g32]), rtol=1e-5)
    assert r["warned"] == []


def test_float16_edit_warning_is_shown_once():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).half()
    opt = halfadam.AdamW(model.parameters())
    scaler = halfadam.GradScaler(init_scale=2.0**8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            opt.zero_grad()
            scaler.scale(model(torch.randn(2, 4).half()).float().sum()).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-2)
            scaler.step(opt)
            scaler.update()
    assert [w.category for w in caught] == [Float16GradWarning]
    assert opt.state[model.weight]["step"].item() == 3
