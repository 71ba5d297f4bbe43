"""`halfadam bench` (src/halfadam/bench.py), at toy sizes."""

import argparse
import json
import math

import pytest

from halfadam import bench


def test_bench_json_rows(capsys):
    argv = ["--sizes", "20480", "--tensors", "4", "--impls", "reference,foreach", "--state-modes", "fp32,compact",
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
    # state bytes per parameter (20,480 elements in 4 tensors of 40 rows of 128: a block per row)
    assert state[("torch fused", "fp32", None)]["state_bytes_per_param"] == 8 + 4 * 4 / 20480  # + the 0-d steps
    assert state[("halfadam foreach", "fp16", "fp32")]["state_bytes_per_param"] == 12 + 4 * 4 / 20480
    compact = (2 + 1 + 1) + (1 + 1 + 1) / 128 + 4 * 4 / 20480  # remainder, codes; tie byte and scales per block
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
    assert "x fused" in out and "halfadam reference" in out


def test_bench_state_modes_are_the_presets():
    from halfadam.encodings import PRESETS

    assert bench.STATE_MODES == tuple(PRESETS)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--threads", "0"], "argument --threads: expected a positive integer, got '0'"),
        (["--sizes", "-1"], "argument --sizes: expected positive integer parameter counts like 1M,20M or 1e6,2e7, "
                            "got '-1'"),
        (["--sizes", "0"], "argument --sizes: expected positive integer parameter counts like 1M,20M or 1e6,2e7, "
                           "got '0'"),
        (["--sizes", "abc"], "argument --sizes: expected positive integer parameter counts like 1M,20M or 1e6,2e7, "
                             "got 'abc'"),
        (["--sizes", "1e6,2.5"], "argument --sizes: expected positive integer parameter counts like 1M,20M or "
                                 "1e6,2e7, got '2.5' in '1e6,2.5'"),
        (["--sizes", "1M,1.0001k"], "got '1.0001k' in '1M,1.0001k'"),
        (["--sizes", "M"], "got 'M'"),
        (["--sizes", "1x"], "got '1x'"),
        (["--tensors", "0"], "argument --tensors: expected a positive integer, got '0'"),
        (["--repeat", "0"], "argument --repeat: expected a positive integer, got '0'"),
        (["--repeat", "-1"], "argument --repeat: expected a positive integer, got '-1'"),
        (["--warmup", "-1"], "argument --warmup: expected a non-negative integer, got '-1'"),
        (["--sizes", "10", "--tensors", "50"], "--sizes 10 is smaller than --tensors 50"),
        (["--device", "tpu"], "unknown device 'tpu'"),
        (["--dtypes", "fp8"], "--dtypes: unknown dtype 'fp8' (choose from fp16, bf16, fp32)"),
        (["--impls", "magic"], "--impls: unknown implementation 'magic'"),
        (["--state-modes", "mini"], "--state-modes: unknown state mode 'mini'"),
        (["--per-core", "--threads", "2"], "--per-core times at 1 thread: leave out --threads (got --threads 2)"),
        (["--host-cores", "2", "--host-bandwidth", "9", "--threads", "2"],
         "--host-cores (--per-core) times at 1 thread"),
        (["--host-cores", "128"], "--host-cores and --host-bandwidth go together"),
        (["--host-bandwidth", "400"], "--host-cores and --host-bandwidth go together"),
        (["--model-params", "7B"], "--model-params needs --host-cores and --host-bandwidth"),
        (["--host-bandwidth", "0"], "argument --host-bandwidth: expected a positive number of GB/s or 'here', got '0'"),
        (["--host-bandwidth", "fast"], "argument --host-bandwidth: expected a positive number of GB/s or 'here'"),
        (["--host-cores", "0"], "argument --host-cores: expected a positive integer, got '0'"),
        (["--model-params", "7.5"], "argument --model-params: expected a positive integer parameter count like 7B"),
    ],
)
def test_bad_options_are_one_line_exit_2(argv, expected, capsys, monkeypatch):
    monkeypatch.setattr(bench, "measure", lambda args: pytest.fail("measured despite bad options"))
    monkeypatch.setattr(bench, "measure_bandwidth", lambda threads: pytest.fail("measured despite bad options"))
    assert bench.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("halfadam bench: error: ") and captured.err.count("\n") == 1, captured.err
    assert expected in captured.err and "Traceback" not in captured.err


FAILING = ["--sizes", "8192", "--tensors", "2", "--no-small", "--impls", "reference", "--dtypes", "fp16,bf16",
           "--state-modes", "fp32", "--warmup", "1", "--repeat", "2"]


def _fail_when(monkeypatch, broken, on_call=1):
    """Make bench's timing of one configuration raise, for the optimizers ``broken(opt)`` picks, from their
    ``on_call``-th step on (a damaged Inductor cache entry, say)."""
    time_step, calls = bench._time_step, {}

    def timed(opt, device):
        if broken(opt):
            calls[id(opt)] = calls.get(id(opt), 0) + 1
            if calls[id(opt)] >= on_call:
                raise RuntimeError("damaged cache entry\nsecond line")
        return time_step(opt, device)

    monkeypatch.setattr(bench, "_time_step", timed)
    return calls


def test_a_failing_configuration_is_a_row_and_the_table_goes_on(capsys, monkeypatch):
    import halfadam
    import torch

    calls = _fail_when(monkeypatch, lambda opt: isinstance(opt, halfadam.AdamW)
                       and opt.param_groups[0]["params"][0].dtype == torch.float16, on_call=2)
    assert bench.main(FAILING) == 1
    captured = capsys.readouterr()
    assert list(calls.values()) == [2]  # failed in its second round, then never stepped again
    lines = captured.out.splitlines()
    assert "8192/2: 8,192 parameters in 2 tensors, cpu, " in captured.out  # the case's heading
    fp16 = [line for line in lines if "halfadam reference" in line and " fp16 " in line]
    assert len(fp16) == 1 and fp16[0].split() == ["halfadam", "reference", "fp16", "fp32", "failed:",
                                                 "RuntimeError:", "damaged", "cache", "entry"], fp16
    bf16 = [line.split() for line in lines if "halfadam reference" in line and " bf16 " in line]
    assert len(bf16) == 1 and float(bf16[0][4]) > 0  # timed: ms/step
    # torch for-loop, foreach and fused on fp32 parameters, and fused on bf16 parameters
    assert sum(line.split()[:1] == ["torch"] for line in lines) == 4
    assert captured.err == "halfadam bench: 1 of 6 configurations failed (the rows marked failed)\n"


def test_a_failing_reference_column_in_json(capsys, monkeypatch):
    import torch

    _fail_when(monkeypatch, lambda opt: type(opt) is torch.optim.AdamW and opt.defaults.get("fused")
               and opt.param_groups[0]["params"][0].dtype == torch.float32)
    assert bench.main(FAILING + ["--json"]) == 1
    captured = capsys.readouterr()
    rows = json.loads(captured.out)
    failed = [r for r in rows if "failed" in r]
    assert [(r["impl"], r["dtype"], r["failed"]) for r in failed] == [
        ("torch fused", "fp32", "RuntimeError: damaged cache entry")]
    assert "ms" not in failed[0]
    others = [r for r in rows if "failed" not in r]
    assert len(others) == 5 and all(r["ms"] > 0 and r["vs_torch_fused"] is None for r in others)
    assert captured.err.count("\n") == 1 and "1 of 6 configurations failed" in captured.err


def test_gpt_case_has_the_real_shapes():
    """--gpt: the 1.3B GPT's parameter list (GPT-3 XL sizes): 292 tensors, 1,315,723,264 elements,
    built in those shapes (here a 2-layer, width-8 one, for size)."""
    import math

    import torch

    shapes = bench.gpt_shapes()
    assert len(shapes) == 292 and sum(math.prod(s) for s in shapes) == 1_315_723_264
    small = bench.gpt_shapes(layers=2, width=8, vocab=11, context=5)
    params = bench._make_params(dict(numel=sum(math.prod(s) for s in small), tensors=len(small), shapes=small),
                                torch.bfloat16, "cpu", 0)
    assert [tuple(p.shape) for p in params] == small and all(p.grad.shape == p.shape for p in params)


def test_sizes_become_matrices_of_whole_blocks(capsys):
    """A --sizes count whose share per tensor is no whole number of blocks (1e6 / 50 = 20,000 elements,
    156.25 blocks) is timed on matrices of whole-block rows, rounded, and says so: so the per-block modes
    store their encodings (4.07 B/param in compact), as on a transformer's matrices, not the float32
    fields of 1-D tensors (12 B/param)."""
    assert bench.matrix_shapes(1_000_000, 50) == [(156, 128)] * 50
    assert bench.matrix_shapes(20_000_000, 50) == [(3125, 128)] * 50  # 400,000 elements: no rounding
    assert bench.matrix_shapes(51_200, 50) == [(1, 1024)] * 50
    assert bench.matrix_shapes(20_000, 2000) == [(10,)] * 2000  # fewer than a block: 1-D
    argv = ["--sizes", "10000", "--tensors", "4", "--no-small", "--impls", "foreach", "--dtypes", "bf16",
            "--warmup", "0", "--repeat", "1", "--json"]
    assert bench.main(argv) == 0
    captured = capsys.readouterr()
    assert ("10000/4: 10,240 parameters (10,000 asked), 4 matrices of 20 rows of 128 elements (rows of whole "
            "128-element blocks)") in captured.err
    rows = {r.get("state"): r for r in json.loads(captured.out) if r["impl"] == "halfadam foreach"}
    assert {r["numel"] for r in rows.values()} == {10_240}
    compact = (2 + 1 + 1) + (1 + 1 + 1) / 128 + 4 * 4 / 10_240  # as in test_bench_json_rows
    assert rows["compact"]["state_bytes_per_param"] == pytest.approx(compact)


def test_tiny_tensors_say_they_keep_float32_fields():
    case = bench._case("overhead", bench.matrix_shapes(20_000, 2000), 20_000)
    assert "1-D tensors of 10 elements" in bench._describe_case(case) and "12 B/param" in bench._describe_case(case)


def _args_of(monkeypatch, argv):
    """The options ``halfadam bench argv`` would time, its defaults filled in (nothing is timed)."""
    seen = []
    monkeypatch.setattr(bench, "measure", lambda args: seen.append(args) or [])
    assert bench.main(argv) == 0
    return seen[0]


def test_the_default_times_every_state_mode_on_one_small_case(monkeypatch):
    """No options: every state mode, tiny included, in the implementation a user gets (auto), on one 4M case of
    bfloat16 parameters, no many-small or overhead case (the old sweep took 4 min and 9 GB: it is --full)."""
    args = _args_of(monkeypatch, [])
    assert args.state_modes == ["fp32", "split", "bf16", "compact", "tiny"]
    assert (args.sizes, args.tensors, args.small, args.dtypes, args.impls) == ([4_000_000], 16, False, ["bf16"],
                                                                               ["auto"])
    assert [c["name"] for c in bench._cases(args)] == ["4M/16"]


def test_full_is_the_old_sweep_and_options_given_still_win(monkeypatch):
    args = _args_of(monkeypatch, ["--full"])
    assert (args.sizes, args.tensors, args.small) == ([1_000_000, 20_000_000], 50, True)
    assert args.dtypes == ["fp16", "bf16", "fp32"] and args.state_modes == ["fp32", "compact"]
    assert args.impls == ["reference", "foreach", "fused", "cpp", "triton"] and (args.warmup, args.repeat) == (2, 7)
    assert [c["name"] for c in bench._cases(args)] == ["1M/50", "20M/50", "many-small 2M/2000", bench.OVERHEAD_CASE]
    args = _args_of(monkeypatch, ["--full", "--state-modes", "tiny", "--sizes", "2M", "--no-small"])
    assert (args.state_modes, args.sizes, args.small, args.tensors) == (["tiny"], [2_000_000], False, 50)


def test_help_states_what_the_default_and_full_cost(capsys):
    from halfadam.cli import main

    assert main(["bench", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert ("Without options (5 s, up to 50 s when the cores are busy, and 0.9 GB on 2 cores): every state mode "
            "(fp32,split,bf16,compact,tiny)") in text
    assert "--full the full sweep:" in text and "(about 4 min and 9 GB on 2 cores)" in text


@pytest.mark.parametrize(("text", "sizes"), [
    ("1M", [1_000_000]), ("20M,1k", [20_000_000, 1_000]), ("1.5M", [1_500_000]), ("2.5k", [2_500]),
    ("1e6,2e7", [1_000_000, 20_000_000]), ("1000000", [1_000_000]), ("1_000", [1_000]), ("1G", [10**9]),
    (" 4m , 16K", [4_000_000, 16_000]),
])
def test_sizes_take_suffixes(text, sizes):
    assert bench._sizes(text) == sizes


def test_dtype_aliases_are_the_short_names(monkeypatch):
    """--dtypes float16,bfloat16,float32 (torch's names, in the API and the output) are fp16,bf16,fp32."""
    aliased = _args_of(monkeypatch, ["--dtypes", "float16,bfloat16,float32"])
    assert aliased.dtypes == ["fp16", "bf16", "fp32"] == _args_of(monkeypatch, ["--dtypes", "fp16,bf16,fp32"]).dtypes
    assert _args_of(monkeypatch, ["--dtypes", "BFloat16"]).dtypes == ["bf16"]


def test_block_is_the_encodings_block():
    from halfadam.encodings import BLOCK

    assert bench.BLOCK == BLOCK


def test_tables_fit_100_characters(capsys, monkeypatch):
    """Every line a table run prints fits 100 characters: the legend, the case heading and every row, tiny
    included, every dtype, and a failed row whose message is long (cut with "...")."""
    import torch

    long = "x" * 300
    time_step = bench._time_step

    def timed(opt, device):
        if type(opt) is torch.optim.AdamW and not opt.defaults.get("fused") and not opt.defaults.get("foreach"):
            raise RuntimeError(long)
        return time_step(opt, device)

    monkeypatch.setattr(bench, "_time_step", timed)
    argv = ["--sizes", "2560", "--tensors", "2", "--impls", "reference,foreach", "--dtypes", "float16,bfloat16,fp32",
            "--warmup", "0", "--repeat", "1"]
    assert bench.main(argv) == 1
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 100, max(lines, key=len)
    rows = [line.split() for line in lines]
    assert sum(r[:4] == ["halfadam", "foreach", "bf16", "tiny"] for r in rows) == 1
    assert sum(r[:2] == ["halfadam", "reference"] for r in rows) == 3 * 5  # 3 dtypes x 5 state modes
    failed = [line for line in lines if "failed: RuntimeError: xxx" in line]
    assert len(failed) == 1 and failed[0].endswith("...") and len(failed[0]) == 100
    assert lines[0].startswith("ms/step: ") and "2560/2: 2,560 parameters in 2 tensors, cpu, " in "\n".join(lines)


@pytest.fixture
def restore_threads():
    """--per-core sets torch's thread count to 1 for the process: give the other tests theirs back."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


#: Bytes one step moves per element, bf16 parameters and gradients (as bench makes them) in matrices of whole
#: 128-element blocks, derived by hand: gradient read (2), parameter read and written (2 + 2: the master-sync
#: rule reads it, the step writes it), then each state tensor read and written (x 2): fp32 master 4, split
#: remainder master_hi + master_lo 1 + 1 and its tie byte 1 per block, split8 master_hi 1 (no tie),
#: float32/bfloat16/uint8 moments 4/2/1, a uint8 moment's scale byte 1 per block. The 0-d step counts aside.
MOVED_BF16 = {
    "fp32": 2 + 2 * 2 + 2 * (4 + 4 + 4),  # 30
    "split": 2 + 2 * 2 + 2 * ((1 + 1) + 4 + 4 + 1 / 128),  # 26.016
    "bf16": 2 + 2 * 2 + 2 * ((1 + 1) + 2 + 2 + 1 / 128),  # 18.016
    "compact": 2 + 2 * 2 + 2 * ((1 + 1) + 1 + 1 + 3 / 128),  # 14.047: tie, exp_avg_scale, exp_avg_sq_exponent
    "tiny": 2 + 2 * 2 + 2 * (1 + 1 + 1 + 2 / 128),  # 12.031
}
#: float32 parameters have no master (the parameter is the weight): gradient 4, weight 4 + 4, moments x 2.
MOVED_FP32 = {"fp32": 4 + 2 * 4 + 2 * (4 + 4), "bf16": 4 + 2 * 4 + 2 * (2 + 2),
              "compact": 4 + 2 * 4 + 2 * (1 + 1 + 2 / 128)}


def test_bytes_moved_per_state_mode_and_torch(capsys):
    """Every row's bytes moved per element, from its tensors, is the hand derivation above; torch's AdamW moves
    28 B on fp32 parameters (grad 4, weight 8, moments 16) and 14 on bf16 ones (bf16 moments, no master)."""
    argv = ["--sizes", "16k", "--tensors", "2", "--impls", "foreach", "--dtypes", "bf16,fp32", "--state-modes", "all",
            "--warmup", "0", "--repeat", "1", "--json"]
    assert bench.main(argv) == 0
    rows = {(r["impl"], r["dtype"], r.get("state")): r["bytes_moved_per_param"]
            for r in json.loads(capsys.readouterr().out)}
    for mode, moved in MOVED_BF16.items():
        assert rows[("halfadam foreach", "bf16", mode)] == pytest.approx(moved, rel=1e-12), mode
    for mode, moved in MOVED_FP32.items():
        assert rows[("halfadam foreach", "fp32", mode)] == pytest.approx(moved, rel=1e-12), mode
    assert rows[("torch fused", "fp32", None)] == rows[("torch for-loop", "fp32", None)] == 28
    assert rows[("torch fused", "bf16", None)] == 14


def test_predict_step_seconds_is_the_roofline():
    """7e9 elements on 128 cores at 400 GB/s (a DGX A100 host's figures): at 2 ns and 14 B per element the
    compute takes 7e9 * 2 / 128 ns = 0.109375 s, the memory 7e9 * 14 / 400e9 = 0.245 s: memory-bound, 0.245 s.
    At 10 ns the compute, 0.546875 s. The crossover, 14 B / (400 / 128 GB/s) = 4.48 ns, gives both 0.245 s."""
    assert bench.predict_step_seconds(7e9, 2.0, 14, 128, 400) == pytest.approx(0.245)
    assert bench.predict_step_seconds(7e9, 10.0, 14, 128, 400) == pytest.approx(0.546875)
    assert bench.predict_step_seconds(7e9, 4.48, 14, 128, 400) == pytest.approx(0.245)
    assert bench.predict_step_seconds(1000, 3.0, 30, 1, 5.0) == pytest.approx(6e-6)  # 1 core: 3 us, memory 6 us
    for args, name in [((-1, 2.0, 14, 128, 400.0), "numel"), ((7e9, math.nan, 14, 128, 400.0), "ns_per_element"),
                       ((7e9, 2.0, -14, 128, 400.0), "bytes_per_element"), ((7e9, 2.0, 14, 0, 400.0), "cores"),
                       ((7e9, 2.0, 14, 1.5, 400.0), "cores"), ((7e9, 2.0, 14, 128, 0), "bandwidth_gbs"),
                       ((7e9, 2.0, 14, 128, math.inf), "bandwidth_gbs")]:
        with pytest.raises(ValueError, match=f"predict_step_seconds: {name} must be"):
            bench.predict_step_seconds(*args)


PER_CORE = ["--per-core", "--sizes", "64k", "--tensors", "2", "--impls", "foreach", "--dtypes", "bf16",
            "--state-modes", "fp32,compact", "--warmup", "0", "--repeat", "1"]


def test_per_core_table_has_the_columns(capsys, restore_threads):
    """--per-core: the case at 1 thread, and per row ns/el, B/el (the bytes moved), GB/s/core = B/el / ns/el;
    with a host, the predicted step of 7B parameters and its bound. 128 cores at 1 GB/s is memory-bound below
    128 x B/el ns per element (1.8 us and more), so the prediction is the memory time: 7e9 x 30 B / 1 GB/s =
    210 s in the fp32 state, 7e9 x 14.046875 / 1 = 98.328 s in compact."""
    assert bench.main(PER_CORE + ["--host-cores", "128", "--host-bandwidth", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 100
    assert "a step of 7,000,000,000 parameters on 128 cores at 1.0 GB/s," in lines[3]
    assert any(line.startswith("64000/2: 64,000 parameters in 2 tensors, cpu, 1 thread") for line in lines)
    head = next(line for line in lines if line.startswith("implementation"))
    assert head.split() == ["implementation", "dtype", "state", "ms/step", "ns/el", "B/el", "GB/s/core", "pred",
                            "ms", "bound"]
    rows = {tuple(line.split()[:4]): line.split()[4:] for line in lines if line.startswith("halfadam foreach")}
    for mode, moved, memory_ms in (("fp32", MOVED_BF16["fp32"], 210_000), ("compact", MOVED_BF16["compact"], 98_328)):
        ms, ns, b_el, crossover, pred_ms, bound = rows[("halfadam", "foreach", "bf16", mode)]
        assert float(b_el) == pytest.approx(moved, abs=0.005)
        assert float(ns) == pytest.approx(float(ms) * 1e6 / 64_000, rel=0.01, abs=0.01)
        assert float(crossover) == pytest.approx(moved / float(ns), rel=0.01, abs=0.01)
        assert float(ns) < 128 * moved  # else this machine took 1.8 us per element: the step is compute-bound
        assert (float(pred_ms), bound) == (memory_ms, "memory")


def test_per_core_json_and_a_measured_host(capsys, monkeypatch, restore_threads):
    """--host-bandwidth here measures this machine at --host-cores threads (stderr says the figure) and predicts
    with it; the JSON rows carry the per-core figures and the prediction."""
    import torch

    seen = []
    monkeypatch.setattr(bench, "measure_bandwidth", lambda threads: seen.append(threads) or 5.0)
    argv = PER_CORE + ["--host-cores", "2", "--host-bandwidth", "here", "--model-params", "20M", "--json"]
    assert bench.main(argv) == 0
    captured = capsys.readouterr()
    assert seen == [2] and "halfadam bench: --host-bandwidth here: 5.0 GB/s measured at 2 threads" in captured.err
    assert torch.get_num_threads() == 1
    for r in json.loads(captured.out):
        assert r["threads"] == 1 and r["ns_per_param_core"] == r["ns_per_param"]
        assert r["crossover_gb_per_s_core"] == pytest.approx(r["bytes_moved_per_param"] / r["ns_per_param"])
        compute, memory = 20e6 * r["ns_per_param"] / 2 * 1e-9, 20e6 * r["bytes_moved_per_param"] / 5e9
        assert r["predicted_s"] == pytest.approx(max(compute, memory))
        assert r["bound"] == ("memory" if memory > compute else "compute")
        assert (r["model_params"], r["host_cores"], r["host_bandwidth_gbs"]) == (20_000_000, 2, 5.0)


def test_measure_bandwidth_restores_the_threads(restore_threads):
    import torch

    torch.set_num_threads(1)
    assert bench.measure_bandwidth(2, numel=1 << 16, repeat=2) > 0
    assert torch.get_num_threads() == 1
    with pytest.raises(ValueError, match="measure_bandwidth: threads must be at least 1, got 0"):
        bench.measure_bandwidth(0)


