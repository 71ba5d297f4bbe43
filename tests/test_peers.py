"""``halfadam train/bench --peers`` (src/halfadam/cli/peers.py).

The peers' packages are never installed by CI: every test that needs one skips without it
(``pytest.importorskip``), and :func:`test_no_peer_installed` runs with all of them hidden.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import sys
import types

import pytest
import torch

from halfadam import bench
from halfadam.cli import main
from halfadam.cli.modes import parse_modes
from halfadam.cli.peers import PEERS, select, tensor_parts
from halfadam.cli.train import optimizer_state_bytes

TRAIN_PEERS = [p for p in PEERS.values() if not p.bench_only]
TINY = ["train", "--task", "digits", "--steps", "4", "--batch-size", "16", "--eval-every", "2", "--no-progress"]
BENCH = ["--sizes", "8192", "--tensors", "2", "--no-small", "--impls", "reference", "--dtypes", "bf16",
         "--warmup", "1", "--repeat", "1", "--json", "--peers"]


@contextlib.contextmanager
def eager_torchao():
    """torchao compiles its step for every parameter shape (seconds each on a small CPU): run it eagerly."""
    compile_ = torch.compile

    def compile(model=None, **kwargs):
        if getattr(model, "__module__", "").startswith("torchao."):
            return model
        return compile_(model, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "compile", compile)
        yield


def _run(argv) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), eager_torchao():
        rc = main(argv)
    return rc, buf.getvalue()


# ------------------------------------------------------------------------- without any peer installed
def test_no_peer_installed(tmp_path, monkeypatch, capsys):
    for peer in PEERS.values():
        monkeypatch.setitem(sys.modules, peer.module, None)  # `import optimi` now raises ImportError
    rc, out = _run([*TINY, "--modes", "fp32", "--peers", "--out", str(tmp_path)])
    assert rc == 0
    for peer in TRAIN_PEERS:
        assert f"--peers: skipped {peer.name}: {peer.package} is not installed (pip install {peer.package})" in out
    assert list(json.loads((tmp_path / "metrics.json").read_text())["modes"]) == ["fp32"]

    with pytest.raises(ValueError, match="needs the package torch-optimi, which is not installed"):
        parse_modes("fp32,bf16-optimi-kahan")

    assert bench.main(BENCH) == 0
    captured = capsys.readouterr()
    assert {r["impl"] for r in json.loads(captured.out)} == {"torch for-loop", "torch foreach", "torch fused",
                                                            "halfadam reference"}
    for peer in PEERS.values():  # DeepSpeed's CPU Adam too
        assert f"halfadam bench: --peers: skipped {peer.name}: {peer.package} is not installed" in captured.err


def test_state_bytes_count_a_shared_tensor_once():
    p = torch.nn.Parameter(torch.zeros(4))
    q = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([p, q], lr=0.1)
    table = torch.zeros(256)  # bitsandbytes keeps one code table for every parameter
    opt.state[p] = {"state1": torch.zeros(4, dtype=torch.uint8), "qmap1": table, "step": 1}
    opt.state[q] = {"state1": torch.zeros(4, dtype=torch.uint8), "qmap1": table, "step": 1}
    assert optimizer_state_bytes(opt) == 4 + 4 + 256 * 4


def test_flashoptim_is_skipped_without_cuda(monkeypatch):
    """FlashOptim quantizes its state only for CUDA tensors (on the CPU it would keep float32 moments):
    where the device is not CUDA it is left out with one line, installed or not."""
    monkeypatch.setitem(sys.modules, "flashoptim", types.ModuleType("flashoptim"))  # imports: "installed"
    lines = []
    assert select(["fp32", "bf16-flashoptim"], add=False, device="cpu", log=lines.append) == ["fp32"]
    assert lines == ["--peers: skipped bf16-flashoptim: flashoptim.FlashAdamW(master_weight_bits=24) needs CUDA "
                     "(it quantizes its state only for CUDA tensors), not cpu"]


def test_state_bytes_count_the_tensors_an_object_holds():
    """FlashOptim keeps each moment in a plain object (``_MaybeQuantizedTensor``: int8 codes, an fp16
    scale per 32): the bytes counted are its tensors', 3.125 per parameter with the int8 correction."""

    class Quantized:  # the attributes of flashoptim's _MaybeQuantizedTensor once quantized
        def __init__(self, n):
            self._quantized = torch.zeros(n, dtype=torch.int8)
            self._scales = torch.zeros(n // 32, dtype=torch.float16)
            self.data = None

    p = torch.nn.Parameter(torch.zeros(4096, dtype=torch.bfloat16))
    opt = torch.optim.SGD([p], lr=0.1)
    opt.state[p] = {"exp_avg": Quantized(4096), "exp_avg_sq": Quantized(4096),
                    "error_bits": torch.zeros(4096, dtype=torch.int8), "step": torch.tensor(3)}
    assert optimizer_state_bytes(opt) == 3.125 * 4096
    assert bench._memory_bytes(opt, scratch=False) == 3.125 * 4096 + 8  # the int64 step counter too


# --------------------------------------------------------------------------- with the peers installed
def _installed() -> list:
    return [p for p in TRAIN_PEERS if importlib.util.find_spec(p.module) is not None]


@pytest.fixture(scope="module")
def peer_run(tmp_path_factory):
    """One ``--peers`` run next to fp32; returns (stdout, metrics)."""
    if not _installed():
        pytest.skip("no peer package installed")
    out = tmp_path_factory.mktemp("peers")
    rc, stdout = _run([*TINY, "--modes", "fp32", "--peers", "--weight-decay", "0.1", "--out", str(out)])
    assert rc == 0
    return stdout, json.loads((out / "metrics.json").read_text())


def _expected_state_bytes(name: str, sizes: list[int]) -> int:
    """What each peer stores for parameters of ``sizes`` elements, from its source."""
    if name == "bf16-optimi-kahan":  # exp_avg, exp_avg_sq, kahan_comp in bf16
        return sum(3 * 2 * n for n in sizes)
    if name == "bf16-torchao-sr":  # exp_avg, exp_avg_sq in bf16
        return sum(2 * 2 * n for n in sizes)
    if name == "bf16-torchao-8bit":  # per moment: uint8 codes, fp32 scale per 256, its own 256-entry fp32 table
        return sum(2 * (n + 4 * n // 256 + 4 * 256) if n >= 4096 and n % 256 == 0 else 2 * 2 * n for n in sizes)
    if name == "bf16-bnb-8bit":  # per moment: uint8, fp32 absmax per 256; 2 tables shared; small: fp32 moments
        big = [n for n in sizes if n >= 4096]
        return (sum(2 * (n + 4 * math.ceil(n / 256)) for n in big) + (2 * 256 * 4 if big else 0)
                + sum(2 * 4 * n for n in sizes if n < 4096))
    raise AssertionError(name)


@pytest.mark.parametrize("name", [p.name for p in TRAIN_PEERS])
def test_peer_trains_as_a_mode(name, peer_run):
    peer = PEERS[name]
    pytest.importorskip(peer.module)
    stdout, metrics = peer_run
    if f"skipped {name}" in stdout:  # bitsandbytes built without a backend for this CPU
        pytest.skip(stdout.split(f"skipped {name}: ")[1].splitlines()[0])
    m = metrics["modes"][name]
    assert m["optimizer"] == peer.source and m["param_dtype"] == "bfloat16"
    assert m["diverged_at_step"] is None and math.isfinite(m["final_val_loss"])
    assert m["val_loss_vs_fp32_percent"] is not None
    from halfadam.cli.models import DigitsMLP

    sizes = [p.numel() for p in DigitsMLP(64, 10).parameters()]
    assert m["optimizer_state_bytes_per_param"] == _expected_state_bytes(name, sizes) / sum(sizes)
    assert name in stdout.split("mode ")[1]  # a row of the table


@pytest.mark.parametrize("name", [p.name for p in TRAIN_PEERS])
def test_peer_weight_decay_is_torch_adamw_decay(name):
    """With zero gradients the step is the decay alone: w * (1 - lr * wd), as torch.optim.AdamW."""
    peer = PEERS[name]
    pytest.importorskip(peer.module)
    if peer.cuda_only and not torch.cuda.is_available():
        pytest.skip(f"{peer.source} runs as itself on CUDA only")
    w = torch.ones(4096, dtype=torch.bfloat16, requires_grad=True)  # 4096: the 8-bit peers quantize it
    w.grad = torch.zeros_like(w)
    with eager_torchao():
        try:
            peer.build([w], lr=0.25, weight_decay=2.0).step()
        except Exception as exc:  # bitsandbytes without a backend for this CPU
            pytest.skip(f"{peer.source}: {exc}")
    assert torch.equal(w.detach(), torch.full_like(w, 0.5))  # 1 - 0.25 * 2; wd alone would give -1


def test_peer_mode_names_parse_when_installed():
    pytest.importorskip("optimi")
    assert [m.name for m in parse_modes("fp32,bf16-optimi-kahan")] == ["fp32", "bf16-optimi-kahan"]


def test_tensor_parts_open_torchao_state():
    pytest.importorskip("torchao")
    try:
        from torchao.optim.subclass_8bit import OptimState8bit
    except ImportError:
        from torchao.prototype.low_bit_optim.subclass_8bit import OptimState8bit
    state = OptimState8bit.zeros((64, 128), True, 256, "cpu", dtype=torch.bfloat16)
    assert state.numel() * state.element_size() == 64 * 128 * 2  # what it poses as
    parts = tensor_parts(state)
    assert [t.dtype for t in parts] == [torch.uint8, torch.float32, torch.float32]  # codes, scale, qmap
    assert sum(t.nbytes for t in parts) == 64 * 128 + 4 * 64 * 128 // 256 + 4 * 256


def test_bench_peers_rows(capsys):
    installed = [p for p in PEERS.values() if importlib.util.find_spec(p.module) is not None]
    if not installed:
        pytest.skip("no peer package installed")
    with eager_torchao():
        assert bench.main(BENCH) == 0
    captured = capsys.readouterr()
    rows = {r["impl"]: r for r in json.loads(captured.out)}
    for peer in installed:
        if f"skipped {peer.name}" in captured.err:
            continue
        row = rows[peer.label]
        assert row["dtype"] == ("fp32" if peer.param_dtype == torch.float32 else "bf16")
        assert row["ms"] > 0 and row["memory_mb"] > 0


def test_bench_rows_have_distinct_labels():
    """Each peer is its own ``halfadam bench`` row: DeepSpeed's two CPU Adam configurations too."""
    labels = [p.label for p in PEERS.values()]
    assert len(set(labels)) == len(labels), labels
    assert PEERS["bf16-deepspeed-cpuadam"].label == "deepspeed cpuadam bf16-state"


@pytest.mark.parametrize("name, state_dtype", [("fp32-deepspeed-cpuadam", torch.float32),
                                               ("bf16-deepspeed-cpuadam", torch.bfloat16)])
def test_deepspeed_cpu_adam_state_dtype(name, state_dtype):
    """DeepSpeed's CPU Adam keeps float32 moments on float32 parameters, and with
    ``fp32_optimizer_states=False`` (DeepSpeed#8010) bfloat16 moments on bfloat16 parameters; its step
    is torch's AdamW step (on float32 copies) to the parameters' precision."""
    pytest.importorskip("deepspeed")
    peer = PEERS[name]
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(4096, generator=g) * 0.02
    grads = [torch.randn(4096, generator=g) * 1e-3 for _ in range(3)]
    w = w0.to(peer.param_dtype, copy=True).requires_grad_()
    try:
        opt = peer.build([w], lr=1e-2, weight_decay=0.1)
    except TypeError as exc:  # a DeepSpeed before #8010: no fp32_optimizer_states
        pytest.skip(f"{peer.source}: {exc}")
    ref = w0.clone().requires_grad_()
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    for grad in grads:
        w.grad, ref.grad = grad.to(peer.param_dtype), grad.clone()
        opt.step()
        ref_opt.step()
    state = opt.state[w]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == state_dtype
    assert bench._memory_bytes(opt, scratch=False) == 2 * 4096 * state_dtype.itemsize
    tol = 1e-6 if state_dtype == torch.float32 else 2e-3  # bf16 weights: within a few bf16 ulps of 0.02
    torch.testing.assert_close(w.detach().float(), ref.detach(), atol=tol, rtol=0)
