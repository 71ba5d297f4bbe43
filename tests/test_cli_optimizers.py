"""``halfadam train --optimizer adamw|sgd|lion``: every mode for each rule, the optimizers the modes build,
the naive Lion of the CLI, the options' checks and defaults (tiny configurations, CPU)."""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest
import torch

import halfadam
from halfadam.cli import main
from halfadam.cli.modes import MODES, get_mode
from halfadam.cli.naive_lion import NaiveLion, naive_lion_step_
from halfadam.cli.optimizers import ALGORITHMS, defaults

ALL_MODES = list(MODES)
TINY = ["--steps", "6", "--batch-size", "4", "--seq-len", "16", "--d-model", "16", "--layers", "1",
        "--heads", "2", "--eval-every", "3", "--no-progress"]

#: Per rule: the optimizer class the fp32, naive and halfadam modes report (metrics.json's "optimizer").
SOURCES = {
    "sgd": ("torch.optim.SGD", "torch.optim.SGD", "halfadam.SGD"),
    "lion": ("halfadam.Lion", "halfadam.cli.naive_lion.NaiveLion", "halfadam.Lion"),
}
#: Per rule: optimizer state bytes per parameter of the fp32, bf16-naive and bf16-halfadam modes: one moment
#: (SGD's momentum buffer, Lion's exp_avg) in the parameter's dtype; with halfadam an fp32 master and moment.
STATE_BYTES = {"sgd": (4, 2, 8), "lion": (4, 2, 8)}


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "tiny.py"
    path.write_text("".join(f"def f{i}(x):\n    return x * {i % 7} + {i}  # ok\n" for i in range(300)))
    return path


def _run(argv: list[str]) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(argv)
    return rc, buf.getvalue()


@pytest.mark.parametrize("optimizer", ["sgd", "lion"])
def test_every_mode_trains_with_the_rule(optimizer, text_file, tmp_path):
    rc, stdout = _run(["train", "--optimizer", optimizer, "--text", str(text_file), "--out", str(tmp_path), *TINY])
    assert rc == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    cfg, modes = metrics["config"], metrics["modes"]
    hyper = defaults(optimizer, "char-lm")
    assert cfg["optimizer"] == optimizer and cfg["lr"] == hyper["lr"] and cfg["weight_decay"] == hyper["weight_decay"]
    assert cfg["momentum"] == (0.9 if optimizer == "sgd" else None)
    assert list(modes) == ALL_MODES
    # the table: a title naming the rule, then one row per mode, every number finite
    lines = stdout.splitlines()
    title = next(i for i, line in enumerate(lines) if line.startswith("optimizer: "))
    assert lines[title].startswith(f"optimizer: {ALGORITHMS[optimizer].title} (lr {hyper['lr']:g}")
    assert lines[title + 1].split()[:2] == ["mode", "train"]
    rows = {line.split()[0]: line.split() for line in lines[title + 3:title + 3 + len(ALL_MODES)]}
    assert list(rows) == ALL_MODES
    for name, row in rows.items():
        assert all(math.isfinite(float(cell.rstrip("%"))) for cell in row[1:]), row
    assert f"  train: 6 steps x 4, {ALGORITHMS[optimizer].title} lr {hyper['lr']:g} (constant)" in stdout
    fp32_source, naive_source, halfadam_source = SOURCES[optimizer]
    for name, m in modes.items():
        assert m["diverged_at_step"] is None and len(m["train_loss"]) == 6, name
        assert all(math.isfinite(v) for v in m["train_loss"] + m["val_loss"]), name
        assert math.isfinite(m["weight_distance_to_fp32"]) and math.isfinite(m["val_loss_vs_fp32_percent"])
        expected = fp32_source if name == "fp32" else naive_source if "naive" in name else halfadam_source
        assert m["optimizer"] == expected, name
    assert modes["fp32"]["weight_distance_to_fp32"] == 0.0
    fp32_bytes, naive_bytes, halfadam_bytes = STATE_BYTES[optimizer]
    assert modes["fp32"]["optimizer_state_bytes_per_param"] == fp32_bytes
    assert modes["bf16-naive"]["optimizer_state_bytes_per_param"] == naive_bytes
    assert modes["fp16-naive"]["optimizer_state_bytes_per_param"] == naive_bytes
    assert modes["bf16-halfadam"]["optimizer_state_bytes_per_param"] == halfadam_bytes
    assert modes["fp16-halfadam"]["loss_scaler"] == "halfadam.GradScaler"
    # one initialisation, one batch sequence: the first losses of a dtype agree
    assert modes["bf16-naive"]["train_loss"][0] == modes["bf16-halfadam-tiny"]["train_loss"][0]
    assert "master_weight_distance_to_fp32" in modes["bf16-halfadam-compact"]


def test_adamw_stays_the_default(text_file, tmp_path):
    rc, stdout = _run(["train", "--text", str(text_file), "--out", str(tmp_path), "--modes", "fp32,bf16-naive", *TINY])
    assert rc == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["config"]["optimizer"] == "adamw" and metrics["config"]["momentum"] is None
    assert metrics["config"]["lr"] == 3e-4 and metrics["config"]["weight_decay"] == 0.0
    assert [m["optimizer"] for m in metrics["modes"].values()] == ["torch.optim.AdamW", "torch.optim.AdamW"]
    assert "optimizer: AdamW (lr 0.0003, weight decay 0); fp32: torch.optim.AdamW;" in stdout


def test_lr_weight_decay_and_momentum_override_the_defaults(tmp_path):
    pytest.importorskip("sklearn")
    rc, stdout = _run(["train", "--task", "digits", "--optimizer", "sgd", "--lr", "0.02", "--weight-decay", "0",
                       "--momentum", "0", "--steps", "3", "--modes", "fp32,bf16-halfadam", "--out", str(tmp_path),
                       "--no-progress"])
    assert rc == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    cfg = metrics["config"]
    assert (cfg["lr"], cfg["weight_decay"], cfg["momentum"]) == (0.02, 0.0, 0.0)
    # momentum 0: neither torch's SGD nor halfadam's keeps a buffer (halfadam's: the fp32 master alone)
    assert metrics["modes"]["fp32"]["optimizer_state_bytes_per_param"] == 0
    assert metrics["modes"]["bf16-halfadam"]["optimizer_state_bytes_per_param"] == 4
    assert "SGD lr 0.02 (constant), momentum 0, weight decay 0" in stdout


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--optimizer", "adam"], "argument --optimizer: invalid choice: 'adam'"),
        (["--optimizer", "Lion"], "argument --optimizer: invalid choice: 'Lion'"),
        (["--momentum", "0.9"], "--momentum is SGD's: it needs --optimizer sgd, not --optimizer adamw"),
        (["--optimizer", "lion", "--momentum", "0.9"], "--momentum is SGD's"),
        (["--optimizer", "sgd", "--momentum", "-1"], "non-negative number"),
        (["--optimizer", "sgd", "--peers"], "the peer modes are AdamWs: they run with --optimizer adamw"),
    ],
)
def test_bad_optimizer_options_are_one_line_exit_2(args, expected, tmp_path, capsys):
    rc = main(["train", "--out", str(tmp_path / "out"), "--no-progress", *args])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("halfadam train: error:"), err
    assert expected in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_help_names_the_optimizers(capsys):
    assert main(["train", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--optimizer {adamw,sgd,lion}" in out and "--momentum MOMENTUM" in out
    assert "sgd: char-lm 0.02, digits 0.01" in out and "lion: char-lm 0.0001, digits 0.0003" in out


@pytest.mark.parametrize("optimizer", ["sgd", "lion"])
def test_each_mode_builds_the_rules_optimizer(optimizer):
    def build(name, dtype):
        p = torch.nn.Parameter(torch.zeros(4, 128, dtype=dtype))
        return get_mode(name, optimizer).make_optimizer([{"params": [p]}], lr=1e-3, weight_decay=0.1,
                                                        **({"momentum": 0.8} if optimizer == "sgd" else {}))

    reference = build("fp32", torch.float32)
    naive = build("bf16-naive", torch.bfloat16)
    tiny = build("bf16-halfadam-tiny", torch.bfloat16)
    if optimizer == "sgd":
        assert type(reference) is torch.optim.SGD and type(naive) is torch.optim.SGD
        assert reference.param_groups[0]["momentum"] == naive.param_groups[0]["momentum"] == 0.8
        assert type(tiny) is halfadam.SGD and tiny.param_groups[0]["momentum"] == 0.8
    else:
        assert type(reference) is halfadam.Lion and type(naive) is NaiveLion and type(tiny) is halfadam.Lion
    assert tiny.state_format.master == "split8" and tiny.state_format.exp_avg == torch.uint8  # state_mode="tiny"
    assert reference.param_groups[0]["weight_decay"] == 0.1
    assert get_mode("bf16-halfadam", optimizer).description.startswith(SOURCES[optimizer][2])
    with pytest.raises(ValueError, match="momentum is SGD's"):
        get_mode("fp32", "lion").make_optimizer([torch.nn.Parameter(torch.zeros(2))], lr=1e-3, weight_decay=0,
                                                momentum=0.9)


def _paper_lion(w, g, m, lr, wd, beta1, beta2):
    """Lion as Chen et al. 2023 write it (Algorithm 2), in float32, every operation rounded once:
    the reference the naive Lion rounds into its half-precision weight."""
    w, g, m = w.float(), g.float(), m.float()
    w = w * torch.tensor(1 - lr * wd, dtype=torch.float32)
    c = m * beta1 + g * torch.tensor(1 - beta1, dtype=torch.float32)
    w = w - torch.sign(c) * lr
    m = m * beta2 + g * torch.tensor(1 - beta2, dtype=torch.float32)
    return w, m


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_naive_lion_is_the_paper_update_rounded_into_the_weight(dtype):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(1000, generator=gen).to(dtype)
    m = (torch.randn(1000, generator=gen) * 0.1).to(dtype)
    g = torch.randn(1000, generator=gen).to(dtype)
    g[:10] = 0  # sign(c) of the moment alone
    m[:5] = 0  # and sign(0) = 0
    expected_w, expected_m = _paper_lion(w, g, m, 3e-3, 0.5, 0.9, 0.99)
    naive_lion_step_(w, g, m, lr=3e-3, weight_decay=0.5, betas=(0.9, 0.99))
    assert torch.equal(w, expected_w.to(dtype)) and torch.equal(m, expected_m.to(dtype))
    assert w.dtype == m.dtype == dtype


def test_naive_lion_loses_a_step_below_half_an_ulp_where_halfadam_keeps_it():
    """The point of the naive mode: a bf16 weight of 1.0 (ulp 2**-7) does not move by lr 1e-3; halfadam's master
    does, and after 4 steps the bf16 weight follows."""
    naive_p = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    master_p = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    naive = NaiveLion([naive_p], lr=1e-3)
    master = halfadam.Lion([master_p], lr=1e-3)
    for _ in range(4):
        for p in (naive_p, master_p):
            p.grad = torch.ones_like(p)
        naive.step()
        master.step()
    assert torch.equal(naive_p.detach(), torch.ones(8, dtype=torch.bfloat16))
    expected = torch.ones(8)
    for _ in range(4):
        expected = expected - 1e-3  # sign(c) = 1, no decay: w - lr in float32
    assert torch.equal(master.master_weight(master_p), expected)
    assert torch.equal(master_p.detach(), torch.full((8,), 0.99609375, dtype=torch.bfloat16))
    assert naive.state[naive_p]["exp_avg"].dtype == torch.bfloat16


def test_naive_lion_refuses_bad_hyperparameters():
    p = [torch.nn.Parameter(torch.zeros(2))]
    for kwargs, what in (({"lr": -1.0}, "lr"), ({"weight_decay": -0.1}, "weight_decay"), ({"betas": (0.9, 1.0)}, "betas")):
        with pytest.raises(ValueError, match=what):
            NaiveLion(p, **kwargs)


RESUME = ["train", "--task", "digits", "--eval-every", "2", "--batch-size", "16", "--no-progress",
          "--modes", "fp32,bf16-naive,bf16-halfadam-tiny"]


@pytest.mark.parametrize("optimizer", ["sgd", "lion"])
def test_resume_continues_each_rule_exactly_and_refuses_another(optimizer, tmp_path, capsys):
    pytest.importorskip("sklearn")
    args = RESUME + ["--optimizer", optimizer]
    assert main(args + ["--steps", "4", "--out", str(tmp_path / "full")]) == 0
    assert main(args + ["--steps", "2", "--out", str(tmp_path / "part"), "--save", str(tmp_path / "ck")]) == 0
    assert main(args + ["--steps", "4", "--out", str(tmp_path / "rest"), "--resume", str(tmp_path / "ck")]) == 0
    full = json.loads((tmp_path / "full" / "metrics.json").read_text())["modes"]
    rest = json.loads((tmp_path / "rest" / "metrics.json").read_text())["modes"]
    for name in full:
        assert rest[name]["train_loss"] == full[name]["train_loss"], name
        assert rest[name]["val_loss"] == full[name]["val_loss"], name
    capsys.readouterr()
    other = "lion" if optimizer == "sgd" else "sgd"
    assert main(RESUME + ["--optimizer", other, "--steps", "4", "--out", str(tmp_path / "x"),
                          "--resume", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "written with other options (" in err and "--optimizer" in err, err


def test_a_checkpoint_from_before_optimizer_resumes_as_adamw(tmp_path):
    """A checkpoint written before --optimizer (its options without ``optimizer`` and ``momentum``) is AdamW's."""
    from halfadam.cli.checkpointing import _check_resumed_options, _run_identity
    from halfadam.cli.config import resolve_config
    from halfadam.cli import build_parser
    from halfadam.cli.errors import CLIError

    cfg, _ = resolve_config(build_parser().parse_args(["train", "--task", "digits"]))
    old = {k: v for k, v in _run_identity(cfg).items() if k not in ("optimizer", "momentum")}
    entries = {"config": old, "history": {"train_loss": []}, "rng": None}
    _check_resumed_options(cfg, tmp_path / "fp32.pt", entries)  # accepted
    lion, _ = resolve_config(build_parser().parse_args(["train", "--task", "digits", "--optimizer", "lion"]))
    with pytest.raises(CLIError, match="--optimizer"):
        _check_resumed_options(lion, tmp_path / "fp32.pt", entries)
