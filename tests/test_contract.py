"""The mindformers AdamW contract: golden trajectories, hyperparameter forms, validation, functional call."""

import math
import warnings

import numpy as np
import pytest
import torch

import halfadam
from halfadam.schedules import CosineWithWarmUpLR

N_PARAMS, STEPS = 3, 40


def _build(scenario, params, arrays):
    """The constructor calls of the golden json's `scenarios`, written for halfadam."""
    p0, p1, p2 = params
    lr_list = [float(v) for v in arrays["lr_list"]]
    return {
        "defaults": lambda: halfadam.AdamW(params),
        "wd_lr": lambda: halfadam.AdamW(params, learning_rate=5e-3, weight_decay=0.3),
        "betas_eps": lambda: halfadam.AdamW(params, learning_rate=2e-3, betas=(0.7, 0.9), eps=1e-3, weight_decay=0.01),
        "lr_iterable": lambda: halfadam.AdamW(params, learning_rate=lr_list, weight_decay=0.1),
        "lr_tensor_vector": lambda: halfadam.AdamW(params, learning_rate=torch.tensor(lr_list), weight_decay=0.1),
        "lr_schedule_cosine": lambda: halfadam.AdamW(
            params, learning_rate=CosineWithWarmUpLR(learning_rate=1e-2, warmup_steps=5, total_steps=40),
            weight_decay=0.05),
        "groups_order": lambda: halfadam.AdamW(
            [{"params": [p0], "weight_decay": 0.5}, {"params": [p2, p1], "lr": 3e-3}, {"order_params": [p0, p1, p2]}],
            learning_rate=1e-2, weight_decay=0.0),
    }[scenario]()


SCENARIOS = ["defaults", "wd_lr", "betas_eps", "lr_iterable", "lr_tensor_vector", "lr_schedule_cosine", "groups_order"]


def _run(scenario, arrays, dtype, via):
    params = [torch.nn.Parameter(torch.from_numpy(arrays[f"init{i}"]).to(dtype, copy=True)) for i in range(N_PARAMS)]
    opt = _build(scenario, params, arrays)
    for t in range(STEPS):
        grads = [torch.from_numpy(arrays[f"grad{t}_{i}"]) for i in range(N_PARAMS)]
        if via == "functional":
            assert opt(tuple(grads)) == (True,) * N_PARAMS
        elif dtype == torch.float32:
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
        else:
            opt.step(grads=dict(zip(params, grads)))
    return params, opt


@pytest.mark.parametrize("via", ["functional", "step"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_golden_fp32(golden, scenario, via):
    arrays, meta = golden
    assert scenario in meta["scenarios"]
    params, _ = _run(scenario, arrays, torch.float32, via)
    for i, p in enumerate(params):
        np.testing.assert_allclose(p.detach().numpy(), arrays[f"{scenario}_final{i}"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_golden_bf16_masters(golden, scenario):
    """On bf16 parameters (initialised from the same bf16-rounded values) the fp32 masters follow the
    fp32 run exactly: only the copy in the parameter is rounded."""
    arrays, _ = golden
    rounded = {k: (torch.from_numpy(v).bfloat16().float().numpy() if k.startswith("init") else v)
               for k, v in arrays.items()}
    fp32_params, _ = _run(scenario, rounded, torch.float32, "functional")
    bf16_params, opt = _run(scenario, rounded, torch.bfloat16, "functional")
    for p32, p16 in zip(fp32_params, bf16_params):
        np.testing.assert_allclose(opt.master_weight(p16).numpy(), p32.detach().numpy(), rtol=0, atol=1e-6)
        assert torch.equal(p16.detach(), opt.master_weight(p16).bfloat16())


def test_group_lr_is_the_coming_steps_lr():
    """group["lr"] holds the learning rate the next step uses (as after a torch lr_scheduler.step()),
    so frameworks that read it before or after a step see the right value."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = halfadam.AdamW([p], learning_rate=[0.1, 0.2, 0.3])
    shown, moved = [], []
    for _ in range(5):
        shown.append(opt.param_groups[0]["lr"])
        before = p.detach().clone()
        opt([torch.ones(2)])
        moved.append(round((before - p.detach())[0].item(), 6))  # constant gradient: Adam moves by lr
    assert shown == [0.1, 0.2, 0.3, 0.3, 0.3]  # past the end the last value holds
    assert moved == shown
    assert opt.param_groups[0]["lr"] == 0.3


def test_int_and_0d_tensor_lr():
    p = torch.nn.Parameter(torch.zeros(2))
    assert halfadam.AdamW([p], lr=1).param_groups[0]["lr"] == 1.0
    assert halfadam.AdamW([p], lr=torch.tensor(0.25)).param_groups[0]["lr"] == 0.25
    assert halfadam.AdamW([p], lr=torch.tensor(0.25)).param_groups[0]["lr_schedule"] is None


def test_weight_decay_schedule_hand_computed():
    """Zero gradient: Adam's step is 0, so only the decoupled decay w <- w (1 - lr wd_t) acts."""
    lr, w0, steps = 0.1, 2.0, 6
    p = torch.nn.Parameter(torch.full((3,), w0, dtype=torch.float64))
    schedule = lambda t: 0.1 * (t + 1)  # noqa: E731
    opt = halfadam.AdamW([p], lr=lr, weight_decay=schedule)
    expected = w0
    for t in range(steps):
        opt([torch.zeros(3, dtype=torch.float64)])
        expected *= 1 - lr * schedule(t)
        assert opt.param_groups[0]["weight_decay"] == pytest.approx(schedule(t + 1))  # the coming step's
    assert p.detach() == pytest.approx(torch.full((3,), expected, dtype=torch.float64), rel=1e-12)


def test_group_fallback_and_learning_rate_alias_in_groups():
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = halfadam.AdamW([{"params": [a], "learning_rate": 0.5}, {"params": [b]}], lr=0.01, weight_decay=0.2)
    g0, g1 = opt.param_groups
    assert (g0["lr"], g0["weight_decay"], g1["lr"], g1["weight_decay"]) == (0.5, 0.2, 0.01, 0.2)


def test_order_params_orders_the_functional_call():
    a, b, c = (torch.nn.Parameter(torch.zeros(n)) for n in (1, 2, 3))
    opt = halfadam.AdamW([{"params": [c, a]}, {"params": [b]}, {"order_params": [a, b, c]}], lr=0.1)
    assert [p.numel() for p in opt.params_in_order()] == [1, 2, 3]
    opt([torch.ones(1), torch.ones(2), torch.ones(3)])
    assert all(torch.allclose(p.detach(), torch.full_like(p, -0.1)) for p in (a, b, c))
    with pytest.raises(ValueError, match="gradients has 2 entries"):
        opt([torch.ones(1), torch.ones(2)])
    with pytest.raises(ValueError, match=r"gradients\[1\] has shape"):
        opt([torch.ones(1), torch.ones(3), torch.ones(3)])
    assert opt.state[a]["step"].item() == 1


@pytest.mark.parametrize(
    "make_groups, match",
    [
        (lambda a, b, c: [{"params": [a]}, {"params": [b, c]}, {"order_params": [a, b]}], "missing from order_params"),
        (lambda a, b, c: [{"params": [a]}, {"params": [b, c]}, {"order_params": [a, b, c, a]}], r"order_params\[3\].*more than once"),
        (lambda a, b, c: [{"params": [a]}, {"params": [b]}, {"order_params": [a, b, c]}], r"order_params\[2\].*in no parameter group"),
    ],
)
def test_order_params_errors(make_groups, match):
    a, b, c = (torch.nn.Parameter(torch.zeros(n)) for n in (1, 2, 3))
    with pytest.raises(ValueError, match=match):
        halfadam.AdamW(make_groups(a, b, c))


P = torch.nn.Parameter(torch.zeros(2))


@pytest.mark.parametrize(
    "kwargs, exc, names",
    [
        (dict(learning_rate="0.1"), TypeError, ["learning_rate", "'0.1'"]),
        (dict(lr=object()), TypeError, ["lr"]),
        (dict(lr=-1.0), ValueError, ["lr", "-1.0"]),
        (dict(lr=float("nan")), ValueError, ["lr", "nan"]),
        (dict(lr=float("inf")), ValueError, ["lr", "inf"]),
        (dict(lr=[0.1, -0.2]), ValueError, ["lr[1]", "-0.2"]),
        (dict(lr=[0.1, float("nan")]), ValueError, ["lr[1]", "nan"]),
        (dict(lr=torch.ones(2, 2)), ValueError, ["lr", "(2, 2)"]),
        (dict(lr=0.1, learning_rate=0.1), TypeError, ["lr", "learning_rate"]),
        (dict(betas=(0.9, 1)), TypeError, ["betas[1]", "1"]),
        (dict(betas=(0.9,)), TypeError, ["betas"]),
        (dict(betas=(0.0, 0.999)), ValueError, ["betas[0]", "0.0"]),
        (dict(betas=(0.9, 1.0)), ValueError, ["betas[1]", "1.0"]),
        (dict(betas=(0.9, float("nan"))), ValueError, ["betas[1]", "nan"]),
        (dict(eps=1), TypeError, ["eps", "1"]),
        (dict(eps=0.0), ValueError, ["eps", "0.0"]),
        (dict(eps=-1e-8), ValueError, ["eps"]),
        (dict(eps=float("inf")), ValueError, ["eps", "inf"]),
        (dict(weight_decay="0.1"), TypeError, ["weight_decay", "'0.1'"]),
        (dict(weight_decay=-0.1), ValueError, ["weight_decay", "-0.1"]),
        (dict(weight_decay=float("nan")), ValueError, ["weight_decay", "nan"]),
    ],
)
def test_validation(kwargs, exc, names):
    with pytest.raises(exc) as info:
        halfadam.AdamW([P], **kwargs)
    for name in names:
        assert name in str(info.value)


@pytest.mark.parametrize(
    "params, exc, match",
    [
        ([], ValueError, "empty"),
        ([P, 3.0], TypeError, r"params\[1\]"),
        (P, TypeError, "iterable"),
        ([{"params": [P], "lr": -1.0}], ValueError, r"param_groups\[0\]\['lr'\]"),
        ([{"params": [P], "eps": 0}], TypeError, r"param_groups\[0\]\['eps'\]"),
        ([{"params": [P]}, {"params": [P]}], ValueError, "more than one parameter group"),
    ],
)
def test_params_validation(params, exc, match):
    with pytest.raises(exc, match=match):
        halfadam.AdamW(params)


def test_failed_add_param_group_changes_nothing():
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = halfadam.AdamW([a])
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['weight_decay'\]"):
        opt.add_param_group({"params": [b], "weight_decay": -1})
    assert len(opt.param_groups) == 1


def test_schedule_returning_bad_value_fails_before_any_change():
    a = torch.nn.Parameter(torch.zeros(2))
    b = torch.nn.Parameter(torch.zeros(2))
    opt = halfadam.AdamW([{"params": [a]}, {"params": [b], "lr": lambda t: 0.1 if t < 1 else -1.0}])
    opt([torch.ones(2), torch.ones(2)])
    before = [a.detach().clone(), b.detach().clone()]
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['lr'\].*-1.0"):
        opt([torch.ones(2), torch.ones(2)])
    assert torch.equal(a.detach(), before[0]) and torch.equal(b.detach(), before[1])
    assert [g["global_step"] for g in opt.param_groups] == [1, 1]


def test_mindformers_style_readme_example():
    model = torch.nn.Linear(4, 2).to(torch.bfloat16)
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    group_params = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay},
                    {"order_params": list(model.parameters())}]
    opt = halfadam.AdamW(group_params, learning_rate=CosineWithWarmUpLR(learning_rate=1e-3, warmup_steps=2,
                                                                        total_steps=10), weight_decay=0.0)
    lrs = []
    for _ in range(4):
        loss = model(torch.randn(3, 4).bfloat16()).float().pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        lrs.append(opt.param_groups[0]["lr"])  # the learning rate of the next step
    assert lrs[0] == pytest.approx(5e-4) and lrs[1] == pytest.approx(1e-3)
    assert math.isclose(opt.param_groups[1]["weight_decay"], 0.0)


def test_torch_scheduler_on_a_scheduled_lr_warns():
    """A torch lr_scheduler cannot drive an lr that is already a schedule: it is overwritten each step."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = halfadam.AdamW([p], lr=lambda t: 1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    opt([torch.ones(2)])
    sched.step()
    with pytest.warns(UserWarning, match=r"param_groups\[0\]\['lr'\] was changed outside"):
        opt([torch.ones(2)])
    assert opt.param_groups[0]["lr"] == 1e-3


def test_loading_into_a_stepped_scheduled_optimizer_does_not_warn():
    """A loaded group's lr is the checkpoint's step's, not a change from outside: the next step warns nothing
    (it did, comparing it with the lr this optimizer's own last step had written)."""
    def make():
        p = torch.nn.Parameter(torch.zeros(2))
        return halfadam.AdamW([p], lr=CosineWithWarmUpLR(learning_rate=1e-2, warmup_steps=2, total_steps=20))
    opt = make()
    for _ in range(3):
        opt([torch.ones(2)])
    saved = opt.state_dict()
    other = make()
    for _ in range(5):
        other([torch.ones(2)])
    other.load_state_dict(saved)
    with torch.no_grad():  # the model's weights load apart from the optimizer's
        other.param_groups[0]["params"][0].copy_(opt.param_groups[0]["params"][0])
    assert other.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        other([torch.ones(2)])
        opt([torch.ones(2)])
    assert torch.equal(other.param_groups[0]["params"][0], opt.param_groups[0]["params"][0])


def test_a_set_of_parameters_is_rejected():
    with pytest.raises(TypeError, match="ordered"):
        halfadam.AdamW({P})
