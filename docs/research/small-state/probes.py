"""Three probes of each mode against torch.optim.AdamW on fp32 weights (the same start, bf16(w0)):

  small   lr 1e-5, no decay, gradients 1 + 0.1 N(0,1), weights 1 + 0.01 N(0,1), 2,000 steps: the master's
          distance to fp32's (relative to fp32's movement) and the share of masters that never moved
  decay   zero gradients, lr 1e-3, wd 0.1, 1,000 steps, weights N(0,1) + 2: master norm / start (fp32 0.9048)
  elem    tests/test_state_modes.py's small element beside large ones (column 7 of 64 x 128, its gradient
          s for 50 steps then 0 for 200): mean of moved / fp32's moved after the gradient stops;
          elem-scatter: the small element in a random column of each row (not a whole column)

  PYTHONPATH=src nice -n 10 python3 docs/research/small-state/probes.py compact P:M8sr:m8:V4log1 ...
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import proto  # noqa: E402


def run(name, w0, grads, steps, lr, wd):
    """Train one weight tensor from bf16(w0) with gradients grads(step); returns (start, final) masters."""
    dtype = torch.float32 if name == "fp32" else torch.bfloat16
    p = torch.nn.Parameter(w0.to(torch.bfloat16).to(dtype))
    opt = proto.make_optimizer(name, [p], lr=lr, weight_decay=wd)
    start, marks = w0.to(torch.bfloat16).float(), {}
    for t in range(steps):
        p.grad = grads(t).to(dtype)
        opt.step()
        if t == getattr(grads, "mark", -1):
            marks["mark"] = proto.master_of(opt, p).clone()
    return start, proto.master_of(opt, p).clone(), marks.get("mark")


def small_update(name):
    g = torch.Generator().manual_seed(0)
    w0 = 1.0 + 0.01 * torch.randn(16, 128, generator=g)
    noise = torch.randn(2000, 16, 128, generator=g)
    grads = lambda t: 1.0 + 0.1 * noise[t]  # noqa: E731
    start, ref, _ = run("fp32", w0, grads, 2000, 1e-5, 0.0)
    start, w, _ = run(name, w0, grads, 2000, 1e-5, 0.0)
    return dict(small_dist_rel_move=((w - ref).norm() / (ref - start).norm()).item(),
                small_never_moved=(w == start).float().mean().item(),
                small_moved_vs_fp32=((start - w).mean() / (start - ref).mean()).item())


def decay(name):
    g = torch.Generator().manual_seed(3)
    w0 = torch.randn(16, 128, generator=g) + 2.0
    start, w, _ = run(name, w0, lambda t: torch.zeros(16, 128), 1000, 1e-3, 0.1)
    return dict(decay_norm_ratio=(w.norm() / start.norm()).item())


def elem(name, small, scatter):
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    w0 = torch.randn(64, 128) * 0.1 + 1.0
    cols = torch.randint(0, 128, (64,), generator=torch.Generator().manual_seed(5)) if scatter else torch.full((64,), 7)
    rows = torch.arange(64)
    noise = torch.randn(250, 64, 128, generator=g)

    def grads(t):
        x = 1.0 + 0.1 * noise[t]
        x[rows, cols] = small if t < 50 else 0.0
        return x
    grads.mark = 49
    _, ref, ref_mark = run("fp32", w0, grads, 250, 1e-3, 0.0)
    _, w, mark = run(name, w0, grads, 250, 1e-3, 0.0)
    moved_ref, moved = (ref - ref_mark)[rows, cols], (w - mark)[rows, cols]
    return (moved / moved_ref).mean().item()


def main():
    torch.set_num_threads(1)
    (HERE / "results").mkdir(exist_ok=True)
    for name in sys.argv[1:]:
        row = dict(mode=name, **small_update(name), **decay(name))
        for small in (1e-2, 1e-3, 1e-4):
            row[f"elem_{small:g}"] = elem(name, small, False)
            row[f"elem_scatter_{small:g}"] = elem(name, small, True)
        print(json.dumps(row), flush=True)
        with open(HERE / "results" / "probes.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
