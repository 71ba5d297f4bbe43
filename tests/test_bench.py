"""`halfadam bench` (src/halfadam/bench.py), at toy sizes."""

import argparse
import json

import pytest

from halfadam import bench


def test_bench_json_rows(capsys):
    argv = ["--sizes", "20000", "--tensors", "4", "--no-small", "--impls", "reference,foreach",
            "--dtypes", "fp16,fp32", "--warmup", "1", "--repeat", "2", "--json"]
    assert bench.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    impls = {(r["impl"], r["dtype"]) for r in rows}
    assert ("torch fused", "fp32") in impls and ("halfadam foreach", "fp16") in impls
    assert len(rows) == 3 + 2 * 2 * 2  # torch's three; 2 impls x 2 dtypes x state modes fp32, compact
    for r in rows:
        assert r["ns_per_param"] > 0 and r["gb_per_s"] > 0 and r["memory_mb"] > 0
        assert abs(r["gb_per_s"] - 28 / r["ns_per_param"]) < 1e-6 * r["gb_per_s"] + 1e-9
    assert {r["vs_torch_fused"] for r in rows if r["impl"] == "torch fused"} == {1.0}
    state = {(r["impl"], r["dtype"], r.get("state")): r for r in rows}
    # state bytes per parameter (20,000 elements in 4 tensors of 5,000: blocks of 128 pad each to 5,120)
    assert state[("torch fused", "fp32", None)]["state_bytes_per_param"] == 8 + 4 * 4 / 20000  # + the 0-d steps
    assert state[("halfadam foreach", "fp16", "fp32")]["state_bytes_per_param"] == 12 + 4 * 4 / 20000
    compact = 5120 / 5000 * (2 + 1 + 1) + 40 / 5000 * (1 + 4 + 4) + 4 * 4 / 20000
    assert state[("halfadam foreach", "fp16", "compact")]["state_bytes_per_param"] == pytest.approx(compact)
    assert state[("halfadam foreach", "fp32", "compact")]["vs_fp32_state"] > 0
    assert state[("halfadam foreach", "fp16", "fp32")]["vs_fp32_state"] == 1.0


def test_bench_table_and_cli_protocol(capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert isinstance(bench.HELP, str)
    args = parser.parse_args(["--sizes", "8000", "--tensors", "2", "--no-small", "--impls", "reference",
                              "--dtypes", "bf16", "--warmup", "0", "--repeat", "1"])
    assert bench.run(args) == 0
    out = capsys.readouterr().out
    assert "x torch fused" in out and "halfadam reference" in out


def test_bench_rejects_unknown_choices(capsys):
    assert bench.main(["--dtypes", "fp8"]) == 2
    assert bench.main(["--impls", "magic"]) == 2
    assert bench.main(["--state-modes", "tiny"]) == 2
    assert "unknown" in capsys.readouterr().err


def test_bench_state_modes_are_the_presets():
    from halfadam.encodings import PRESETS

    assert bench.STATE_MODES == tuple(PRESETS)
