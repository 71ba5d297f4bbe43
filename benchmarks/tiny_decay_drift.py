"""How far ``state_mode="tiny"``'s masters drift from ``"fp32"``'s under weight decay alone.

A split8 master (``"tiny"``, bfloat16 parameters) rounds its 8-bit remainder stochastically each
step: unbiased, but a weight that gets no gradient accumulates the rounding noise as a random walk
away from the exact (``"fp32"``) master. This script steps two ``halfadam.AdamW(lr=1e-3,
weight_decay=0.1)`` optimizers, ``state_mode="tiny"`` and ``state_mode="fp32"``, over the same
bfloat16 weights (``--numel`` elements rounded down to whole rows of 1,024, ``randn + 2``: the weights of
``tests/test_split8_master.py``'s decay test) with zero gradients, and prints at each checkpoint
(1,000, 3,000, 10,000, ... up to ``--steps``):

* the standard deviation and the maximum of ``tiny master - fp32 master`` in bf16 ulps of the fp32
  master (``opt.master_weight(p)``);
* the share of weights whose bfloat16 parameter differs from the fp32 mode's parameter;

and last, the fit ``std = k * sqrt(steps)`` (least squares over the checkpoints) with each
checkpoint's ``std / sqrt(steps)``: constant for a random walk.

    python benchmarks/tiny_decay_drift.py [--steps 10000] [--numel 1e6] [--implementation auto]

One thread (``torch.set_num_threads(1)``); with the C++ kernel 10,000 steps of 1M weights take about
35 s, 30,000 about 105 s (docs/state-modes.md's table).
"""

from __future__ import annotations

import argparse
import math
import time

import torch

import halfadam

ROW = 1024


def checkpoints(steps: int) -> list:
    """1,000, 3,000, 10,000, 30,000, ... up to ``steps`` (and ``steps`` itself)."""
    marks, k = [], 0
    while True:
        for m in (1, 3):
            c = m * 1000 * 10**k
            if c < steps:
                marks.append(c)
            else:
                return marks + [steps]
        k += 1


def drift(opt_tiny, p_tiny, opt_fp32, p_fp32) -> dict:
    """The tiny master's distance from the fp32 one, in bf16 ulps of the fp32 master, and the share
    of bfloat16 parameters that differ."""
    ref = opt_fp32.master_weight(p_fp32).detach().double()
    ulp = torch.exp2(torch.floor(torch.log2(ref.abs())) - 7)
    d = (opt_tiny.master_weight(p_tiny).detach().double() - ref) / ulp
    return {"std": d.std().item(), "max": d.abs().max().item(), "mean": d.mean().item(),
            "off": (p_tiny.detach() != p_fp32.detach()).double().mean().item()}


def run(steps: int, numel: int, implementation: str, seed: int = 3, out=print) -> list:
    """Step both optimizers ``steps`` times; return a row (a dict) per checkpoint."""
    g = torch.Generator().manual_seed(seed)
    w0 = (torch.randn(max(numel // ROW, 1), min(numel, ROW), generator=g) + 2.0).to(torch.bfloat16)  # whole rows
    params, opts = {}, {}
    for mode in ("tiny", "fp32"):
        params[mode] = torch.nn.Parameter(w0.clone())
        params[mode].grad = torch.zeros_like(w0)
        opts[mode] = halfadam.AdamW([params[mode]], lr=1e-3, weight_decay=0.1, state_mode=mode,
                                    implementation=implementation)
    rows, done, start = [], 0, time.perf_counter()
    for mark in checkpoints(steps):
        for _ in range(mark - done):
            opts["tiny"].step()
            opts["fp32"].step()
        done = mark
        row = {"steps": mark, **drift(opts["tiny"], params["tiny"], opts["fp32"], params["fp32"]),
               "seconds": time.perf_counter() - start}
        out(f"{mark:>8,} {row['std']:>9.3f} {row['max']:>9.2f} {row['mean']:>+10.4f} {100 * row['off']:>7.1f}% "
            f"{row['std'] / math.sqrt(mark):>12.5f} {row['seconds']:>7.0f} s")
        rows.append(row)
    return rows


def sqrt_fit(rows: list) -> float:
    """The least-squares k of ``std = k * sqrt(steps)``."""
    return sum(r["std"] * math.sqrt(r["steps"]) for r in rows) / sum(r["steps"] for r in rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10000, help="the last checkpoint (default 10000)")
    ap.add_argument("--numel", type=float, default=1e6, help="weights, in rows of 1,024 (default 1e6)")
    ap.add_argument("--implementation", default="auto", help="halfadam's implementation= (default auto)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.numel < 1:
        ap.error("--steps and --numel must be positive")
    torch.set_num_threads(1)
    numel = int(args.numel)
    rows_of, row = max(numel // ROW, 1), min(numel, ROW)
    print(f"tiny vs fp32 masters, zero gradients, AdamW lr 1e-3, weight_decay 0.1: {rows_of} x {row} bf16 weights "
          f"(randn + 2), implementation={args.implementation!r}, torch {torch.__version__}")
    print(f"{'steps':>8} {'std ulp':>9} {'max ulp':>9} {'mean ulp':>10} {'bf16 off':>8} "
          f"{'std/sqrt(t)':>12} {'elapsed':>9}")
    rows = run(args.steps, numel, args.implementation)
    k = sqrt_fit(rows)
    worst = max(abs(r["std"] / (k * math.sqrt(r["steps"])) - 1) for r in rows)
    print(f"fit: std = {k:.5f} * sqrt(steps) ulp (each checkpoint within {100 * worst:.0f}% of it)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
