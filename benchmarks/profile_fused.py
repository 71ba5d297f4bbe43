"""Where the time of a fused mixed-precision step goes (CPU), against torch.optim.AdamW(fused=True).

    PYTHONPATH=src python benchmarks/profile_fused.py [--numel 20000000] [--tensors 50] [--threads N]

Times, round-robin in one run (median of --repeat): the whole halfadam fused step on fp16 parameters;
its parts (the per-step scalars, the compiled kernel called once per parameter as the step does); the
same kernel over one flat buffer; torch's fused AdamW on fp32 parameters; and a plain copy of 28 B/param
(the memory-bandwidth floor). The step minus its parts is Python and dispatch overhead.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # this checkout's halfadam

import halfadam
from halfadam import executions
from halfadam.bench import _make_params
from halfadam.functional import adam_coefficients


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=20_000_000)
    ap.add_argument("--tensors", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    n = a.numel
    ps = _make_params(dict(numel=n, tensors=a.tensors), torch.float16, "cpu", 0)
    opt = halfadam.AdamW(ps, lr=1e-3, weight_decay=0.01, implementation="fused")
    opt.step()
    b = opt._states.group_layout(opt.param_groups[0]).buckets[0]
    grads = [p.grad for p in ps]
    f64 = dict(dtype=torch.float64)
    kernel = executions._get_compiled(("profile",))
    kw = dict(master="fp32", exp_avg=torch.float32, exp_avg_sq=torch.float32, decay="decoupled",
              optimized_update=False)
    seed = torch.tensor(1, dtype=torch.int64)

    def coeffs():
        return adam_coefficients(step=b.steps[0].to(**f64), lr=torch.tensor(1e-3, **f64), beta1=0.9, beta2=0.999,
                                 eps=1e-8, weight_decay=torch.tensor(0.01, **f64))

    c = coeffs()

    def per_param_kernels():  # what the step runs: one call per (large) parameter, in place
        for i, (p, g) in enumerate(zip(ps, grads)):
            kernel(b.segment(i, i + 1), g.view(-1), p.detach().view(-1), c, seed, None, None, **kw)

    flat_grad = torch.cat([g.view(-1) for g in grads])
    flat_out = torch.empty(n, dtype=torch.float16)
    tp = _make_params(dict(numel=n, tensors=a.tensors), torch.float32, "cpu", 0)
    topt = torch.optim.AdamW(tp, lr=1e-3, weight_decay=0.01, fused=True)
    topt.step()
    src = torch.empty(n * 7, dtype=torch.float32)  # 28 B/param: read 14 B, write 14 B
    dst = torch.empty_like(src[: n * 7 // 2])
    parts = {
        "halfadam fused step (fp16 params)": opt.step,
        "  per-step scalars (eager 0-d ops)": coeffs,
        "  compiled kernel, one call per parameter": per_param_kernels,
        "(same kernel over one flat buffer)": lambda: kernel(b.segment(0, len(ps)), flat_grad, flat_out, c, seed, None, None,
                                                             **kw),
        "torch.optim.AdamW(fused=True) fp32": topt.step,
        "copy 14 B/param -> 14 B/param (bandwidth floor)": lambda: dst.copy_(src[: n * 7 // 2]),
    }
    times = {k: [] for k in parts}
    for r in range(a.repeat + 2):
        for k, f in parts.items():
            t = time.perf_counter()
            f()
            dt = time.perf_counter() - t
            if r >= 2:
                times[k].append(dt)
    base = statistics.median(times["torch.optim.AdamW(fused=True) fp32"])
    print(f"{n} params in {a.tensors} tensors, {torch.get_num_threads()} threads")
    for k, ts in times.items():
        t = statistics.median(ts)
        print(f"{k:52s} {t * 1e3:8.2f} ms  {t / n * 1e9:6.3f} ns/param  {t / base:5.2f}x torch fused")


if __name__ == "__main__":
    main()
