"""examples/resume.py: a run stopped, saved and resumed in a new process ends with the bits of one that never stopped.

The reference is the same script run straight through in its own process. Every tensor of the final
state (model, optimizer, scaler, scheduler, RNG states, data position) is compared bit for bit.
A checkpoint with one entry replaced by what a run that did not restore it would hold (a fresh
scheduler, the RNG as after start-up, the first batch) must end elsewhere: the comparison sees it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

import halfadam
from halfadam.checkpoint import load_checkpoint, save_checkpoint

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "resume.py"
STEPS, STOP = 20, 11  # 8 batches an epoch: the stop is mid-epoch, and the run crosses two epoch ends
IMPL = ["--implementation", "foreach"]  # every implementation gives the same bits; this one needs no compiler
ENTRIES = {"model", "optimizer", "scaler", "scheduler", "step", "batch", "epoch_start", "rng"}


def command(*args):
    return [sys.executable, str(EXAMPLE), "--steps", str(STEPS), *IMPL, *map(str, args)]


def finished(proc):
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    return out


def losses(stdout):
    return {int(line.split()[1]): line for line in stdout.splitlines() if line.startswith("step ")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(halfadam.__file__).parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    popen = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp)
    straight = subprocess.Popen(command("--out", tmp / "straight.pt"), **popen)
    first = subprocess.Popen(command("--stop-at", STOP, "--save", tmp / "ckpt.pt"), **popen)
    straight_out, first_out = finished(straight), finished(first)
    second_out = finished(subprocess.Popen(command("--resume", tmp / "ckpt.pt", "--out", tmp / "resumed.pt"), **popen))
    return dict(tmp=tmp, straight=straight_out, first=first_out, second=second_out)


def differences(a, b, where="") -> list:
    """The paths at which ``a`` and ``b`` differ: tensors by dtype, shape and every byte."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a.reshape(-1).contiguous().view(torch.uint8),
                                                       b.reshape(-1).contiguous().view(torch.uint8)))
        return [] if same else [where]
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if set(a) != set(b):
            return [f"{where} keys"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and type(a) is type(b) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}/{i}")]
    return [] if type(a) is type(b) and a == b else [where]


def test_differences_sees_one_bit():
    x = torch.tensor([0.0, 1.0], dtype=torch.bfloat16)
    assert differences({"a": [x]}, {"a": [x.clone()]}) == []
    assert differences({"a": [x]}, {"a": [torch.tensor([-0.0, 1.0], dtype=torch.bfloat16)]}) == ["/a/0"]
    assert differences({"a": x}, {"a": x.float()}) == ["/a"]
    assert differences({"s": 3}, {"s": 4}) == ["/s"]


def test_the_resumed_run_ends_with_the_straight_runs_bits(runs):
    tmp = runs["tmp"]
    assert f"saved at step {STOP}" in runs["first"]
    assert sorted(losses(runs["second"])) == list(range(STOP + 1, STEPS + 1))  # the second process went on
    straight, resumed = load_checkpoint(tmp / "straight.pt"), load_checkpoint(tmp / "resumed.pt")
    assert set(straight) == ENTRIES
    assert straight["step"] == STEPS and straight["optimizer"]["param_groups"][0]["global_step"] == STEPS
    state = straight["optimizer"]["state"][0]  # the first weight's: tiny's packed state
    assert state["master_hi"].dtype == torch.int8 and state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.uint8
    assert differences(straight, resumed) == []
    # and every step's loss and learning rate, printed to 6 digits, as the straight run's
    straight_losses = losses(runs["straight"])
    assert [straight_losses[s] for s in range(1, STOP + 1)] == list(losses(runs["first"]).values())
    assert [straight_losses[s] for s in range(STOP + 1, STEPS + 1)] == list(losses(runs["second"]).values())


def example():
    spec = importlib.util.spec_from_file_location("resume_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def unrestored(entry, ex):
    """What a resumed run that did not restore ``entry`` would hold instead: a fresh run's."""
    model, opt, scaler, scheduler, loader, shuffle = ex.build(STEPS, "foreach")
    return {"rng": {"rng": ex.rng_states()}, "scheduler": {"scheduler": scheduler.state_dict()},
            "data": {"batch": 0, "epoch_start": shuffle.get_state()},
            "scaler": {"scaler": scaler.state_dict()}}[entry]


@contextlib.contextmanager
def rng_kept():
    """torch's and Python's RNG states as they were when the block ends (the example seeds both)."""
    python_state = random.getstate()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        random.setstate(python_state)


def in_process(ex, *args):
    """``examples/resume.py`` run in this process."""
    with rng_kept():
        ex.main(["--steps", str(STEPS), *IMPL, *map(str, args)])


def test_a_stop_at_an_epoch_end_resumes_too(runs, tmp_path):
    """Stopped after the first epoch's last batch (its order drawn, all 8 batches taken), then resumed."""
    ex = example()
    in_process(ex, "--stop-at", 8, "--save", tmp_path / "ckpt.pt")
    assert load_checkpoint(tmp_path / "ckpt.pt")["batch"] == 8
    in_process(ex, "--resume", tmp_path / "ckpt.pt", "--out", tmp_path / "out.pt")
    assert differences(load_checkpoint(runs["tmp"] / "straight.pt"), load_checkpoint(tmp_path / "out.pt")) == []


@pytest.mark.parametrize("entry, changed", [
    ("rng", "/model"),           # other dropout masks
    ("scheduler", "/model"),     # other learning rates
    ("data", "/model"),          # other batches
    ("scaler", "/scaler"),       # its growth tracker (bf16 gradients scale exactly: the weights agree)
])
def test_an_entry_not_restored_ends_elsewhere(runs, tmp_path, entry, changed):
    tmp, ex = runs["tmp"], example()
    saved = load_checkpoint(tmp / "ckpt.pt")
    with rng_kept():
        saved.update(unrestored(entry, ex))
    save_checkpoint(tmp_path / "ckpt.pt", **saved)
    in_process(ex, "--resume", tmp_path / "ckpt.pt", "--out", tmp_path / "out.pt")
    found = differences(load_checkpoint(tmp / "straight.pt"), load_checkpoint(tmp_path / "out.pt"))
    assert any(d.startswith(changed) for d in found), found


def test_the_docs_show_the_examples_lines():
    """docs/checkpoints.md's "Resuming bit for bit" quotes examples/resume.py: each of its code lines is one there."""
    section = (ROOT / "docs" / "checkpoints.md").read_text(encoding="utf-8").split("## Resuming bit for bit", 1)[1]
    quoted = section.split("```python\n", 1)[1].split("```", 1)[0]
    lines = {line.strip() for line in EXAMPLE.read_text(encoding="utf-8").splitlines()}
    shown = [line.strip() for line in quoted.splitlines() if line.strip() and not line.strip().startswith("...")]
    assert len(shown) > 10
    assert [line for line in shown if line not in lines] == []
