"""``halfadam doctor``: what this machine runs, and whether its kernels give the reference's bits.

One screen to paste into a bug report. It prints the versions (halfadam, torch, triton, CUDA, Python,
the C++ compiler), each device with its capability, the CPU's vector extensions, which C++ path is
built (AVX-512, AVX2 or scalar) and whether it came from the cache; then runs the self-check of
:mod:`halfadam.selfcheck` for every state mode and parameter dtype on every device (the C++ kernel on
the CPU, the Triton kernel on each CUDA device; also Adam's L2 decay with a loss scale, in bfloat16),
times one step per state mode against ``torch.optim.AdamW(fused=True)`` on float32 parameters on the
same device, and prints the state's bytes per parameter, counted from the optimizer's state tensors.

Exit status: 0 when every check agrees (or no kernel runs here, so there is nothing to check: the
last line says so), 1 when one differs. Timed steps run on 1 CPU thread unless ``--threads`` says
otherwise (a shared machine's second thread waits for a core, and torch's fused step with it). No progress bars. The module follows the ``halfadam.cli`` command protocol (``HELP``,
``add_arguments(parser)``, ``run(args) -> int``); it imports torch only when it runs.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import time
import warnings
from importlib import metadata
from typing import Dict, List, Optional, Tuple

#: One-line summary (the ``halfadam.cli`` command protocol).
HELP = "print versions and devices, check every kernel against the reference bit for bit, time one step"

#: The CPU flags printed (Linux ``/proc/cpuinfo`` names) that the C++ kernel's paths depend on.
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16", "amx_bf16")
DTYPES = ("bfloat16", "float16", "float32")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--params", type=float, default=None, metavar="N",
                        help="parameters of the timed step, in 8 matrices (default 4e6 on the CPU, 16e6 on CUDA)")
    parser.add_argument("--threads", type=int, default=1, metavar="N",
                        help="torch's CPU threads for the timed steps (default 1: stable on a shared machine)")
    parser.add_argument("--no-timing", action="store_true", help="skip the timed steps (checks only)")
    return parser


def run(args) -> int:
    import torch

    from . import selfcheck

    out = lambda text="": print(text, flush=True)  # noqa: E731
    out(f"halfadam doctor  ({time.strftime('%Y-%m-%d %H:%M')})")
    for name, value in _versions(torch):
        out(f"  {name:<10} {value}")
    devices = [torch.device("cpu")] + [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    for device in devices:
        out(f"  {str(device):<10} {_describe_device(torch, device)}")
    out(f"  {'cpp':<10} {_cpp_status()}")
    with selfcheck.recheck():  # every configuration again (those checked before, and with the checks off)
        checked, failed = _check_all(torch, devices, out)
    if not args.no_timing:
        threads = torch.get_num_threads()
        torch.set_num_threads(args.threads)
        try:
            for device in devices:
                default = 16e6 if device.type == "cuda" else 4e6
                _time_modes(torch, device, int(args.params or default), args.threads, out)
        finally:
            torch.set_num_threads(threads)
    if failed:
        out(f"result: {failed} configuration(s) differ from the reference: please report this output")
    elif not checked:
        out("result: no hand-written kernel runs here, so none was checked (implementation='auto' runs "
            "torch.compile or eager torch ops)")
    else:
        out(f"result: every kernel gives the reference's bits ({checked} configurations)")
    return 1 if failed else 0


def _versions(torch) -> List[Tuple[str, str]]:
    from . import __version__

    def version(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "not installed"

    cuda = torch.version.cuda or "none (a CPU build of torch)"
    if torch.version.cuda and not torch.cuda.is_available():
        cuda += " (no device available)"
    return [("halfadam", __version__), ("torch", torch.__version__), ("triton", version("triton")),
            ("CUDA", cuda), ("python", f"{platform.python_version()} ({platform.machine()})"),
            ("compiler", _compiler())]


def _compiler() -> str:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"{cxx}: not found (the C++ kernel cannot be built)"
    try:
        first = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=10).stdout.splitlines()
        return f"{cxx}: {first[0] if first else 'unknown version'}"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{cxx}: {type(exc).__name__}"


def _describe_device(torch, device) -> str:
    if device.type == "cpu":
        name, flags = platform.processor() or platform.machine(), set()
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name") and name in ("", platform.machine(), platform.processor()):
                        name = line.split(":", 1)[1].strip()
                    elif line.startswith(("flags", "Features")):
                        flags = set(line.split(":", 1)[1].split())
        except OSError:
            pass
        present = " ".join(f for f in CPU_FLAGS if f in flags) or "none of " + ", ".join(CPU_FLAGS[:3])
        return f"{name}; {os.cpu_count()} cores, torch threads: {torch.get_num_threads()}; {present}"
    props = torch.cuda.get_device_properties(device)
    return f"{props.name}, sm_{props.major}{props.minor}, {props.total_memory / 2 ** 30:.0f} GiB"


def _cpp_status() -> str:
    from .kernels import cpp

    cached = cpp.library_path().exists()
    kernel = cpp.load()
    if kernel is None:
        return f"unavailable ({cpp.unavailable_reason()}): implementation='auto' runs torch.compile on the CPU"
    widths = {16: "AVX-512 (16 lanes)", 8: "AVX2 (8 lanes)", 1: "scalar (1 lane)"}
    return (f"{widths.get(cpp.lanes(), cpp.lanes())} built, {'loaded from the cache' if cached else 'built now'}: "
            f"{cpp.library_path()}")


def _kernel_for(device) -> Optional[str]:
    """The hand-written kernel ``implementation="auto"`` runs on ``device``, or ``None``."""
    if device.type == "cpu":
        from .kernels import cpp

        return "cpp" if cpp.load() is not None else None
    from .kernels import triton

    return "triton" if triton.available(device) else None


def _check_all(torch, devices, out) -> Tuple[int, int]:
    """Steps every state mode and dtype on every device once (and checks run on first use); prints a
    line per device and each difference; returns the numbers of configurations checked and differing."""
    import halfadam

    from . import selfcheck
    from .encodings import PRESETS

    out("self-check: the kernel's every output bit against the reference, 2 steps over "
        f"{sum(torch.Size(s).numel() for s in selfcheck.SHAPES):,} synthetic elements per configuration")
    checked = failed = 0
    for device in devices:
        kernel = _kernel_for(device)
        if kernel is None:
            out(f"  {device}: no hand-written kernel runs here, nothing to check")
            continue
        before = set(selfcheck.results())
        cases = [(halfadam.AdamW, mode, dtype, False) for mode in PRESETS for dtype in DTYPES]
        cases += [(halfadam.Adam, mode, "bfloat16", True) for mode in PRESETS]  # L2 decay, a loss scale
        cases += [(cls, mode, "bfloat16", False) for cls in (_nesterov_sgd, _plain_sgd, halfadam.Lion) for mode in PRESETS]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # reported below, with the rest
            for cls, mode, dtype, scaled in cases:
                _one_step(torch, cls, mode, getattr(torch, dtype), device, scaled)
        verdicts = [v for c, v in selfcheck.results().items() if c not in before and c.device == str(device)]
        bad = [v for v in verdicts if not v.agrees]
        checked, failed = checked + len(verdicts), failed + len(bad)
        seconds = sum(v.seconds for v in verdicts)
        out(f"  {device} {kernel}: {len(verdicts) - len(bad)} of {len(verdicts)} configurations agree "
            f"({seconds * 1e3:.0f} ms, {seconds * 1e3 / max(len(verdicts), 1):.0f} ms each)")
        out(f"    ({len(PRESETS)} state modes x {len(DTYPES)} dtypes with AdamW; in bfloat16, Adam's L2 decay with "
            f"a loss scale, SGD (nesterov momentum; none) and Lion; 1-D parameters are configurations of their own)")
        for v in bad:
            out(f"    DIFFERS: {v.config.describe()}: {v.difference}")
    return checked, failed


def _nesterov_sgd(params, **kw):
    import halfadam
    return halfadam.SGD(params, momentum=0.9, nesterov=True, **kw)


def _plain_sgd(params, **kw):
    import halfadam
    return halfadam.SGD(params, **kw)


def _one_step(torch, cls, mode: str, dtype, device, scaled: bool) -> None:
    """One step of ``cls`` in ``mode`` over a (64, 96) weight and a (64,) bias of ``dtype`` on ``device``."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(64, 96, generator=gen).to(dtype).to(device).requires_grad_(),
              torch.randn(64, generator=gen).to(dtype).to(device).requires_grad_()]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(dtype).to(device)
    opt = cls(params, lr=1e-3, weight_decay=0.01, state_mode=mode)
    opt.step(grad_scale=torch.tensor(0.5, device=device) if scaled else None)


def _time_modes(torch, device, numel: int, threads: int, out) -> None:
    """Median step time of each state mode (bfloat16 parameters) and of torch's fused AdamW (float32),
    round-robin over 7 rounds after 2 warm-up steps, with the state's bytes per parameter."""
    import halfadam

    from .encodings import PRESETS

    rows = max(1, numel // 8 // 1024)
    gen = torch.Generator().manual_seed(0)

    def make(dtype):
        params = [torch.randn(rows, 1024, generator=gen).to(dtype).to(device).requires_grad_() for _ in range(8)]
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype).to(device) * 1e-3
        return params

    optimizers: Dict[str, object] = {"torch fused": torch.optim.AdamW(make(torch.float32), lr=1e-3, fused=True)}
    for mode in PRESETS:
        optimizers[mode] = halfadam.AdamW(make(torch.bfloat16), lr=1e-3, state_mode=mode)
    times: Dict[str, List[float]] = {name: [] for name in optimizers}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for round_ in range(9):
        for name, opt in optimizers.items():
            sync()
            start = time.perf_counter()
            opt.step()
            sync()
            if round_ >= 2:
                times[name].append(time.perf_counter() - start)
    reference = statistics.median(times["torch fused"])
    total = 8 * rows * 1024
    where = f"{device}, {threads} thread{'s' if threads > 1 else ''}" if device.type == "cpu" else str(device)
    out(f"step time on {where}, {total / 1e6:.1f}M parameters in 8 matrices (median of 7; bfloat16 parameters, "
        f"torch fused on float32):")
    out(f"  {'':<12} {'ms':>8} {'x torch':>8} {'state B/param':>14}")
    for name, opt in optimizers.items():
        ms = statistics.median(times[name]) * 1e3
        state = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)
        out(f"  {name:<12} {ms:>8.2f} {ms / reference / 1e3:>8.2f} {state / total:>14.2f}")
