"""Where real exp_avg_sq values sit inside their 128-blocks: train halfadam (bf16, reference impl) for a few
steps on the CLI's task, then report, over all elements with v > 0, the fraction that each 8-bit encoding
sends to 0 (nearest rounding) or clamps (log8 range), relative to the block absmax.
Usage: PYTHONPATH=src python3 vstats.py --task digits --steps 300
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moments  # noqa: E402
import train_compare as TC  # noqa: E402
from halfadam.cli import train as T  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="digits")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--block", type=int, default=128)
    a = ap.parse_args()
    torch.set_num_threads(1)
    cfg = TC.config(a.task, a.steps)
    ds, base, _, _ = T.build_task(cfg)
    plan = ds.sample_plan(cfg.steps, cfg.batch_size, cfg.seed)
    T.train_mode(TC.get_mode("bf16-halfadam-ref"), base, ds, plan, cfg, torch.device("cpu"))
    opt = TC.LAST_OPT[0]
    rel = []
    for st in opt.state.values():
        v = st["exp_avg_sq"].reshape(-1)
        pad = (-v.numel()) % a.block
        b = torch.cat([v, v.new_zeros(pad)]).view(-1, a.block)
        r = b / b.amax(1, keepdim=True).clamp_min(1e-38)
        rel.append(r[b > 0])
    r = torch.cat(rel).double()
    dmin = float(moments.dynamic_map(False)[1])
    print(f"{a.task}, {a.steps} steps, block {a.block}: {r.numel():,} elements with v > 0; "
          f"median v/blockmax {float(r.median()):.2e}")
    for label, thr in [("lin8u -> 0 (v < max/510)", 1 / 510), ("sqrt8 -> 0 (sqrt v < sqrt max/510)", (1 / 510) ** 2),
                       (f"dyn8u -> 0 (v < {dmin/2:.2e} max)", dmin / 2), ("log8 R=16 clamped (v < 2^-16 max)", 2.0**-16),
                       ("log8 R=24 clamped (v < 2^-24 max)", 2.0**-24), ("log8 R=32 clamped (v < 2^-32 max)", 2.0**-32)]:
        print(f"  {label:40s} {float((r < thr).double().mean()):.4f}")


if __name__ == "__main__":
    main()
