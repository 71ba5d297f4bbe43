"""``halfadam train --offload``: the host and device memory one mode's run adds, measured from the process.

:class:`MemoryProbe` reads the process's resident host memory (``VmRSS`` of ``/proc/self/status``, after
glibc has returned its freed heap pages with ``malloc_trim``, so that freed memory is not counted) before the
mode's model copy and optimizer are built and after each of its first :data:`MEASURED_STEPS` steps (the
parameters, their gradients and the optimizer state alive), and on CUDA the device's peak allocated bytes
(``torch.cuda.max_memory_allocated``, its peak statistics reset first). Nothing is computed from a layout.
"""

from __future__ import annotations

import ctypes
import gc

import torch

from halfadam.distributed import _all_reduce_

#: The probe's last reading follows this many steps (or every step of a shorter run).
MEASURED_STEPS = 3


def resident_bytes() -> int | None:
    """This process's resident memory (``VmRSS``) in bytes, freed heap pages returned first; ``None`` where
    ``/proc/self/status`` has none (not Linux)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: resident memory as it is
        pass
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), None)
    except OSError:
        return None


class MemoryProbe:
    """The memory one mode's run adds: :meth:`sample` after a step, :meth:`result` per parameter."""

    def __init__(self, device: torch.device):
        self.device = device
        gc.collect()  # the previous mode's run, gone
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        self.before = resident_bytes()
        self.after: int | None = None
        self.steps = 0

    def sample(self) -> None:
        """Read the resident memory after a step (the last reading stays)."""
        self.after = resident_bytes()
        self.steps += 1

    def result(self, n_params: int, world: int) -> dict:
        """The measured figures per parameter (of all ``n_params``, summed over the ``world`` processes, which
        each hold their shards): ``host_bytes_per_param`` (resident memory added), ``device_bytes_per_param``
        (CUDA's peak allocated; ``None`` on the CPU, where the device is the host), and what they came from."""
        host_added = None if self.before is None or self.after is None else self.after - self.before
        device_peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        if world > 1:
            both = torch.tensor([float(host_added or 0), float(device_peak or 0)], dtype=torch.float64)
            _all_reduce_(both, torch.distributed.ReduceOp.SUM, None)  # (nccl: through a CUDA copy)
            host_added = None if host_added is None else int(both[0].item())
            device_peak = None if device_peak is None else int(both[1].item())
        return {
            "host_bytes_per_param": None if host_added is None else host_added / n_params,
            "device_bytes_per_param": None if device_peak is None else device_peak / n_params,
            "host_resident_added_bytes": host_added,
            "device_peak_allocated_bytes": device_peak,
            "after_steps": self.steps,
            "processes": world,
            "source": "VmRSS of /proc/self/status after malloc_trim, before the mode's model and after its "
                      "first steps" + ("; torch.cuda.max_memory_allocated" if device_peak is not None else
                                       "; on the CPU the device is the host"),
        }
