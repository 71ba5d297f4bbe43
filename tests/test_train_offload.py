"""``halfadam train --offload cpu``: FSDP2's CPUOffloadPolicy in one process (a one-rank gloo group), the
same losses bit for bit as ``--dist fsdp`` without offloading, host and device bytes per parameter measured
from the process, and ``--dist ddp`` refused before anything is created."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from halfadam.cli import main
from conftest import needs_gloo

ARGS = ["train", "--task", "digits", "--steps", "3", "--batch-size", "16", "--eval-every", "3", "--no-progress",
        "--modes", "fp32,bf16-halfadam-tiny,bf16-halfadam-compact"]


def _metrics(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())


@needs_gloo
def test_offload_cpu_matches_fsdp_and_measures_memory(tmp_path, capsys):
    pytest.importorskip("sklearn")
    assert main(ARGS + ["--offload", "cpu", "--out", str(tmp_path / "off")]) == 0
    out = capsys.readouterr().out
    assert "--offload cpu in one process: FSDP2 on a one-rank process group" in out
    assert "pin_memory=False" in out
    assert not torch.distributed.is_initialized()  # the one-rank group is gone with the run
    off = _metrics(tmp_path / "off")
    assert off["config"]["offload"] == "cpu" and off["config"]["dist"] == "fsdp"
    for name, m in off["modes"].items():
        mem = m["memory_measured"]
        assert mem["after_steps"] == 3 and mem["processes"] == 1, name
        assert isinstance(mem["host_resident_added_bytes"], int), name  # read from /proc/self/status
        assert mem["host_bytes_per_param"] == mem["host_resident_added_bytes"] / off["model"]["parameters"]
        assert mem["device_bytes_per_param"] is None  # on the CPU the device is the host
        line = next(line for line in out.splitlines() if line.startswith(name + " ") and "measured: host" in line)
        assert f"host {mem['host_bytes_per_param']:.2f} B/param" in line and "device the host (CPU run)" in line

    assert main(ARGS + ["--dist", "fsdp", "--out", str(tmp_path / "fsdp")]) == 0
    out = capsys.readouterr().out
    assert "measured: host" not in out  # only --offload measures
    ref = _metrics(tmp_path / "fsdp")
    for name, m in off["modes"].items():  # bit for bit: JSON keeps every float's shortest exact repr
        assert m["train_loss"] == ref["modes"][name]["train_loss"], name
        assert m["val_loss"] == ref["modes"][name]["val_loss"], name
        assert m["optimizer_state_bytes_per_param"] == ref["modes"][name]["optimizer_state_bytes_per_param"], name


@pytest.mark.parametrize("dist", ["ddp"])
def test_offload_with_ddp_is_refused(dist, tmp_path, capsys):
    out = tmp_path / "runs" / "off"
    assert main(["train", "--task", "digits", "--offload", "cpu", "--dist", dist, "--out", str(out),
                 "--save", str(tmp_path / "ckpt"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("halfadam train: error:"), err
    assert "--offload cpu" in err and "--dist ddp" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "ckpt").exists()
