"""halfadam.AdamW / Adam / AdamFP16 against torch.optim and hand-derived values."""

import math

import pytest
import torch

import halfadam

SHAPES = [(17, 9), (33,), (4, 5, 6), (1,)]


def _grads(steps, shapes, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) * scale for s in shapes] for _ in range(steps)]


def _params(shapes, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _half_and_fp32(dtype, shapes=SHAPES):
    """Half parameters and fp32 copies holding exactly the same (rounded) values."""
    ref = _params(shapes)
    ours = [torch.nn.Parameter(p.detach().to(dtype)) for p in ref]
    with torch.no_grad():
        for p, q in zip(ours, ref):
            q.copy_(p.float())
    return ours, ref


def _groups(params, hyper):
    return [{"params": params[:2], **hyper[0]}, {"params": params[2:], **hyper[1]}]


GROUP_HYPER = [dict(lr=3e-3, weight_decay=0.1), dict(lr=1e-2, weight_decay=0.0, betas=(0.8, 0.99), eps=1e-6)]


@pytest.mark.parametrize("cls_pair", [(halfadam.AdamW, torch.optim.AdamW), (halfadam.Adam, torch.optim.Adam)])
def test_fp32_matches_torch_600_steps(cls_pair):
    ours_cls, torch_cls = cls_pair
    ours, ref = _params(SHAPES), _params(SHAPES)
    opt = ours_cls(_groups(ours, GROUP_HYPER))
    ref_opt = torch_cls(_groups(ref, GROUP_HYPER))
    for grads in _grads(600, SHAPES):
        for p, q, g in zip(ours, ref, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    for p, q in zip(ours, ref):
        assert _rel(p.detach(), q.detach()) <= 1e-6
        assert "master_weight" not in opt.state[p]  # fp32 parameters are updated in place
    for p, q in zip(ours, ref):
        assert _rel(opt.state[p]["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"]) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_params_master_matches_torch_fp32(dtype):
    """Fed the same fp32 gradients, the master weights follow torch.optim.AdamW on fp32 copies."""
    ours, ref = _half_and_fp32(dtype)  # torch's fp32 run starts from the values the half model holds
    opt = halfadam.AdamW(_groups(ours, GROUP_HYPER))
    ref_opt = torch.optim.AdamW(_groups(ref, GROUP_HYPER))
    for grads in _grads(500, SHAPES, scale=1e-3):
        for q, g in zip(ref, grads):
            q.grad = g.clone()
        opt.step(grads=dict(zip(ours, grads)))
        ref_opt.step()
    for p, q in zip(ours, ref):
        master = opt.master_weight(p)
        assert master.dtype == torch.float32 and p.dtype == dtype
        assert _rel(master, q.detach()) <= 1e-6
        # the half parameter is the master rounded to nearest
        assert torch.equal(p.detach(), master.to(dtype))


def test_half_grads_from_autograd():
    """The usual path: .grad in the parameter's dtype, read and upcast by the optimizer."""
    ours, ref = _half_and_fp32(torch.bfloat16)
    opt, ref_opt = halfadam.AdamW(ours, lr=1e-3), torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.0)
    for grads in _grads(50, SHAPES):
        for p, q, g in zip(ours, ref, grads):
            p.grad = g.bfloat16()
            q.grad = g.bfloat16().float()
        opt.step()
        ref_opt.step()
    for p, q in zip(ours, ref):
        assert _rel(opt.master_weight(p), q.detach()) <= 1e-6


def test_small_updates_are_not_lost_in_fp16():
    """fp16 at 1.0 has an ulp of ~9.8e-4: an update of lr=1e-4 is below half of it."""
    steps, lr = 200, 1e-4
    naive = torch.nn.Parameter(torch.ones(8, dtype=torch.float16))
    ours = torch.nn.Parameter(torch.ones(8, dtype=torch.float16))
    torch_opt = torch.optim.AdamW([naive], lr=lr, weight_decay=0.0)
    opt = halfadam.AdamW([ours], lr=lr)
    for _ in range(steps):
        naive.grad = torch.full_like(naive, 0.5)
        ours.grad = torch.full_like(ours, 0.5)
        torch_opt.step()
        opt.step()
    assert torch.all(naive == 1.0)  # torch never moves it
    # Adam with a constant gradient moves by lr each step (m / sqrt(v) = 1 after bias correction)
    # (fp32 rounding of 200 additions to 1.0 leaves ~1e-5 of slack)
    moved = 1.0 - opt.master_weight(ours)
    assert moved == pytest.approx(torch.full((8,), steps * lr), rel=1e-3)
    assert torch.equal(ours.detach(), opt.master_weight(ours).half())
    assert ours[0].item() < 1.0


def test_storage_and_tied_weights_kept():
    flat = torch.zeros(30, dtype=torch.bfloat16)
    emb = torch.nn.Embedding(5, 4).to(torch.bfloat16)
    head = torch.nn.Linear(4, 5, bias=False).to(torch.bfloat16)
    head.weight = emb.weight  # tied
    view = torch.nn.Parameter(flat[10:20].view(2, 5))  # shares flat's storage
    params = list({id(p): p for p in [emb.weight, head.weight, view]}.values())
    assert len(params) == 2
    opt = halfadam.AdamW(params, lr=1e-2)
    ptrs = [p.data_ptr() for p in params]
    for _ in range(5):
        x = torch.randint(0, 5, (7,))
        loss = head(emb(x).float().bfloat16()).float().pow(2).mean() + view.float().sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert [p.data_ptr() for p in params] == ptrs
    assert head.weight is emb.weight
    assert torch.equal(flat[10:20].view(2, 5), view.detach())  # the write landed in the shared storage
    assert flat[10:20].float().abs().sum() > 0


def test_master_weights_switch():
    p16 = torch.nn.Parameter(torch.randn(4).half())
    p32 = torch.nn.Parameter(torch.randn(4))
    opt = halfadam.AdamW([{"params": [p16]}, {"params": [p32], "master_weights": True}])
    p16.grad, p32.grad = torch.ones(4).half(), torch.ones(4)
    opt.step()
    assert opt.state[p16]["master_weight"].dtype == torch.float32
    assert opt.state[p32]["master_weight"] is not p32
    assert opt.master_weight(p32) is opt.state[p32]["master_weight"]

    off = torch.nn.Parameter(torch.randn(4).half())
    opt2 = halfadam.AdamW([off], master_weights=False)
    off.grad = torch.ones(4).half()
    opt2.step()
    assert "master_weight" not in opt2.state[off]
    assert opt2.state[off]["exp_avg"].dtype == torch.float32
    with pytest.raises(ValueError, match="master weights are off"):
        opt2.master_weight(off)


def test_lr_scheduler_drives_lr():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = halfadam.AdamW([p], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    seen = []
    for _ in range(6):
        p.grad = torch.ones(3)
        opt.step()
        seen.append(opt.param_groups[0]["lr"])
        sched.step()
    assert seen == [0.1, 0.1, 0.05, 0.05, 0.025, 0.025]
    assert sched.get_last_lr() == [0.0125]


def _hand_adam(w, g, steps, lr, b1, b2, eps, wd, decay, optimized):
    """Scalar Adam written out from the equations (float64)."""
    m = v = 0.0
    for t in range(1, steps + 1):
        if decay == "l2":
            gt = g + wd * w
        else:
            w = w * (1 - (lr * wd if decay == "decoupled" else wd))
            gt = g
        m = b1 * m + (1 - b1) * gt
        v = b2 * v + (1 - b2) * gt * gt
        if optimized:
            w = w - lr * math.sqrt(1 - b2**t) / (1 - b1**t) * m / (math.sqrt(v) + eps)
        else:
            w = w - lr / (1 - b1**t) * m / (math.sqrt(v) / math.sqrt(1 - b2**t) + eps)
    return w


@pytest.mark.parametrize(
    "wd_args, decay",
    [
        (dict(weight_decay=0.1, weight_decouple=True, absolute=False), "decoupled"),
        (dict(weight_decay=0.01, weight_decouple=True, absolute=True), "absolute"),
        (dict(weight_decay=0.1, weight_decouple=False), "l2"),
    ],
)
@pytest.mark.parametrize("optimized", [True, False])
def test_adamfp16_options_hand_derived(wd_args, decay, optimized):
    lr, b1, b2, eps, steps = 1e-2, 0.9, 0.99, 1e-3, 7
    w0, g = 0.75, -0.3
    p = torch.nn.Parameter(torch.full((3,), w0, dtype=torch.float16))
    opt = halfadam.AdamFP16([p], lr=lr, betas=(b1, b2), eps=eps,
                            weight_decay=halfadam.WeightDecay(**wd_args), optimized_update=optimized)
    assert opt.param_groups[0]["decay"] == decay
    for _ in range(steps):
        p.grad = torch.full_like(p, g)
        opt.step()
    # the master starts at fp16(0.75) == 0.75 exactly; the gradient -0.3 arrives as fp16(-0.3)
    expected = _hand_adam(w0, float(torch.tensor(g).half()), steps, lr, b1, b2, eps, wd_args["weight_decay"],
                          decay, optimized)
    assert opt.master_weight(p)[0].item() == pytest.approx(expected, rel=1e-6)


def test_adamfp16_defaults():
    p = torch.nn.Parameter(torch.zeros(2).half())
    opt = halfadam.AdamFP16([p])
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"], g["optimized_update"]) == (1e-3, (0.9, 0.999), 1e-16, 0.0, True)
    with pytest.raises(TypeError, match="weight_decay"):
        halfadam.AdamFP16([p], weight_decay=0.1)


def test_state_layout_and_dtypes():
    p = torch.nn.Parameter(torch.randn(3, 2).bfloat16())
    opt = halfadam.AdamW([p])
    p.grad = torch.ones_like(p)
    opt.step()
    st = opt.state[p]
    assert set(st) == {"step", "master_weight", "exp_avg", "exp_avg_sq"}
    assert st["step"].item() == 1.0
    assert all(st[k].dtype == torch.float32 and st[k].shape == p.shape for k in ("master_weight", "exp_avg", "exp_avg_sq"))


def test_params_without_grad_are_skipped():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = halfadam.AdamW([a, b], lr=0.1)
    a.grad = torch.ones(2)
    opt.step()
    assert opt.state[a]["step"].item() == 1 and len(opt.state[b]) == 0
    assert torch.equal(b.detach(), torch.ones(2))
    assert opt.param_groups[0]["global_step"] == 1


@pytest.mark.parametrize(
    "bad_grad, exc, match",
    [
        (torch.ones(3, dtype=torch.int64), TypeError, "floating"),
        (torch.ones(4), ValueError, "shape"),
        (torch.ones(3).to_sparse(), TypeError, "sparse"),
    ],
)
def test_bad_gradient_changes_nothing(bad_grad, exc, match):
    a = torch.nn.Parameter(torch.ones(2).half())
    b = torch.nn.Parameter(torch.ones(3).half())
    opt = halfadam.AdamW([{"params": [a]}, {"params": [b]}], lr=0.1)
    with pytest.raises(exc, match=match) as info:
        opt.step(grads={a: torch.ones(2), b: bad_grad})
    assert "param_groups[1]['params'][0]" in str(info.value)
    assert len(opt.state) == 0 and opt.param_groups[0]["global_step"] == 0
    assert torch.equal(a.detach(), torch.ones(2).half())


@pytest.mark.parametrize(
    "params, exc, match",
    [
        ([torch.ones(2, dtype=torch.int32)], TypeError, r"params'\]\[0\].*floating"),
        ([torch.ones(2).to_sparse()], TypeError, "sparse"),
        ([{"params": [torch.ones(2, requires_grad=True)]}, {"params": [torch.ones(2, requires_grad=True) * 2]}],
         ValueError, "non-leaf"),
    ],
)
def test_bad_parameters(params, exc, match):
    with pytest.raises(exc, match=match):
        halfadam.AdamW(params)


def test_adam_l2_matches_torch_on_half_params():
    ours, ref = _half_and_fp32(torch.float16)
    opt = halfadam.Adam(ours, lr=1e-3, weight_decay=0.05)
    ref_opt = torch.optim.Adam(ref, lr=1e-3, weight_decay=0.05)
    for grads in _grads(100, SHAPES, seed=3):
        for q, g in zip(ref, grads):
            q.grad = g
        opt.step(grads=dict(zip(ours, grads)))
        ref_opt.step()
    for p, q in zip(ours, ref):
        assert _rel(opt.master_weight(p), q.detach()) <= 1e-6
