"""`halfadam bench` (src/halfadam/bench.py), at toy sizes."""

import argparse
import json

from halfadam import bench


def test_bench_json_rows(capsys):
    argv = ["--sizes", "20000", "--tensors", "4", "--no-small", "--impls", "reference,foreach",
            "--dtypes", "fp16,fp32", "--warmup", "1", "--repeat", "2", "--json"]
    assert bench.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    impls = {(r["impl"], r["dtype"]) for r in rows}
    assert ("torch fused", "fp32") in impls and ("halfadam foreach", "fp16") in impls
    assert len(rows) == 3 + 2 * 2
    for r in rows:
        assert r["ns_per_param"] > 0 and r["gb_per_s"] > 0 and r["memory_mb"] > 0
        assert abs(r["gb_per_s"] - 28 / r["ns_per_param"]) < 1e-6 * r["gb_per_s"] + 1e-9
    assert {r["vs_torch_fused"] for r in rows if r["impl"] == "torch fused"} == {1.0}


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
    assert "unknown" in capsys.readouterr().err
