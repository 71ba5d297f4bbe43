"""``halfadam train --save/--resume``: each mode's checkpoint, and the checks that a run may continue from it.

A checkpoint holds the mode's model, optimizer and loss scaler, the run's options (:func:`_run_identity`),
the RNG state and the curves recorded so far. ``--dist ddp`` writes DIR/<mode>.pt
(:func:`halfadam.checkpoint.save_checkpoint`, atomically); ``--dist fsdp`` the DCP directory
DIR/<mode>.dcp (:func:`halfadam.distributed.save_checkpoint`, every rank writing its shards).
:func:`_check_resume` reads and checks every checkpoint of a ``--resume`` before any mode trains;
:func:`_resume_mode` loads one into a mode's objects.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

import torch

from .config import TrainConfig, _lr_schedule
from .errors import CLIError
from .modes import Mode

#: Options that may differ between a run and its --resume (all others must match).
_RESUME_FREE = ("out", "progress", "save", "save_every", "resume", "modes", "nproc", "peers", "dist",
                "offload")
#: Options that may also differ when --resume extends a run to more --steps (their defaults follow --steps;
#: _check_resumed_options requires the steps already taken to keep their learning rates).
_EXTEND_FREE = ("steps", "warmup_steps", "eval_every")


def _run_identity(cfg: TrainConfig) -> dict:
    """The options a checkpoint records, which its ``--resume`` must match (:data:`_RESUME_FREE` aside)."""
    return {k: v for k, v in asdict(cfg).items() if k not in _RESUME_FREE}


def _save_mode(cfg: TrainConfig, mode: Mode, model, optimizer, scaler, history: dict) -> None:
    """Write the mode's checkpoint: model, optimizer, scaler, options, RNG state and the curves so far.

    ``--dist ddp``: DIR/<mode>.pt (rank 0; atomically, :func:`halfadam.checkpoint.save_checkpoint`).
    ``--dist fsdp``: the DCP directory DIR/<mode>.dcp (every rank writes its shards,
    :func:`halfadam.distributed.save_checkpoint`, with its SHA-256 manifest, which writes it beside the old
    one and swaps it in once whole, so a save that dies half-way leaves the previous checkpoint).
    """
    from halfadam.checkpoint import CheckpointError, save_checkpoint

    objects = dict(config=_run_identity(cfg), history=history, rng=torch.get_rng_state())
    if torch.device(cfg.device).type == "cuda":
        objects["cuda_rng"] = torch.cuda.get_rng_state(torch.device(cfg.device))
    path = _checkpoint_path(cfg, cfg.save, mode.name)
    try:
        if cfg.dist == "fsdp":
            from halfadam.distributed import save_checkpoint as save_sharded

            save_sharded(path, model, optimizer,
                         extra=objects if scaler is None else dict(objects, scaler=scaler.state_dict()))
        else:
            save_checkpoint(path, model=model, optimizer=optimizer, **objects,
                            **({} if scaler is None else {"scaler": scaler}))
    except CheckpointError as exc:
        raise CLIError(f"--save {cfg.save}: {exc}") from None
    except OSError as exc:
        raise CLIError(f"--save {cfg.save}: cannot write the checkpoint {path}: {exc.strerror or exc}") from None


def _checkpoint_path(cfg: TrainConfig, directory: str, name: str) -> Path:
    """Where mode ``name``'s checkpoint is in ``directory``: <name>.pt (--dist ddp) or the DCP directory
    <name>.dcp (--dist fsdp)."""
    return Path(directory) / f"{name}.{'dcp' if cfg.dist == 'fsdp' else 'pt'}"


def _resume_path(cfg: TrainConfig, name: str) -> Path:
    """Where ``--resume`` looks for mode ``name``'s checkpoint."""
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
            _check_not_stranded(cfg, path)
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


def _check_not_stranded(cfg: TrainConfig, path: Path) -> None:
    """CLIError where a ``--dist fsdp`` save to the missing ``path`` was killed between its two renames and left
    its complete checkpoint beside it (:func:`halfadam.distributed.verify_checkpoint` names it): resuming that
    mode from scratch would lose it (and the run's next save would then replace it)."""
    if cfg.dist != "fsdp":
        return  # a .pt file is renamed into place in one step: a missing one was never saved
    from halfadam.checkpoint import CheckpointError
    from halfadam.distributed import verify_checkpoint

    try:
        verify_checkpoint(path)
    except CheckpointError as exc:
        if "left the complete checkpoint" in str(exc):
            raise CLIError(f"--resume: {exc}") from None


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
    saved = {"optimizer": "adamw", **saved}  # written before --optimizer: AdamW's
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
