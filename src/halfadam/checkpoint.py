"""Checkpoints that never lose precision: fp32 export and atomic files, over the optimizer's state_dict.

The optimizer's own state_dict (layout, checked loading, torch interop) lives in
:mod:`halfadam.state_dict`; its public names are re-exported here (``CheckpointError``,
``optimizer_state_dict``, ``load_optimizer_state_dict``, ``to_torch_state_dict``).

fp32 export (:func:`master_state_dict`, from :mod:`halfadam.state_dict`) gives a model's state_dict with the fp32 master weights in place
of its float16/bfloat16 parameters; :func:`load_master_state_dict` puts such a dict or file back into a
half-precision model and its optimizer without loss.

Files: :func:`save_checkpoint` writes several objects' state atomically (temporary file, fsync,
rename) with a checksum; :func:`load_checkpoint` checks the file and every object's state before
loading any of them.
"""

from __future__ import annotations

import copy
import hashlib
import os
import pickle
import re
import tempfile
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import torch
from torch import Tensor

from . import encodings
from ._tempfiles import _make_parents, _remove_dead_temporaries, _sync_directory, _writer_tag
from ._tempfiles import _TMP_NAME, _process_start, _writer_scope  # noqa: F401  (tests/test_checkpoint.py)
from .distributed import halfadam_optimizer
from .state_dict import (CheckpointError, _commit_load, _prepare_load, _where, load_optimizer_state_dict,
                         master_state_dict, optimizer_state_dict, to_torch_state_dict)

__all__ = [
    "CheckpointError",
    "optimizer_state_dict",
    "load_optimizer_state_dict",
    "to_torch_state_dict",
    "master_state_dict",
    "load_master_state_dict",
    "save_checkpoint",
    "load_checkpoint",
]

_FORMAT = "halfadam.checkpoint"
_FORMAT_VERSION = 1

PathLike = Union[str, "os.PathLike[str]"]


def _is_halfadam(optimizer: Any) -> bool:
    return halfadam_optimizer(optimizer) is optimizer


# ============================================================================ fp32 import
def _read_tensor_file(path: PathLike) -> Mapping[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no such file: {path}")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path), device="cpu")
        except Exception as exc:
            raise CheckpointError(f"{path} cannot be read (truncated or corrupt?): {_first_line(exc)}") from None
    data = _torch_load(path, what="a state_dict file", map_location="cpu", weights_only=True)
    if isinstance(data, Mapping) and data.get("format") == _FORMAT:
        raise CheckpointError(f"{path} is a halfadam checkpoint; use load_checkpoint")
    if not isinstance(data, Mapping):
        raise CheckpointError(f"{path} holds a {type(data).__name__}, not a state_dict")
    return data


def load_master_state_dict(
    model: torch.nn.Module,
    source: Union[Mapping[str, Tensor], PathLike],
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    strict: bool = True,
) -> None:
    """Load fp32 weights (from :func:`master_state_dict`, a dict or a file) into a model and its optimizer.

    Each parameter receives the value rounded to its dtype (round to nearest even; exact for float32
    parameters); with ``optimizer`` (a halfadam one), each parameter that keeps a master weight gets
    the value as its master, as exactly as its state mode stores one:

    ``"fp32"`` bit for bit; ``"split"``, ``"bf16"``, ``"compact"``: bit for bit (bf16: one fp32 ulp
    lower at a block's second tie, :mod:`halfadam.encodings`; fp16: below 2**-14 within 2**-41);
    ``"tiny"`` over bfloat16: within 2**-8 of a bf16 ulp (the 8-bit remainder; 99.6% of masters move).
    Moments and steps are left as they are (a fresh optimizer starts from zero). Buffers are copied.

    Args:
        model: the model, in any floating dtype.
        source: a dict of tensors, or a path: ``*.safetensors`` is read with safetensors, anything
            else with ``torch.load(weights_only=True)``.
        optimizer: a halfadam optimizer over ``model``'s parameters, or ``None``.
        strict: the keys must be exactly the model's (default); ``False`` loads the common keys.

    Raises:
        CheckpointError (nothing is changed): an unreadable file (not written by ``torch.save``,
            truncated, or holding Python objects other than tensors); missing or unexpected keys (strict);
            a value that is not a tensor, of another shape, floating for a non-floating entry or the
            reverse; tied entries with different values.
        TypeError: ``optimizer`` is not a halfadam optimizer.
    """
    if optimizer is not None and not _is_halfadam(optimizer):
        raise TypeError(f"optimizer must be a halfadam optimizer, got {type(optimizer).__name__}")
    if not isinstance(source, Mapping):
        source = _read_tensor_file(source)
    targets = model.state_dict(keep_vars=True)
    missing = [k for k in targets if k not in source]
    unexpected = [k for k in source if k not in targets]
    if strict and (missing or unexpected):
        raise CheckpointError(f"the weights do not match the model: missing keys {missing[:10]}, unexpected keys "
                              f"{unexpected[:10]}")
    seen: Dict[int, Tuple[str, Tensor]] = {}
    for key, target in targets.items():
        if key not in source or not isinstance(target, Tensor):
            continue
        value = source[key]
        if not isinstance(value, Tensor):
            raise CheckpointError(f"'{key}' must be a tensor, got {type(value).__name__}")
        if value.shape != target.shape:
            raise CheckpointError(f"'{key}' has shape {tuple(value.shape)}, the model's has {tuple(target.shape)}")
        if value.is_floating_point() != target.is_floating_point() or (
                not target.is_floating_point() and value.dtype != target.dtype):
            raise CheckpointError(f"'{key}' has dtype {value.dtype}, the model's has {target.dtype}")
        if value.is_meta:
            raise CheckpointError(f"'{key}' is on the meta device (no data)")
        if id(target) in seen:
            other, other_value = seen[id(target)]
            if not torch.equal(other_value.cpu(), value.cpu()):
                raise CheckpointError(f"'{key}' and '{other}' are the same (tied) tensor but have different values")
        seen[id(target)] = (key, value)
    group_of = {}
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                group_of[id(p)] = group
    with torch.no_grad():
        for key, target in targets.items():
            if key not in source or not isinstance(target, Tensor):
                continue
            value = source[key]
            target.copy_(value)
            group = group_of.get(id(target))
            if group is None:
                continue
            if optimizer._states.use_master(target, group) or optimizer.state.get(target):  # type: ignore[union-attr]
                state = optimizer._states.init(target, group)  # type: ignore[union-attr]
                encodings.set_master_(target, state, value)  # an fp32 or a split master (its remainder)


# ============================================================================ files
def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


#: How every file torch.save writes begins: a zip archive (the default), or torch's pickled magic number
#: (``_use_new_zipfile_serialization=False``).
_TORCH_FILE_STARTS = (b"PK\x03\x04", pickle.dumps(torch.serialization.MAGIC_NUMBER, protocol=2))


def _written_by_torch_save(path: Path) -> bool:
    """Whether ``path`` begins as a ``torch.save`` file does (it may still be truncated or damaged)."""
    try:
        with open(path, "rb") as f:
            head = f.read(max(len(s) for s in _TORCH_FILE_STARTS))
    except OSError:
        return True  # unreadable: let torch.load's own error speak
    return head.startswith(_TORCH_FILE_STARTS)


def _torch_load(path: Path, *, what: str, weights_only_flag: bool = False, **kwargs: Any) -> Any:
    """``torch.load(path, **kwargs)``, its failures as a CheckpointError saying which of these it is.

    * not a ``torch.save`` file at all (text, random bytes, an empty file, a bare pickle): ``what`` it is
      not. Found from the file's first bytes before ``torch.load`` runs (which, with
      ``weights_only=False``, would unpickle a bare pickle's first object);
    * a ``torch.save`` file that ``weights_only=True`` refuses because it holds other Python objects
      (one named from torch's message). torch's advice to retry with ``weights_only=False`` is never
      passed on: such a file can run code (``os.system``) when unpickled. With ``weights_only_flag``
      (the caller saves arbitrary ``extra``) ``torch.serialization.safe_globals`` is named, which
      admits that one global and never one of the modules torch blocks (``os``, ``subprocess``...);
    * a ``torch.save`` file of a device this machine lacks;
    * otherwise truncated or corrupt.
    """
    if not _written_by_torch_save(path):
        raise CheckpointError(f"{path} is not {what} (not a file written by torch.save)")
    try:
        return torch.load(path, **kwargs)
    except Exception as exc:
        raise _torch_load_error(path, exc, weights_only_flag) from None


def _torch_load_error(path: Path, exc: Exception, weights_only_flag: bool) -> CheckpointError:
    """The CheckpointError for a ``torch.save`` file that ``torch.load`` failed on (see :func:`_torch_load`)."""
    text = str(exc)
    found = re.search(r"(?:Unsupported global: |unsupported )GLOBAL (\S+)( whose module \S+ is blocked)?", text)
    if found or text.startswith("Weights only load failed"):
        name = found[1] if found else None
        allow = (f"; if you saved {name} yourself, allow it: with torch.serialization.safe_globals([{name}]): ..."
                 if weights_only_flag and name and not found[2] else "")
        return CheckpointError(f"{path} holds objects that are not allowed{f' ({name})' if name else ''}: a "
                               f"halfadam checkpoint holds only tensors and plain data, so it was not loaded{allow}")
    if "CUDA" in text or "device" in text:
        hint = "it was saved on a device this machine lacks; pass map_location='cpu'"
    else:
        hint = "truncated or corrupt?"
    return CheckpointError(f"{path} cannot be read ({hint}): {_first_line(exc)}")


def _describe(value: Any) -> str:
    """A few words on what a foreign file held (for "not a halfadam checkpoint" messages)."""
    if isinstance(value, Mapping):
        keys = [repr(k) for k in list(value)[:4]]
        more = ", ..." if len(value) > 4 else ""
        if not keys:
            return "an empty dict"
        return f"a dict of {len(value)} entr{'y' if len(value) == 1 else 'ies'} ({', '.join(keys)}{more})"
    return f"a {type(value).__name__}"


def _digest(obj: Any) -> str:
    """SHA-256 over a canonical walk of ``obj`` (tensor bytes, dtypes and shapes, keys, plain values)."""
    h = hashlib.sha256()

    def visit(x: Any) -> None:
        if isinstance(x, Tensor):
            if x.is_meta:
                raise ValueError("a tensor on the meta device holds no data")
            t = x.detach().to("cpu").contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            if t.numel():
                h.update(t.reshape(-1).view(torch.uint8).numpy())
        elif isinstance(x, Mapping):
            h.update(f"D{len(x)}".encode())
            for k, v in x.items():
                visit(k)
                visit(v)
        elif isinstance(x, (list, tuple)):
            h.update(f"{'L' if isinstance(x, list) else 'U'}{len(x)}".encode())
            for v in x:
                visit(v)
        elif x is None or isinstance(x, (bool, int, float, str, bytes, torch.dtype, torch.device)):
            h.update(f"{type(x).__name__}:{x!r};".encode())
        else:
            h.update(f"O{type(x).__qualname__};".encode())

    visit(obj)
    return h.hexdigest()


def _state_of(obj: Any) -> Any:
    return obj.state_dict() if callable(getattr(obj, "state_dict", None)) else obj


class _RecordingWriter:
    """The file as ``torch.save`` sees it: keeps the OSError that torch's writer turns into a RuntimeError."""

    def __init__(self, file: Any) -> None:
        self.file, self.error = file, None

    def write(self, data: Any) -> int:
        try:
            return self.file.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.file.flush()


def save_checkpoint(path: PathLike, **objects: Any) -> Path:
    """Write ``objects`` to ``path`` atomically: a crash or kill mid-save leaves the previous file intact.

    Each keyword names one entry: an object with ``state_dict()`` (a model, an optimizer, a scaler, an
    lr scheduler) is stored as its state_dict, anything else as is (a step count, an RNG state tensor,
    lists of losses). The file is written with ``torch.save`` to a temporary file in the same
    directory (``.<name>.<random>.<pid>-<start time>-<scope>.tmp``), flushed and fsync'ed, then renamed
    over ``path`` (``os.replace``) and the directory fsync'ed. It holds ``{"format":
    "halfadam.checkpoint", "version": 1, "sha256": ..., "objects": {name: state}}``; the checksum
    covers every value, so :func:`load_checkpoint` detects a corrupt file (``torch.load`` does not
    verify its data). With halfadam objects and plain values, the file loads with ``torch.load(path,
    weights_only=True)``.

    A process killed mid-save leaves its temporary file behind; the next :func:`save_checkpoint` or
    :func:`load_checkpoint` in that directory removes every temporary file whose writing process has
    provably ended (on Linux: its pid is free or names a process started at another time); the
    temporary files of live writers stay.

    Returns:
        ``path`` as a :class:`~pathlib.Path`. Creates missing parent directories.

    Raises:
        TypeError: no objects.
        ValueError: a tensor on the meta device (it has no data to save).
        pickle.PicklingError, AttributeError...: an object that ``torch.save`` cannot pickle (the old
            file stays; the temporary file is removed).
        OSError: the file cannot be written (disk full, file size limit, permissions, a parent that
            is a file: NotADirectoryError...): its ``filename`` is ``path`` and its ``strerror`` the
            cause. The old file stays; the temporary file is removed.
    """
    if not objects:
        raise TypeError("save_checkpoint needs at least one object to save")
    path = Path(path)
    _make_parents(path)
    states = {name: _state_of(obj) for name, obj in objects.items()}
    payload = {"format": _FORMAT, "version": _FORMAT_VERSION, "sha256": _digest(states), "objects": states}
    _remove_dead_temporaries(path.parent)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f"{_writer_tag()}.tmp", dir=path.parent)
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            writer = _RecordingWriter(f)
            try:
                torch.save(payload, writer)
            except RuntimeError:  # torch's writer reports a failed write as "[enforce fail at ...]"
                if writer.error is None:
                    raise
                raise writer.error from None
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        if isinstance(exc, OSError):
            raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc
        raise
    _sync_directory(path.parent)
    return path


def _check_module_state(name: str, module: torch.nn.Module, state: Any) -> None:
    if not isinstance(state, Mapping):
        raise CheckpointError(f"'{name}': expected a model state_dict, got {type(state).__name__}")
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        raise CheckpointError(
            f"'{name}': the checkpoint is of another model: missing keys {missing[:10]}, unexpected keys "
            f"{unexpected[:10]}"
        )
    for key, target in own.items():
        value = state[key]
        if not isinstance(target, Tensor):
            continue
        if not isinstance(value, Tensor):
            raise CheckpointError(f"'{name}': '{key}' must be a tensor, got {type(value).__name__}")
        if value.shape != target.shape:
            raise CheckpointError(
                f"'{name}': '{key}' has shape {tuple(value.shape)} in the checkpoint, the model's has "
                f"{tuple(target.shape)}"
            )
        if value.dtype != target.dtype:
            raise CheckpointError(
                f"'{name}': '{key}' has dtype {value.dtype} in the checkpoint, the model's has {target.dtype} "
                f"(convert the model first, or load fp32 weights with load_master_state_dict)"
            )
        if value.is_meta:
            raise CheckpointError(f"'{name}': '{key}' is on the meta device (no data)")


def _check_torch_optimizer_state(name: str, optimizer: torch.optim.Optimizer, state: Any) -> None:
    if not isinstance(state, Mapping) or "state" not in state or "param_groups" not in state:
        raise CheckpointError(f"'{name}': expected an optimizer state_dict")
    groups, saved = optimizer.param_groups, state["param_groups"]
    if len(groups) != len(saved):
        raise CheckpointError(f"'{name}': the checkpoint has {len(saved)} parameter group(s), the optimizer "
                              f"{len(groups)}")
    params = {}
    index = 0
    for gi, (g, s) in enumerate(zip(groups, saved)):
        if len(g["params"]) != len(s["params"]):
            raise CheckpointError(f"'{name}': param_groups[{gi}] has {len(s['params'])} parameter(s) in the "
                                  f"checkpoint, {len(g['params'])} in the optimizer")
        for j, (pid, p) in enumerate(zip(s["params"], g["params"])):
            params[pid] = (p, _where(index, gi, j, p))
            index += 1
    for pid, st in state["state"].items():
        if pid not in params:
            raise CheckpointError(f"'{name}': state for parameter index {pid!r}, which is in no group")
        p, where = params[pid]
        for key, value in st.items():
            if isinstance(value, Tensor) and value.dim() > 0 and value.shape != p.shape:
                raise CheckpointError(f"'{name}': {where}: {key} has shape {tuple(value.shape)} in the checkpoint")


def _load_into_copy(name: str, obj: Any, state: Any) -> None:
    """Prove that ``obj.load_state_dict(state)`` succeeds by loading a deep copy of ``obj`` (``obj`` is unchanged).

    For an object halfadam does not know (an lr scheduler, a scaler, anything with ``load_state_dict``).
    An lr scheduler's copy shares its optimizer (its ``load_state_dict`` sets only its own attributes).
    Raises CheckpointError naming the entry when the state does not load, TypeError when ``obj`` cannot
    be deep-copied.
    """
    schedulers = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    memo = {id(obj.optimizer): obj.optimizer} if isinstance(obj, schedulers) else {}
    try:
        trial = copy.deepcopy(obj, memo)
    except Exception as exc:
        raise TypeError(f"'{name}': a {type(obj).__name__} cannot be deep-copied, so its saved state cannot be "
                        f"checked before loading ({_first_line(exc)})") from None
    try:
        trial.load_state_dict(copy.deepcopy(state))
    except Exception as exc:
        raise CheckpointError(f"'{name}': the saved state does not load into a {type(obj).__name__}: "
                              f"{_first_line(exc)}") from None


def _check_entry(name: str, obj: Any, state: Any) -> Any:
    """Validate ``state`` for ``obj``; returns how to commit it."""
    if isinstance(obj, torch.nn.Module):
        _check_module_state(name, obj, state)
        return lambda: obj.load_state_dict(state)
    if _is_halfadam(obj):
        if isinstance(state, Mapping):
            state = dict(state)
        for hook in getattr(obj, "_optimizer_load_state_dict_pre_hooks", {}).values():
            result = hook(obj, state)
            if result is not None:
                state = result
        try:
            plan = _prepare_load(obj, state)
        except CheckpointError as exc:
            raise CheckpointError(f"'{name}': {exc}") from None

        def commit():
            _commit_load(obj, plan)
            for hook in getattr(obj, "_optimizer_load_state_dict_post_hooks", {}).values():
                hook(obj)
        return commit
    if isinstance(obj, torch.optim.Optimizer):
        try:
            _check_torch_optimizer_state(name, obj, state)
        except (KeyError, TypeError, AttributeError) as exc:  # not laid out as a state_dict
            raise CheckpointError(f"'{name}': a malformed optimizer state_dict ({_first_line(exc)})") from None
        return lambda: obj.load_state_dict(state)
    if callable(getattr(obj, "load_state_dict", None)):
        _load_into_copy(name, obj, state)
        return lambda: obj.load_state_dict(state)
    raise TypeError(f"'{name}': {type(obj).__name__} has no load_state_dict(); read plain entries from the "
                    f"returned dict instead")


def load_checkpoint(
    path: PathLike,
    *,
    map_location: Any = "cpu",
    weights_only: bool = True,
    **objects: Any,
) -> Dict[str, Any]:
    """Read a :func:`save_checkpoint` file and load its entries into ``objects``, all or nothing.

    ``load_checkpoint(path, model=model, optimizer=opt, scaler=scaler)`` checks the file (readable,
    the halfadam checkpoint format, checksum), that every named entry exists, and every object's state
    (models: keys, shapes, dtypes; halfadam optimizers: everything :func:`load_optimizer_state_dict`
    checks; other optimizers: group and parameter counts and shapes; any other object, such as a
    scaler or an lr scheduler: its state loads into a deep copy of it) before loading any of them; then loads models first (so that master weights rebuilt from parameters see the
    loaded values), then optimizers, then the rest. Tensors are read onto ``map_location`` (CPU by
    default) and copied to each parameter's device on load.

    Args:
        path: the file.
        map_location: as ``torch.load``'s (``"cpu"``: a checkpoint written on CUDA loads anywhere).
        weights_only: as ``torch.load``'s; ``True`` (default) reads plain data and tensors only. For
            other objects you saved, prefer ``torch.serialization.safe_globals([cls])`` around the
            call; pass ``False`` only for a trusted file (loading it can run code).
        **objects: name -> object with ``load_state_dict`` (the names used with save_checkpoint).

    Returns:
        The checkpoint's entries, name -> saved value (state_dicts and plain entries such as the step).

    Raises:
        CheckpointError: no such file; a file that is not a halfadam checkpoint (not written by
            ``torch.save`` at all, such as text or random bytes, or a ``torch.save`` file without the
            checkpoint format); a truncated or corrupt file; with ``weights_only=True``, a file holding
            other Python objects (the message names one); a missing entry; a state that does not match
            its object (the message names the entry and what differs). Nothing has been loaded.
        TypeError: an object without ``load_state_dict``, or one (other than a model or an optimizer)
            that cannot be deep-copied to check its state. Nothing has been loaded.

    Also removes the temporary files of killed :func:`save_checkpoint` calls in the file's directory
    (see there).
    """
    path = Path(path)
    _remove_dead_temporaries(path.parent)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    payload = _torch_load(path, what="a halfadam checkpoint", weights_only_flag=True, map_location=map_location,
                          weights_only=weights_only)
    if not isinstance(payload, Mapping) or payload.get("format") != _FORMAT:
        raise CheckpointError(f"{path} is not a halfadam checkpoint (one written by save_checkpoint): it holds "
                              f"{_describe(payload)}")
    if payload.get("version") != _FORMAT_VERSION:
        raise CheckpointError(f"{path} has checkpoint format version {payload.get('version')!r}; this halfadam "
                              f"reads version {_FORMAT_VERSION}")
    entries = payload.get("objects")
    try:
        digest = _digest(entries) if isinstance(entries, Mapping) else None
    except ValueError as exc:
        raise CheckpointError(f"{path} was read with map_location={map_location!r}: {exc}; use 'cpu'") from None
    if digest is None or digest != payload.get("sha256"):
        raise CheckpointError(f"{path} is corrupt: its contents do not match the checksum written with it")
    missing = [name for name in objects if name not in entries]
    if missing:
        raise CheckpointError(f"{path} has no entry {missing[0]!r} (it holds: {', '.join(entries)})")
    order = sorted(objects, key=lambda n: 0 if isinstance(objects[n], torch.nn.Module)
                   else 1 if isinstance(objects[n], torch.optim.Optimizer) else 2)
    commits = [(name, _check_entry(name, objects[name], entries[name])) for name in order]
    for name, commit in commits:
        commit()
    return dict(entries)
