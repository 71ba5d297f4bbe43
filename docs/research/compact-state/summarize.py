"""Print the results table (markdown) from results/*.jsonl.

State B/param is computed analytically from the mode and the model's parameter shapes: int16 low bits
(split) 2 B, fp32 master 4 B, fp32/bf16 moments 4/2 B, 8-bit block codecs n + 4*ceil(n/B) bytes per
tensor (one fp32 scale per block, no padding stored).  The last run of a (task, steps, mode) wins.
Usage: python3 summarize.py [--steps-char 800] [--steps-digits 300]
"""
import argparse
import json
import math
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from halfadam.cli.models import CharGPT, DigitsMLP  # noqa: E402


def shapes(task):
    m = CharGPT(102, 64, 128, 2, 4) if task == "char-lm" else DigitsMLP(64, 10)
    return [p.numel() for p in m.parameters()]


def codec_bytes(spec, n):
    if spec == "fp32":
        return 4 * n
    if spec.startswith("bf16"):
        return 2 * n
    block = int(spec.split("-")[1])
    return n + 4 * math.ceil(n / block)


def state_bpp(mode, task):
    ns = shapes(task)
    total = sum(ns)
    if not mode.startswith("C:"):
        return {"fp32": 8.0}.get(mode, 12.0)
    _, master, m, v = mode.split(":")
    b = sum((2 if master.startswith("split") else 4) * n + codec_bytes(m, n) + codec_bytes(v, n) for n in ns)
    return b / total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps-char", type=int, default=800)
    ap.add_argument("--steps-digits", type=int, default=300)
    args = ap.parse_args()
    rows = {}
    for task, steps in (("char-lm", args.steps_char), ("digits", args.steps_digits)):
        path = HERE / "results" / f"{task}-{steps}.jsonl"
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            r = json.loads(line)
            rows.setdefault(r["mode"], {}).setdefault(task, []).append(r)
    print("| mode | B/param (char-LM / digits) | char-LM val vs fp32 | char-LM dist | digits val vs fp32 | digits dist |")
    print("|---|---|---|---|---|---|")

    def cell(runs, key, fmt):
        if not runs:
            return "-"
        xs = [r.get(key) for r in runs]
        if any(x is None or not math.isfinite(x) for x in xs):
            return "diverged"
        if len(xs) == 1:
            return fmt.format(xs[0])
        # repeated runs (stochastic rounding draws differ): first run, then [min, max] over n runs
        return f"{fmt.format(xs[0])} [{fmt.format(min(xs))}, {fmt.format(max(xs))}; n={len(xs)}]"

    for mode, by in rows.items():
        c, d = by.get("char-lm"), by.get("digits")
        if d and mode in ("C:split:fp32:fp32",):  # the first digits runs were repeated after a bug fix: keep the last
            d = d[-1:]
        print(f"| {mode} | {state_bpp(mode, 'char-lm'):.3f} / {state_bpp(mode, 'digits'):.3f} | "
              f"{cell(c, 'val_vs_fp32_pct', '{:+.3f}%')} | {cell(c, 'dist', '{:.2e}')} | "
              f"{cell(d, 'val_vs_fp32_pct', '{:+.2f}%')} | {cell(d, 'dist', '{:.2e}')} |")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
