"""FSDP2 on one rank with and without ``CPUOffloadPolicy``: step time, device and host bytes per parameter.

Each configuration runs in its own process (``halfadam.distributed.launch``, one rank): a stack of
bf16 ``Linear(width, width)`` layers, each its own ``fully_shard`` unit, a halfadam optimizer of the
given state mode, ``--warmup`` steps then ``--steps`` timed steps (forward, backward, optimizer
step). Printed per configuration: the median step time, the device's peak allocated bytes per
parameter (``torch.cuda.max_memory_allocated``, CUDA only) and the host's resident bytes per parameter
that the model, its training and its optimizer added (``VmRSS`` of ``/proc/self/status`` before the
model is built and after the last step, its gradients still alive, freed heap pages returned first: measured, not computed; the
process's peak ``VmHWM`` beside it, per parameter, includes torch itself). ``--modes torch``:
``torch.optim.AdamW`` on float32 parameters. On CUDA the offloaded run uses
``pin_memory=True`` (FSDP2's default: pinned host shards, asynchronous copies); on the CPU
``pin_memory=False`` (pinning needs an accelerator) and offloading changes only FSDP2's code path.

    python benchmarks/offload_step.py [--device cuda] [--width 4096] [--layers 8] [--modes fp32,tiny]
"""

import argparse
import ctypes
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

import halfadam  # noqa: E402
import halfadam.distributed as hd  # noqa: E402


def _status_bytes(key: str) -> int:
    """``VmRSS`` (resident now) or ``VmHWM`` (its peak) of this process, in bytes, after glibc has
    returned its freed heap pages to the system (``malloc_trim``), so that freed memory is not counted."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: resident memory as it is
        pass
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(f"{key}:"))


def _run(rank, world, device, width, layers, mode, offload, warmup, steps, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    cuda = device == "cuda"
    rss0 = _status_bytes("VmRSS")
    torch.manual_seed(0)
    # offloading needs the parameters materialized on the CPU; without it they start on the device.
    # "torch": torch.optim.AdamW on float32 parameters (what torchao's offload keeps by default)
    dtype = torch.float32 if mode == "torch" else torch.bfloat16
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]).to(dtype)
    if not offload:
        model.to(device)
    policy = CPUOffloadPolicy(pin_memory=cuda) if offload else OffloadPolicy()
    mesh = init_device_mesh(device, (1,))
    for layer in model:
        fully_shard(layer, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1) if mode == "torch" else
           halfadam.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, state_mode=mode))
    numel = sum(p.numel() for p in model.parameters())
    x = torch.randn(8, width, device=device, dtype=dtype)
    times = []
    for t in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        model(x).float().pow(2).mean().backward()
        opt.step()
        if t == warmup + steps - 1:  # parameters, gradients and state alive
            host = (_status_bytes("VmRSS") - rss0) / numel
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if t >= warmup:
            times.append(time.perf_counter() - start)
    where = next(iter(model.parameters())).device
    peak = torch.cuda.max_memory_allocated() / numel if cuda else float("nan")
    print(f"{mode:8s} offload={'yes' if offload else 'no ':3s} params on {where.type:4s} {numel / 1e6:7.1f}M: "
          f"step {statistics.median(times) * 1e3:8.1f} ms, device peak {peak:6.2f} B/param, "
          f"host RSS added {host:6.2f} B/param (peak {_status_bytes('VmHWM') / numel:6.2f} of the process)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--modes", default="fp32,tiny", help="halfadam state modes, or torch (AdamW, fp32 parameters)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    backend = "nccl" if args.device == "cuda" else "gloo"
    print(f"torch {torch.__version__}, {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else "")
          + f", {torch.get_num_threads()} threads")
    for mode in args.modes.split(","):
        for offload in (False, True):
            hd.launch(_run, 1, args.device, args.width, args.layers, mode, offload, args.warmup, args.steps, None,
                      backend=backend, timeout_s=600)


if __name__ == "__main__":
    main()
