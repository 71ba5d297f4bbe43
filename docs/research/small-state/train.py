"""halfadam train's job (digits / char-lm: the CLI's data, model, batch plan and loop) in each mode,
compared with fp32 on the same seed. Appends rows to results/<task>-<steps>[-cosine].jsonl.

  PYTHONPATH=src nice -n 10 python3 docs/research/small-state/train.py --task digits --seeds 0-4 \
      --modes fp32,compact,flashoptim,P:M8sr:m8:V4log1
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import proto  # noqa: E402
from halfadam.cli import train as T  # noqa: E402
from halfadam.cli.models import relative_distance  # noqa: E402


def config(task, steps, seed, schedule):
    d = T.TASK_DEFAULTS[task]
    steps = steps or d["steps"]
    char = task == "char-lm"
    return T.TrainConfig(task=task, modes=[], steps=steps, batch_size=d["batch_size"], lr=d["lr"],
                         lr_schedule=schedule, warmup_steps=max(1, steps // 10), weight_decay=0.0, seed=seed,
                         device="cpu", out="/tmp/unused", eval_every=steps, text=None, seq_len=64 if char else None,
                         d_model=128 if char else None, layers=2 if char else None, heads=4 if char else None,
                         progress=False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="digits")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--schedule", default="constant", choices=("constant", "cosine"))
    ap.add_argument("--modes", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    a, _, b = args.seeds.partition("-")
    seeds = range(int(a), int(b or a) + 1)
    names = [n for n in args.modes.split(",") if n]
    (HERE / "cache").mkdir(exist_ok=True)
    (HERE / "results").mkdir(exist_ok=True)
    for seed in seeds:
        cfg = config(args.task, args.steps, seed, args.schedule)
        tag = f"{cfg.task}-{cfg.steps}" + ("-cosine" if args.schedule == "cosine" else "")
        dataset, base_model, _, _ = T.build_task(cfg)
        plan = dataset.sample_plan(cfg.steps, cfg.batch_size, cfg.seed)
        ref_path = HERE / "cache" / f"{tag}-s{seed}-fp32.pt"
        todo = names if ref_path.exists() or "fp32" in names else ["fp32"] + names
        for name in todo:
            proto.SEED[0] = seed
            torch.manual_seed(seed)
            t0 = time.time()
            metrics, (final, _) = T.train_mode(proto.get_mode(name), base_model, dataset, plan, cfg, torch.device("cpu"))
            val = metrics["final_val_loss"]
            if name == "fp32":
                torch.save({"final": final, "val": val}, ref_path)
            ref = torch.load(ref_path)
            ok = metrics["diverged_at_step"] is None and math.isfinite(val)
            shapes = [tuple(t.shape) for t in final]
            row = dict(mode=name, task=cfg.task, steps=cfg.steps, schedule=args.schedule, seed=seed, val=val,
                       val_vs_fp32_pct=100 * (val - ref["val"]) / ref["val"] if ok else None,
                       dist=relative_distance(final, ref["final"]) if ok else None,
                       B_per_param_2d=bytes_2d(name, shapes), wall_s=round(time.time() - t0, 1))
            print(json.dumps(row), flush=True)
            with open(HERE / "results" / f"{tag}.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")


def bytes_2d(name, shapes):
    """State bytes per parameter over the model's >= 2-D parameters (prototype modes)."""
    if not name.startswith("P:"):
        return None
    _, master, m, v = name.split(":")
    s2 = [s for s in shapes if len(s) >= 2]
    return round(sum(proto.C.state_bytes(s, master, m, v) for s in s2) / sum(math.prod(s) for s in s2), 4)


if __name__ == "__main__":
    main()
