"""Check of the FlashOptim CPU harness (fo_cpu.py): the decay probe (zero gradients, lr 1e-3, wd 0.1,
1,000 steps; fp32 and FlashOptim's own math give (1 - lr wd)^1000 = 0.9048), through its fused Triton
kernel (interpreted) and through its unfused torch path (fused=False), and a 20-step comparison of the
two paths' masters on random gradients.

  PYTHONPATH=src nice -n 10 python3 docs/research/small-state/fo_check.py
"""
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import proto  # noqa: E402
import probes  # noqa: E402


def main():
    torch.set_num_threads(1)
    out = dict(decay_fused=probes.decay("flashoptim"))
    import flashoptim
    g = torch.Generator().manual_seed(3)
    w0 = torch.randn(16, 128, generator=g) + 2.0
    res = {}
    for fused in (True, False):
        p = torch.nn.Parameter(w0.to(torch.bfloat16))
        opt = proto.flashoptim_adamw([p], lr=1e-3, weight_decay=0.1, fused=fused)
        for t in range(1000):
            p.grad = torch.zeros_like(p)
            opt.step()
        res[fused] = (proto.flashoptim_master(opt, p).norm() / w0.to(torch.bfloat16).float().norm()).item()
    out["decay_fused_direct"], out["decay_unfused"] = res[True], res[False]
    gg = torch.Generator().manual_seed(4)
    grads = [torch.randn(16, 128, generator=gg) for _ in range(20)]
    ms = {}
    for fused in (True, False):
        p = torch.nn.Parameter(w0.to(torch.bfloat16))
        opt = proto.flashoptim_adamw([p], lr=1e-3, weight_decay=0.1, fused=fused)
        for t in range(20):
            p.grad = grads[t].to(torch.bfloat16)
            opt.step()
        ms[fused] = proto.flashoptim_master(opt, p).clone()
    out["fused_vs_unfused_20_steps_rel"] = ((ms[True] - ms[False]).norm() / (ms[False] - w0).norm()).item()
    print(json.dumps(out), flush=True)
    with open(HERE / "results" / "fo_check.jsonl", "a") as f:
        f.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
