"""Checkpoints: fp32 state kept fp32, atomic and exact loading, torch interop, fp32 export, atomic files."""

import copy
import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import halfadam
from halfadam import checkpoint
from halfadam.checkpoint import CheckpointError
from halfadam.hyperparams import PerStepValues

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
HALF = [torch.float16, torch.bfloat16]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    return env


def make(dtype=torch.float16, seed=0, cls=halfadam.AdamW, **kwargs):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).to(dtype)
    groups = [
        {"params": [model[0].weight, model[2].weight], "weight_decay": 0.05},
        {"params": [model[0].bias, model[2].bias], "weight_decay": 0.0},
    ]
    kwargs.setdefault("lr", 1e-2)
    return model, cls(groups, **kwargs)


def train(model, optimizer, steps, seed=1, start=0):
    dtype = next(model.parameters()).dtype
    for i in range(start, start + steps):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        x, y = torch.randn(16, 4, generator=g), torch.randn(16, 3, generator=g)
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)
        loss.backward()
        optimizer.step()


def clone_tree(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: clone_tree(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(clone_tree(v) for v in x)
    return copy.deepcopy(x)


def assert_same_tree(a, b, path="sd"):
    assert type(a) is type(b), f"{path}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} vs {list(b)}"
        for k in a:
            assert_same_tree(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (u, v) in enumerate(zip(a, b)):
            assert_same_tree(u, v, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ------------------------------------------------------------------------------------- state_dict
@pytest.mark.parametrize("dtype", HALF + [torch.float32])
def test_state_dict_holds_fp32_state_and_group_keys(dtype):
    model, opt = make(dtype)
    train(model, opt, 3)
    sd = opt.state_dict()
    assert sorted(sd["state"]) == [0, 1, 2, 3]
    for st in sd["state"].values():
        expected = {"step", "exp_avg", "exp_avg_sq"} | ({"master_weight"} if dtype in HALF else set())
        assert set(st) == expected
        assert st["step"].dtype == torch.float32 and st["step"].item() == 3
        for key in expected - {"step"}:
            assert st[key].dtype == torch.float32
    g = sd["param_groups"][0]
    assert g["global_step"] == 3 and g["decay"] == "decoupled" and g["params"] == [0, 1]
    assert {"lr", "betas", "eps", "weight_decay", "lr_schedule", "weight_decay_schedule", "optimized_update",
            "master_weights"} <= set(g)


@pytest.mark.parametrize("dtype", HALF)
def test_load_keeps_fp32_dtypes_and_values(dtype):
    model, opt = make(dtype)
    train(model, opt, 4)
    saved = roundtrip(opt.state_dict())  # weights_only=True works
    model2, opt2 = make(dtype, seed=5, lr=0.3)
    train(model2, opt2, 1, seed=9)  # existing state of the same shapes, other values
    before = {p: {k: v for k, v in opt2.state[p].items()} for p in model2.parameters()}
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(saved)
    for p, q in zip(model.parameters(), model2.parameters()):
        for key in ("master_weight", "exp_avg", "exp_avg_sq", "step"):
            assert opt2.state[q][key].dtype == torch.float32
            assert torch.equal(opt2.state[q][key], opt.state[p][key])
            # loaded INTO the existing tensors (they may be views into flat buffers)
            assert opt2.state[q][key] is before[q][key]
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert [g["global_step"] for g in opt2.param_groups] == [4, 4]


def test_load_into_fresh_optimizer_then_steps_match():
    model, opt = make(torch.bfloat16)
    train(model, opt, 3)
    model2, opt2 = make(torch.bfloat16, seed=3)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(roundtrip(opt.state_dict()))
    train(model, opt, 3, start=3)
    train(model2, opt2, 3, start=3)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["master_weight"], opt2.state[q]["master_weight"])


def test_schedules_saved_by_value_and_global_step_round_trip():
    class Halving:  # a schedule with state of its own
        def __init__(self, base):
            self.base = base

        def __call__(self, step):
            return self.base / (1 + step)

        def state_dict(self):
            return {"base": self.base}

        def load_state_dict(self, sd):
            self.base = sd["base"]

    model, opt = make(torch.float16, lr=[0.01, 0.02, 0.03, 0.04])
    opt.param_groups[1]["weight_decay_schedule"] = Halving(0.5)
    train(model, opt, 2)
    sd = roundtrip(opt.state_dict())
    assert sd["param_groups"][0]["lr_schedule"]["attrs"] == {"values": [0.01, 0.02, 0.03, 0.04]}
    assert sd["param_groups"][1]["weight_decay_schedule"]["state_dict"] == {"base": 0.5}
    model2, opt2 = make(torch.float16, lr=1e-3)
    opt2.param_groups[1]["weight_decay_schedule"] = Halving(7.0)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr_schedule"] == PerStepValues([0.01, 0.02, 0.03, 0.04])
    assert opt2.param_groups[1]["weight_decay_schedule"].base == 0.5
    assert [g["global_step"] for g in opt2.param_groups] == [2, 2]

    # A lambda cannot be saved by value: the loading optimizer must hold one, and keeps it.
    model3, opt3 = make(torch.float16, lr=lambda step: 1e-3)
    train(model3, opt3, 1)
    sd3 = roundtrip(opt3.state_dict())
    assert "repr" in sd3["param_groups"][0]["lr_schedule"]
    keep = lambda step: 2e-3  # noqa: E731
    model4, opt4 = make(torch.float16, lr=keep)
    opt4.load_state_dict(sd3)
    assert opt4.param_groups[0]["lr_schedule"] is keep
    model5, opt5 = make(torch.float16)
    before = clone_tree(opt5.state_dict())
    with pytest.raises(CheckpointError, match="could not be saved by value"):
        opt5.load_state_dict(sd3)
    assert_same_tree(before, clone_tree(opt5.state_dict()))


# ------------------------------------------------------------------------------------- atomic loads
def _bad_cases():
    def groups(sd):
        sd["param_groups"].pop()

    def count(sd):
        sd["param_groups"][1]["params"].pop()

    def shape(sd):
        sd["state"][3]["exp_avg"] = torch.zeros(4)

    def master_shape(sd):
        sd["state"][2]["master_weight"] = torch.zeros(6, 3)

    def missing(sd):
        del sd["state"][3]["exp_avg_sq"]

    def unexpected(sd):
        sd["state"][3]["max_exp_avg_sq"] = torch.zeros(3)

    def half_state(sd):
        sd["state"][3]["exp_avg"] = sd["state"][3]["exp_avg"].half()

    def int_state(sd):
        sd["state"][3]["exp_avg_sq"] = torch.zeros(3, dtype=torch.int32)

    def bad_step(sd):
        sd["state"][3]["step"] = torch.tensor(-1.0)

    def bad_lr(sd):
        sd["param_groups"][1]["lr"] = float("nan")

    def bad_betas(sd):
        sd["param_groups"][1]["betas"] = (0.9, 1.5)

    def bad_decay(sd):
        sd["param_groups"][1]["decay"] = "sideways"

    def bad_global_step(sd):
        sd["param_groups"][1]["global_step"] = -3

    def foreign_schedule(sd):
        sd["param_groups"][1]["lr_schedule"] = {"__schedule__": "os:system", "attrs": {}}

    def stray(sd):
        sd["state"][17] = sd["state"][0]

    def not_a_dict(sd):
        sd["state"][3] = [1, 2]

    def neither(sd):
        for g in sd["param_groups"]:
            for k in ("global_step", "decay", "betas"):
                g.pop(k)

    return {
        "groups": (groups, "parameter group"),
        "count": (count, r"param_groups\[1\] has 1 parameter"),
        "shape": (shape, r"parameter 3 .*exp_avg has shape \(4,\)"),
        "master_shape": (master_shape, r"parameter 2 .*master_weight has shape \(6, 3\)"),
        "missing": (missing, r"parameter 3 .*exp_avg_sq.* missing"),
        "unexpected": (unexpected, r"parameter 3 .*unexpected state key.*max_exp_avg_sq"),
        "half_state": (half_state, r"parameter 3 .*torch.float16.*expected torch.float32"),
        "int_state": (int_state, r"parameter 3 .*torch.int32"),
        "bad_step": (bad_step, r"parameter 3 .*step must be a whole number"),
        "bad_lr": (bad_lr, r"param_groups\[1\]\['lr'\] must be finite"),
        "bad_betas": (bad_betas, r"betas"),
        "bad_decay": (bad_decay, r"decay"),
        "bad_global_step": (bad_global_step, "global_step"),
        "foreign_schedule": (foreign_schedule, "os:system"),
        "stray": (stray, "in no group"),
        "not_a_dict": (not_a_dict, r"parameter 3 .*must be a dict"),
        "neither": (neither, "neither a halfadam group nor a torch"),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_state_dict_is_rejected_and_nothing_changes(case):
    mutate, message = _bad_cases()[case]
    model, opt = make(torch.float16)
    train(model, opt, 3)
    sd = clone_tree(opt.state_dict())
    mutate(sd)
    model2, opt2 = make(torch.float16, seed=7, lr=0.5)
    train(model2, opt2, 2, seed=4)
    before = clone_tree(opt2.state_dict())
    params_before = [p.detach().clone() for p in model2.parameters()]
    with pytest.raises(CheckpointError, match=message):
        opt2.load_state_dict(sd)
    assert_same_tree(before, clone_tree(opt2.state_dict()))
    for p, q in zip(params_before, model2.parameters()):
        assert torch.equal(p, q)


def test_master_for_a_parameter_without_one_is_rejected():
    # master_weights is structure, not a hyperparameter: the loading optimizer's setting stays.
    model, opt = make(torch.float32, master_weights=True)
    train(model, opt, 2)
    model2, opt2 = make(torch.float32)
    train(model2, opt2, 1)
    before = clone_tree(opt2.state_dict())
    with pytest.raises(CheckpointError, match="parameter 0 .*master weight \\(master_weight\\) but this optimizer keeps none"):
        opt2.load_state_dict(opt.state_dict())
    assert_same_tree(before, clone_tree(opt2.state_dict()))
    # The other way round the masters are rebuilt from the parameters, with a warning.
    model3, opt3 = make(torch.float32, master_weights=True)
    with pytest.warns(UserWarning, match="master weights rebuilt"):
        opt3.load_state_dict(opt2.state_dict())
    assert opt3.param_groups[0]["master_weights"] is True
    assert torch.equal(opt3.state[model3[0].weight]["master_weight"], model3[0].weight)


def test_state_moves_to_the_parameter_device_and_stays_fp32():
    model, opt = make(torch.bfloat16)
    train(model, opt, 2)
    sd = opt.state_dict()
    model2, opt2 = make(torch.bfloat16)
    opt2.load_state_dict(sd)
    for p in model2.parameters():
        for key in ("master_weight", "exp_avg", "exp_avg_sq"):
            assert opt2.state[p][key].device == p.device and opt2.state[p][key].dtype == torch.float32
        assert opt2.state[p]["step"].device.type == "cpu"


# ------------------------------------------------------------------------------------- exact resume
def test_bitwise_resume_in_a_fresh_process(tmp_path):
    """Train N, save (model, optimizer, scaler), load in a new process, train M == N+M uninterrupted."""
    n, m = 5, 6
    helper = str(HERE / "checkpoint_helper.py")
    for phase in ("first", "second"):
        run = subprocess.run([sys.executable, helper, phase, str(tmp_path), str(n), str(m)], env=_env(),
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
    for name in ("float16", "bfloat16", "float32"):
        full = torch.load(tmp_path / f"full-{name}.pt", weights_only=True)
        resumed = torch.load(tmp_path / f"resumed-{name}.pt", weights_only=True)
        assert_same_tree(full, resumed, name)
        if name != "float32":
            assert all(st["master_weight"].dtype == torch.float32 for st in resumed["state"])
    assert full["global_step"] == [n + m, n + m]


# ------------------------------------------------------------------------------------- torch interop
@pytest.mark.parametrize("ours, theirs", [(halfadam.AdamW, torch.optim.AdamW), (halfadam.Adam, torch.optim.Adam)])
def test_torch_checkpoint_continues_like_torch(ours, theirs):
    model, _ = make(torch.float32)
    topt = theirs([{"params": [model[0].weight, model[2].weight], "weight_decay": 0.05},
                   {"params": [model[0].bias, model[2].bias], "weight_decay": 0.0}], lr=1e-2)
    train(model, topt, 4)
    saved = roundtrip(topt.state_dict())
    model2 = copy.deepcopy(model)
    model2_, opt = make(torch.float32, cls=ours, lr=0.5)
    opt2 = ours([{"params": [model2[0].weight, model2[2].weight]}, {"params": [model2[0].bias, model2[2].bias]}],
                lr=0.5)
    opt2.load_state_dict(saved)  # fp32 parameters: no master to rebuild, no warning
    assert [g["global_step"] for g in opt2.param_groups] == [4, 4]
    assert opt2.param_groups[0]["weight_decay"] == 0.05 and opt2.param_groups[0]["lr"] == 1e-2
    train(model, topt, 5, start=4)
    train(model2, opt2, 5, start=4)
    for p, q in zip(model.parameters(), model2.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6)
        torch.testing.assert_close(opt2.state[q]["exp_avg_sq"], topt.state[p]["exp_avg_sq"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("ours, theirs", [(halfadam.AdamW, torch.optim.AdamW), (halfadam.Adam, torch.optim.Adam)])
def test_export_to_torch_continues_like_halfadam(ours, theirs):
    model, opt = make(torch.float32, cls=ours, lr=[0.01, 0.02, 0.005, 0.004, 0.003])
    train(model, opt, 3)
    tsd = roundtrip(opt.to_torch_state_dict())
    assert tsd["param_groups"][0]["lr"] == 0.004  # the next step's learning rate
    assert "master_weight" not in tsd["state"][0]
    model2 = copy.deepcopy(model)
    topt = theirs([{"params": [model2[0].weight, model2[2].weight]}, {"params": [model2[0].bias, model2[2].bias]}])
    topt.load_state_dict(tsd)
    for group in opt.param_groups:  # compare with a constant lr from here on
        group["lr_schedule"], group["lr"] = None, 0.004
    train(model, opt, 4, start=3)
    train(model2, topt, 4, start=3)
    for p, q in zip(model.parameters(), model2.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", HALF)
def test_torch_half_checkpoint_rebuilds_masters_with_a_warning(dtype):
    model, _ = make(dtype)
    topt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, topt, 2)
    model2, opt2 = make(dtype, seed=1)
    opt2 = halfadam.AdamW(model2.parameters(), lr=1e-3)
    model2.load_state_dict(model.state_dict())
    with pytest.warns(UserWarning, match=r"master weights rebuilt .*parameter\(s\) \[0, 1, 2, 3\]"):
        opt2.load_state_dict(topt.state_dict())
    for p, q in zip(model.parameters(), model2.parameters()):
        st = opt2.state[q]
        assert st["master_weight"].dtype == torch.float32 and torch.equal(st["master_weight"], q.float())
        assert st["exp_avg"].dtype == torch.float32 and torch.equal(st["exp_avg"], topt.state[p]["exp_avg"].float())
        assert st["step"].item() == 2
    train(model2, opt2, 1)  # and it steps


def test_torch_amsgrad_checkpoint_is_rejected():
    model, _ = make(torch.float32)
    topt = torch.optim.AdamW(model.parameters(), amsgrad=True)
    train(model, topt, 1)
    opt = halfadam.AdamW(model.parameters())
    with pytest.raises(CheckpointError, match="amsgrad"):
        opt.load_state_dict(topt.state_dict())
    assert opt.state_dict()["state"] == {}


def test_absolute_decay_cannot_go_to_torch():
    model, opt = make(torch.float16, cls=halfadam.AdamFP16, weight_decay=halfadam.WeightDecay(0.1, absolute=True))
    with pytest.raises(ValueError, match="absolute"):
        opt.to_torch_state_dict()


# ------------------------------------------------------------------------------------- fp32 export
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_export_and_reload_fp32_masters(tmp_path, dtype, fmt):
    model, opt = make(dtype)
    model[2].register_buffer("running", torch.arange(3, dtype=dtype))
    train(model, opt, 4)
    exported = opt.master_state_dict(model)
    for key, p in model.named_parameters():
        assert exported[key].dtype == torch.float32
        assert torch.equal(exported[key], opt.state[p]["master_weight"])
        assert exported[key].data_ptr() != opt.state[p]["master_weight"].data_ptr()
    assert exported["2.running"].dtype == torch.float32
    path = tmp_path / f"w.{fmt}"
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(exported, str(path))
    else:
        torch.save(exported, path)
    # Back into a fresh half-precision model and optimizer: masters exact, parameters rounded.
    model2, opt2 = make(dtype, seed=11)
    model2[2].register_buffer("running", torch.zeros(3, dtype=dtype))
    checkpoint.load_master_state_dict(model2, path, opt2)
    for (key, p), q in zip(model.named_parameters(), model2.parameters()):
        assert q.dtype == dtype and torch.equal(q, p)
        assert torch.equal(opt2.state[q]["master_weight"], opt.state[p]["master_weight"])
    assert torch.equal(model2[2].running, model[2].running)
    # An fp32 model takes the file with plain torch.
    fp32 = copy.deepcopy(model2).float()
    fp32.load_state_dict(exported)
    assert torch.equal(fp32[0].weight, opt.state[model[0].weight]["master_weight"])


def test_load_master_state_dict_checks_first(tmp_path):
    model, opt = make(torch.float16)
    train(model, opt, 2)
    exported = opt.master_state_dict(model)
    model2, opt2 = make(torch.float16, seed=3)
    params = [p.detach().clone() for p in model2.parameters()]
    bad = dict(exported)
    bad["2.bias"] = torch.zeros(5)
    with pytest.raises(CheckpointError, match=r"'2.bias' has shape \(5,\)"):
        checkpoint.load_master_state_dict(model2, bad, opt2)
    bad = dict(exported)
    del bad["2.bias"]
    with pytest.raises(CheckpointError, match="missing keys"):
        checkpoint.load_master_state_dict(model2, bad, opt2)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="cannot be read"):
        checkpoint.load_master_state_dict(model2, tmp_path / "junk.safetensors", opt2)
    assert all(torch.equal(p, q) for p, q in zip(params, model2.parameters()))
    assert not opt2.state


# ------------------------------------------------------------------------------------- files
def _trio(dtype=torch.float16, seed=0):
    model, opt = make(dtype, seed=seed)
    scaler = halfadam.GradScaler(init_scale=1024.0, growth_interval=3)
    return model, opt, scaler


def test_save_and_load_checkpoint_round_trip(tmp_path):
    model, opt, scaler = _trio()
    train(model, opt, 3)
    scaler.update(new_scale=256.0) if scaler._scale is not None else None
    path = checkpoint.save_checkpoint(tmp_path / "run" / "ckpt.pt", model=model, optimizer=opt, scaler=scaler,
                                      step=3, losses=[1.0, 0.5], rng=torch.get_rng_state())
    assert path.is_file() and not [f for f in path.parent.iterdir() if f.name.endswith(".tmp")]
    raw = torch.load(path, weights_only=True)  # plain torch reads it
    assert raw["format"] == "halfadam.checkpoint" and set(raw["objects"]) >= {"model", "optimizer", "step"}
    model2, opt2, scaler2 = _trio(seed=4)
    entries = checkpoint.load_checkpoint(path, model=model2, optimizer=opt2, scaler=scaler2)
    assert entries["step"] == 3 and entries["losses"] == [1.0, 0.5]
    assert scaler2.state_dict() == scaler.state_dict()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))
    assert_same_tree(clone_tree(opt.state_dict()), clone_tree(opt2.state_dict()))


def _unchanged(model, opt, scaler):
    snap = ([p.detach().clone() for p in model.parameters()], clone_tree(opt.state_dict()), scaler.state_dict())

    def check():
        assert all(torch.equal(p, q) for p, q in zip(snap[0], model.parameters()))
        assert_same_tree(snap[1], clone_tree(opt.state_dict()))
        assert snap[2] == scaler.state_dict()
    return check


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "text", "plain_torch"])
def test_corrupt_files_are_rejected_without_partial_load(tmp_path, damage):
    model, opt, scaler = _trio()
    train(model, opt, 2)
    path = checkpoint.save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, scaler=scaler)
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) * 2 // 3])
    elif damage == "flip":  # inside the tensor data, which torch.load does not verify
        target = opt.state[model[0].weight]["exp_avg"].reshape(-1)[:4].numpy().tobytes()
        pos = data.find(target)
        assert pos > 0
        path.write_bytes(data[:pos] + bytes([data[pos] ^ 0x40]) + data[pos + 1:])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "text":
        path.write_text("hello")
    else:
        torch.save(model.state_dict(), path)
    model2, opt2, scaler2 = _trio(seed=5)
    train(model2, opt2, 1)
    check = _unchanged(model2, opt2, scaler2)
    with pytest.raises(CheckpointError, match="corrupt|cannot be read|not a halfadam checkpoint"):
        checkpoint.load_checkpoint(path, model=model2, optimizer=opt2, scaler=scaler2)
    check()


def test_checkpoint_of_another_model_or_dtype_is_rejected_atomically(tmp_path):
    model, opt, scaler = _trio()
    train(model, opt, 2)
    path = checkpoint.save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, scaler=scaler, step=2)

    other = torch.nn.Sequential(torch.nn.Linear(4, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).half()
    other_opt = halfadam.AdamW(other.parameters())
    check = _unchanged(other, other_opt, scaler)
    with pytest.raises(CheckpointError, match=r"'model': '0.weight' has shape \(6, 4\)"):
        checkpoint.load_checkpoint(path, model=other, optimizer=other_opt)
    check()

    model_bf, opt_bf, scaler_bf = _trio(torch.bfloat16, seed=2)
    check = _unchanged(model_bf, opt_bf, scaler_bf)
    with pytest.raises(CheckpointError, match=r"'model': '0.weight' has dtype torch.float16 in the checkpoint"):
        checkpoint.load_checkpoint(path, model=model_bf, optimizer=opt_bf, scaler=scaler_bf)
    check()

    # The model matches but the optimizer does not: the model is not loaded either.
    model3, _, scaler3 = _trio(seed=6)
    opt3 = halfadam.AdamW(model3.parameters())  # one group, not two
    check = _unchanged(model3, opt3, scaler3)
    with pytest.raises(CheckpointError, match="'optimizer': the checkpoint has 2 parameter group"):
        checkpoint.load_checkpoint(path, model=model3, optimizer=opt3, scaler=scaler3)
    check()

    model4, opt4, scaler4 = _trio(seed=6)
    check = _unchanged(model4, opt4, scaler4)
    with pytest.raises(CheckpointError, match="no entry 'ema'"):
        checkpoint.load_checkpoint(path, model=model4, ema=torch.nn.Linear(2, 2))
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        checkpoint.load_checkpoint(tmp_path / "missing.pt", model=model4)
    with pytest.raises(CheckpointError, match="meta"):
        checkpoint.load_checkpoint(path, map_location="meta", model=model4, optimizer=opt4)
    check()


@pytest.mark.parametrize("stage", ["write", "fsync"])
def test_killed_save_leaves_previous_checkpoint_loadable(tmp_path, stage):
    path = tmp_path / "ckpt.pt"
    proc = subprocess.Popen([sys.executable, str(HERE / "checkpoint_helper.py"), "killed-save", str(path), stage],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "saved"
        assert proc.stdout.readline().strip() == "in-save", proc.stderr.read()
        assert [f for f in tmp_path.iterdir() if f.name.endswith(".tmp")]  # the new file is being written
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    entries = checkpoint.load_checkpoint(path)
    assert entries["step"] == 1 and torch.equal(entries["data"], torch.arange(10.0))
    checkpoint.save_checkpoint(path, step=3)  # and the next save works
    assert checkpoint.load_checkpoint(path)["step"] == 3


def test_scaler_state_round_trip_and_atomic():
    scaler = halfadam.GradScaler(init_scale=512.0, growth_interval=5)
    scaler.scale(torch.ones(()))
    sd = scaler.state_dict()
    other = halfadam.GradScaler()
    before = other.state_dict()
    with pytest.raises(ValueError):
        other.load_state_dict({**sd, "_growth_tracker": -1})
    assert other.state_dict() == before
    other.load_state_dict(roundtrip(sd))
    assert other.state_dict() == sd


def test_halfadam_schedules_round_trip_with_weights_only():
    schedules = pytest.importorskip("halfadam.schedules")  # not on every branch yet
    cosine = schedules.CosineWithWarmUpLR(learning_rate=1e-2, warmup_steps=2, total_steps=10, lr_end=0.0)
    model, opt = make(torch.float16, lr=cosine)
    train(model, opt, 3)
    sd = roundtrip(opt.state_dict())
    model2, opt2 = make(torch.float16, lr=1e-3)  # no schedule: restored from the checkpoint
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(sd)
    restored = opt2.param_groups[0]["lr_schedule"]
    assert type(restored) is type(cosine) and restored is not cosine
    assert [restored(t) for t in range(12)] == [cosine(t) for t in range(12)]
    train(model, opt, 4, start=3)
    train(model2, opt2, 4, start=3)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))


def test_checkpoint_of_another_optimizer_class_warns_about_the_update_rule():
    model, opt = make(torch.float16, cls=halfadam.AdamW)
    train(model, opt, 1)
    model2, opt2 = make(torch.float16, cls=halfadam.Adam)
    with pytest.warns(UserWarning, match="decay='decoupled' replaces this optimizer's 'l2'"):
        opt2.load_state_dict(opt.state_dict())
    assert opt2.param_groups[0]["decay"] == "decoupled"  # hyperparameters come from the checkpoint, as in torch


def test_non_plain_entries_need_weights_only_false(tmp_path):
    from fractions import Fraction

    path = checkpoint.save_checkpoint(tmp_path / "c.pt", extra=Fraction(1, 3), step=4)
    with pytest.raises(CheckpointError, match=r"allow it: with torch.serialization.safe_globals\(\[fractions.Fraction\]\)"):
        checkpoint.load_checkpoint(path)
    with torch.serialization.safe_globals([Fraction]):  # the way the message names
        assert checkpoint.load_checkpoint(path)["extra"] == Fraction(1, 3)
    assert checkpoint.load_checkpoint(path, weights_only=False)["extra"] == Fraction(1, 3)
    # An object torch.save cannot pickle: the error comes out, the old file stays, no temporary is left.
    with pytest.raises(Exception):
        checkpoint.save_checkpoint(path, schedule=lambda step: 1.0)
    assert checkpoint.load_checkpoint(path, weights_only=False)["step"] == 4
    assert [f.name for f in tmp_path.iterdir()] == ["c.pt"]


@pytest.mark.parametrize("content", ["text", "random", "empty", "bare_pickle", "bare_pickle_of_objects"])
def test_a_file_not_written_by_torch_save_is_not_a_checkpoint(tmp_path, content):
    import pickle
    from fractions import Fraction

    path = tmp_path / "c.pt"
    data = {"text": b"step 1: loss 0.5\n", "random": torch.randint(0, 256, (4096,), generator=torch.Generator()
                                                                       .manual_seed(0), dtype=torch.uint8).numpy()
            .tobytes(), "empty": b"", "bare_pickle": pickle.dumps({"step": 1}),
            "bare_pickle_of_objects": pickle.dumps({"x": Fraction(1, 3)})}[content]
    path.write_bytes(data)
    model, opt = make()
    for weights_only in (True, False):
        with pytest.raises(CheckpointError) as info:
            checkpoint.load_checkpoint(path, weights_only=weights_only, model=model, optimizer=opt)
        assert str(info.value) == f"{path} is not a halfadam checkpoint (not a file written by torch.save)"
    with pytest.raises(CheckpointError) as info:
        checkpoint.load_master_state_dict(model, path, opt)
    assert str(info.value) == f"{path} is not a state_dict file (not a file written by torch.save)"
    assert not opt.state


class _Touch:
    """Unpickling it creates the file ``path`` (code a pickle runs)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def test_a_bare_pickle_is_refused_unread_even_with_weights_only_false(tmp_path):
    import pickle

    path, marker = tmp_path / "c.pt", tmp_path / "ran"
    path.write_bytes(pickle.dumps(_Touch(marker)))
    with pytest.raises(CheckpointError, match=r"is not a halfadam checkpoint \(not a file written by torch.save\)$"):
        checkpoint.load_checkpoint(path, weights_only=False)
    assert not marker.exists()


def test_a_torch_file_of_other_objects_names_one_and_never_advises_weights_only_false(tmp_path):
    from fractions import Fraction

    path = tmp_path / "c.pt"
    torch.save({"ratio": Fraction(1, 3)}, path)
    with pytest.raises(CheckpointError) as info:
        checkpoint.load_checkpoint(path)
    assert str(info.value) == (f"{path} holds objects that are not allowed (fractions.Fraction): a halfadam checkpoint "
                               f"holds only tensors and plain data, so it was not loaded; if you saved "
                               f"fractions.Fraction yourself, allow it: with torch.serialization.safe_globals("
                               f"[fractions.Fraction]): ...")
    with pytest.raises(CheckpointError, match="is not a halfadam checkpoint"):  # trusted, read: still not one
        checkpoint.load_checkpoint(path, weights_only=False)
    model, _ = make()
    with pytest.raises(CheckpointError) as info:  # no weights_only to pass there
        checkpoint.load_master_state_dict(model, path)
    assert str(info.value) == (f"{path} holds objects that are not allowed (fractions.Fraction): a halfadam checkpoint "
                               f"holds only tensors and plain data, so it was not loaded")


@pytest.mark.parametrize("below", ["c.pt", "sub/c.pt"])
def test_a_checkpoint_path_under_a_file_names_the_checkpoint_path(tmp_path, below):
    (tmp_path / "afile").write_text("not a directory")
    path = tmp_path / "afile" / below
    model, opt = make()
    with pytest.raises(NotADirectoryError) as info:
        checkpoint.save_checkpoint(path, model=model, optimizer=opt)
    assert info.value.filename == str(path)
    assert info.value.strerror == f"{tmp_path / 'afile'} is a file, not a directory"
    assert (tmp_path / "afile").read_text() == "not a directory"


class _System:
    """Unpickles as ``os.system(command)``: what a malicious checkpoint holds."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_a_checkpoint_that_calls_os_system_is_refused_as_not_allowed_and_runs_nothing(tmp_path):
    path, marker = tmp_path / "c.pt", tmp_path / "ran"
    model, opt = make()
    checkpoint.save_checkpoint(path, model=model, optimizer=opt)
    payload = torch.load(path, weights_only=True)
    payload["extra"] = _System(f"touch {marker}")
    torch.save(payload, path)
    for load in (lambda: checkpoint.load_checkpoint(path, model=model, optimizer=opt),
                 lambda: checkpoint.load_master_state_dict(model, path)):
        with pytest.raises(CheckpointError) as info:
            load()
        message = str(info.value)
        assert message.startswith(f"{path} holds objects that are not allowed (posix.system): "), message
        assert "weights_only=False" not in message and "corrupt" not in message and "allow it" not in message
    assert not marker.exists()


def test_a_torch_file_without_the_checkpoint_format_is_not_a_checkpoint(tmp_path):
    model, opt = make()
    path = tmp_path / "weights.pt"
    torch.save(model.state_dict(), path)
    with pytest.raises(CheckpointError) as info:
        checkpoint.load_checkpoint(path, model=model)
    assert str(info.value) == (f"{path} is not a halfadam checkpoint (one written by save_checkpoint): it holds a "
                               f"dict of 4 entries ('0.weight', '0.bias', '2.weight', '2.bias')")
    torch.save([1, 2], path)
    with pytest.raises(CheckpointError, match=r"is not a halfadam checkpoint \(one written by save_checkpoint\): it "
                                              r"holds a list$"):
        checkpoint.load_checkpoint(path)


def test_load_master_state_dict_leaves_fp32_parameters_without_state():
    model, opt = make(torch.float32)
    exported = opt.master_state_dict(model)
    model2, opt2 = make(torch.float32, seed=2)
    checkpoint.load_master_state_dict(model2, exported, opt2)
    assert not opt2.state and all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))


# A file-size limit makes torch's writer fail mid-file (EFBIG): save_checkpoint must say OSError, not RuntimeError.
_FSIZE_SAVE = """
import json, resource, signal, sys, torch
from halfadam import checkpoint
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
path = sys.argv[1]
checkpoint.save_checkpoint(path, step=1, data=torch.arange(10.0))
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
try:
    checkpoint.save_checkpoint(path, step=2, data=torch.zeros(100_000))
except BaseException as exc:
    print(json.dumps({"type": type(exc).__name__, "oserror": isinstance(exc, OSError), "text": str(exc),
                      "errno": getattr(exc, "errno", None), "filename": getattr(exc, "filename", None),
                      "strerror": getattr(exc, "strerror", None)}))
"""


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="no file-size limits here")
def test_write_failure_is_an_oserror_naming_the_path(tmp_path):
    import errno
    import json

    path = tmp_path / "ckpt.pt"
    proc = subprocess.run([sys.executable, "-c", _FSIZE_SAVE, str(path)], env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["oserror"] and result["errno"] == errno.EFBIG, result
    assert result["filename"] == str(path) and result["strerror"] == os.strerror(errno.EFBIG), result
    assert str(path) in result["text"] and "enforce fail" not in result["text"]
    # the old file stays, the temporary file is gone
    assert [f.name for f in tmp_path.iterdir()] == ["ckpt.pt"]
    assert checkpoint.load_checkpoint(path)["step"] == 1


# -------------------------------------------------------------------- temporaries of killed writers
needs_proc = pytest.mark.skipif(checkpoint._writer_scope() is None, reason="no /proc: dead writers cannot be proven")


def _paused_save(path: Path) -> subprocess.Popen:
    """A process in the middle of save_checkpoint(path) (its temporary file half written), paused."""
    proc = subprocess.Popen([sys.executable, str(HERE / "checkpoint_helper.py"), "killed-save", str(path), "write"],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "saved"
    assert proc.stdout.readline().strip() == "in-save", proc.stderr.read()
    return proc


def _temporaries(directory: Path) -> dict:
    """pid -> name of the temporary files in ``directory``."""
    found = {}
    for f in directory.iterdir():
        match = checkpoint._TMP_NAME.match(f.name)
        if match:
            found[int(match[1])] = f.name
    return found


@needs_proc
def test_killed_writers_temporaries_are_removed_live_writers_kept(tmp_path):
    killed = _paused_save(tmp_path / "a.pt")
    live = _paused_save(tmp_path / "b.pt")
    try:
        assert set(_temporaries(tmp_path)) == {killed.pid, live.pid}
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
        assert set(_temporaries(tmp_path)) == {killed.pid, live.pid}  # nothing removes it by itself
        assert checkpoint.load_checkpoint(tmp_path / "a.pt")["step"] == 1  # a load in the directory...
        assert set(_temporaries(tmp_path)) == {live.pid}  # ...removes the dead writer's file only
        checkpoint.save_checkpoint(tmp_path / "c.pt", step=5)  # a save neither touches the live writer's
        assert set(_temporaries(tmp_path)) == {live.pid}
        assert live.poll() is None
        live.send_signal(signal.SIGKILL)
        live.wait(timeout=30)
        checkpoint.save_checkpoint(tmp_path / "c.pt", step=6)  # once it is killed, a save removes it
        assert sorted(f.name for f in tmp_path.iterdir()) == ["a.pt", "b.pt", "c.pt"]
        assert checkpoint.load_checkpoint(tmp_path / "b.pt")["step"] == 1
    finally:
        for proc in (killed, live):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@needs_proc
def test_only_provably_dead_writers_temporaries_are_removed(tmp_path):
    scope, pid = checkpoint._writer_scope(), os.getpid()
    start = checkpoint._process_start(pid)
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True)
    gone = int(finished.stdout)  # a pid whose process has ended (unless reused since: then its start differs)
    other_scope = "0" * 8 if scope != "0" * 8 else "1" * 8
    names = {
        f".c.pt.aaaaaaaa.{pid}-{start}-{scope}.tmp": True,  # this process, alive: kept
        f".c.pt.bbbbbbbb.{pid}-{int(start) + 1}-{scope}.tmp": False,  # our pid, another start: a reused pid
        f".c.pt.cccccccc.{gone}-{start}-{scope}.tmp": False,  # its writer has ended
        f".c.pt.dddddddd.{gone}-{start}-{other_scope}.tmp": True,  # another machine, boot or pid namespace
        ".c.pt.eeeeeeee.tmp": True,  # no writer recorded (an older halfadam): cannot be proven dead
        "notes.txt": True,
    }
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    checkpoint.save_checkpoint(tmp_path / "c.pt", step=1)
    left = {f.name for f in tmp_path.iterdir()}
    assert left == {name for name, kept in names.items() if kept} | {"c.pt"}


# -------------------------------------------------------------------- entries halfadam does not know
def test_unknown_entries_are_checked_in_a_copy_before_anything_loads(tmp_path):
    model, opt, scaler = _trio()
    train(model, opt, 2)
    step_lr = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    path = checkpoint.save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, scaler=scaler, sched=step_lr,
                                      counter={"n": 1})

    model2, opt2, scaler2 = _trio(seed=5)
    train(model2, opt2, 1)
    lambda_lr = torch.optim.lr_scheduler.LambdaLR(opt2, lambda step: 0.5)
    sched_before = {k: v for k, v in lambda_lr.state_dict().items() if k != "lr_lambdas"}
    check = _unchanged(model2, opt2, scaler2)
    with pytest.raises(CheckpointError, match=r"'sched': the saved state does not load into a LambdaLR: KeyError"):
        checkpoint.load_checkpoint(path, model=model2, optimizer=opt2, scaler=scaler2, sched=lambda_lr)
    check()
    assert {k: v for k, v in lambda_lr.state_dict().items() if k != "lr_lambdas"} == sched_before

    class Counter:  # sets one attribute, then fails: only its copy may see that
        n = 0

        def load_state_dict(self, state):
            self.n = state["n"]
            self.m = state["m"]

    counter = Counter()
    with pytest.raises(CheckpointError, match=r"'counter': the saved state does not load into a Counter: KeyError"):
        checkpoint.load_checkpoint(path, model=model2, optimizer=opt2, counter=counter)
    check()
    assert counter.n == 0 and not hasattr(counter, "m")

    # The matching scheduler loads, and its optimizer was shared with the trial copy, not copied.
    step_lr2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=7)
    checkpoint.load_checkpoint(path, model=model2, optimizer=opt2, sched=step_lr2)
    assert step_lr2.state_dict() == step_lr.state_dict() and step_lr2.optimizer is opt2


def test_malformed_torch_optimizer_entry_is_a_checkpoint_error(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    path = checkpoint.save_checkpoint(tmp_path / "c.pt", model=model,
                                      optimizer={"state": {}, "param_groups": [{"lr": 0.1}]})
    model2 = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in model2.parameters()]
    with pytest.raises(CheckpointError, match="'optimizer': a malformed optimizer state_dict"):
        checkpoint.load_checkpoint(path, model=model2, optimizer=opt)
    assert all(torch.equal(p, q) for p, q in zip(before, model2.parameters()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["fp32", "split", "bf16", "compact", "tiny"])
def test_load_master_state_dict_keeps_what_its_docstring_says(mode, dtype):
    """fp32: every master bit for bit; split/bf16/compact: bit for bit in the normal range (float16
    masters below 2**-14 within 2**-41); tiny over bfloat16: within 2**-8 of a bf16 ulp (measured
    against the ulp of the master's own binade)."""
    torch.manual_seed(3)
    model = torch.nn.Linear(512, 256).to(dtype)
    opt = halfadam.AdamW(model.parameters(), state_mode=mode)
    source = {k: torch.randn(v.shape) * 0.05 for k, v in model.state_dict().items()}
    checkpoint.load_master_state_dict(model, source, opt)
    for name, p in model.named_parameters():
        master, want = opt.master_weight(p), source[name]
        assert torch.equal(p, want.to(dtype)), name
        if mode == "tiny" and dtype == torch.bfloat16 and p.dim() == 2:
            ulp = torch.frexp(want)[1].to(torch.float32).sub(8).exp2()  # a bf16 ulp in |want|'s binade
            assert ((master - want).abs() <= ulp * 2.0**-8).all()
            assert (master != want).float().mean() > 0.9  # the claim is not trivial: most do move
        else:
            normal = want.abs() >= 2.0**-14
            assert torch.equal(master[normal], want[normal]) or dtype == torch.bfloat16 and torch.equal(master, want)
            assert ((master - want).abs() <= 2.0**-41).all()


# ------------------------------------------------------------------ reordered parameters (by name)
def _named(order, seed=0, mode="compact"):
    torch.manual_seed(seed)
    params = {"a": torch.nn.Parameter(torch.randn(8, 128).to(torch.bfloat16)),
              "b": torch.nn.Parameter(torch.randn(8, 128).to(torch.bfloat16))}
    return params, halfadam.AdamW([(name, params[name]) for name in order], lr=1e-2, state_mode=mode)


def _step_named(params, opt, seed):
    g = torch.Generator().manual_seed(seed)
    for name in sorted(params):
        params[name].grad = torch.randn(params[name].shape, generator=g).to(torch.bfloat16)
    opt.step()


@pytest.mark.parametrize("mode", ["fp32", "compact"])
def test_a_reordered_model_loads_each_parameter_its_own_state_by_name(mode):
    params, opt = _named("ab", mode=mode)
    for k in range(3):
        _step_named(params, opt, k)
    saved = opt.state_dict()
    params2, opt2 = _named("ba", seed=9, mode=mode)
    for name in params:
        params2[name].data.copy_(params[name])  # the model first
    opt2.load_state_dict(saved)
    assert opt2.param_groups[0]["param_names"] == ["b", "a"]  # its own labels, not the checkpoint's
    for name in params:
        assert torch.equal(opt2.master_weight(params2[name]), opt.master_weight(params[name])), name
        for key in opt.state[params[name]]:
            assert torch.equal(opt2.state[params2[name]][key], opt.state[params[name]][key]), (name, key)
    _step_named(params, opt, 3)  # both go on: the same weights
    _step_named(params2, opt2, 3)
    for name in params:
        assert torch.equal(params2[name], params[name]), name


def test_parameter_names_that_differ_are_refused_naming_both_and_nothing_changes():
    params, opt = _named("ab")
    _step_named(params, opt, 0)
    saved = opt.state_dict()
    saved["param_groups"][0]["param_names"] = ["a", "c"]
    params2, opt2 = _named("ba", seed=9)
    _step_named(params2, opt2, 0)
    before = copy.deepcopy(opt2.state_dict())
    with pytest.raises(CheckpointError) as info:
        opt2.load_state_dict(saved)
    assert str(info.value) == ("param_groups[0]: the checkpoint's parameters are not this optimizer's: ['b'] only "
                               "here, ['c'] only in the checkpoint")
    after = opt2.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for pid, state in before["state"].items():
        for key, value in state.items():
            assert torch.equal(after["state"][pid][key], value) if isinstance(value, torch.Tensor) else \
                after["state"][pid][key] == value


# ------------------------------------------------------------------ optimizer loaded before the model
@pytest.mark.parametrize("source", ["split", "compact", "tiny"])
@pytest.mark.parametrize("target", ["fp32", "compact"])
def test_the_order_of_the_model_and_optimizer_loads_does_not_matter(source, target):
    """A checkpoint whose masters are remainders over the parameters, loaded into another state mode
    before the model's weights: the masters are decoded at the next use, against the loaded weights,
    so they are the saved ones (the bits the bf16 weights lack kept) and the next step is the same as
    with the model loaded first."""
    model, opt = make(torch.bfloat16, state_mode=source)
    train(model, opt, 5)
    saved, weights = opt.state_dict(), copy.deepcopy(model.state_dict())
    masters = [opt.master_weight(p).clone() for p in model.parameters()]
    runs = []
    for optimizer_first in (False, True):
        model2, opt2 = make(torch.bfloat16, seed=7, state_mode=target)
        if optimizer_first:
            opt2.load_state_dict(saved)
            model2.load_state_dict(weights)
        else:
            model2.load_state_dict(weights)
            opt2.load_state_dict(saved)
        for p, master in zip(model2.parameters(), masters):
            assert torch.equal(opt2.master_weight(p), master)
        train(model2, opt2, 1, start=5)
        runs.append([p.detach().clone() for p in model2.parameters()])
    assert sum(int((m != m.to(torch.bfloat16).float()).sum()) for m in masters) > 10  # the bits at stake
    for a, b in zip(*runs):
        assert torch.equal(a, b)
