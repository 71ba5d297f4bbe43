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
* ``--optimizer sgd`` or ``lion`` trains every mode with that rule instead of AdamW
  (:mod:`halfadam.cli.optimizers`): the fp32 mode with ``torch.optim.SGD`` or ``halfadam.Lion`` on float32
  parameters (torch has no Lion; there it keeps no master and is the paper's update to float32 rounding),
  the naive modes the same on half parameters (Lion: :mod:`halfadam.cli.naive_lion`, the update in float32
  rounded into the weight, no master), the halfadam modes ``halfadam.SGD``/``halfadam.Lion`` in their
  state modes; each rule has its own default ``--lr`` and ``--weight-decay`` (SGD ``--momentum`` too).
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
  ``DIR/<mode>.dcp`` per mode, every rank writing its shards). ``--offload cpu`` adds FSDP2's
  ``CPUOffloadPolicy`` (implying ``--dist fsdp``; one process runs a one-rank group) and prints each mode's
  host and device bytes per parameter, measured (:mod:`.memory`).

This module is the command's entry: its options (:func:`add_arguments`) and :func:`run`. The rest lives
beside it: :mod:`.config` (the resolved options, the task's data and model), :mod:`.loop` (the training
of one mode), :mod:`.checkpointing` (``--save``/``--resume``), :mod:`.launch` (``--nproc``) and
:mod:`.report` (what is printed and written), :mod:`.optimizers` (``--optimizer``'s rules, their defaults and the
optimizer each mode builds) and :mod:`.naive_lion` (the naive modes' Lion).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from .args import nonnegative_float, nonnegative_int, positive_float, positive_int
from .config import TASK_DEFAULTS, TASKS, TrainConfig, build_task, resolve_config
from .errors import CLIError
from .launch import _launch, _write_failure
from .modes import MODES, PEER_MODES, Mode, get_mode, parse_modes
from .optimizers import ALGORITHMS
from .optimizers import defaults as optimizer_defaults
from .peers import select as select_peers

if TYPE_CHECKING:
    import torch

#: Names this module offers from its heavy neighbours (torch and the training code), imported on first use so
#: that ``halfadam train --help`` loads neither: name -> module. ``_run`` looks ``_save_mode`` up here, so
#: that replacing ``halfadam.cli.train._save_mode`` takes effect; the others are reached as
#: ``halfadam.cli.train.<name>`` from before this module was split (the tests, docs/research).
_LAZY = {"_check_resume": ".checkpointing", "_save_mode": ".checkpointing", "_check_resumed_options": ".checkpointing",
         "_run_identity": ".checkpointing", "train_mode": ".loop", "optimizer_state_bytes": ".loop"}


def __getattr__(name: str):
    """A name of :data:`_LAZY`, imported from its module on first use (PEP 562)."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name], __package__), name)


HELP = "train one model in several precision modes and compare them with float32"


def _modes(text: str) -> list[Mode]:
    """``--modes``: :func:`~halfadam.cli.modes.parse_modes`, its ValueError as argparse's error."""
    try:
        return parse_modes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``halfadam train``'s options on ``parser``."""
    parser.description = (
        "Train one model from one initialisation on the same batches in several precision modes "
        "and compare each with the float32 reference. Modes (--optimizer adamw): "
        + "; ".join(f"{m.name}: {m.description}" for m in MODES.values())
        + ". --optimizer sgd and lion train the same modes with their own optimizers: "
        + "; ".join(f"{a.name}: fp32 {a.reference}, naive {a.naive}, halfadam {a.halfadam}"
                    for a in ALGORITHMS.values() if a.name != "adamw")
        + "."
    )
    parser.add_argument("--task", choices=TASKS, default="char-lm",
                        help="char-lm: GPT-style character model on text (default); digits: MLP on scikit-learn digits")
    parser.add_argument("--text", metavar="PATH",
                        help="text file for char-lm (default: the Python standard library's .py sources)")
    parser.add_argument("--modes", type=_modes, default=list(MODES.values()), metavar="LIST",
                        help=f"comma-separated modes to run (default: all = {','.join(MODES)}); also the "
                             f"--peers names whose package is installed. A part of one mode's name stands for it "
                             f"(tiny, compact, halfadam-tiny), and torch's dtype names for the short ones "
                             f"(bfloat16-halfadam)")
    parser.add_argument("--peers", action="store_true",
                        help="also train the optimizers a user would pick instead of halfadam, each only if its "
                             "package is installed (else one line says which is missing): "
                             + ", ".join(f"{m.name} ({m.peer.source}, package {m.peer.package})"
                                         for m in PEER_MODES.values()))
    def per_task(key: str) -> str:
        return "default: " + ", ".join(f"{task} {TASK_DEFAULTS[task][key]:g}" for task in TASKS)

    parser.add_argument("--steps", type=positive_int,
                        help=f"training steps per mode ({per_task('steps')}); with --resume, a larger value than "
                             f"the checkpoint's extends its run")
    parser.add_argument("--batch-size", type=positive_int,
                        help=f"sequences/examples per step ({per_task('batch_size')})")
    def per_optimizer(key: str) -> str:
        return "; ".join(f"{name}: " + ", ".join(f"{task} {optimizer_defaults(name, task)[key]:g}" for task in TASKS)
                         for name in ALGORITHMS)

    parser.add_argument("--optimizer", choices=tuple(ALGORITHMS), default="adamw",
                        help="the update rule every mode trains with (default adamw): adamw, sgd (with momentum) "
                             "or lion. The fp32 mode runs torch.optim.AdamW / torch.optim.SGD / halfadam.Lion "
                             "(torch has no Lion: on float32 parameters it keeps no master and is the paper's "
                             "update to float32 rounding); the naive modes the same on half parameters (Lion: "
                             "halfadam.cli.naive_lion, the update in float32 rounded into the weight, no master); "
                             "the halfadam modes halfadam.AdamW / SGD / Lion in their state modes")
    parser.add_argument("--lr", type=positive_float, help=f"(peak) learning rate (default: {per_optimizer('lr')})")
    parser.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                        help="constant (default), or linear warm-up then cosine decay to 0 "
                             "(halfadam.schedules.CosineWithWarmUpLR)")
    parser.add_argument("--warmup-steps", type=nonnegative_int,
                        help="warm-up steps for --lr-schedule cosine (default: 10%% of --steps)")
    parser.add_argument("--weight-decay", type=nonnegative_float,
                        help="weight decay on weight matrices and embeddings: decoupled for adamw and lion, "
                             "torch.optim.SGD's L2 term (added to the gradient) for sgd (default: "
                             f"{per_optimizer('weight_decay')})")
    parser.add_argument("--momentum", type=nonnegative_float,
                        help=f"SGD's momentum, with --optimizer sgd only (default {optimizer_defaults('sgd', TASKS[0])['momentum']:g};"
                             f" 0 keeps no momentum buffer)")
    parser.add_argument("--seed", type=nonnegative_int, default=0,
                        help="seed for the initialisation and the batch order (default 0)")
    parser.add_argument("--device", default="cpu",
                        help="cpu (default), cuda[:N] or auto. On CPU, weights are stored in the mode's dtype "
                             "but computed in float32; on CUDA, computed in the parameter dtype")
    parser.add_argument("--out", metavar="DIR", help="output directory (default: runs/<task>)")
    parser.add_argument("--eval-every", type=positive_int,
                        help="evaluate the validation loss every N steps (default: steps/10)")
    model = parser.add_argument_group("char-lm model")
    model.add_argument("--seq-len", type=positive_int, default=64, help="context length in characters (default 64)")
    model.add_argument("--d-model", type=positive_int, default=128, help="embedding width (default 128)")
    model.add_argument("--layers", type=positive_int, default=2, help="transformer blocks (default 2)")
    model.add_argument("--heads", type=positive_int, default=4, help="attention heads (default 4)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars (drawn only where stderr is a terminal; elsewhere each mode ends "
                             "with one summary line, which this also leaves out)")
    _add_checkpoint_arguments(parser)
    _add_distributed_arguments(parser)


def _add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """``--save``, ``--save-every`` and ``--resume`` (:mod:`halfadam.cli.checkpointing`)."""
    parser.add_argument("--save", metavar="DIR",
                        help="checkpoint each mode to DIR/<mode>.pt (--dist fsdp: the DCP directory DIR/<mode>.dcp, "
                             "with a SHA-256 manifest) atomically (a run killed mid-save keeps the previous "
                             "checkpoint) at the end and every --save-every steps; DIR is created and checked for "
                             "writing before training starts")
    parser.add_argument("--save-every", type=positive_int, metavar="N",
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


def _add_distributed_arguments(parser: argparse.ArgumentParser) -> None:
    """``--nproc`` and ``--dist`` (:mod:`halfadam.cli.launch`, :func:`halfadam.cli.loop.train_mode`)."""
    parser.add_argument("--nproc", type=positive_int, default=1, metavar="N",
                        help="train data-parallel in N processes on this machine (DDP over gloo, CPU only; "
                             "default 1). Each process takes 1/N of every batch, so --batch-size must be "
                             "divisible by N; the losses match --nproc 1 up to rounding. Only the first process "
                             "prints and writes metrics.json, loss.png and the --save checkpoints (the replicas "
                             "are identical); --resume loads the same checkpoints in every process, and a "
                             "checkpoint resumes under any --nproc. The same under torchrun (also with --device "
                             "cuda, one GPU per process): torchrun --standalone --nproc-per-node N -m halfadam "
                             "train ... (without --nproc)")
    parser.add_argument("--dist", choices=("ddp", "fsdp"), default=None,
                        help="with more than one process (--nproc N or torchrun; with one it changes only the "
                             "checkpoints' format): "
                             "ddp (default; fsdp with --offload) replicates the model (DistributedDataParallel); "
                             "fsdp shards parameters, "
                             "gradients and optimizer state over the processes (FSDP2 fully_shard, every state "
                             "mode; no --peers; --save/--resume write and read DCP directories DIR/<mode>.dcp)")
    parser.add_argument("--offload", choices=("cpu",), default=None,
                        help="cpu: keep parameters, gradients and optimizer state on the host and step them there "
                             "(FSDP2 fully_shard with CPUOffloadPolicy, pinned memory on CUDA; implies --dist fsdp, "
                             "refused with --dist ddp; one process runs a one-rank gloo group); prints the host and "
                             "device bytes per parameter each mode added, measured from the process")


def run(args: argparse.Namespace) -> int:
    """Run ``halfadam train`` with parsed ``args``; returns the exit status.

    ``--nproc N > 1``: validates the options, creates the output directory and starts N processes
    (:func:`halfadam.cli.launch._launch`), each of which runs this function again inside the process
    group. Under ``torchrun`` the process group is set up here from the environment
    (:func:`halfadam.distributed.init_from_env`) and destroyed at the end.
    """
    import torch.distributed as dist

    from halfadam import distributed as hd

    cfg, device = resolve_config(args)
    out = Path(cfg.out)
    grouped = dist.is_available() and dist.is_initialized()
    # the launching process of --nproc N (resolve_config refused --nproc under torchrun, whose processes
    # have cfg.nproc = their WORLD_SIZE and set up their group below)
    if getattr(args, "nproc", 1) > 1 and not grouped:
        with _run_dirs(cfg, out) as created:
            status = _launch(_run_rank, args, cfg.nproc)
            if status:
                _remove_empty(created)
            return status
    rank, world = hd.init_from_env("nccl" if device.type == "cuda" else "gloo")
    if cfg.offload and not dist.is_initialized():
        _init_one_rank(device)  # FSDP2 needs a process group, even of one
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


def _init_one_rank(device: torch.device) -> None:
    """A one-rank process group for FSDP2 in this process (``--offload`` without ``--nproc``): gloo on the CPU;
    on CUDA nccl for the device's tensors and gloo for the host's (``"cuda:nccl,cpu:gloo"``). An in-memory
    store: no port, no file."""
    import torch.distributed as dist

    backend = "gloo"
    if device.type == "cuda":
        import torch

        torch.cuda.set_device(device)
        backend = "cuda:nccl,cpu:gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def _run_rank(rank: int, world: int, args: argparse.Namespace, error_dir: str) -> None:
    """One process of ``--nproc``: :func:`run` in the process group :func:`halfadam.distributed.launch` set up.

    A failure is also written to ``error_dir/<rank>.json`` (:func:`halfadam.cli.launch._write_failure`: a
    :class:`CLIError`'s message, or the exception's type and first line), for the launching process to
    report in one line.
    """
    try:
        run(args)
    except Exception as exc:
        _write_failure(error_dir, rank, exc)
        raise


def _make_dirs(cfg: TrainConfig, out: Path) -> list[Path]:
    """Create the output directory and the ``--save`` one and check that files can be written in them;
    returns the directories created (parents first), for :func:`_remove_empty`.

    Done before training, so that a bad directory fails at once rather than after the run (CLIError).
    """
    created: list[Path] = []
    for option, path in (("--out", out), ("--save", Path(cfg.save) if cfg.save else None)):
        if path is None:
            continue
        missing = [p for p in (path, *path.parents) if not p.exists()][::-1]
        try:
            path.mkdir(parents=True, exist_ok=True)
            created += [p for p in missing if p not in created]
        except OSError as exc:
            raise CLIError(f"{option} {path}: cannot create the directory: {exc.strerror or exc}") from None
        try:
            with tempfile.TemporaryFile(dir=path):
                pass
        except OSError as exc:
            raise CLIError(f"{option} {path}: cannot write files there: {exc.strerror or exc}") from None
    return created


def _remove_empty(created: list[Path]) -> None:
    """Remove the directories of ``created`` (parents first) that a failed run left empty, deepest first."""
    for path in reversed(created):
        try:
            path.rmdir()  # only an empty directory goes
        except OSError:
            pass


@contextlib.contextmanager
def _run_dirs(cfg: TrainConfig, out: Path, make: bool = True):
    """Create the run's directories (:func:`_make_dirs`, where ``make``) for the body of the ``with``; a body
    that raises leaves none of them behind empty (a bad ``--text`` file, an interrupted run)."""
    created = _make_dirs(cfg, out) if make else []
    try:
        yield created
    except BaseException:
        _remove_empty(created)
        raise


def _run(cfg: TrainConfig, device: torch.device, out: Path, rank: int, world: int) -> int:
    """The body of :func:`run` in one process (rank ``rank`` of ``world``); only rank 0 prints and writes."""
    from . import report

    this = sys.modules[__name__]  # _check_resume as this module names it (see _LAZY)
    lead = rank == 0
    skipped: list[str] = []  # peers that cannot run here, one line each
    if cfg.peers or any(name in PEER_MODES for name in cfg.modes):
        cfg.modes = select_peers(cfg.modes, add=cfg.peers, device=device, log=skipped.append)
        if not cfg.modes:
            raise CLIError("no mode left to run: " + "; ".join(skipped))
    fresh = this._check_resume(cfg) if cfg.resume else []
    with _run_dirs(cfg, out, make=lead):
        dataset, base_model, data_line, model_line = build_task(cfg)
        if lead:
            report.print_header(cfg, device, world, data_line, model_line,
                                sum(p.numel() for p in base_model.parameters()), skipped, fresh)
        if device.type == "cpu" and (cfg.optimizer == "lion" or any(get_mode(name).optimizer == "halfadam"
                                                                      for name in cfg.modes)):
            from halfadam.kernels import cpp

            cpp.load()  # a first build takes a minute or two and says so on a line of its own, before the bars
        return _train_and_report(cfg, device, out, rank, world, dataset, base_model, model_line)


def _train_and_report(cfg: TrainConfig, device: torch.device, out: Path, rank: int, world: int, dataset,
                      base_model: torch.nn.Module, model_line: str) -> int:
    """Train every mode of ``cfg`` on ``dataset`` from ``base_model``; rank 0 then prints the table and writes
    ``metrics.json`` and ``loss.png`` to ``out``."""
    import torch

    import halfadam

    from . import report

    this = sys.modules[__name__]  # train_mode and _save_mode as this module names them (see _LAZY)
    n_params = sum(p.numel() for p in base_model.parameters())
    plan = dataset.sample_plan(cfg.steps, cfg.batch_size, cfg.seed)
    results: dict[str, dict] = {}
    weights: dict[str, tuple] = {}
    started = time.perf_counter()
    for name in cfg.modes:
        results[name], weights[name] = this.train_mode(get_mode(name, cfg.optimizer), base_model, dataset, plan, cfg,
                                                       device, rank, world, save=this._save_mode)
    if rank != 0:
        return 0

    report.compare_with_fp32(results, weights)
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
    print(report.format_table(results, title=report.table_title(cfg)))
    for line in report.memory_lines(results):
        print(line)
    try:
        metrics_path = report.write_metrics(summary, out / "metrics.json")
        plot_path = report.plot_losses(results, out / "loss.png", title=report.plot_title(cfg, model_line))
    except OSError as exc:
        raise CLIError(f"cannot write results to {out}: {exc.strerror or exc}") from None
    print(f"\nwrote {metrics_path}\nwrote {plot_path}")
    return 0
