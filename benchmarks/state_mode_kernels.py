"""One kernel alone, per state encoding, against the fp32-state kernel and torch's fused AdamW in the same run.

Times ``halfadam.executions._flat_kernel`` (``--impl fused``: compiled as the fused step compiles it)
or the C++ kernel's ``adam_step`` (``--impl cpp``) over one flat bucket of bf16 parameters for each
state format: fp32 state, split master, bf16 ``exp_avg``, uint8 ``exp_avg``, uint8 ``exp_avg_sq``,
the ``bf16``, ``compact`` and ``tiny`` presets; and ``torch.optim.AdamW(fused=True)`` over as many fp32
parameters. No per-tensor entry costs: this isolates the cost of each encoding, which is where a
mode's step time goes. Prints ms and the ratios to the fp32 state and to torch.

    python benchmarks/state_mode_kernels.py [--impl cpp] [--numel 4e6] [--threads 1] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from halfadam import encodings as E
from halfadam import executions as X
from halfadam.functional import ADAM, adam_coefficients
from halfadam.kernels import cpp as cpu_kernel

FORMATS = {
    "fp32 state": E.StateFormat(),
    "split master": E.StateFormat("split"),
    "bf16 exp_avg": E.StateFormat("fp32", torch.bfloat16, torch.float32),
    "uint8 exp_avg": E.StateFormat("fp32", torch.uint8, torch.float32),
    "uint8 exp_avg_sq": E.StateFormat("fp32", torch.float32, torch.uint8),
    "bf16 preset": E.PRESETS["bf16"],
    "compact preset": E.PRESETS["compact"],
    "tiny preset": E.PRESETS["tiny"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=float, default=4e6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--impl", choices=("fused", "cpp"), default="fused")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n = int(args.numel) // E.BLOCK * E.BLOCK
    f64 = dict(dtype=torch.float64)
    coefficients = adam_coefficients(step=torch.tensor(3.0, **f64), lr=torch.tensor(1e-3, **f64), beta1=0.9,
                                     beta2=0.999, eps=1e-8, weight_decay=torch.tensor(0.01, **f64))
    device = torch.device("cpu")
    runs = {}
    for name, fmt in FORMATS.items():
        param = (torch.randn(n) * 0.02).bfloat16()
        grad = (torch.randn(n) * 1e-3).bfloat16()
        stored = {k: torch.zeros(n, dtype=dt) for k, dt in E.element_keys(fmt, True).items()}
        stored.update({k: torch.zeros(n // E.BLOCK, dtype=dt) for k, dt in E.block_keys(fmt, True).items()})
        if "master_weight" in stored:
            stored["master_weight"].copy_(param)
        kwargs = dict(fmt=fmt, rule=ADAM, flags=(False, False))
        seed = E.random_seed(fmt, 3, device)
        if args.impl == "cpp":
            kernel, floats = cpu_kernel.load(), [float(c) for c in coefficients]
            runs[name] = (lambda stored=stored, grad=grad, param=param:
                          kernel.adam_step([param], [grad], stored, [0], [0], [n], floats, None, False, False, 3,
                                           []))
        else:
            runs[name] = (lambda stored=stored, grad=grad, param=param, seed=seed, kwargs=kwargs:
                          X._run_kernel("fused", stored, grad, param, coefficients, seed, None, **kwargs))
        runs[name]()  # compile
    weight = torch.nn.Parameter(torch.randn(n) * 0.02)
    weight.grad = torch.randn(n) * 1e-3
    torch_opt = torch.optim.AdamW([weight], lr=1e-3, weight_decay=0.01, fused=True)
    runs["torch fused (fp32)"] = torch_opt.step
    torch_opt.step()
    times = {k: [] for k in runs}
    for _ in range(args.repeat):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    base, ref = statistics.median(times["fp32 state"]), statistics.median(times["torch fused (fp32)"])
    print(f"{n / 1e6:.1f}M bf16 elements in one bucket, {args.impl} kernel, {args.threads} thread(s); "
          f"median of {args.repeat}")
    for name in runs:
        t = statistics.median(times[name])
        print(f"  {name:18s} {t * 1e3:8.2f} ms  {t / base:6.2f}x fp32 state  {t / ref:6.2f}x torch fused")


if __name__ == "__main__":
    main()
