"""The hand-written CPU kernel (``implementation="cpp"``): built on first use, cached, optional.

``csrc/adam_cpu.cpp`` holds ``adam_step(params, grads, state, offsets, coefficients, grad_scale, l2,
optimized_update, step)``: one Adam/AdamW step over a list of float16/bfloat16/float32 parameters
whose state lives in a bucket's flat buffers (``state``: :attr:`halfadam.buckets.Bucket.flat`), in
one call (no gathering of gradients or parameters, no per-tensor Python), for the state formats of
:func:`supports` (the encodings of :mod:`halfadam.encodings`, bit for bit); and
``first_invalid(params, grads)``, the optimizer's per-gradient checks in one call (the index of the
first pair they would reject). Its equations are
:mod:`halfadam.functional`'s, term for term (the file's header states them), vectorised with AVX2
and F16C where the CPU has them, split over torch's intra-op threads (``torch.set_num_threads``).

It is compiled by :func:`torch.utils.cpp_extension.load` (gcc or clang, and ninja) with
``-O3 -march=native -ffp-contract=off -fopenmp``, once per source, torch version, CPU and compiler
(``CXX``): the build directory's name carries a digest of them, under ``TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``). The first build takes about a minute; later processes load it in
well under a second. Where it cannot be built (no compiler, no ninja, a failed build) :func:`load`
returns ``None`` and :func:`unavailable_reason` says why (also logged), and ``implementation="auto"``
runs the ``torch.compile`` path instead. Set ``HALFADAM_CPP=0`` (or ``false``/``off``/``no``) to never
build or use it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch

from .encodings import StateFormat

__all__ = ["load", "loaded", "supports", "unavailable_reason", "SOURCE"]

SOURCE = Path(__file__).with_name("csrc") / "adam_cpu.cpp"
# -fopenmp: at::parallel_for is inline OpenMP (ATen/ParallelOpenMP.h); without it the loop runs on one
# thread. The module links libgomp by its soname, so it shares the runtime torch has loaded.
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"]

_log = logging.getLogger("halfadam")
_lock = threading.Lock()
_module: Optional[ModuleType] = None
_reason: Optional[str] = None  # why the kernel is unavailable, once known


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU's flags (Linux), else the processor's name."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def supports(fmt: StateFormat) -> bool:
    """Whether the kernel implements state format ``fmt``: an fp32 or split master, and both moments
    float32 or both bfloat16 (the presets ``fp32``, ``split`` and ``bf16``; not the 8-bit moments)."""
    return fmt.exp_avg == fmt.exp_avg_sq and fmt.exp_avg in (torch.float32, torch.bfloat16)


def load() -> Optional[ModuleType]:
    """The compiled extension module, building it on first use; ``None`` where it cannot be built.

    A build is announced on the ``halfadam`` logger at WARNING level (printed to stderr unless logging
    is configured otherwise), as is a failure. A failed build leaves ``halfadam_build_failed.txt`` with
    the reason in its build directory, so later processes do not retry it (delete the file to retry).
    """
    global _module, _reason
    if _module is not None or _reason is not None:
        return _module
    with _lock:
        if _module is not None or _reason is not None:
            return _module
        setting = os.environ.get("HALFADAM_CPP", "1")
        if setting.strip().lower() in ("0", "false", "off", "no"):
            _reason = f"disabled (HALFADAM_CPP={setting})"
            return None
        compiler = os.environ.get("CXX", "c++")  # a fixed or changed compiler gets a new build directory
        digest = hashlib.sha256(SOURCE.read_bytes() + repr((CFLAGS, torch.__version__, _cpu_signature(),
                                                            compiler)).encode())
        name = f"halfadam_cpu_{digest.hexdigest()[:16]}"
        failed: Optional[Path] = None
        try:
            from torch.utils import cpp_extension

            build_dir = cpp_extension._get_build_directory(name, verbose=False)
            failed = Path(build_dir) / "halfadam_build_failed.txt"
            if failed.exists():
                _reason = f"{failed.read_text().strip()} (an earlier build; delete {failed} to retry)"
                _log.warning("halfadam: the C++ CPU kernel is skipped: %s", _reason)
                return None
            if not (Path(build_dir) / f"{name}.so").exists():
                _log.warning("halfadam: compiling the C++ CPU kernel (once for this version and CPU, about a minute; "
                             "cached in %s; HALFADAM_CPP=0 skips it)", build_dir)
            _module = cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=CFLAGS,
                                          extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as exc:  # no compiler or ninja, a failed build
            _reason = f"{type(exc).__name__}: {_first_cause(str(exc))}"
            remembered = ""
            if failed is not None:
                try:
                    failed.write_text(_reason + "\n")
                    remembered = f"; remembered in {failed} (delete it to retry)"
                except OSError:
                    pass
            _log.warning("halfadam: the C++ CPU kernel is unavailable (%s); implementation='auto' runs the "
                         "torch.compile path instead%s", _reason, remembered)
        return _module


def _first_cause(message: str) -> str:
    """The line of a build log that says what went wrong (a compiler error, a missing program)."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()] or [""]
    for marker in ("error:", "not found", "fatal", "no such file", "error"):
        for line in lines:
            if marker in line.lower() and not line.startswith("["):  # "[1/2] g++ ...": ninja's command echo
                return line[:300]
    return lines[-1][:300]


def loaded() -> Optional[ModuleType]:
    """The extension module if :func:`load` has built or loaded it in this process (never builds)."""
    return _module


def unavailable_reason() -> Optional[str]:
    """Why :func:`load` returned ``None`` (``None`` if it has not failed, or has not been called)."""
    return _reason
