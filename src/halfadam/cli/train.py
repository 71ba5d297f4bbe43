"""``halfadam train``: one model, one initialisation, the same batches, several precision modes.

The float32 model is built once from the seed; every mode trains a copy cast to its parameter dtype, on
the same precomputed batch sequence, with the same hyperparameters. The command prints a table (final
losses, distance of the final weights to the float32 run, optimizer state bytes per parameter, step
time) and writes ``metrics.json`` and ``loss.png`` to ``--out``.

Choices worth knowing when reading the numbers:

* On CPU the weights are stored in the mode's dtype but the layers compute in float32 (half-precision
  matmuls are far slower there); gradients still arrive in the parameter's dtype. On CUDA the model
  computes in the parameter dtype.
* ``fp16-naive`` has no loss scaler: ``torch.amp.GradScaler`` refuses to unscale float16 gradients. A
  mode whose loss turns inf/nan stops there and is reported as diverged.
* The learning rate for step ``t`` (0-based) is ``schedule(t)``, written into every optimizer's groups
  before the step, so all modes see the same rates even when the loss scaler skips a step.
* Optimizer state bytes count every per-element tensor in ``optimizer.state`` (the 0-d ``step``
  counters are left out): 8 bytes/parameter for torch's AdamW in fp32, 12 for halfadam on fp16/bf16
  (fp32 master weight, ``exp_avg`` and ``exp_avg_sq``). A tensor subclass counts as the tensors it
  holds (torchao's 8-bit state: codes, scales, code table), and a tensor shared between parameters
  (bitsandbytes' code tables) once.
* ``--peers`` adds the optimizers a user would pick instead of halfadam (:mod:`halfadam.cli.peers`:
  optimi with Kahan summation, torchao's bf16 stochastic-rounding and 8-bit AdamW, bitsandbytes'
  8-bit AdamW), each only if its package is installed, as more modes of the same run.
* ``--nproc N`` trains data-parallel in N CPU processes (``DistributedDataParallel`` over gloo, started
  by :func:`halfadam.distributed.launch`): every process builds the same model and batch plan, takes
  its 1/N slice of each batch and back-propagates its share of the batch's mean loss; DDP sums the
  gradients. Every example's gradient so enters with the same weight as in one process (float16 loss
  scaling sees the same ranges), and the run matches ``--nproc 1`` up to floating-point rounding. The
  reported train loss is that of the whole batch. Only rank 0 prints and writes files.
  ``torchrun ... -m halfadam train`` (without ``--nproc``) runs the same code path. ``--dist fsdp``
  shards instead of replicating (FSDP2, ``torch.distributed.fsdp.fully_shard``: one unit per
  transformer block and the root; parameters, gradients and optimizer state in every state mode
  sharded by rows over the processes; gradients summed as with DDP); the table's state bytes per
  parameter are then the job's total, each process holding its shard. Its ``--save``/``--resume``
  go through DCP (:func:`halfadam.distributed.save_checkpoint`: one checksummed directory
  ``DIR/<mode>.dcp`` per mode, every rank writing its shards).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

import halfadam
from halfadam.distributed import is_dtensor, local

from . import data as data_mod
from .errors import CLIError
from .models import CharGPT, DigitsMLP, relative_distance, set_compute_dtype
from .modes import MODES, PEER_MODES, Mode, get_mode, parse_modes
from .peers import select as select_peers, tensor_parts

HELP = "train one model in several precision modes and compare them with float32"

TASKS = ("char-lm", "digits")

#: Per-task defaults for options left unset on the command line.
TASK_DEFAULTS = {
    "char-lm": {"steps": 800, "lr": 3e-4, "batch_size": 16},
    "digits": {"steps": 300, "lr": 1e-3, "batch_size": 64},
}

#: The reported train loss is the mean over the last this-many steps (the per-step loss is noisy).
TRAIN_LOSS_WINDOW = 10


# --------------------------------------------------------------------------------------------- options
def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def _float(text: str, *, positive: bool) -> float:
    kind = "a positive" if positive else "a non-negative"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {kind} number, got {text!r}") from None
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise argparse.ArgumentTypeError(f"expected {kind} number, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    return _float(text, positive=True)


def _nonnegative_float(text: str) -> float:
    return _float(text, positive=False)


def _modes(text: str) -> list[Mode]:
    try:
        return parse_modes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``halfadam train``'s options on ``parser``."""
    parser.description = (
        "Train one model from one initialisation on the same batches in several precision modes "
        "and compare each with the float32 reference. Modes: "
        + "; ".join(f"{m.name}: {m.description}" for m in MODES.values())
        + "."
    )
    parser.add_argument("--task", choices=TASKS, default="char-lm",
                        help="char-lm: GPT-style character model on text (default); digits: MLP on scikit-learn digits")
    parser.add_argument("--text", metavar="PATH",
                        help="text file for char-lm (default: the Python standard library's .py sources)")
    parser.add_argument("--modes", type=_modes, default=list(MODES.values()), metavar="LIST",
                        help=f"comma-separated modes to run (default: all = {','.join(MODES)}); also the "
                             f"--peers names whose package is installed")
    parser.add_argument("--peers", action="store_true",
                        help="also train the optimizers a user would pick instead of halfadam, each only if its "
                             "package is installed (else one line says which is missing): "
                             + ", ".join(f"{m.name} ({m.peer.source}, package {m.peer.package})"
                                         for m in PEER_MODES.values()))
    def per_task(key: str) -> str:
        return "default: " + ", ".join(f"{task} {TASK_DEFAULTS[task][key]:g}" for task in TASKS)

    parser.add_argument("--steps", type=_positive_int,
                        help=f"training steps per mode ({per_task('steps')}); with --resume, a larger value than "
                             f"the checkpoint's extends its run")
    parser.add_argument("--batch-size", type=_positive_int,
                        help=f"sequences/examples per step ({per_task('batch_size')})")
    parser.add_argument("--lr", type=_positive_float, help=f"(peak) learning rate ({per_task('lr')})")
    parser.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                        help="constant (default), or linear warm-up then cosine decay to 0 "
                             "(halfadam.schedules.CosineWithWarmUpLR)")
    parser.add_argument("--warmup-steps", type=_nonnegative_int,
                        help="warm-up steps for --lr-schedule cosine (default: 10%% of --steps)")
    parser.add_argument("--weight-decay", type=_nonnegative_float, default=0.0,
                        help="decoupled weight decay on weight matrices and embeddings (default 0)")
    parser.add_argument("--seed", type=_nonnegative_int, default=0,
                        help="seed for the initialisation and the batch order (default 0)")
    parser.add_argument("--device", default="cpu",
                        help="cpu (default), cuda[:N] or auto. On CPU, weights are stored in the mode's dtype "
                             "but computed in float32; on CUDA, computed in the parameter dtype")
    parser.add_argument("--out", metavar="DIR", help="output directory (default: runs/<task>)")
    parser.add_argument("--eval-every", type=_positive_int,
                        help="evaluate the validation loss every N steps (default: steps/10)")
    model = parser.add_argument_group("char-lm model")
    model.add_argument("--seq-len", type=_positive_int, default=64, help="context length in characters (default 64)")
    model.add_argument("--d-model", type=_positive_int, default=128, help="embedding width (default 128)")
    model.add_argument("--layers", type=_positive_int, default=2, help="transformer blocks (default 2)")
    model.add_argument("--heads", type=_positive_int, default=4, help="attention heads (default 4)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--save", metavar="DIR",
                        help="checkpoint each mode to DIR/<mode>.pt (--dist fsdp: the DCP directory DIR/<mode>.dcp, "
                             "with a SHA-256 manifest) atomically (a run killed mid-save keeps the previous "
                             "checkpoint) at the end and every --save-every steps; DIR is created and checked for "
                             "writing before training starts")
    parser.add_argument("--save-every", type=_positive_int, metavar="N",
                        help="with --save, also checkpoint every N steps (default: only at the end)")
    parser.add_argument("--resume", metavar="DIR",
                        help="continue each mode from DIR/<mode>.pt (--dist fsdp: DIR/<mode>.dcp), written by "
                             "--save with the same options, "
                             "except that a larger --steps extends the run (--eval-every and --warmup-steps may then "
                             "differ too) as long as the steps already taken keep their learning rates: always with "
                             "--lr-schedule constant; with cosine, whose decay spans --steps, only for a run stopped "
                             "before its decay began (same --warmup-steps), else it is refused. The validation losses "
                             "recorded so far stay. A mode without a checkpoint yet (the run stopped before it) "
                             "starts from scratch. Every checkpoint is checked before training starts")
    parser.add_argument("--nproc", type=_positive_int, default=1, metavar="N",
                        help="train data-parallel in N processes on this machine (DDP over gloo, CPU only; "
                             "default 1). Each process takes 1/N of every batch, so --batch-size must be "
                             "divisible by N; the losses match --nproc 1 up to rounding. Only the first process "
                             "prints and writes metrics.json, loss.png and the --save checkpoints (the replicas "
                             "are identical); --resume loads the same checkpoints in every process, and a "
                             "checkpoint resumes under any --nproc. The same under torchrun (also with --device "
                             "cuda, one GPU per process): torchrun --standalone --nproc-per-node N -m halfadam "
                             "train ... (without --nproc)")
    parser.add_argument("--dist", choices=("ddp", "fsdp"), default="ddp",
                        help="with more than one process (--nproc N or torchrun; with one it changes only the "
                             "checkpoints' format): "
                             "ddp (default) replicates the model (DistributedDataParallel); fsdp shards parameters, "
                             "gradients and optimizer state over the processes (FSDP2 fully_shard, every state "
                             "mode; no --peers; --save/--resume write and read DCP directories DIR/<mode>.dcp)")


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


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise CLIError(f"unknown device {name!r} (use cpu, cuda, cuda:N or auto)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise CLIError(f"--device {name}: CUDA is not available on this machine (use --device cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise CLIError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s)")
    elif device.type != "cpu":
        raise CLIError(f"unsupported device {name!r} (use cpu, cuda, cuda:N or auto)")
    return device


def resolve_config(args: argparse.Namespace) -> tuple[TrainConfig, torch.device]:
    """Fill task defaults into the parsed options and validate what argparse cannot."""
    defaults = TASK_DEFAULTS[args.task]
    steps = args.steps or defaults["steps"]
    if args.task == "char-lm" and args.d_model % args.heads:
        raise CLIError(f"--d-model {args.d_model} must be divisible by --heads {args.heads}")
    if args.text is not None and args.task != "char-lm":
        raise CLIError("--text only applies to --task char-lm")
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, steps // 10)
    if args.lr_schedule == "cosine" and warmup >= steps:
        raise CLIError(f"--warmup-steps {warmup} must be smaller than --steps {steps}")
    device = _resolve_device(args.device)
    char = args.task == "char-lm"
    cfg = TrainConfig(
        task=args.task,
        modes=[m.name for m in args.modes],
        steps=steps,
        batch_size=args.batch_size or defaults["batch_size"],
        lr=args.lr or defaults["lr"],
        lr_schedule=args.lr_schedule,
        warmup_steps=warmup if args.lr_schedule == "cosine" else 0,
        weight_decay=args.weight_decay,
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
        dist=getattr(args, "dist", "ddp"),
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
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


# ------------------------------------------------------------------------------------------ training
def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction=reduction)


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset, device: torch.device, batch_size: int) -> float:
    """Mean cross-entropy of ``model`` over the dataset's fixed validation set."""
    total, count = 0.0, 0
    for x, y in dataset.val_batches(batch_size, device):
        total += float(_loss(model, x, y, reduction="sum"))
        count += y.numel()
    return total / count


def param_groups(model: torch.nn.Module) -> list[dict]:
    """Two groups: matrices and embeddings (decayed) and vectors such as LayerNorm and biases (not)."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2]},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every per-element tensor in ``optimizer.state`` (scalar step counters are left out).

    A ``DTensor`` counts as this process's shard; a tensor subclass counts as the plain tensors it
    holds (:func:`halfadam.cli.peers.tensor_parts`; torchao's 8-bit state poses as bfloat16), and a
    tensor held by several entries (bitsandbytes shares its code tables between parameters) counts once.
    """
    total = 0
    seen = set()

    def visit(value):
        nonlocal total
        if torch.is_tensor(value):
            value = local(value)  # a DTensor (FSDP2): this rank's shard
            if value.dim() > 0:
                for part in tensor_parts(value):
                    key = (part.data_ptr(), part.nbytes)
                    if key not in seen:
                        seen.add(key)
                        total += part.nbytes
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)

    for state in optimizer.state.values():
        visit(state)
    return total


def _lr_schedule(cfg: TrainConfig):
    """A function step -> learning rate (``step`` 0-based, as halfadam's schedules count)."""
    if cfg.lr_schedule == "constant":
        return lambda step: cfg.lr
    from halfadam.schedules import CosineWithWarmUpLR

    return CosineWithWarmUpLR(learning_rate=cfg.lr, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps, lr_end=0.0)


#: Options that may differ between a run and its --resume (all others must match).
_RESUME_FREE = ("out", "progress", "save", "save_every", "resume", "modes", "nproc", "peers", "dist")
#: Options that may also differ when --resume extends a run to more --steps (their defaults follow --steps;
#: _check_resumed_options requires the steps already taken to keep their learning rates).
_EXTEND_FREE = ("steps", "warmup_steps", "eval_every")


def _run_identity(cfg: TrainConfig) -> dict:
    return {k: v for k, v in asdict(cfg).items() if k not in _RESUME_FREE}


def _save_mode(cfg: TrainConfig, mode: Mode, model, optimizer, scaler, history: dict) -> None:
    """Write the mode's checkpoint: model, optimizer, scaler, options, RNG state and the curves so far.

    ``--dist ddp``: DIR/<mode>.pt (rank 0; atomically, :func:`halfadam.checkpoint.save_checkpoint`).
    ``--dist fsdp``: the DCP directory DIR/<mode>.dcp (every rank writes its shards,
    :func:`halfadam.distributed.save_checkpoint`, with its SHA-256 manifest), written beside the old one
    and swapped in once whole, so a save that dies half-way leaves the previous checkpoint.
    """
    from halfadam.checkpoint import CheckpointError, save_checkpoint

    objects = dict(config=_run_identity(cfg), history=history, rng=torch.get_rng_state())
    if torch.device(cfg.device).type == "cuda":
        objects["cuda_rng"] = torch.cuda.get_rng_state(torch.device(cfg.device))
    path = _checkpoint_path(cfg, cfg.save, mode.name)
    try:
        if cfg.dist == "fsdp":
            _save_sharded(path, model, optimizer,
                          objects if scaler is None else dict(objects, scaler=scaler.state_dict()))
        else:
            save_checkpoint(path, model=model, optimizer=optimizer, **objects,
                            **({} if scaler is None else {"scaler": scaler}))
    except CheckpointError as exc:
        raise CLIError(f"--save {cfg.save}: {exc}") from None
    except OSError as exc:
        raise CLIError(f"--save {cfg.save}: cannot write the checkpoint {path}: {exc.strerror or exc}") from None


def _save_sharded(path: Path, model, optimizer, extra: dict) -> None:
    """A DCP checkpoint at ``path``, written whole to ``path.tmp`` first (every rank) and then swapped in
    (rank 0, between barriers)."""
    import shutil

    from halfadam.distributed import save_checkpoint as save_sharded

    dist = torch.distributed
    grouped = dist.is_available() and dist.is_initialized()
    lead = not grouped or dist.get_rank() == 0
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    if lead:
        shutil.rmtree(tmp, ignore_errors=True)
    if grouped:
        dist.barrier()
    save_sharded(tmp, model, optimizer, extra=extra)
    if lead:
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    if grouped:
        dist.barrier()


def _checkpoint_path(cfg: TrainConfig, directory: str, name: str) -> Path:
    """Where mode ``name``'s checkpoint is in ``directory``: <name>.pt (--dist ddp) or the DCP directory
    <name>.dcp (--dist fsdp)."""
    return Path(directory) / f"{name}.{'dcp' if cfg.dist == 'fsdp' else 'pt'}"


def _resume_path(cfg: TrainConfig, name: str) -> Path:
    return _checkpoint_path(cfg, cfg.resume, name)


def _read_resume(cfg: TrainConfig, path: Path, **objects) -> dict:
    """The entries of the checkpoint at ``path`` (``--dist fsdp``: a DCP directory's extra data), loaded
    into ``objects`` (all or nothing) when given; CLIError for a bad file."""
    from halfadam.checkpoint import CheckpointError, load_checkpoint

    try:
        if cfg.dist != "fsdp":
            return load_checkpoint(path, **objects)
        from halfadam.distributed import load_checkpoint as load_sharded
        from halfadam.distributed import verify_checkpoint

        if not objects:
            verify_checkpoint(path)  # every file, not only those the extra data lies in
        return load_sharded(path, objects.get("model"), objects.get("optimizer"))
    except CheckpointError as exc:
        raise CLIError(f"--resume: {exc}") from None


def _check_resume(cfg: TrainConfig) -> list[str]:
    """The modes of ``cfg`` that --resume starts from scratch (no checkpoint yet: the run stopped before them).

    Reads every other mode's checkpoint and checks its options (:func:`_check_resumed_options`), so that a
    bad one is refused before any mode trains. Raises CLIError for that, or when no mode has a checkpoint
    (the wrong directory?).
    """
    fresh = []
    for name in cfg.modes:
        path = _resume_path(cfg, name)
        if not path.exists():
            fresh.append(name)
            continue
        _check_resumed_options(cfg, path, _read_resume(cfg, path))  # read and verified; loaded into nothing
    if fresh == cfg.modes:
        other = replace(cfg, dist="ddp" if cfg.dist == "fsdp" else "fsdp")
        found = [str(_resume_path(other, name)) for name in cfg.modes if _resume_path(other, name).exists()]
        hint = f" (--dist {other.dist} wrote {', '.join(found)}: resume it with --dist {other.dist})" if found else ""
        raise CLIError(f"--resume: no checkpoint at {_resume_path(cfg, '<mode>')} for any of --modes "
                       f"{','.join(cfg.modes)}{hint}")
    return fresh


def _check_resumed_options(cfg: TrainConfig, path: Path, entries: dict) -> None:
    """Raise CLIError unless the checkpoint ``entries`` (of ``path``) can continue under ``cfg``.

    Its options must be ``cfg``'s (:data:`_RESUME_FREE` aside), except that ``cfg`` may have more
    ``steps`` (then also other :data:`_EXTEND_FREE`): the run is extended, which is sound only if the
    steps already taken are those an uninterrupted run with ``cfg`` takes. The batches are (a longer
    plan begins with the shorter one) and the model and optimizer options match; the learning rates
    must match too, which a cosine schedule's decay, laid out over ``steps``, breaks.
    """
    saved = entries.get("config")
    if not isinstance(saved, dict) or not isinstance(entries.get("history"), dict) or "rng" not in entries:
        raise CLIError(f"--resume {path}: a halfadam checkpoint, but not one written by halfadam train --save")
    ours = _run_identity(cfg)
    longer = isinstance(saved.get("steps"), int) and cfg.steps > saved["steps"]
    free = _EXTEND_FREE if longer else ()
    diff = sorted(k for k in set(ours) | set(saved) if k not in free and saved.get(k) != ours.get(k))
    if diff:
        fewer = f"; --steps can only grow from its {saved['steps']}" if "steps" in diff else ""
        raise CLIError(f"--resume {path}: written with other options "
                       f"({', '.join('--' + k.replace('_', '-') for k in diff)}){fewer}")
    if not longer:
        return
    done = len(entries["history"].get("train_loss", ()))
    before = _lr_schedule(replace(cfg, steps=saved["steps"], warmup_steps=saved.get("warmup_steps", cfg.warmup_steps)))
    after = _lr_schedule(cfg)
    if any(before(t) != after(t) for t in range(done)):
        raise CLIError(f"--resume {path}: --steps {cfg.steps} changes the learning rates of the {done} steps "
                       f"already taken (--lr-schedule {cfg.lr_schedule} decays over the checkpoint's --steps "
                       f"{saved['steps']}), so it cannot extend that run: resume with --steps {saved['steps']}, "
                       f"or start a new run")


def _resume_mode(cfg: TrainConfig, mode: Mode, model, optimizer, scaler) -> dict | None:
    """Load DIR/<mode>.pt into model, optimizer and scaler (all or nothing); returns the saved history.

    ``None`` (nothing loaded) when the mode has no checkpoint yet: it starts from scratch. The options
    were checked by :func:`_check_resume` before training began; they are checked again here (a file
    replaced since then is refused too).
    """
    path = _resume_path(cfg, mode.name)
    if not path.exists():
        return None
    if cfg.dist == "fsdp":  # the options first: a DCP load writes into the live model and optimizer
        _check_resumed_options(cfg, path, _read_resume(cfg, path))
        entries = _read_resume(cfg, path, model=model, optimizer=optimizer)
        if scaler is not None and "scaler" in entries:
            scaler.load_state_dict(entries["scaler"])
    else:
        objects = dict(model=model, optimizer=optimizer, **({"scaler": scaler} if scaler is not None else {}))
        entries = _read_resume(cfg, path, **objects)
        _check_resumed_options(cfg, path, entries)  # the copies loaded into are dropped if it raises
    torch.set_rng_state(entries["rng"])
    if "cuda_rng" in entries:
        torch.cuda.set_rng_state(entries["cuda_rng"], torch.device(cfg.device))
    return entries["history"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allreduce_sum_hook(process_group, bucket):
    """A DDP communication hook: the gradients summed over the ranks (DDP's default averages them)."""
    fut = torch.distributed.all_reduce(bucket.buffer(), group=process_group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def train_mode(mode: Mode, base_model: torch.nn.Module, dataset, plan: torch.Tensor, cfg: TrainConfig,
               device: torch.device, rank: int = 0, world: int = 1
               ) -> tuple[dict, tuple[list[torch.Tensor], list[torch.Tensor] | None]]:
    """Train a copy of ``base_model`` in ``mode`` on the batches of ``plan``.

    With ``world > 1`` (an initialised process group; every rank calls this with the same arguments)
    the model is wrapped in ``DistributedDataParallel`` (``cfg.dist == "ddp"``) or sharded in place
    by :func:`_fully_shard` (``"fsdp"``), rank ``rank`` trains on its slice
    ``plan[step].chunk(world)[rank]`` of each batch, the recorded train loss is the mean over the
    ranks, and only rank 0 saves checkpoints. The replicas stay identical (or the shards form one
    model), so every rank evaluates the same validation loss and returns the same (gathered) weights.

    Returns the mode's metrics and ``(final weights, final master weights or None)``, both as float32
    CPU tensors in parameter order.

    Every optimizer gets the learning rate ``schedule(step)`` written into its groups before step
    ``step``. The step time covers forward, backward, (un)scaling and the optimizer step.
    """
    from tqdm import tqdm

    model = copy.deepcopy(base_model).to(device=device, dtype=mode.param_dtype)
    set_compute_dtype(model, torch.float32 if device.type == "cpu" else None)
    sharded = world > 1 and cfg.dist == "fsdp"
    if sharded:  # before the optimizer: its parameters are the DTensors
        _fully_shard(model, device, world)
    optimizer = mode.make_optimizer(param_groups(model), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scaler = mode.make_scaler(device)
    schedule = _lr_schedule(cfg)
    n_params = sum(p.numel() for p in model.parameters())

    train_losses: list[float] = []
    val_steps: list[int] = []
    val_losses: list[float] = []
    step_times: list[float] = []
    skipped = 0
    diverged_at = None

    def record_val(step: int) -> None:
        val_steps.append(step)
        val_losses.append(evaluate(model, dataset, device, max(cfg.batch_size, 64)))

    def history() -> dict:
        return {"train_loss": train_losses, "val_steps": val_steps, "val_loss": val_losses, "skipped": int(skipped),
                "diverged_at": diverged_at}

    first_step = 0
    saved = _resume_mode(cfg, mode, model, optimizer, scaler) if cfg.resume else None
    if saved is not None:
        train_losses, val_steps, val_losses = saved["train_loss"], saved["val_steps"], saved["val_loss"]
        skipped, diverged_at = saved["skipped"], saved["diverged_at"]
        first_step = cfg.steps if diverged_at is not None else len(train_losses)  # a diverged run stays so
    else:
        record_val(0)
    net = model
    if world > 1 and not sharded:  # ``model`` keeps the same parameters (evaluation, checkpoints and weights use it)
        net = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        net.register_comm_hook(None, _allreduce_sum_hook)  # with the loss divided by world: see below
    bar = tqdm(range(first_step, cfg.steps), initial=first_step, total=cfg.steps, desc=f"{mode.name:>13}",
               unit="step", disable=not cfg.progress or rank != 0, dynamic_ncols=True, leave=True)
    for step in bar:
        x, y = dataset.batch(plan[step].chunk(world)[rank] if world > 1 else plan[step], device)
        lr = schedule(step)
        for group in optimizer.param_groups:
            if torch.is_tensor(group["lr"]):  # torchao keeps lr as a tensor and refuses a float
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        _sync(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = _loss(net, x, y)
        if world > 1:
            # Each rank back-propagates its share of the whole batch's mean loss (its slice's mean / world)
            # and DDP (_allreduce_sum_hook) or FSDP2 (_fully_shard) sums the gradients, so every example's
            # gradient enters with the weight 1/batch-size as in --nproc 1. DDP's own averaging (the slice's mean, then divide after
            # the sum) weighs it world times more on the rank: float16 gradients under a loss scale that
            # --nproc 1 keeps in range then overflow there, and the scaler skips steps --nproc 1 does not.
            loss = loss / world
        if scaler is not None:
            scale_before = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            skipped += scaler.get_scale() < scale_before
        else:
            loss.backward()
            optimizer.step()
        if world > 1:  # the loss of the whole batch; inf/nan on any rank makes every rank stop here
            loss = loss.detach().clone()
            torch.distributed.all_reduce(loss)
        loss_value = loss.item()
        _sync(device)
        step_times.append(time.perf_counter() - start)
        train_losses.append(loss_value)
        if not math.isfinite(loss_value):  # the weights are inf/nan: nothing more to learn here
            diverged_at = step
            bar.set_postfix_str(f"loss {loss_value} after {step} step{'s' * (step != 1)}: stopped")
            break
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            record_val(step + 1)
            bar.set_postfix(loss=f"{loss_value:.3f}", val=f"{val_losses[-1]:.3f}")
        elif step % 10 == 0:
            bar.set_postfix(loss=f"{loss_value:.3f}", val=f"{val_losses[-1]:.3f}")
        save_now = (cfg.save_every and (step + 1) % cfg.save_every == 0) or step + 1 == cfg.steps
        if cfg.save and (rank == 0 or cfg.dist == "fsdp") and save_now:  # fsdp: every rank writes its shards
            _save_mode(cfg, mode, model, optimizer, scaler, history())
    bar.close()
    del net  # DDP sits in reference cycles; the next mode builds its own
    if diverged_at is not None and first_step < cfg.steps:  # diverged in this run (not a resumed one)
        if val_steps[-1] != diverged_at:
            record_val(diverged_at)
        if cfg.save and (rank == 0 or cfg.dist == "fsdp"):
            _save_mode(cfg, mode, model, optimizer, scaler, history())
    elif diverged_at is None and not math.isfinite(val_losses[-1]):  # the last update broke the weights
        diverged_at = len(train_losses)

    note = None
    if diverged_at is not None:
        eps = optimizer.param_groups[0].get("eps")
        if isinstance(eps, float) and eps > 0 and torch.tensor(eps, dtype=mode.param_dtype).item() == 0:
            note = (f"eps={eps:g} rounds to 0 in {str(mode.param_dtype).removeprefix('torch.')}, "
                    f"so the update is 0/0 = nan wherever a gradient is 0")

    timed = step_times[1:] if len(step_times) > 1 else step_times  # the first step allocates state
    tail = train_losses[-TRAIN_LOSS_WINDOW:]
    if sharded:
        model.reshard()  # the root keeps its parameters gathered after a forward (the last evaluation)
    final_weights = [_gathered(p) for p in model.parameters()]
    masters = None
    if mode.optimizer == "halfadam" and diverged_at is None:
        masters = [_gathered(optimizer.master_weight(p)) for p in model.parameters()]
    state_bytes = optimizer_state_bytes(optimizer)
    if sharded:  # the job's total: each rank holds its shards
        total = torch.tensor(float(state_bytes), dtype=torch.float64)
        torch.distributed.all_reduce(total)
        state_bytes = int(total.item())
    metrics = {
        "description": mode.description,
        "param_dtype": str(mode.param_dtype).removeprefix("torch."),
        "optimizer": mode.source,
        "loss_scaler": "halfadam.GradScaler" if mode.loss_scaler else None,
        "final_train_loss": sum(tail) / len(tail),
        "final_val_loss": val_losses[-1],
        "diverged_at_step": diverged_at,
        "divergence_note": note,
        "optimizer_state_bytes_per_param": state_bytes / n_params,
        "mean_step_ms": 1000 * sum(timed) / len(timed) if timed else None,
        "steps_run": len(train_losses),
        "train_loss": train_losses,
        "val_steps": val_steps,
        "val_loss": val_losses,
    }
    if scaler is not None:
        metrics["skipped_steps"] = int(skipped)
        metrics["final_loss_scale"] = float(scaler.get_scale())
    return metrics, (final_weights, masters)


def _fully_shard(model: torch.nn.Module, device: torch.device, world: int) -> None:
    """Shard ``model`` in place with FSDP2 over ``world`` processes: one ``fully_shard`` unit per
    transformer block and one for the rest. Gradients are summed over the ranks (divide factor 1), as
    the DDP path's hook does: each rank's loss is already its share of the batch mean."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh(device.type, (world,))
    for block in getattr(model, "blocks", ()):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)


def _gathered(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a float32 CPU tensor, gathered from its shards when it is a DTensor (every rank calls this)."""
    return (t.full_tensor() if is_dtensor(t) else t).detach().float().cpu()


def build_task(cfg: TrainConfig) -> tuple[object, torch.nn.Module, str, str]:
    """Load the task's data and build its float32 model from ``cfg.seed``.

    Returns ``(dataset, model, data description, model description)``. The model is built once; every
    mode trains a copy of it cast to the mode's dtype, so all modes start from the same weights.
    """
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


def _run_rank(rank: int, world: int, args: argparse.Namespace, error_dir: str) -> None:
    """One process of ``--nproc``: :func:`run` in the process group :func:`halfadam.distributed.launch` set up.

    A failure is also written to ``error_dir/<rank>.json`` (a :class:`CLIError`'s message, or the
    exception's type and first line), for the launching process to report in one line.
    """
    try:
        run(args)
    except Exception as exc:
        cli = isinstance(exc, CLIError)
        first = (str(exc).strip().splitlines() or [""])[0]
        message = first if cli else f"{type(exc).__name__}: {first}".rstrip(": ")
        Path(error_dir, f"{rank}.json").write_text(json.dumps({"cli": cli, "message": message}))
        raise


def _launch(args: argparse.Namespace, nproc: int) -> int:
    """Run :func:`run` in ``nproc`` gloo processes (:func:`halfadam.distributed.launch`); returns the exit status.

    A failure in any process ends all of them and is reported as one line: a :class:`CLIError` raised
    by any rank is raised here (the other ranks then fail only because a peer went away); anything else
    prints the failing rank and exception and returns 1.
    """
    from torch.multiprocessing.spawn import ProcessException, ProcessExitedException

    from halfadam.distributed import launch

    spawn_log = logging.getLogger("torch.multiprocessing.spawn")
    level = spawn_log.level
    spawn_log.setLevel(logging.ERROR)  # no "Terminating process ... via signal SIGTERM" when a rank fails
    try:
        with tempfile.TemporaryDirectory(prefix="halfadam-nproc-") as error_dir:
            try:
                launch(_run_rank, nproc, args, error_dir)
                return 0
            except ProcessException as exc:
                errors = {}
                for path in Path(error_dir).glob("*.json"):
                    try:
                        errors[int(path.stem)] = json.loads(path.read_text())
                    except (OSError, ValueError):
                        pass
                cli = sorted(r for r, e in errors.items() if e.get("cli"))
                if cli:
                    raise CLIError(errors[cli[0]]["message"]) from None
                rank = exc.error_index
                if rank in errors:
                    what = errors[rank]["message"]
                elif isinstance(exc, ProcessExitedException) and exc.signal_name:
                    what = f"terminated by {exc.signal_name}"
                else:
                    what = str(exc).strip().splitlines()[-1]
                prog = getattr(args, "_prog", "halfadam train")
                print(f"{prog}: error: process {rank} of --nproc {nproc} failed: {what} "
                      f"(the same command under torchrun --standalone --nproc-per-node {nproc} -m halfadam "
                      f"shows the traceback)", file=sys.stderr)
                return 1
    finally:
        spawn_log.setLevel(level)


def run(args: argparse.Namespace) -> int:
    """Run ``halfadam train`` with parsed ``args``; returns the exit status.

    ``--nproc N > 1``: validates the options, creates the output directory and starts N processes
    (:func:`_launch`), each of which runs this function again inside the process group. Under
    ``torchrun`` the process group is set up here from the environment
    (:func:`halfadam.distributed.init_from_env`) and destroyed at the end.
    """
    from halfadam import distributed as hd

    cfg, device = resolve_config(args)
    out = Path(cfg.out)
    dist = torch.distributed
    grouped = dist.is_available() and dist.is_initialized()
    # the launching process of --nproc N (resolve_config refused --nproc under torchrun, whose processes
    # have cfg.nproc = their WORLD_SIZE and set up their group below)
    if getattr(args, "nproc", 1) > 1 and not grouped:
        _make_dirs(cfg, out)
        return _launch(args, cfg.nproc)
    rank, world = hd.init_from_env("nccl" if device.type == "cuda" else "gloo")
    owns_group = not grouped and dist.is_available() and dist.is_initialized()  # torchrun: set up just now
    try:
        status = _run(cfg, device, out, rank, world)
        if owns_group:
            import gc

            gc.collect()  # free the DDP modules before the group goes (see halfadam.distributed.launch)
            dist.barrier()
        return status
    finally:
        if owns_group:
            dist.destroy_process_group()


def _make_dirs(cfg: TrainConfig, out: Path) -> None:
    """Create the output directory and the ``--save`` one and check that files can be written in them.

    Done before training, so that a bad directory fails at once rather than after the run (CLIError).
    """
    for option, path in (("--out", out), ("--save", Path(cfg.save) if cfg.save else None)):
        if path is None:
            continue
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CLIError(f"{option} {path}: cannot create the directory: {exc.strerror or exc}") from None
        try:
            with tempfile.TemporaryFile(dir=path):
                pass
        except OSError as exc:
            raise CLIError(f"{option} {path}: cannot write files there: {exc.strerror or exc}") from None


def _run(cfg: TrainConfig, device: torch.device, out: Path, rank: int, world: int) -> int:
    """The body of :func:`run` in one process (rank ``rank`` of ``world``); only rank 0 prints and writes."""
    from . import report

    lead = rank == 0
    skipped: list[str] = []  # peers that cannot run here, one line each
    if cfg.peers or any(name in PEER_MODES for name in cfg.modes):
        cfg.modes = select_peers(cfg.modes, add=cfg.peers, device=device, log=skipped.append)
        if not cfg.modes:
            raise CLIError("no mode left to run: " + "; ".join(skipped))
    fresh = _check_resume(cfg) if cfg.resume else []
    if lead:
        _make_dirs(cfg, out)

    dataset, base_model, data_line, model_line = build_task(cfg)
    n_params = sum(p.numel() for p in base_model.parameters())
    plan = dataset.sample_plan(cfg.steps, cfg.batch_size, cfg.seed)
    compute = "float32 compute, weights stored per mode" if device.type == "cpu" else "compute in the parameter dtype"

    if lead:
        print(f"halfadam train: {cfg.task} on {device} ({compute})")
        print(f"  data:  {data_line}")
        print(f"  model: {model_line}, {n_params:,} parameters")
        sched = "constant" if cfg.lr_schedule == "constant" else f"cosine, {cfg.warmup_steps} warm-up steps"
        if world > 1:
            backend = torch.distributed.get_backend()
            how = "DDP" if cfg.dist == "ddp" else "FSDP2: parameters, gradients and optimizer state sharded"
            print(f"  data-parallel: {world} processes ({how}, {backend}), {cfg.batch_size // world} per process "
                  f"per step")
        elif cfg.dist == "fsdp":
            print("  --dist fsdp in one process: nothing is sharded (start N processes with --nproc N or torchrun); "
                  "checkpoints are DCP directories all the same")
        print(f"  train: {cfg.steps} steps x {cfg.batch_size}, AdamW lr {cfg.lr:g} ({sched}), "
              f"weight decay {cfg.weight_decay:g}, seed {cfg.seed}; modes: {', '.join(cfg.modes)}", flush=True)
        for line in skipped:
            print(f"  {line}", flush=True)
        if fresh:
            print(f"  resume: from {cfg.resume}; no checkpoint yet, so from scratch: {', '.join(fresh)}", flush=True)

    results: dict[str, dict] = {}
    weights: dict[str, tuple] = {}
    started = time.perf_counter()
    for name in cfg.modes:
        results[name], weights[name] = train_mode(get_mode(name), base_model, dataset, plan, cfg, device, rank, world)
    if not lead:
        return 0

    ref = weights.get("fp32")
    for name, metrics in results.items():
        final, masters = weights[name]
        ok = metrics["diverged_at_step"] is None
        metrics["weight_distance_to_fp32"] = relative_distance(final, ref[0]) if ref and ok else None
        if masters is not None and ref:
            metrics["master_weight_distance_to_fp32"] = relative_distance(masters, ref[0])
        if "fp32" in results and ok:
            ref_val = results["fp32"]["final_val_loss"]
            metrics["val_loss_vs_fp32_percent"] = 100 * (metrics["final_val_loss"] - ref_val) / ref_val
        else:
            metrics["val_loss_vs_fp32_percent"] = None

    config = asdict(cfg)
    config.pop("progress")
    summary = {
        "halfadam_version": getattr(halfadam, "__version__", None),
        "torch_version": torch.__version__,
        "config": config,
        "data": dataset.info,
        "model": {"description": model_line, "parameters": n_params},
        "wall_time_s": time.perf_counter() - started,
        "modes": results,
    }
    print()
    print(report.format_table(results))
    try:
        metrics_path = report.write_metrics(summary, out / "metrics.json")
        plot_path = report.plot_losses(results, out / "loss.png", title=f"halfadam train: {cfg.task}, {model_line}")
    except OSError as exc:
        raise CLIError(f"cannot write results to {out}: {exc.strerror or exc}") from None
    print(f"\nwrote {metrics_path}\nwrote {plot_path}")
    return 0
