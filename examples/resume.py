"""Stop a run, resume it in a new process, and get the bits of a run that never stopped.

bf16 parameters, halfadam's "tiny" state, a GradScaler that clips, a torch LR scheduler, dropout
(so torch's RNG matters) and a shuffled DataLoader (so the data position matters)::

    python examples/resume.py --steps 20 --out straight.pt                  # 20 steps in one go
    python examples/resume.py --steps 20 --stop-at 11 --save ckpt.pt        # 11 steps, save, exit
    python examples/resume.py --steps 20 --resume ckpt.pt --out resumed.pt  # load, steps 12-20

straight.pt and resumed.pt then hold the same bits (tests/test_resume_example.py checks it).
What a resume needs, and why: docs/checkpoints.md, "Resuming bit for bit".
"""

from __future__ import annotations

import argparse
import random

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import halfadam
from halfadam.checkpoint import load_checkpoint, save_checkpoint


def build(steps: int, implementation: str):
    """The run as it starts: model, optimizer, scaler, scheduler, data, and the generator that shuffles."""
    torch.manual_seed(0)  # the initial weights; dropout then draws from torch's RNG
    random.seed(0)  # unused here, but yours may draw from it (augmentation)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Dropout(0.2), nn.Linear(128, 8)).to(torch.bfloat16)
    opt = halfadam.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, state_mode="tiny",
                         implementation=implementation)
    scaler = halfadam.GradScaler(max_grad_norm=1.0)  # clips by the global norm inside the step
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    data = torch.Generator().manual_seed(1)
    x = torch.randn(64, 32, generator=data)
    y = (x[:, :8] + 0.5 * torch.randn(64, 8, generator=data)).argmax(1)
    shuffle = torch.Generator().manual_seed(2)  # the loader's own: mid-epoch, its state is the data position
    loader = DataLoader(TensorDataset(x.to(torch.bfloat16), y), batch_size=8, shuffle=True, generator=shuffle)
    return model, opt, scaler, scheduler, loader, shuffle


def rng_states() -> dict:
    states = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states  # numpy's too if you use it: see docs/checkpoints.md


def set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="train to this step")
    parser.add_argument("--stop-at", type=int, help="after this step, write --save and exit")
    parser.add_argument("--save", help="the checkpoint --stop-at writes")
    parser.add_argument("--resume", help="continue from this checkpoint")
    parser.add_argument("--out", help="write the final state here (a checkpoint too)")
    parser.add_argument("--implementation", default="auto", help="halfadam's (every one gives the same bits)")
    args = parser.parse_args(argv)

    model, opt, scaler, scheduler, loader, shuffle = build(args.steps, args.implementation)
    objects = dict(model=model, optimizer=opt, scaler=scaler, scheduler=scheduler)
    step, batch = 0, 0                # steps done; batches of this epoch done
    epoch_start = shuffle.get_state()  # the loader draws this epoch's order from this state
    if args.resume:
        saved = load_checkpoint(args.resume, **objects)  # all checked, then loaded
        step, batch, epoch_start = saved["step"], saved["batch"], saved["epoch_start"]
        set_rng_states(saved["rng"])

    def save(path):
        save_checkpoint(path, **objects, step=step, batch=batch, epoch_start=epoch_start, rng=rng_states())

    while step < args.steps:
        shuffle.set_state(epoch_start)
        for i, (x, y) in enumerate(loader):
            if i < batch:
                continue  # taken before the checkpoint
            opt.zero_grad()
            loss = F.cross_entropy(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scheduler.step()
            step, batch = step + 1, batch + 1
            print(f"step {step} loss {loss.item():.6f} lr {scheduler.get_last_lr()[0]:.6e}")
            if step == args.stop_at:
                save(args.save)
                print(f"saved at step {step}: {args.save}")
                return
            if step == args.steps:
                break
        else:
            batch, epoch_start = 0, shuffle.get_state()
    if args.out:
        save(args.out)


if __name__ == "__main__":
    main()
