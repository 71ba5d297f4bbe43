"""The training of one mode in ``halfadam train`` (:func:`train_mode`), and what it measures.

Every mode trains a copy of the same float32 model, cast to its parameter dtype, on the same batch
plan with the same learning rates (:func:`halfadam.cli.config._lr_schedule`). :class:`_ModeRun` is one
mode's run: the model copy, its optimizer and loss scaler, and the curves it records (:class:`_Curves`,
which its checkpoints carry). Under ``--nproc`` or torchrun every rank runs the same code, the model
replicated by ``DistributedDataParallel`` or sharded by FSDP2 (:func:`_fully_shard`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from halfadam.distributed import _all_reduce_, is_dtensor, local

from .checkpointing import _resume_mode, _save_mode
from .config import TrainConfig, _lr_schedule
from .memory import MEASURED_STEPS, MemoryProbe
from .models import set_compute_dtype
from .modes import Mode
from .peers import tensor_parts

#: The reported train loss is the mean over the last this-many steps (the per-step loss is noisy).
TRAIN_LOSS_WINDOW = 10


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """The cross-entropy of ``model(x)`` against ``y`` (computed in float32), reduced by ``reduction``."""
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

    A ``DTensor`` counts as this process's shard; a tensor subclass, or an object holding tensors,
    counts as the plain tensors it holds (:func:`halfadam.cli.peers.tensor_parts`; torchao's 8-bit state
    poses as bfloat16, FlashOptim's is an object), and a tensor held by several entries (bitsandbytes
    shares its code tables between parameters) counts once.
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
        else:  # an object holding tensors (FlashOptim's quantized state)
            for part in tensor_parts(value):
                visit(part)

    for state in optimizer.state.values():
        visit(state)
    return total


def _sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA), so that a step's time is its own."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allreduce_sum_hook(process_group, bucket):
    """A DDP communication hook: the gradients summed over the ranks (DDP's default averages them)."""
    fut = torch.distributed.all_reduce(bucket.buffer(), group=process_group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _fully_shard(model: torch.nn.Module, device: torch.device, world: int, offload: str | None = None) -> None:
    """Shard ``model`` in place with FSDP2 over ``world`` processes: one ``fully_shard`` unit per
    transformer block and one for the rest. Gradients are summed over the ranks (divide factor 1), as
    the DDP path's hook does: each rank's loss is already its share of the batch mean.

    ``offload="cpu"``: ``CPUOffloadPolicy`` (the model on the host already): the shards, their gradients and
    the optimizer step stay on the host; pinned memory on CUDA (pinning needs an accelerator)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world,))
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload == "cpu" else OffloadPolicy()
    for block in getattr(model, "blocks", ()):
        fully_shard(block, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)


def _gathered(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a float32 CPU tensor, gathered from its shards when it is a DTensor (every rank calls this)."""
    return (t.full_tensor() if is_dtensor(t) else t).detach().float().cpu()


class _TqdmHandler(logging.Handler):
    """A logging handler writing each record on a line of its own above the progress bar (``tqdm.write``)."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging's own convention
            self.handleError(record)


@contextlib.contextmanager
def _log_above(bar):
    """While ``bar`` is shown, the ``halfadam`` logger's lines (a C++ kernel rebuild, say) go on lines of their
    own above it, not after its text, where logging is not configured (no handler would take them: Python's
    last-resort handler would write them after the bar's text)."""
    logger = logging.getLogger("halfadam")
    if bar.disable or logger.hasHandlers():
        yield
        return
    handler = _TqdmHandler(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


@dataclass
class _Curves:
    """What one mode's run records: the train loss per step, the validation losses and the steps they follow,
    the number of steps the loss scaler skipped, and the step whose loss was inf/nan (``None`` while finite).

    The mode's checkpoints carry it as their ``history`` entry (:meth:`history`); ``--resume`` continues it.
    """

    train_loss: list[float] = field(default_factory=list)
    val_steps: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    skipped: int = 0
    diverged_at: int | None = None

    def history(self) -> dict:
        """The checkpoints' ``history`` entry."""
        return {"train_loss": self.train_loss, "val_steps": self.val_steps, "val_loss": self.val_loss,
                "skipped": int(self.skipped), "diverged_at": self.diverged_at}


class _ModeRun:
    """One mode's training run (see :func:`train_mode`): a copy of the model in the mode's parameter dtype,
    its optimizer and loss scaler, the learning-rate schedule, and the curves and step times recorded.

    :meth:`train` runs the steps (from the mode's ``--resume`` checkpoint, if it has one); :meth:`metrics`
    then reports them.
    """

    def __init__(self, mode: Mode, base_model: torch.nn.Module, dataset, cfg: TrainConfig, device: torch.device,
                 rank: int, world: int, save: Callable):
        self.mode, self.dataset, self.cfg, self.device = mode, dataset, cfg, device
        self.rank, self.world, self.save_checkpoint = rank, world, save
        self.memory = MemoryProbe(device) if cfg.offload else None  # before the mode's model and optimizer
        # offloaded, the parameters start on the host (FSDP2 copies each unit's to the device for its compute)
        model = copy.deepcopy(base_model).to(device="cpu" if cfg.offload else device, dtype=mode.param_dtype)
        set_compute_dtype(model, torch.float32 if device.type == "cpu" else None)
        self.sharded = (world > 1 and cfg.dist == "fsdp") or bool(cfg.offload)
        if self.sharded:  # before the optimizer: its parameters are the DTensors
            _fully_shard(model, device, world, cfg.offload)
        self.model = model
        self.optimizer = mode.make_optimizer(param_groups(model), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                             momentum=cfg.momentum)
        self.scaler = mode.make_scaler(device)
        self.schedule = _lr_schedule(cfg)
        self.n_params = sum(p.numel() for p in model.parameters())
        self.curves = _Curves()
        self.step_times: list[float] = []
        # --dist fsdp: every rank writes its shards; ddp: the replicas are identical, rank 0 writes
        self.writes_checkpoints = bool(cfg.save) and (rank == 0 or cfg.dist == "fsdp")

    def record_val(self, step: int) -> None:
        """Record the validation loss after ``step`` steps."""
        self.curves.val_steps.append(step)
        self.curves.val_loss.append(evaluate(self.model, self.dataset, self.device, max(self.cfg.batch_size, 64)))

    def checkpoint(self) -> None:
        """Write the mode's checkpoint with the curves so far (``save``: :func:`_save_mode`'s signature)."""
        self.save_checkpoint(self.cfg, self.mode, self.model, self.optimizer, self.scaler, self.curves.history())

    def train(self, plan: torch.Tensor) -> None:
        """Take the steps of ``plan`` that are left (all of them unless ``--resume`` loaded a checkpoint)."""
        from tqdm import tqdm

        cfg = self.cfg
        first_step = self._start()
        net = self.model
        # ``model`` keeps the same parameters (evaluation, checkpoints and weights use it)
        if self.world > 1 and not self.sharded:
            net = torch.nn.parallel.DistributedDataParallel(self.model, gradient_as_bucket_view=True)
            net.register_comm_hook(None, _allreduce_sum_hook)  # with the loss divided by world: see _update
        # disable=None: no bar where stderr is not a terminal (a log file gets one summary line instead)
        bar = tqdm(range(first_step, cfg.steps), initial=first_step, total=cfg.steps, desc=f"{self.mode.name:>13}",
                   unit="step", disable=True if not cfg.progress or self.rank != 0 else None, dynamic_ncols=True,
                   leave=True)
        started, drawn = time.perf_counter(), not bar.disable  # (close() sets disable)
        with _log_above(bar):
            for step in bar:
                if not self._step(net, plan, step, bar):
                    break
        bar.close()
        if not drawn and cfg.progress and self.rank == 0:
            self._summary_line(first_step, time.perf_counter() - started)
        del net  # DDP sits in reference cycles; the next mode builds its own
        self._finish(first_step)

    def _summary_line(self, first_step: int, seconds: float) -> None:
        """The line on stderr that stands for the progress bar where stderr is not a terminal."""
        curves = self.curves
        taken = len(curves.train_loss) - first_step
        loss = f", loss {curves.train_loss[-1]:.3f}" if taken > 0 else ""
        val = f", val {curves.val_loss[-1]:.3f}" if curves.val_loss else ""
        if curves.diverged_at is not None and taken > 0:
            loss, val = f", stopped: loss {curves.train_loss[-1]}", ""
        print(f"{self.mode.name:>13}: {taken} step{'s' * (taken != 1)} in {seconds:.1f} s{loss}{val}",
              file=sys.stderr, flush=True)

    def _start(self) -> int:
        """The first step to take: where the mode's ``--resume`` checkpoint left off (its curves restored), or 0
        (the validation loss before training recorded)."""
        cfg = self.cfg
        saved = _resume_mode(cfg, self.mode, self.model, self.optimizer, self.scaler) if cfg.resume else None
        if saved is None:
            self.record_val(0)
            return 0
        self.curves = _Curves(saved["train_loss"], saved["val_steps"], saved["val_loss"], saved["skipped"],
                              saved["diverged_at"])
        if self.curves.diverged_at is not None:  # a diverged run stays so
            return cfg.steps
        return len(self.curves.train_loss)

    def _step(self, net: torch.nn.Module, plan: torch.Tensor, step: int, bar) -> bool:
        """Step ``step`` (0-based) on this rank's slice of its batch, timed, then the evaluation, progress bar
        and checkpoint due after it; False when its loss is inf/nan (the run stops)."""
        cfg, curves, world = self.cfg, self.curves, self.world
        x, y = self.dataset.batch(plan[step].chunk(world)[self.rank] if world > 1 else plan[step], self.device)
        lr = self.schedule(step)
        for group in self.optimizer.param_groups:
            if torch.is_tensor(group["lr"]):  # torchao keeps lr as a tensor and refuses a float
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        _sync(self.device)
        start = time.perf_counter()
        loss_value = self._update(net, x, y)
        _sync(self.device)
        self.step_times.append(time.perf_counter() - start)
        if self.memory is not None and self.memory.steps < MEASURED_STEPS:  # the gradients still alive
            self.memory.sample()
        curves.train_loss.append(loss_value)
        if not math.isfinite(loss_value):  # the weights are inf/nan: nothing more to learn here
            curves.diverged_at = step
            bar.set_postfix_str(f"loss {loss_value} after {step} step{'s' * (step != 1)}: stopped")
            return False
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            self.record_val(step + 1)
            bar.set_postfix(loss=f"{loss_value:.3f}", val=f"{curves.val_loss[-1]:.3f}")
        elif step % 10 == 0:
            bar.set_postfix(loss=f"{loss_value:.3f}", val=f"{curves.val_loss[-1]:.3f}")
        save_now = (cfg.save_every and (step + 1) % cfg.save_every == 0) or step + 1 == cfg.steps
        if self.writes_checkpoints and save_now:
            self.checkpoint()
        return True

    def _update(self, net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
        """Forward, backward, (un)scaling and the optimizer step on ``(x, y)``; returns the whole batch's loss
        (summed over the ranks) and counts a step the loss scaler skips."""
        optimizer, scaler, world = self.optimizer, self.scaler, self.world
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
            self.curves.skipped += scaler.get_scale() < scale_before
        else:
            loss.backward()
            optimizer.step()
        if world > 1:  # the loss of the whole batch; inf/nan on any rank makes every rank stop here
            loss = loss.detach().clone()
            torch.distributed.all_reduce(loss)
        return loss.item()

    def _finish(self, first_step: int) -> None:
        """After the last step: a run that diverged records its validation loss at that step and saves; a run
        whose last update broke the weights (finite loss, inf/nan validation loss) is marked diverged."""
        curves = self.curves
        if curves.diverged_at is not None and first_step < self.cfg.steps:  # diverged in this run (not a resumed one)
            if curves.val_steps[-1] != curves.diverged_at:
                self.record_val(curves.diverged_at)
            if self.writes_checkpoints:
                self.checkpoint()
        elif curves.diverged_at is None and not math.isfinite(curves.val_loss[-1]):  # the last update broke the weights
            curves.diverged_at = len(curves.train_loss)

    def metrics(self) -> tuple[dict, tuple[list[torch.Tensor], list[torch.Tensor] | None]]:
        """The mode's metrics and ``(final weights, final master weights or None)`` (see :func:`train_mode`)."""
        mode, model, curves = self.mode, self.model, self.curves
        note = self._divergence_note()
        timed = self.step_times[1:] if len(self.step_times) > 1 else self.step_times  # the first step allocates state
        tail = curves.train_loss[-TRAIN_LOSS_WINDOW:]
        if self.sharded:
            model.reshard()  # the root keeps its parameters gathered after a forward (the last evaluation)
        final_weights = [_gathered(p) for p in model.parameters()]
        masters = None
        if mode.optimizer == "halfadam" and curves.diverged_at is None:
            masters = [_gathered(self.optimizer.master_weight(p)) for p in model.parameters()]
        metrics = {
            "description": mode.description,
            "param_dtype": str(mode.param_dtype).removeprefix("torch."),
            "optimizer": mode.source,
            "loss_scaler": "halfadam.GradScaler" if mode.loss_scaler else None,
            "final_train_loss": sum(tail) / len(tail),
            "final_val_loss": curves.val_loss[-1],
            "diverged_at_step": curves.diverged_at,
            "divergence_note": note,
            "optimizer_state_bytes_per_param": self._state_bytes() / self.n_params,
            "mean_step_ms": 1000 * sum(timed) / len(timed) if timed else None,
            "steps_run": len(curves.train_loss),
            "train_loss": curves.train_loss,
            "val_steps": curves.val_steps,
            "val_loss": curves.val_loss,
        }
        if self.memory is not None:
            metrics["offload"] = self.cfg.offload
            metrics["memory_measured"] = self.memory.result(self.n_params, self.world)
        if self.scaler is not None:
            metrics["skipped_steps"] = int(curves.skipped)
            metrics["final_loss_scale"] = float(self.scaler.get_scale())
        return metrics, (final_weights, masters)

    def _divergence_note(self) -> str | None:
        """Why a diverged mode went nan, where that is known: an ``eps`` that rounds to 0 in its dtype."""
        if self.curves.diverged_at is None:
            return None
        eps = self.optimizer.param_groups[0].get("eps")
        if isinstance(eps, float) and eps > 0 and torch.tensor(eps, dtype=self.mode.param_dtype).item() == 0:
            return (f"eps={eps:g} rounds to 0 in {str(self.mode.param_dtype).removeprefix('torch.')}, "
                    f"so the update is 0/0 = nan wherever a gradient is 0")
        return None

    def _state_bytes(self) -> int:
        """:func:`optimizer_state_bytes` of the optimizer; sharded, the job's total (each rank holds its shards)."""
        state_bytes = optimizer_state_bytes(self.optimizer)
        if self.sharded:
            total = torch.tensor(float(state_bytes), dtype=torch.float64)
            _all_reduce_(total, torch.distributed.ReduceOp.SUM, None)  # (nccl: through a CUDA copy)
            state_bytes = int(total.item())
        return state_bytes


def train_mode(mode: Mode, base_model: torch.nn.Module, dataset, plan: torch.Tensor, cfg: TrainConfig,
               device: torch.device, rank: int = 0, world: int = 1, *, save: Callable = _save_mode
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

    ``save(cfg, mode, model, optimizer, scaler, history)`` writes the mode's checkpoints
    (:func:`halfadam.cli.checkpointing._save_mode`); ``halfadam train`` passes the one
    :mod:`halfadam.cli.train` names, so that replacing ``halfadam.cli.train._save_mode`` takes effect.
    """
    run = _ModeRun(mode, base_model, dataset, cfg, device, rank, world, save)
    run.train(plan)
    return run.metrics()
