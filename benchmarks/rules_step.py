"""The CPU step of halfadam.SGD and halfadam.Lion in every state mode, against torch.optim.SGD(fused=True).

20M bfloat16 parameters in 50 matrices of 1,024-element rows (``--numel``, ``--tensors``); the yardstick is
``torch.optim.SGD(momentum=0.9, fused=True)`` on float32 parameters of the same shapes, timed in the same
process (issue 47's target: SGD with momentum and Lion in the fp32 state at most 1.25x it: 24 bytes moved per
parameter against its 20). Median of ``--repeat`` interleaved rounds, at 1 and 2 threads (``--threads``);
``implementation="auto"`` (the C++ kernel where it builds). Prints ms per step and the ratio.

    python benchmarks/rules_step.py [--numel 2e7] [--tensors 50] [--repeat 9] [--threads 1,2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import halfadam

MODES = ("fp32", "split", "bf16", "compact", "tiny")


def _params(numel: int, tensors: int, dtype: torch.dtype, seed: int):
    rows = max(1, numel // tensors // 1024)
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter((torch.randn(rows, 1024, generator=gen) * 0.02).to(dtype)) for _ in range(tensors)]
    for p in params:
        p.grad = (torch.randn(rows, 1024, generator=gen) * 1e-3).to(dtype)
    return params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=float, default=2e7)
    ap.add_argument("--tensors", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--threads", default="1,2")
    args = ap.parse_args()
    n, k = int(args.numel), args.tensors
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        runs = {"torch SGD fused (fp32)": torch.optim.SGD(_params(n, k, torch.float32, 0), lr=1e-2, momentum=0.9,
                                                          fused=True)}
        for mode in MODES:
            runs[f"SGD momentum {mode}"] = halfadam.SGD(_params(n, k, torch.bfloat16, 0), lr=1e-2, momentum=0.9,
                                                        state_mode=mode)
        for mode in MODES:
            runs[f"Lion {mode}"] = halfadam.Lion(_params(n, k, torch.bfloat16, 0), lr=1e-4, weight_decay=0.1,
                                                 state_mode=mode)
        times = {name: [] for name in runs}
        for r in range(args.repeat + 2):
            for name, opt in runs.items():
                t0 = time.perf_counter()
                opt.step()
                if r >= 2:
                    times[name].append(time.perf_counter() - t0)
        ref = statistics.median(times["torch SGD fused (fp32)"])
        total = sum(p.numel() for p in runs["torch SGD fused (fp32)"].param_groups[0]["params"])
        print(f"{total / 1e6:.1f}M parameters, {threads} thread(s), median of {args.repeat}; "
              f"x torch.optim.SGD(momentum=0.9, fused=True) on float32")
        for name, ts in times.items():
            ms = statistics.median(ts) * 1e3
            print(f"  {name:<24} {ms:8.2f} ms  {ms / ref / 1e3:5.2f}x")


if __name__ == "__main__":
    main()
