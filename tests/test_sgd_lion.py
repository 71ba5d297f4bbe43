"""halfadam.SGD and halfadam.Lion: the engine's other rules, against independent references.

* float32 parameters: ``torch.optim.SGD`` (every flag) and a transcription of the Lion paper's Algorithm 2
  (lucidrains' ``lion-pytorch`` update), 100 steps, within float32 rounding;
* bfloat16 parameters in the fp32 state mode, given the float32 run's gradients: the master follows it;
* a decay below half a bfloat16 ulp: lost by torch's SGD on bf16 weights, kept by the master (a hand-derived value);
* every state mode: the per-parameter reference and the flat (foreach) execution give the same bits, and the
  state holds the bytes the docs claim;
* errors named before anything changes.
"""

from __future__ import annotations

import pytest
import torch

import halfadam
from halfadam import encodings

SHAPES = [(16, 40), (300,), (7, 5, 3)]
STEPS = 100


def _relative(a, b) -> float:
    """max |a - b| over max |a| (a float32 run's rounding shows as a few 1e-8)."""
    return max(((x.double() - y.double()).abs().max() / x.double().abs().max()).item() for x, y in zip(a, b))


def _lion_paper_(p, g, m, lr, beta1, beta2, wd):
    """Chen et al. 2023, Algorithm 2, as lucidrains' lion-pytorch writes it."""
    p.mul_(1 - lr * wd)
    update = (m * beta1 + g * (1 - beta1)).sign_()
    p.add_(update, alpha=-lr)
    m.mul_(beta2).add_(g, alpha=1 - beta2)


SGD_CASES = [dict(momentum=0.9, weight_decay=0.01), dict(momentum=0.9, nesterov=True, weight_decay=0.003),
             dict(momentum=0.8, dampening=0.3, maximize=True), dict(), dict(weight_decay=0.05, maximize=True)]


@pytest.mark.parametrize("kw", SGD_CASES, ids=str)
@pytest.mark.parametrize("impl", ["reference", "foreach"])
def test_sgd_float32_matches_torch(kw, impl):
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=gen) for s in SHAPES]
    a = [torch.nn.Parameter(x.clone()) for x in start]
    b = [torch.nn.Parameter(x.clone()) for x in start]
    ta, hb = torch.optim.SGD(a, lr=0.01, **kw), halfadam.SGD(b, lr=0.01, implementation=impl, **kw)
    for _ in range(STEPS):
        for x, y in zip(a, b):
            g = torch.randn(x.shape, generator=gen)
            x.grad, y.grad = g.clone(), g.clone()
        ta.step()
        hb.step()
    assert _relative(a, b) <= 1e-6
    buffers = [ta.state[x].get("momentum_buffer") for x in a]
    if kw.get("momentum"):
        assert _relative(buffers, [hb.state[y]["momentum_buffer"] for y in b]) <= 1e-6
    else:
        assert sorted(hb.state[b[0]]) == ["step"]  # no momentum: no buffer kept


@pytest.mark.parametrize("impl", ["reference", "foreach"])
def test_lion_float32_matches_the_paper(impl):
    gen = torch.Generator().manual_seed(1)
    start = [torch.randn(s, generator=gen) for s in SHAPES]
    ref, moments = [x.clone() for x in start], [torch.zeros(s) for s in SHAPES]
    b = [torch.nn.Parameter(x.clone()) for x in start]
    opt = halfadam.Lion(b, lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1, implementation=impl)
    for _ in range(STEPS):
        for x, m, y in zip(ref, moments, b):
            g = torch.randn(x.shape, generator=gen)
            g[0] = 0.0  # sign(0) = 0: no step there, only the decay
            y.grad = g.clone()
            _lion_paper_(x, g, m, 3e-3, 0.9, 0.99, 0.1)
        opt.step()
    assert _relative(ref, b) <= 1e-6
    assert _relative(moments, [opt.state[y]["exp_avg"] for y in b]) <= 1e-6


@pytest.mark.parametrize("make", [lambda ps: halfadam.SGD(ps, lr=0.02, momentum=0.9, weight_decay=0.01),
                                  lambda ps: halfadam.Lion(ps, lr=1e-3, weight_decay=0.1)], ids=["sgd", "lion"])
def test_bf16_master_follows_the_float32_run(make):
    """bf16 parameters (fp32 state mode), each step given the float32 run's gradient: the master is that run."""
    gen = torch.Generator().manual_seed(2)
    start = torch.randn(64, 96, generator=gen)
    w32 = torch.nn.Parameter(start.clone())
    w16 = torch.nn.Parameter(start.to(torch.bfloat16))
    o32, o16 = make([w32]), make([w16])
    o16.master_weight(w16).copy_(start)  # the same fp32 start
    for _ in range(50):
        g = torch.randn(w32.shape, generator=gen)
        w32.grad, w16.grad = g.clone(), g.to(torch.bfloat16)
        o32.step()
        o16.step(grads={w16: g})  # the fp32 gradient, as the GradScaler hands it over
    master = o16.master_weight(w16)
    assert _relative([w32.detach()], [master]) <= 1e-6
    assert torch.equal(w16.detach(), master.to(torch.bfloat16))


def test_small_decay_lands_on_the_master_not_on_bf16_weights():
    """SGD weight decay lr * wd = 1e-7 of a weight of 1.0: below half a bf16 ulp (2**-9), so torch's SGD on
    the bf16 weight never moves it; the master moves as torch's SGD on float32 weights does: in float32 each
    step's 1e-7 (1.68 float32 ulps below 1.0) rounds to 2 ulps, so 1000 steps give 1 - 1000 * 2**-23."""
    p_torch = torch.nn.Parameter(torch.ones(4, 128, dtype=torch.bfloat16))
    p_half = torch.nn.Parameter(torch.ones(4, 128, dtype=torch.bfloat16))
    p_fp32 = torch.nn.Parameter(torch.ones(4, 128))
    opts = [torch.optim.SGD([p_torch], lr=1e-3, weight_decay=1e-4), halfadam.SGD([p_half], lr=1e-3, weight_decay=1e-4),
            torch.optim.SGD([p_fp32], lr=1e-3, weight_decay=1e-4)]
    for _ in range(1000):
        for p, opt in zip((p_torch, p_half, p_fp32), opts):
            p.grad = torch.zeros_like(p)
            opt.step()
    assert torch.all(p_torch == 1.0)
    master = opts[1].master_weight(p_half)
    assert torch.all(master == 1 - 1000 * 2.0 ** -23) and torch.equal(master, p_fp32.detach())
    assert torch.all(p_half == master.to(torch.bfloat16))


@pytest.mark.parametrize("mode", list(encodings.PRESETS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("which", ["sgd", "sgd-plain", "lion"])
def test_every_state_mode_reference_and_flat_agree(mode, dtype, which):
    """The per-parameter reference and the flat foreach execution: the same bits, 4 steps, every mode."""
    def make(ps, impl):
        if which == "lion":
            return halfadam.Lion(ps, lr=1e-3, weight_decay=0.1, state_mode=mode, implementation=impl)
        return halfadam.SGD(ps, lr=0.01, momentum=0.0 if which == "sgd-plain" else 0.9, nesterov=which == "sgd",
                            weight_decay=0.01, state_mode=mode, implementation=impl)

    gen = torch.Generator().manual_seed(3)
    start = [torch.randn(s, generator=gen).to(dtype) for s in [(3, 200), (17, 130), (50,)]]
    runs = []
    for impl in ("reference", "foreach"):
        ps = [torch.nn.Parameter(x.clone()) for x in start]
        opt = make(ps, impl)
        g2 = torch.Generator().manual_seed(4)
        for _ in range(4):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g2).to(dtype)
            opt.step()
        runs.append((ps, opt))
    (pa, oa), (pb, ob) = runs
    for x, y in zip(pa, pb):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))
        sa, sb = oa.state[x], ob.state[y]
        assert sorted(sa) == sorted(sb)
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key
    keys = set(oa.state[pa[0]])
    moment = {"sgd": "momentum_buffer", "lion": "exp_avg"}.get(which)
    assert (moment in keys) if moment else not (keys & {"momentum_buffer", "exp_avg", "exp_avg_sq"})
    assert "exp_avg_sq" not in keys


@pytest.mark.parametrize("mode,limit", [("compact", 3.03), ("tiny", 2.03), ("bf16", 4.02), ("fp32", 8.0)])
def test_state_bytes_per_parameter(mode, limit):
    """Rows of 1,024 bf16 elements: the issue's budget (compact <= 3.03, tiny <= 2.03 bytes per parameter)."""
    for opt_cls in (halfadam.Lion, lambda ps, **kw: halfadam.SGD(ps, momentum=0.9, **kw)):
        p = torch.nn.Parameter(torch.randn(8, 1024).to(torch.bfloat16))
        opt = opt_cls([p], state_mode=mode)
        p.grad = torch.randn_like(p)
        opt.step()
        nbytes = sum(t.numel() * t.element_size() for k, t in opt.state[p].items() if k != "step")
        assert nbytes / p.numel() <= limit


def test_errors_are_named_and_change_nothing():
    p = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match="nesterov"):
        halfadam.SGD([p], nesterov=True)
    with pytest.raises(ValueError, match="momentum"):
        halfadam.SGD([p], momentum=-0.1)
    with pytest.raises(TypeError, match="nesterov"):
        halfadam.SGD([p], momentum=0.9, nesterov=1)
    with pytest.raises(ValueError, match=r"betas\[1\]"):
        halfadam.Lion([p], betas=(0.9, 1.5))
    opt = halfadam.SGD([p], lr=0.1)  # built without momentum: no buffer
    p.grad = torch.ones_like(p)
    opt.step()
    before, state = p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}
    opt.param_groups[0]["momentum"] = 0.9
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['momentum'\]"):
        opt.step()
    assert torch.equal(p.detach(), before) and opt.state[p]["step"].item() == state["step"].item()
    with pytest.raises(ValueError, match="momentum"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2))], "momentum": 0.5})
    assert len(opt.param_groups) == 1


def test_grad_scaler_hands_over_to_sgd():
    """One GradScaler step of halfadam.SGD on bf16 weights equals the step with the unscaled fp32 gradient."""
    torch.manual_seed(5)
    w = torch.randn(8, 16)
    model = torch.nn.Linear(16, 8, bias=False).to(torch.bfloat16)
    model.weight.data.copy_(w)
    x = torch.randn(4, 16)
    opt = halfadam.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = halfadam.GradScaler(init_scale=1024.0)
    ref = torch.nn.Parameter(w.to(torch.bfloat16))
    ref_opt = halfadam.SGD([ref], lr=0.1, momentum=0.9)
    loss = model(x.to(torch.bfloat16)).float().square().mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    g = model.weight.grad.float() / 1024.0
    ref_opt.step(grads={ref: g})
    assert torch.equal(model.weight.detach(), ref.detach())


def test_a_group_without_momentum_beside_one_with_it_steps_as_torch():
    """A group of momentum 0 and dampening 0.5 in an SGD that keeps buffers (another group has momentum):
    torch steps it by ``g`` (no buffer), not ``(1 - dampening) * g``. lr 0.1, gradients of ones, 2 steps: 0.80."""
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    c, d = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    groups = lambda x, y: [{"params": [x], "momentum": 0.9}, {"params": [y], "momentum": 0.0, "dampening": 0.5}]  # noqa: E731
    ours, theirs = halfadam.SGD(groups(a, b), lr=0.1), torch.optim.SGD(groups(c, d), lr=0.1)
    for _ in range(2):
        for p in (a, b, c, d):
            p.grad = torch.ones(3)
        ours.step()
        theirs.step()
    assert torch.allclose(b.detach(), torch.full((3,), 0.8)) and torch.equal(b.detach(), d.detach())
    assert torch.equal(a.detach(), c.detach())


def test_a_groups_nesterov_without_momentum_is_refused_at_construction():
    """torch checks nesterov against the defaults only; halfadam checks every group when it is built or added,
    naming it, so a migrated script fails at once rather than at its first step."""
    p, q = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match=r"param_groups\[1\].*nesterov"):
        halfadam.SGD([{"params": [p]}, {"params": [q], "nesterov": True, "momentum": 0}], lr=0.1, momentum=0.9)
    opt = halfadam.SGD([p], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"param_groups\[1\].*nesterov"):
        opt.add_param_group({"params": [q], "nesterov": True, "dampening": 0.5})
    assert len(opt.param_groups) == 1
