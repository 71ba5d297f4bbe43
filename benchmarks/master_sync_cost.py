"""What the master-sync rule costs in the fused kernel: the same compiled update with and without it.

The fused step reads each parameter's current value (2 B/param for fp16/bf16) and compares it with its
rounded master before the update (``halfadam.functional.sync_master_``). This script compiles the
bucket kernel (``halfadam.executions._flat_kernel``) twice over one flat 20M-element bucket, once as
shipped and once with the sync removed, and times both round-robin against
``torch.optim.AdamW(fused=True)`` on fp32 in the same run, at 1 thread and at 2.

    python benchmarks/master_sync_cost.py [--numel 2e7] [--repeat 15]
"""

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from halfadam import encodings, executions, functional  # noqa: E402


def _without_sync(weight, grad, exp_avg, exp_avg_sq, out, coefficients, grad_scale, decay, optimized_update):
    g = grad.to(torch.float32)
    if grad_scale is not None:
        g = g * grad_scale
    functional.adam_elementwise_(weight, g, exp_avg, exp_avg_sq, *coefficients, decay=decay,
                                 optimized_update=optimized_update)
    if out is not None:
        out.copy_(weight)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=float, default=2e7)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = ap.parse_args()
    n = int(args.numel)
    kernels = {"with sync": torch.compile(executions._flat_kernel, fullgraph=True,
                                          options={"emulate_precision_casts": True}),
               "without sync": torch.compile(_without_sync, fullgraph=True)}
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    f64 = dict(dtype=torch.float64, device=dev)
    coefficients = functional.adam_coefficients(step=torch.tensor(3.0, **f64), lr=torch.tensor(1e-3, **f64),
                                                beta1=0.9, beta2=0.999, eps=1e-8,
                                                weight_decay=torch.tensor(0.01, **f64))
    seed = torch.tensor(3, dtype=torch.int64, device=dev)
    for threads in (1, 2) if dev.type == "cpu" else (torch.get_num_threads(),):
        torch.set_num_threads(threads)
        p32 = torch.randn(n, device=dev).requires_grad_()
        p32.grad = torch.randn(n, device=dev) * 1e-3
        torch_opt = torch.optim.AdamW([p32], lr=1e-3, weight_decay=0.01, fused=True)
        runs = {"torch fused fp32": torch_opt.step}
        for dtype in (torch.float16, torch.bfloat16):
            master = torch.randn(n, device=dev) * 0.02
            param, grad = master.to(dtype), (torch.randn(n, device=dev) * 1e-3).to(dtype)
            m, v = torch.zeros(n, device=dev), torch.zeros(n, device=dev)
            state = {"master_weight": master, "exp_avg": m, "exp_avg_sq": v}
            runs[f"with sync {str(dtype)[6:]}"] = (lambda fn=kernels["with sync"], state=state, grad=grad, param=param:
                                                  fn(state, grad, param, coefficients, seed, None,
                                                     fmt=encodings.StateFormat(), rule=functional.ADAM,
                                                     flags=(False, False)))
            runs[f"without sync {str(dtype)[6:]}"] = (lambda fn=kernels["without sync"], master=master, grad=grad, m=m,
                                                     v=v, param=param: fn(master, grad, m, v, param, coefficients, None,
                                                                          decay="decoupled", optimized_update=False))
        times = {k: [] for k in runs}
        for r in range(args.repeat + 2):
            for name, run in runs.items():
                sync()
                t0 = time.perf_counter()
                run()
                sync()
                if r >= 2:
                    times[name].append(time.perf_counter() - t0)
        ref = statistics.median(times["torch fused fp32"])
        where = f"{threads} thread(s)" if dev.type == "cpu" else torch.cuda.get_device_name(dev)
        print(f"{where}, {n / 1e6:.0f}M elements in one bucket; median of {args.repeat}")
        for name, ts in times.items():
            t = statistics.median(ts)
            print(f"  {name:22s} {t * 1e3:7.2f} ms  {t / ref:5.2f}x torch fused")
        for dtype in ("float16", "bfloat16"):
            a, b = statistics.median(times[f"with sync {dtype}"]), statistics.median(times[f"without sync {dtype}"])
            print(f"  sync cost {dtype}: {100 * (a / b - 1):+.1f}%")


if __name__ == "__main__":
    main()
