"""Data-parallel training with halfadam under torch.distributed: DDP, ZeRO-1 or FSDP2.

On one machine, CPU (gloo), 2 processes::

    python examples/distributed_train.py --nproc 2 --mode ddp --dtype fp16
    torchrun --standalone --nproc-per-node 2 examples/distributed_train.py --mode fsdp --dtype bf16
    python examples/distributed_train.py --nproc 2 --mode fsdp --dtype bf16 --state-mode compact

On GPUs the same script uses nccl (one GPU per process; torchrun sets LOCAL_RANK). Each process takes
its slice of every global batch; rank 0 prints the global mean loss.
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist
import torch.nn as nn

import halfadam
import halfadam.distributed as hd

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def train(rank: int, world: int, args: argparse.Namespace) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)  # the same initial weights on every rank
    # rows of 128 and 256 elements: whole blocks, so the per-block state modes apply to both weights
    model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 10)).to(device=device, dtype=dtype)
    kw = dict(lr=args.lr, weight_decay=0.01, state_mode=args.state_mode)

    if args.mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        net = model
        opt = halfadam.AdamW(model.parameters(), **kw)
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = DDP(model, gradient_as_bucket_view=True)
        if args.mode == "zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=halfadam.AdamW, **kw)
        else:
            opt = halfadam.AdamW(net.parameters(), **kw)
    # The scaler agrees on inf/nan over the default process group (process_group="auto").
    scaler = halfadam.GradScaler(enabled=dtype == torch.float16)

    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(128, 10, generator=g)
    for step in range(args.steps):
        x = torch.randn(args.batch_size, 128, generator=g)  # the global batch, the same on every rank
        y = (x @ teacher).argmax(-1)
        x, y = x.chunk(world)[rank].to(device, dtype), y.chunk(world)[rank].to(device)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(net(x).float(), y)
        scaler.scale(loss).backward()
        scaler.clip_grad_norm_(opt, 1.0)  # the global norm, across shards under FSDP2
        scaler.step(opt)
        scaler.update()
        mean = loss.detach().reshape(1).clone()
        dist.all_reduce(mean)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {mean.item() / world:.4f}", flush=True)
    if rank == 0:
        print(f"done: {args.mode}, {args.dtype}, {world} processes, state_mode={args.state_mode}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("ddp", "zero", "fsdp"), default="ddp")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch (divisible by the processes)")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--state-mode", choices=tuple(halfadam.encodings.PRESETS), default="fp32",
                        help="halfadam's state mode (every one works under DDP, ZeRO-1 and FSDP2)")
    parser.add_argument("--nproc", type=int, default=1, help="processes to spawn here (ignored under torchrun)")
    args = parser.parse_args(argv)
    rank, world = hd.init_from_env()  # under torchrun
    if world > 1:
        try:
            train(rank, world, args)
            gc.collect()  # free DDP (in reference cycles) before gloo is torn down, on every rank
            dist.barrier()
        finally:
            dist.destroy_process_group()
    else:
        hd.launch(train, args.nproc, args)  # --nproc N: N gloo processes on this machine


if __name__ == "__main__":
    main()
