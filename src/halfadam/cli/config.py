"""The resolved configuration of one ``halfadam train`` run, and what it sets up.

:func:`resolve_config` turns the parsed options into a :class:`TrainConfig` (task defaults filled in,
what argparse cannot check checked); :func:`build_task` loads its data and builds its float32 model;
:func:`_lr_schedule` is its learning rate per step (the training loop and ``--resume``'s checks both
use it).

torch, the data and the models are imported where they are used (``halfadam train --help`` loads none).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .args import resolve_device
from .errors import CLIError
from .modes import PEER_MODES
from .optimizers import defaults as optimizer_defaults

if TYPE_CHECKING:
    import torch

TASKS = ("char-lm", "digits")

#: Per-task defaults for options left unset on the command line (``lr``: AdamW's; ``--optimizer sgd`` and
#: ``lion`` take theirs, and their weight decay, from :func:`halfadam.cli.optimizers.defaults`).
TASK_DEFAULTS = {
    "char-lm": {"steps": 800, "lr": optimizer_defaults("adamw", "char-lm")["lr"], "batch_size": 16},
    "digits": {"steps": 300, "lr": optimizer_defaults("adamw", "digits")["lr"], "batch_size": 64},
}


@dataclass
class TrainConfig:
    """The resolved configuration of one ``halfadam train`` run (recorded in ``metrics.json``)."""

    task: str
    modes: list[str]
    steps: int
    batch_size: int
    lr: float
    lr_schedule: str
    warmup_steps: int
    weight_decay: float
    seed: int
    device: str
    out: str
    eval_every: int
    text: str | None = None
    seq_len: int | None = None
    d_model: int | None = None
    layers: int | None = None
    heads: int | None = None
    progress: bool = field(default=True, repr=False)
    save: str | None = None
    save_every: int | None = None
    resume: str | None = None
    nproc: int = 1
    peers: bool = False
    dist: str = "ddp"
    offload: str | None = None
    optimizer: str = "adamw"  # the update rule (halfadam.cli.optimizers.ALGORITHMS)
    momentum: float | None = None  # SGD's momentum (None for AdamW and Lion)


def resolve_config(args: argparse.Namespace) -> tuple[TrainConfig, torch.device]:
    """Fill task defaults into the parsed options and validate what argparse cannot."""
    defaults = TASK_DEFAULTS[args.task]
    steps = args.steps or defaults["steps"]
    algorithm = getattr(args, "optimizer", "adamw")
    hyper = optimizer_defaults(algorithm, args.task)
    momentum = getattr(args, "momentum", None)
    if momentum is not None and algorithm != "sgd":
        raise CLIError(f"--momentum is SGD's: it needs --optimizer sgd, not --optimizer {algorithm}")
    if algorithm != "adamw" and (getattr(args, "peers", False) or any(m.name in PEER_MODES for m in args.modes)):
        raise CLIError(f"the peer modes are AdamWs: they run with --optimizer adamw, not --optimizer {algorithm}")
    if args.task == "char-lm" and args.d_model % args.heads:
        raise CLIError(f"--d-model {args.d_model} must be divisible by --heads {args.heads}")
    if args.text is not None and args.task != "char-lm":
        raise CLIError("--text only applies to --task char-lm")
    if args.text is not None:
        from .data import read_text_file

        read_text_file(args.text, max_chars=1)  # a missing or unreadable file fails before anything is created
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, steps // 10)
    offload = getattr(args, "offload", None)
    dist = getattr(args, "dist", None) or ("fsdp" if offload else "ddp")
    if offload and dist != "fsdp":
        raise CLIError(f"--offload {offload} runs under --dist fsdp (FSDP2's CPUOffloadPolicy), not --dist {dist}: "
                       f"leave --dist out or use --dist fsdp")
    if args.lr_schedule == "cosine" and warmup >= steps:
        raise CLIError(f"--warmup-steps {warmup} must be smaller than --steps {steps}")
    device = resolve_device(args.device)
    char = args.task == "char-lm"
    cfg = TrainConfig(
        task=args.task,
        modes=[m.name for m in args.modes],
        steps=steps,
        batch_size=args.batch_size or defaults["batch_size"],
        lr=args.lr or hyper["lr"],
        lr_schedule=args.lr_schedule,
        warmup_steps=warmup if args.lr_schedule == "cosine" else 0,
        weight_decay=hyper["weight_decay"] if args.weight_decay is None else args.weight_decay,
        seed=args.seed,
        device=str(device),
        out=args.out or str(Path("runs") / args.task),
        eval_every=args.eval_every or max(1, steps // 10),
        text=args.text if char else None,
        seq_len=args.seq_len if char else None,
        d_model=args.d_model if char else None,
        layers=args.layers if char else None,
        heads=args.heads if char else None,
        progress=not args.no_progress,
        save=args.save,
        save_every=args.save_every,
        resume=args.resume,
        peers=getattr(args, "peers", False),
        dist=dist,
        offload=offload,
        optimizer=algorithm,
        momentum=(hyper["momentum"] if momentum is None else momentum) if algorithm == "sgd" else None,
    )
    if cfg.dist == "fsdp" and (cfg.peers or any(name in PEER_MODES for name in cfg.modes)):
        raise CLIError("--dist fsdp runs without the peer modes: they run under --dist ddp")
    if args.save_every and not args.save:
        raise CLIError("--save-every needs --save DIR")
    nproc = getattr(args, "nproc", 1)
    if nproc > 1:
        if device.type != "cpu":
            raise CLIError(f"--nproc runs CPU processes (gloo); on GPUs launch with "
                           f"torchrun --nproc-per-node N -m halfadam train --device {args.device} ... instead")
        if "WORLD_SIZE" in os.environ:
            raise CLIError("--nproc starts its own processes: under torchrun leave it out "
                           "(torchrun --nproc-per-node sets the number)")
    world = nproc if nproc > 1 else _torchrun_world()
    if cfg.batch_size % world:
        how = f"--nproc {world}" if nproc > 1 else f"the {world} torchrun processes"
        raise CLIError(f"--batch-size {cfg.batch_size} must be divisible by {how} (each process takes an equal slice)")
    cfg.nproc = world
    return cfg, device


def _torchrun_world() -> int:
    """The number of processes of the ``torch.distributed`` job this process is part of (1 if none)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _lr_schedule(cfg: TrainConfig):
    """A function step -> learning rate (``step`` 0-based, as halfadam's schedules count)."""
    if cfg.lr_schedule == "constant":
        return lambda step: cfg.lr
    from halfadam.schedules import CosineWithWarmUpLR

    return CosineWithWarmUpLR(learning_rate=cfg.lr, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps, lr_end=0.0)


def build_task(cfg: TrainConfig) -> tuple[object, torch.nn.Module, str, str]:
    """Load the task's data and build its float32 model from ``cfg.seed``.

    Returns ``(dataset, model, data description, model description)``. The model is built once; every
    mode trains a copy of it cast to the mode's dtype, so all modes start from the same weights.
    """
    import torch

    from . import data as data_mod
    from .models import CharGPT, DigitsMLP

    if cfg.task == "char-lm":
        dataset = data_mod.load_char_corpus(cfg.text, cfg.seq_len)
        torch.manual_seed(cfg.seed)
        model = CharGPT(dataset.vocab_size, cfg.seq_len, cfg.d_model, cfg.layers, cfg.heads)
        data_line = (
            f"{dataset.source}: {dataset.info['characters'] / 1e6:.2f} M characters "
            f"({dataset.info['train_characters']:,} train / {dataset.info['val_characters']:,} validation), "
            f"vocabulary {dataset.vocab_size}"
        )
        model_line = (
            f"CharGPT: {cfg.layers} pre-LN blocks, d_model {cfg.d_model}, {cfg.heads} heads, context {cfg.seq_len}"
        )
    else:
        dataset = data_mod.load_digits_data()
        torch.manual_seed(cfg.seed)
        model = DigitsMLP(dataset.num_features, dataset.num_classes)
        data_line = (
            f"{dataset.source}: {dataset.info['train_examples']} train / "
            f"{dataset.info['val_examples']} validation examples"
        )
        model_line = "DigitsMLP: 2 hidden layers of 128 (Linear, LayerNorm, GELU)"
    return dataset, model, data_line, model_line
