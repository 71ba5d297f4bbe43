"""End-to-end tests of ``halfadam train`` (tiny configurations, CPU)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from halfadam.cli import COMMANDS, build_parser, main
from halfadam.cli.modes import MODES, parse_modes
import halfadam.cli.train as T
from halfadam.cli.train import optimizer_state_bytes
from conftest import needs_gloo

ALL_MODES = list(MODES)
TINY = ["--steps", "6", "--batch-size", "4", "--seq-len", "16", "--d-model", "16", "--layers", "1",
        "--heads", "2", "--eval-every", "3", "--no-progress"]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "tiny.py"
    path.write_text("".join(f"def f{i}(x):\n    return x * {i % 7} + {i}  # ok\n" for i in range(300)))
    return path


@pytest.fixture(scope="module")
def char_run(text_file, tmp_path_factory):
    """One in-process run of every mode on the tiny text; returns (exit code, stdout, out dir)."""
    out = tmp_path_factory.mktemp("char-run")
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["train", "--text", str(text_file), "--out", str(out), *TINY])
    return rc, buf.getvalue(), out


def _metrics(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())


def test_char_lm_all_modes(char_run):
    rc, stdout, out = char_run
    assert rc == 0
    metrics = _metrics(out)
    assert list(metrics["modes"]) == ALL_MODES
    assert metrics["config"]["task"] == "char-lm" and metrics["config"]["steps"] == 6
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {out / 'metrics.json'}" in stdout and f"wrote {out / 'loss.png'}" in stdout
    for name in ALL_MODES:
        assert name in stdout

    modes = metrics["modes"]
    for name, m in modes.items():
        assert m["val_steps"][0] == 0
        if m["diverged_at_step"] is None:  # naive fp16 may turn to nan: that is what it shows
            assert len(m["train_loss"]) == 6 and m["val_steps"] == [0, 3, 6]
            assert all(math.isfinite(v) for v in m["train_loss"] + m["val_loss"]), name
            assert math.isfinite(m["final_val_loss"]) and math.isfinite(m["mean_step_ms"])
            assert m["weight_distance_to_fp32"] >= 0
    for name in ("fp32", "bf16-naive", "fp16-halfadam", "bf16-halfadam"):
        assert modes[name]["diverged_at_step"] is None, name
    assert modes["fp32"]["weight_distance_to_fp32"] == 0.0
    assert modes["fp32"]["val_loss_vs_fp32_percent"] == 0.0
    # master weights + exp_avg + exp_avg_sq in fp32 for half parameters; torch keeps two moments
    assert modes["fp16-halfadam"]["optimizer_state_bytes_per_param"] == 12
    assert modes["bf16-halfadam"]["optimizer_state_bytes_per_param"] == 12
    assert modes["fp32"]["optimizer_state_bytes_per_param"] == 8
    assert modes["bf16-naive"]["optimizer_state_bytes_per_param"] == 4
    assert modes["fp16-naive"]["optimizer_state_bytes_per_param"] == 4
    assert modes["fp16-halfadam"]["loss_scaler"] == "halfadam.GradScaler"
    assert "skipped_steps" in modes["fp16-halfadam"]
    # one initialisation, one batch sequence: the first step sees the same weights (fp16 vs fp16)
    assert modes["fp16-naive"]["train_loss"][0] == modes["fp16-halfadam"]["train_loss"][0]
    assert modes["bf16-naive"]["train_loss"][0] == modes["bf16-halfadam"]["train_loss"][0]
    assert "master_weight_distance_to_fp32" in modes["bf16-halfadam"]


def test_same_seed_same_result(text_file, tmp_path, char_run, capsys):
    _, _, first = char_run
    assert main(["train", "--text", str(text_file), "--out", str(tmp_path), "--modes", "fp32,bf16-halfadam",
                 *TINY]) == 0
    a, b = _metrics(first)["modes"], _metrics(tmp_path)["modes"]
    for name in ("fp32", "bf16-halfadam"):
        assert a[name]["train_loss"] == b[name]["train_loss"]
        assert a[name]["val_loss"] == b[name]["val_loss"]


def test_digits_with_schedule_and_weight_decay(tmp_path, capsys):
    pytest.importorskip("sklearn")
    rc = main(["train", "--task", "digits", "--steps", "8", "--batch-size", "16", "--eval-every", "4",
               "--modes", "fp32,bf16-naive,bf16-halfadam", "--lr-schedule", "cosine", "--weight-decay", "0.1",
               "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    metrics = _metrics(tmp_path)
    assert list(metrics["modes"]) == ["fp32", "bf16-naive", "bf16-halfadam"]
    cfg = metrics["config"]
    assert cfg["task"] == "digits" and cfg["lr_schedule"] == "cosine" and cfg["weight_decay"] == 0.1
    assert cfg["warmup_steps"] == 1
    for m in metrics["modes"].values():
        assert all(math.isfinite(v) for v in m["train_loss"] + m["val_loss"])
    assert metrics["modes"]["bf16-halfadam"]["optimizer_state_bytes_per_param"] == 12
    assert (tmp_path / "loss.png").is_file()


def _env() -> dict:
    """The environment of a ``python -m halfadam`` subprocess: this checkout's halfadam, not an installed one."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    return {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}


def test_python_m_halfadam_subprocess(text_file, tmp_path):
    env = _env()
    proc = subprocess.run(
        [sys.executable, "-m", "halfadam", "train", "--text", str(text_file), "--out", str(tmp_path),
         "--modes", "fp32,fp16-halfadam", *TINY],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert proc.returncode == 0, proc.stderr
    metrics = _metrics(tmp_path)
    assert list(metrics["modes"]) == ["fp32", "fp16-halfadam"]
    assert metrics["modes"]["fp16-halfadam"]["optimizer_state_bytes_per_param"] == 12
    assert (tmp_path / "loss.png").is_file()
    assert "Traceback" not in proc.stderr

    bad = subprocess.run([sys.executable, "-m", "halfadam", "train", "--steps", "-3"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1 and "--steps" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--text", "/no/such/file.txt"], "text file not found"),
        (["--modes", "fp32,fp8-magic"], "unknown mode 'fp8-magic'"),
        (["--modes", ""], "no modes"),
        (["--task", "imagenet"], "invalid choice"),
        (["--steps", "-5"], "positive integer"),
        (["--steps", "many"], "positive integer"),
        (["--lr", "0"], "positive number"),
        (["--weight-decay", "-1"], "non-negative number"),
        (["--device", "tpu"], "device"),
        (["--heads", "3"], "divisible"),
        (["--lr-schedule", "cosine", "--steps", "5", "--warmup-steps", "5"], "warmup"),
        (["--task", "digits", "--text", "x.txt"], "--text only applies"),
        (["--task", "digits", "--batch-size", "15", "--nproc", "2"], "--batch-size 15 must be divisible by --nproc 2"),
        (["--nproc", "0"], "positive integer"),
        (["--dist", "fsdp", "--peers"], "--dist fsdp runs without the peer modes"),
        (["--dist", "zero"], "invalid choice"),
    ],
)
def test_errors_are_one_line(args, expected, tmp_path, capsys):
    rc = main(["train", "--out", str(tmp_path / "out"), "--no-progress", *args])
    err = capsys.readouterr().err
    assert rc != 0
    assert err.count("\n") == 1 and err.startswith("halfadam train: error:"), err
    assert expected in err
    assert "Traceback" not in err


def test_text_too_short(tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("hello world\n")
    assert main(["train", "--text", str(short), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "too short" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_cuda(tmp_path, capsys):
    assert main(["train", "--device", "cuda", "--out", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "CUDA is not available" in err


def test_usage_errors_and_help(capsys):
    assert main([]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert main(["frobnicate"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert main(["train", "--help"]) == 0
    assert "--modes" in capsys.readouterr().out


def test_parse_modes():
    assert [m.name for m in parse_modes("all")] == ALL_MODES
    assert [m.name for m in parse_modes(" bf16-halfadam, fp32 ,bf16-halfadam")] == ["bf16-halfadam", "fp32"]
    with pytest.raises(ValueError, match="unknown mode"):
        parse_modes("fp64")


def test_optimizer_state_bytes_counts_per_element_state():
    p = torch.nn.Parameter(torch.zeros(10, 3))
    opt = torch.optim.AdamW([p])
    p.grad = torch.ones_like(p)
    opt.step()
    assert optimizer_state_bytes(opt) == 2 * 30 * 4  # exp_avg + exp_avg_sq; the 0-d step is not counted


# --save / --resume ------------------------------------------------------------------------------
RESUME_ARGS = ["train", "--task", "digits", "--steps", "12", "--eval-every", "3", "--lr-schedule", "cosine",
        "--warmup-steps", "2", "--no-progress"]


def test_resume_continues_the_loss_curve_exactly(tmp_path, monkeypatch):
    assert main(RESUME_ARGS + ["--out", str(tmp_path / "full")]) == 0
    # A run that stops after its step-6 checkpoint (diverged modes save when they diverge).
    save = T._save_mode
    monkeypatch.setattr(T, "_save_mode", lambda cfg, mode, *rest: save(cfg, mode, *rest)
                        if len(rest[-1]["train_loss"]) == 6 or rest[-1]["diverged_at"] is not None else None)
    assert main(RESUME_ARGS + ["--out", str(tmp_path / "part"), "--save", str(tmp_path / "ck"), "--save-every", "3"]) == 0
    monkeypatch.setattr(T, "_save_mode", save)
    assert main(RESUME_ARGS + ["--out", str(tmp_path / "resumed"), "--resume", str(tmp_path / "ck")]) == 0
    full = json.loads((tmp_path / "full" / "metrics.json").read_text())["modes"]
    resumed = json.loads((tmp_path / "resumed" / "metrics.json").read_text())["modes"]
    for name in full:
        for key in ("train_loss", "val_steps", "val_loss", "weight_distance_to_fp32",
                    "master_weight_distance_to_fp32", "final_loss_scale", "skipped_steps", "diverged_at_step"):
            assert str(full[name].get(key)) == str(resumed[name].get(key)), (name, key)


def test_bad_resume_is_one_line_without_traceback(tmp_path, capsys):
    ck = tmp_path / "ck"
    assert main(RESUME_ARGS + ["--modes", "bf16-halfadam", "--out", str(tmp_path / "a"), "--save", str(ck)]) == 0
    capsys.readouterr()
    (ck / "bf16-halfadam.pt").write_bytes((ck / "bf16-halfadam.pt").read_bytes()[:1000])  # truncated
    assert main(RESUME_ARGS + ["--modes", "bf16-halfadam", "--out", str(tmp_path / "b"), "--resume", str(ck)]) == 2
    err = capsys.readouterr().err
    assert "cannot be read" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert main(RESUME_ARGS + ["--modes", "fp32", "--out", str(tmp_path / "b"), "--resume", str(ck)]) == 2
    assert "no checkpoint at" in capsys.readouterr().err
    assert main(RESUME_ARGS + ["--modes", "bf16-halfadam", "--out", str(tmp_path / "c"), "--save", str(ck)]) == 0
    assert main(RESUME_ARGS + ["--modes", "bf16-halfadam", "--lr", "0.01", "--out", str(tmp_path / "d"),
                        "--resume", str(ck)]) == 2
    assert "written with other options (--lr)" in capsys.readouterr().err


EXTEND_ARGS = ["train", "--task", "digits", "--batch-size", "16", "--eval-every", "2", "--no-progress",
               "--modes", "fp32,fp16-halfadam,bf16-halfadam"]


def test_resume_with_more_steps_extends_the_run_exactly(tmp_path, capsys):
    pytest.importorskip("sklearn")
    assert main(EXTEND_ARGS + ["--steps", "4", "--out", str(tmp_path / "full")]) == 0
    assert main(EXTEND_ARGS + ["--steps", "2", "--out", str(tmp_path / "part"), "--save", str(tmp_path / "ck")]) == 0
    assert main(EXTEND_ARGS + ["--steps", "4", "--out", str(tmp_path / "longer"), "--resume", str(tmp_path / "ck"),
                               "--save", str(tmp_path / "ck")]) == 0
    full, longer = _metrics(tmp_path / "full"), _metrics(tmp_path / "longer")
    assert longer["config"]["steps"] == 4
    for name, m in full["modes"].items():
        assert len(m["train_loss"]) == 4 and m["val_steps"] == [0, 2, 4]
        for key in ("train_loss", "val_steps", "val_loss", "weight_distance_to_fp32", "val_loss_vs_fp32_percent",
                    "master_weight_distance_to_fp32", "final_loss_scale", "skipped_steps", "diverged_at_step"):
            assert str(m.get(key)) == str(longer["modes"][name].get(key)), (name, key)
    # the checkpoints now hold the 4-step run: fewer steps than that are refused as before
    capsys.readouterr()
    assert main(EXTEND_ARGS + ["--steps", "3", "--out", str(tmp_path / "x"), "--resume", str(tmp_path / "ck")]) == 2
    assert capsys.readouterr().err == (f"halfadam train: error: --resume {tmp_path / 'ck' / 'fp32.pt'}: written with "
                                       f"other options (--steps); --steps can only grow from its 4\n")


def _extension(run, saved, done):
    """(cfg of the options ``run``, the checkpoint entries of a run with the options ``saved`` after ``done`` steps)"""
    base = ["train", "--task", "digits", "--no-progress"]
    cfg, _ = T.resolve_config(build_parser().parse_args(base + run))
    old, _ = T.resolve_config(build_parser().parse_args(base + saved))
    return cfg, {"config": T._run_identity(old), "history": {"train_loss": [1.0] * done}, "rng": torch.get_rng_state()}


def test_extending_a_run_keeps_the_learning_rates_of_the_steps_taken(tmp_path):
    path = tmp_path / "fp32.pt"
    # constant rate: any longer run, whatever --eval-every (its default follows --steps)
    cfg, entries = _extension(["--steps", "600"], ["--steps", "300"], 300)
    assert (cfg.eval_every, entries["config"]["eval_every"]) == (60, 30)
    T._check_resumed_options(cfg, path, entries)
    # cosine: the warm-up (and its last step, at the peak) does not depend on --steps; the decay does
    cosine = ["--lr-schedule", "cosine", "--warmup-steps", "3"]
    cfg, entries = _extension(["--steps", "20", *cosine], ["--steps", "10", *cosine], 4)
    T._check_resumed_options(cfg, path, entries)
    cfg, entries = _extension(["--steps", "20", *cosine], ["--steps", "10", *cosine], 5)
    with pytest.raises(T.CLIError) as info:
        T._check_resumed_options(cfg, path, entries)
    assert str(info.value) == (f"--resume {path}: --steps 20 changes the learning rates of the 5 steps already taken "
                               f"(--lr-schedule cosine decays over the checkpoint's --steps 10), so it cannot extend "
                               f"that run: resume with --steps 10, or start a new run")
    cfg, entries = _extension(["--steps", "20", "--lr-schedule", "cosine"], ["--steps", "10", *cosine], 1)
    T._check_resumed_options(cfg, path, entries)  # a default --warm-up of 2 instead of 3: the same rate 0 at step 0
    cfg, entries = _extension(["--steps", "20", "--lr", "0.1"], ["--steps", "10"], 10)
    with pytest.raises(T.CLIError, match=r"written with other options \(--lr\)$"):
        T._check_resumed_options(cfg, path, entries)
    del entries["rng"]
    with pytest.raises(T.CLIError, match="a halfadam checkpoint, but not one written by halfadam train --save"):
        T._check_resumed_options(cfg, path, entries)


def test_resume_from_a_file_that_is_not_a_checkpoint_is_refused_before_training(tmp_path, capsys, monkeypatch):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "bf16-halfadam.pt").write_text("not a checkpoint\n")
    monkeypatch.setattr(T, "train_mode", lambda *a, **k: pytest.fail("trained despite a bad --resume"))
    assert main(RESUME_ARGS + ["--modes", "fp32,bf16-halfadam", "--out", str(tmp_path / "o"), "--resume", str(ck)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"halfadam train: error: --resume: {ck / 'bf16-halfadam.pt'} is not a halfadam checkpoint "
                            f"(not a file written by torch.save)\n")


def test_unwritable_save_dir_fails_before_training(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(T, "train_mode", lambda *a, **k: pytest.fail("trained despite an unwritable --save"))
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(RESUME_ARGS + ["--out", str(tmp_path / "o"), "--save", str(blocker / "ck")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"halfadam train: error: --save {blocker / 'ck'}: cannot create the directory: "
                            f"Not a directory\n")
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert main(RESUME_ARGS + ["--out", str(tmp_path / "o"), "--save", str(locked)]) == 2
        assert capsys.readouterr().err == (f"halfadam train: error: --save {locked}: cannot write files there: "
                                           f"Permission denied\n")


# --nproc: data-parallel processes (DDP over gloo) ------------------------------------------------
NPROC_ARGS = ["train", "--task", "digits", "--steps", "6", "--batch-size", "16", "--eval-every", "3", "--no-progress"]


@needs_gloo
@pytest.mark.distributed
def test_nproc_2_matches_one_process(tmp_path, capfd):
    pytest.importorskip("sklearn")
    assert main(NPROC_ARGS + ["--out", str(tmp_path / "one")]) == 0
    capfd.readouterr()
    assert main(NPROC_ARGS + ["--out", str(tmp_path / "two"), "--nproc", "2"]) == 0
    out = capfd.readouterr().out  # both processes write to this stdout: only rank 0 prints
    assert out.count("wrote ") == 2 and out.count("halfadam train: digits") == 1
    assert "data-parallel: 2 processes (DDP, gloo), 8 per process per step" in out
    one, two = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    assert one["config"]["nproc"] == 1 and two["config"]["nproc"] == 2
    assert (tmp_path / "two" / "loss.png").is_file()
    assert list(two["modes"]) == ALL_MODES

    def rel(a, b):
        return max(abs(x - y) / abs(x) for x, y in zip(a, b))

    for name, m in two["modes"].items():
        ref = one["modes"][name]
        assert m["diverged_at_step"] == ref["diverged_at_step"], name  # fp16-naive: nan after step 1, as alone
        if ref["diverged_at_step"] is not None:
            continue
        assert len(m["train_loss"]) == 6 and m["val_steps"] == [0, 3, 6]
        assert all(math.isfinite(v) for v in m["train_loss"] + m["val_loss"]), name
        assert m["val_loss"][0] == ref["val_loss"][0]  # same initialisation on every rank
        # The same global batches and averaged gradients: only the summation order differs (each rank
        # sums its half of the batch). float32 agrees to ~1e-7 relative after 6 AdamW steps; half
        # gradients are rounded per rank before the all-reduce, so half modes agree to ~1e-4 (bf16).
        tol = 1e-5 if name == "fp32" else 2e-3
        assert rel(ref["train_loss"], m["train_loss"]) < tol, name
        assert rel(ref["val_loss"], m["val_loss"]) < tol, name
    # each rank's loss is its share of the global mean and DDP sums: the scaler sees what one process sees
    assert two["modes"]["fp16-halfadam"]["skipped_steps"] == one["modes"]["fp16-halfadam"]["skipped_steps"]
    assert two["modes"]["fp16-halfadam"]["final_loss_scale"] == one["modes"]["fp16-halfadam"]["final_loss_scale"]


@needs_gloo
@pytest.mark.distributed
def test_nproc_2_fsdp_matches_one_process(tmp_path, capfd):
    """--dist fsdp: every mode sharded by FSDP2 (compact's per-block state included) trains as one
    process does, up to the summation order, and reports the job's total state bytes."""
    pytest.importorskip("sklearn")
    assert main(NPROC_ARGS + ["--out", str(tmp_path / "one")]) == 0
    capfd.readouterr()
    assert main(NPROC_ARGS + ["--out", str(tmp_path / "two"), "--nproc", "2", "--dist", "fsdp"]) == 0
    out = capfd.readouterr().out
    assert "data-parallel: 2 processes (FSDP2: parameters, gradients and optimizer state sharded, gloo)" in out
    one, two = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    assert two["config"]["dist"] == "fsdp" and list(two["modes"]) == ALL_MODES
    for name, m in two["modes"].items():
        ref = one["modes"][name]
        assert m["diverged_at_step"] == ref["diverged_at_step"], name
        assert m["optimizer_state_bytes_per_param"] == ref["optimizer_state_bytes_per_param"], name
        if ref["diverged_at_step"] is None:
            assert m["val_loss"][0] == ref["val_loss"][0]
            tol = 1e-5 if name == "fp32" else 2e-3
            assert max(abs(x - y) / abs(y) for x, y in zip(m["val_loss"], ref["val_loss"])) < tol, name
    assert two["modes"]["fp16-halfadam"]["skipped_steps"] == one["modes"]["fp16-halfadam"]["skipped_steps"]


@needs_gloo
@pytest.mark.distributed
def test_nproc_2_fsdp_saves_and_resumes_through_dcp(tmp_path, capfd):
    """--dist fsdp --save writes one DCP directory per mode (every rank its shards, with the SHA-256
    manifest); --resume continues it to the uninterrupted run's numbers exactly; a corrupt shard is one
    line naming the file, before any mode trains."""
    pytest.importorskip("sklearn")
    args = NPROC_ARGS[:-1] + ["--modes", "fp32,fp16-halfadam,bf16-halfadam-compact", "--nproc", "2", "--dist",
                              "fsdp", "--no-progress"]  # fp32: torch.optim.AdamW, DCP's own way
    steps = args.index("--steps") + 1
    full_args = args[:steps] + ["6"] + args[steps + 1:]
    part_args = args[:steps] + ["3"] + args[steps + 1:]
    assert main(full_args + ["--out", str(tmp_path / "full")]) == 0
    assert main(part_args + ["--out", str(tmp_path / "part"), "--save", str(tmp_path / "ck")]) == 0
    ck = tmp_path / "ck" / "bf16-halfadam-compact.dcp"
    assert {"halfadam.sha256", ".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(os.listdir(ck))
    capfd.readouterr()
    assert main(full_args + ["--out", str(tmp_path / "resumed"), "--resume", str(tmp_path / "ck")]) == 0
    full, resumed = _metrics(tmp_path / "full")["modes"], _metrics(tmp_path / "resumed")["modes"]
    for name in full:
        for key in ("train_loss", "val_steps", "val_loss", "weight_distance_to_fp32", "final_loss_scale",
                    "skipped_steps"):
            assert str(full[name].get(key)) == str(resumed[name].get(key)), (name, key)
    data = bytearray((ck / "__1_0.distcp").read_bytes())
    data[len(data) // 2] ^= 4
    (ck / "__1_0.distcp").write_bytes(bytes(data))
    capfd.readouterr()
    assert main(full_args + ["--out", str(tmp_path / "bad"), "--resume", str(tmp_path / "ck")]) == 2
    out, err = capfd.readouterr()
    assert f"halfadam train: error: --resume: cannot load the checkpoint {ck}" in err, err
    assert "__1_0.distcp: its SHA-256 differs" in err and "Traceback" not in err, err
    assert "halfadam train: digits" not in out  # refused before the run began (its modes come first)


def test_fsdp_in_one_process_says_so(tmp_path, capsys):
    pytest.importorskip("sklearn")
    assert main(NPROC_ARGS + ["--modes", "fp32", "--dist", "fsdp", "--steps", "2", "--out", str(tmp_path)]) == 0
    assert "--dist fsdp in one process: nothing is sharded" in capsys.readouterr().out


@needs_gloo
@pytest.mark.distributed
def test_torchrun_runs_the_same_job(tmp_path):
    """Under torchrun (no --nproc) each process trains as one rank of the job: it must not spawn its own."""
    import halfadam

    pytest.importorskip("sklearn")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "halfadam",
           *NPROC_ARGS, "--modes", "fp32,bf16-halfadam-compact", "--dist", "fsdp", "--out", str(tmp_path)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(halfadam.__file__).parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count("halfadam train: digits") == 1
    assert "data-parallel: 2 processes (FSDP2" in proc.stdout
    assert _metrics(tmp_path)["config"]["nproc"] == 2


def _crash_on_rank_1(rank, world, args, error_dir):
    """Stands in for train._run_rank in the spawned processes: rank 1 fails while loading its data."""
    build = T.build_task

    def broken(cfg):
        if rank == 1:
            raise RuntimeError("boom on rank 1\nmore detail")
        return build(cfg)

    T.build_task = broken
    T._run_rank(rank, world, args, error_dir)  # a fresh process: the real one, not this stand-in


@needs_gloo
@pytest.mark.distributed
def test_nproc_failures_are_one_line(tmp_path, capfd, monkeypatch):
    pytest.importorskip("sklearn")
    # A CLIError in the processes (every rank finds no checkpoint) is the usual one line, status 2.
    assert main(NPROC_ARGS + ["--nproc", "2", "--out", str(tmp_path), "--resume", str(tmp_path / "none")]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("halfadam train: error: --resume: no checkpoint at"), err
    # Any other exception in one process: the others are stopped, one line naming it, status 1.
    monkeypatch.setattr(T, "_run_rank", _crash_on_rank_1)
    assert main(NPROC_ARGS + ["--nproc", "2", "--out", str(tmp_path)]) == 1
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("halfadam train: error: process 1 of --nproc 2 failed: RuntimeError: boom on rank 1 ("), err


def test_resume_after_a_kill_in_an_earlier_mode_equals_an_uninterrupted_run(tmp_path, monkeypatch, capsys):
    args = RESUME_ARGS + ["--steps", "6"]
    assert main(args + ["--out", str(tmp_path / "full")]) == 0
    # Killed right after fp16-halfadam's step-3 checkpoint: the modes before it finished and saved, the ones
    # after it (bf16-halfadam, bf16-halfadam-compact, bf16-halfadam-tiny) never started and have no checkpoint.
    save = T._save_mode

    def save_then_die(cfg, mode, *rest):
        save(cfg, mode, *rest)
        if mode.name == "fp16-halfadam" and len(rest[-1]["train_loss"]) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(T, "_save_mode", save_then_die)
    ck = tmp_path / "ck"
    assert main(args + ["--out", str(tmp_path / "part"), "--save", str(ck), "--save-every", "3"]) == 130
    monkeypatch.setattr(T, "_save_mode", save)
    never_started = ("bf16-halfadam", "bf16-halfadam-compact", "bf16-halfadam-tiny")
    assert sorted(p.name for p in ck.iterdir()) == [f"{m}.pt" for m in sorted(ALL_MODES) if m not in never_started]
    capsys.readouterr()
    assert main(args + ["--out", str(tmp_path / "resumed"), "--resume", str(ck)]) == 0
    assert "no checkpoint yet, so from scratch: bf16-halfadam, bf16-halfadam-compact, bf16-halfadam-tiny" in capsys.readouterr().out
    full, resumed = _metrics(tmp_path / "full")["modes"], _metrics(tmp_path / "resumed")["modes"]
    assert list(resumed) == ALL_MODES
    for name in full:
        for key in ("train_loss", "val_steps", "val_loss", "weight_distance_to_fp32", "val_loss_vs_fp32_percent",
                    "master_weight_distance_to_fp32", "final_loss_scale", "skipped_steps", "diverged_at_step"):
            assert str(full[name].get(key)) == str(resumed[name].get(key)), (name, key)


@pytest.mark.skipif(not hasattr(__import__("signal"), "SIGXFSZ"), reason="no file-size limits here")
def test_save_failure_is_one_line_exit_2(text_file, tmp_path):
    import resource
    import signal

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, resource.RLIM_INFINITY))

    ck = tmp_path / "ck"
    env = {**_env(), "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "halfadam", "train", "--text", str(text_file), "--out", str(tmp_path / "out"),
         "--modes", "bf16-halfadam", "--save", str(ck), *TINY],
        capture_output=True, text=True, timeout=120, env=env, preexec_fn=limit_file_size,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"halfadam train: error: --save {ck}: cannot write the checkpoint "
                                  f"{ck / 'bf16-halfadam.pt'}: File too large"), proc.stderr
    # no temporary file left, and the directories the run created, left empty, are removed (issue 37)
    assert not ck.exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["bench", "--help"]])
def test_help_is_plain_text(argv, capsys):
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "``" not in out and ":func:" not in out and ":class:" not in out, out
    if argv == ["--help"]:
        assert "The halfadam command line: halfadam <command> [options]." in out


README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_quick_start_runs_as_written(tmp_path, monkeypatch):
    text = README.read_text()
    snippet = text.split("## Quick start", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    exec(compile(snippet, "README Quick start", "exec"), {})
    assert (tmp_path / "fp32.pt").is_file()


def test_readme_checkpoint_example_runs_as_written(tmp_path, monkeypatch):
    """The "Checkpoints that never lose precision" example continues the Quick start (its model, opt,
    scaler) and runs as written: the step it saves comes back, and the fp32 export loads without loss."""
    text = README.read_text()
    quick = text.split("## Quick start", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    example = text.split("## Checkpoints that never lose precision", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(quick, "README Quick start", "exec"), namespace)
    with pytest.warns(UserWarning, match="master weights rebuilt"):  # loading torch's state_dict, as it says
        exec(compile(example, "README checkpoint example", "exec"), namespace)
    opt, model = namespace["opt"], namespace["model"]
    assert namespace["step"] == opt.param_groups[0]["global_step"] > 0
    assert (tmp_path / "ckpt.pt").is_file()
    saved = torch.load(tmp_path / "fp32.pt", weights_only=True)  # the fp32 export, loaded back without loss
    for name, p in model.named_parameters():
        assert saved[name].dtype == torch.float32 and torch.equal(opt.master_weight(p), saved[name])


def test_readme_digits_figures(tmp_path, capsys):
    """The README's `halfadam train --task digits` table is what the command gives (up to CPU rounding)."""
    pytest.importorskip("sklearn")
    table = README.read_text().split("`halfadam train --task digits`", 1)[1].split("```", 2)[1]
    rows = {line.split()[0]: line.split() for line in table.splitlines() if line.split()[:1] in ([m] for m in ALL_MODES)}
    assert list(rows) == ALL_MODES
    assert main(["train", "--task", "digits", "--out", str(tmp_path), "--no-progress"]) == 0
    modes = _metrics(tmp_path)["modes"]
    for name, row in rows.items():
        m = modes[name]
        if m["diverged_at_step"] is not None:
            assert row[2] == f"nan@{m['diverged_at_step']}", name
            continue
        # loose enough for another CPU's rounding (AVX2 vs AVX-512 matmul order), tight enough for the claims
        assert abs(float(row[2]) - m["final_val_loss"]) <= 2e-3, name
        # stochastic rounding (the compact and tiny states) draws other bits once values differ by an ulp: on digits
        # a draw moves the validation loss by about 1% (docs/research/compact-state)
        tolerance = 1.5 if name.endswith(("-compact", "-tiny")) else 0.3
        assert abs(float(row[3].rstrip("%")) - m["val_loss_vs_fp32_percent"]) <= tolerance, name


# -- issue 37, item 7: the names a user has seen, --help without torch, no bar redraws off a terminal, no
# -- empty folder after a failed run, the kernel's build message on its own line

@pytest.mark.parametrize(("alias", "canonical"), [
    ("tiny", "bf16-halfadam-tiny"), ("compact", "bf16-halfadam-compact"), ("Tiny", "bf16-halfadam-tiny"),
    ("halfadam-tiny", "bf16-halfadam-tiny"), ("bfloat16-halfadam", "bf16-halfadam"),
    ("float16-halfadam", "fp16-halfadam"), ("float32", "fp32"), ("bfloat16-naive", "bf16-naive"),
    ("tiny,compact,bf16-halfadam-tiny", "bf16-halfadam-tiny,bf16-halfadam-compact"),
])
def test_mode_aliases_are_the_canonical_modes(alias, canonical):
    assert parse_modes(alias) == parse_modes(canonical)
    assert build_parser().parse_args(["train", "--modes", alias]).modes == parse_modes(canonical)


@pytest.mark.parametrize(("name", "expected"), [
    ("naive", "mode 'naive' is ambiguous: it stands for fp16-naive, bf16-naive (give one of them)"),
    ("halfadam", "mode 'halfadam' is ambiguous: it stands for fp16-halfadam, bf16-halfadam, bf16-halfadam-compact, "
                 "bf16-halfadam-tiny"),
    ("split", "short names: compact = bf16-halfadam-compact, tiny = bf16-halfadam-tiny); no halfadam train mode "
              "keeps state_mode='split' (halfadam bench --state-modes split times it)"),
    ("fp64", "unknown mode 'fp64' (choose from fp32, fp16-naive,"),
])
def test_ambiguous_or_unknown_modes_say_which_names_mean_what(name, expected, capsys, tmp_path):
    assert main(["train", "--modes", name, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv", [["--help"], *([name, "--help"] for name in COMMANDS)])
def test_help_does_not_import_torch(argv):
    """--help answers at once: neither ``import halfadam.cli`` nor any command's help imports torch (2-3 s)."""
    code = ("import sys; from halfadam.cli import main; status = main(sys.argv[1:]); "
            "heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'numpy', 'tqdm'))); "
            "print('HEAVY', heavy); raise SystemExit(status)")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60, env=_env())
    assert proc.returncode == 0, proc.stderr
    assert "usage: halfadam" in proc.stdout and proc.stdout.splitlines()[-1] == "HEAVY []", proc.stdout[-500:]


def test_the_package_still_offers_its_names():
    """halfadam's names are imported on first use (so that --help needs no torch) and are the same objects."""
    import halfadam
    from halfadam.optimizer import AdamW

    assert halfadam.AdamW is AdamW and "AdamW" in dir(halfadam)
    assert halfadam.checkpoint.__name__ == "halfadam.checkpoint"
    assert halfadam.encodings.BLOCK == 128  # a submodule, as when the package imported them all
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        halfadam.nothing  # noqa: B018


@pytest.mark.parametrize("nested", [False, True])
def test_a_failed_run_leaves_no_empty_folder(text_file, tmp_path, capsys, nested):
    """A missing --text fails before anything is created; a text too short fails after the folders were made,
    and they go again (the parents the run created too); a folder that was there before stays."""
    out = tmp_path / "a" / "b" / "run" if nested else tmp_path / "run"
    save = tmp_path / "ck"
    assert main(["train", "--text", str(tmp_path / "missing.txt"), "--out", str(out), "--save", str(save)]) == 2
    assert "text file not found" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    short = tmp_path / "short.txt"
    short.write_text("hello world\n")
    assert main(["train", "--text", str(short), "--out", str(out), "--save", str(save), "--no-progress"]) == 2
    assert "too short" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["short.txt"]
    out.mkdir(parents=True)
    assert main(["train", "--text", str(short), "--out", str(out), "--no-progress"]) == 2
    assert out.is_dir()  # there before the run: kept


def _tiny_train(text_file, tmp_path, *extra):
    return main(["train", "--text", str(text_file), "--out", str(tmp_path / "out"), "--modes", "fp32",
                 *[a for a in TINY if a != "--no-progress"], *extra])


def test_no_bar_redraws_when_stderr_is_not_a_terminal(text_file, tmp_path, capsys):
    """stderr captured (not a tty): no progress bar, no '\\r' redraws; one summary line per mode instead."""
    assert _tiny_train(text_file, tmp_path) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "it/s" not in err and "step/s" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].lstrip().startswith("fp32: 6 steps in ") and ", val " in lines[0], lines


class _Terminal:
    """A text stream that says it is a terminal, collecting what is written."""

    def __init__(self):
        self.text = ""

    def write(self, s):
        self.text += s
        return len(s)

    def flush(self):
        pass

    def isatty(self):
        return True


def test_a_terminal_gets_the_bar(text_file, tmp_path, monkeypatch):
    """The same run on a terminal draws the bar (so the test above can tell the two apart)."""
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert _tiny_train(text_file, tmp_path) == 0
    assert "\r" in terminal.text and "6/6" in terminal.text and "fp32: 6 steps in" not in terminal.text


def test_a_log_line_during_the_bar_is_a_line_of_its_own(monkeypatch):
    """A ``halfadam`` warning while a bar is drawn (the C++ kernel's build message) is written on a line of its
    own, not after the bar's text, as Python's last-resort handler would."""
    import logging

    from tqdm import tqdm

    from halfadam.cli.loop import _log_above

    logger = logging.getLogger("halfadam")
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logging.root, "handlers", [])  # as outside pytest: nothing configured
    message = "halfadam: compiling the C++ CPU kernel (a minute or two)"
    for redirect, own_line in ((True, True), (False, False)):
        terminal = _Terminal()
        monkeypatch.setattr(sys, "stderr", terminal)
        monkeypatch.setattr(logging, "lastResort", logging._StderrHandler(logging.WARNING))
        bar = tqdm(range(3), desc="bf16-halfadam", file=terminal, disable=None)
        with _log_above(bar) if redirect else __import__("contextlib").nullcontext():
            for _ in bar:
                logger.warning(message)
                break
        bar.close()
        pieces = terminal.text.replace("\r", "\n").split("\n")
        assert (message in pieces) == own_line, terminal.text
        assert any(message in piece for piece in pieces)
