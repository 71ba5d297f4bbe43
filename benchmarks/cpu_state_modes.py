"""halfadam's C++ CPU kernel per state mode against torch's fused AdamW, as a model's step sees them.

About 20M bfloat16 parameters in 50 matrices with rows of 1,024 elements (``(391, 1024)`` each: 20.0M),
stepped by ``halfadam.AdamW(state_mode=m, implementation="cpp")`` for m in fp32, split, bf16,
compact and tiny, and by ``torch.optim.AdamW(fused=True)`` over float32 copies (float32 gradients), all in one
process and interleaved: each repeat times every optimizer once (``--steps`` steps each, after
``--warmup`` untimed ones), at each thread count of ``--threads`` (``torch.set_num_threads``). The
gradients are random, drawn once before any timing (bfloat16 for the bfloat16 parameters). Prints,
per thread count and optimizer, the median step time over the repeats with its range, and the ratio
to torch fused: the median of the per-repeat ratios (each against torch's time in the same repeat,
so a slow phase of a shared machine weighs on both) with its range.

    python benchmarks/cpu_state_modes.py [--threads 1,2] [--repeat 7] [--steps 3] [--warmup 2]

Run it alone: the times are memory-bound and another job on the machine changes them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import halfadam

MODES = ("fp32", "split", "bf16", "compact", "tiny")
#: The targets (ratio to torch fused, at most), by thread count.
TARGETS = {1: {"fp32": 1.0, "split": 1.2, "bf16": 1.1, "compact": 1.0},
           2: {"fp32": 1.0, "split": 1.0, "bf16": 0.9, "compact": 0.8}}


def _time(opt, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return (time.perf_counter() - start) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per optimizer and repeat")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per optimizer and thread count")
    ap.add_argument("--matrices", type=int, default=50)
    ap.add_argument("--rows", type=int, default=391)
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    shape = (args.rows, 1024)

    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(shape, generator=gen) * 0.02 for _ in range(args.matrices)]
    grads = [torch.randn(shape, generator=gen) * 1e-3 for _ in range(args.matrices)]
    optimizers = {}
    for mode in modes:
        params = [torch.nn.Parameter(v.to(torch.bfloat16)) for v in values]
        for p, g in zip(params, grads):
            p.grad = g.to(torch.bfloat16)
        optimizers[mode] = halfadam.AdamW(params, lr=1e-3, weight_decay=0.01, implementation="cpp", state_mode=mode)
    params = [torch.nn.Parameter(v.clone()) for v in values]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    optimizers["torch fused"] = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
    numel = args.matrices * shape[0] * shape[1]
    print(f"{numel / 1e6:.2f}M bf16 parameters in {args.matrices} matrices of {shape}; torch {torch.__version__}; "
          f"median over {args.repeat} repeats of {args.steps} steps (range in brackets)")

    for t in threads:
        torch.set_num_threads(t)
        for opt in optimizers.values():
            for _ in range(args.warmup):
                opt.step()
        times = {name: [] for name in optimizers}
        for _ in range(args.repeat):
            for name, opt in optimizers.items():
                times[name].append(_time(opt, args.steps))
        base = times["torch fused"]
        print(f"\n{t} thread{'s' if t > 1 else ''}:")
        print(f"  {'optimizer':<12} {'ms/step':>8} {'(range)':>15}   {'ratio':>6} {'(range)':>13}  target")
        for name, ts in times.items():
            ratios = [a / b for a, b in zip(ts, base)]
            target = TARGETS.get(t, {}).get(name)
            mark = "" if target is None else f"<= {target:.1f} {'ok' if statistics.median(ratios) <= target else 'MISSED'}"
            print(f"  {name:<12} {statistics.median(ts) * 1e3:8.1f} ({min(ts) * 1e3:6.1f}-{max(ts) * 1e3:6.1f})   "
                  f"{statistics.median(ratios):6.3f} ({min(ratios):.3f}-{max(ratios):.3f})  {mark}")


if __name__ == "__main__":
    main()
