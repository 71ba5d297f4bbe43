"""The hand-written CPU kernel (``implementation="cpp"``): built on first use, cached, optional.

``csrc/adam_cpu.cpp`` holds ``adam_step(params, grads, master, exp_avg, exp_avg_sq, offsets,
coefficients, grad_scale, l2, optimized_update)``: one Adam/AdamW step over a list of
float16/bfloat16/float32 parameters whose fp32 state lives in a bucket's flat buffers, in one call
(no gathering of gradients or parameters, no per-tensor Python); and ``first_invalid(params, grads)``,
the optimizer's per-gradient checks in one call (the index of the first pair they would reject). Its equations are
:mod:`halfadam.functional`'s, term for term (the file's header states them), vectorised with AVX2
and F16C where the CPU has them, split over torch's intra-op threads (``torch.set_num_threads``).

It is compiled by :func:`torch.utils.cpp_extension.load` (gcc or clang, and ninja) with
``-O3 -march=native -ffp-contract=off -fopenmp``, once per source, torch version and CPU: the build
directory's name carries a digest of all three, under ``TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``). The first build takes about a minute; later processes load it in
well under a second. Where it cannot be built (no compiler, no ninja, a failed build) :func:`load`
returns ``None`` and :func:`unavailable_reason` says why, and ``implementation="auto"`` runs the
``torch.compile`` path instead. Set ``HALFADAM_CPP=0`` to never build or use it.
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

__all__ = ["load", "loaded", "unavailable_reason", "SOURCE"]

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


def load() -> Optional[ModuleType]:
    """The compiled extension module, building it on first use; ``None`` where it cannot be built."""
    global _module, _reason
    if _module is not None or _reason is not None:
        return _module
    with _lock:
        if _module is not None or _reason is not None:
            return _module
        if os.environ.get("HALFADAM_CPP", "1") == "0":
            _reason = "disabled by HALFADAM_CPP=0"
            return None
        digest = hashlib.sha256(SOURCE.read_bytes() + repr((CFLAGS, torch.__version__, _cpu_signature())).encode())
        name = f"halfadam_cpu_{digest.hexdigest()[:16]}"
        try:
            from torch.utils import cpp_extension

            _log.info("halfadam: building the C++ CPU kernel %s (once per machine; about a minute)", name)
            _module = cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=CFLAGS,
                                          extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as exc:  # no compiler or ninja, a failed build
            lines = str(exc).strip().splitlines() or [""]
            first_error = next((line for line in lines if "error" in line.lower()), lines[-1])
            _reason = f"{type(exc).__name__}: {first_error.strip()[:300]}"
            _log.info("halfadam: the C++ CPU kernel is unavailable (%s)", _reason)
        return _module


def loaded() -> Optional[ModuleType]:
    """The extension module if :func:`load` has built or loaded it in this process (never builds)."""
    return _module


def unavailable_reason() -> Optional[str]:
    """Why :func:`load` returned ``None`` (``None`` if it has not failed, or has not been called)."""
    return _reason
