"""Temporary files and directories of halfadam's saves: names that say which process wrote them, and
the removal of those whose writer has provably ended (a save killed mid-way).

A name ends in ``.<pid>-<start>-<scope>.tmp``: the writer's pid, its start time (clock ticks after
boot, from /proc) and a hash of this boot and pid namespace. Used by
:func:`halfadam.checkpoint.save_checkpoint` (a file) and :func:`halfadam.distributed.save_checkpoint`
(a directory). A complete checkpoint directory that a save killed between its two renames left is
never removed while its checkpoint's path is missing: the next save to that path renames it back.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import re
import shutil
from pathlib import Path
from typing import List, Optional

#: save_checkpoint's temporary files: ``.<name>.<random>.<pid>-<start>-<scope>.tmp`` (see _writer_tag).
_TMP_NAME = re.compile(r"^\..+\.([1-9][0-9]{0,9})-([0-9]+)-([0-9a-f]{8})\.tmp$")

#: :func:`halfadam.distributed.save_checkpoint`'s temporary directories of the checkpoint ``<name>``:
#: ``.<name>.<random>.<tag>.tmp`` (the new checkpoint; after an exchange, the old one) and
#: ``.<name>.old.<tag>.tmp`` (the old one renamed aside); the tag ``.<pid>-<start>-<scope>`` is absent
#: without /proc.
_DIR_NAME = re.compile(r"^\.(.+)\.(old|[a-z0-9_]{8})(?:\.[1-9][0-9]{0,9}-[0-9]+-[0-9a-f]{8})?\.tmp$")

#: The files of a complete checkpoint directory: its SHA-256 manifest (``_dcp_io.MANIFEST``, which the
#: writer writes last) and DCP's ``.metadata``.
_COMPLETE = ("halfadam.sha256", ".metadata")


def _process_start(pid: int) -> Optional[str]:
    """When process ``pid`` started (clock ticks after boot, from /proc), or ``None`` if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


@functools.lru_cache(maxsize=None)
def _writer_scope() -> Optional[str]:
    """This boot and pid namespace, hashed: where a pid and start time name one process. ``None`` without /proc."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    return hashlib.sha256(f"{boot} {namespace}".encode()).hexdigest()[:8]


def _writer_tag() -> str:
    """The end of this process's temporary file names: pid, start time and scope (empty without /proc)."""
    pid, scope = os.getpid(), _writer_scope()
    start = _process_start(pid)
    return f".{pid}-{start}-{scope}" if scope and start else ""


def _writer_gone(pid: int, start: str) -> bool:
    """Whether the process ``pid`` that started at ``start`` has provably ended (a reused pid has another start)."""
    now = _process_start(pid)
    if now is not None:
        return now != start
    try:
        os.kill(pid, 0)  # /proc/<pid> unreadable: the pid is free (the writer is gone) or hidden (unknown)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError):
        pass
    return False


def _make_parents(path: Path) -> None:
    """Create the directories above ``path``. An ancestor that is a file raises NotADirectoryError whose
    ``filename`` is ``path`` (``mkdir`` would name the ancestor, with FileExistsError)."""
    for ancestor in reversed(path.parents):
        if ancestor.exists() and not ancestor.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, f"{ancestor} is a file, not a directory", str(path))
    path.parent.mkdir(parents=True, exist_ok=True)


def _dead(name: str) -> bool:
    """Whether ``name`` is a temporary of this machine's processes (same boot and pid namespace) whose
    writer has provably ended."""
    match, scope = _TMP_NAME.match(name), _writer_scope()
    return bool(match and scope and match[3] == scope and _writer_gone(int(match[1]), match[2]))


def _complete(directory: Path) -> bool:
    """Whether ``directory`` (not a link) holds a complete checkpoint: :data:`_COMPLETE`."""
    return directory.is_dir() and not directory.is_symlink() and all((directory / f).is_file() for f in _COMPLETE)


def _killed_saves(path: Path) -> List[Path]:
    """The complete checkpoint directories that saves to ``path`` left beside it (a save killed between
    its two renames leaves its new checkpoint and the old one), newest first: by when their manifest
    was written, and of one save its new checkpoint before the old one (on a coarse clock)."""
    try:
        names = os.listdir(path.parent)
    except OSError:
        return []
    found = []
    for name in names:
        match = _DIR_NAME.match(name)
        if match and match[1] == path.name and _complete(path.parent / name):
            try:
                found.append(((path.parent / name / _COMPLETE[0]).stat().st_mtime_ns, match[2] != "old", name))
            except OSError:
                pass
    return [path.parent / name for *_, name in sorted(found, reverse=True)]


def _recover(path: Path) -> None:
    """Where the checkpoint directory ``path`` does not exist, rename to it the newest complete checkpoint
    that a killed save to it left (:func:`_killed_saves`), if its writer has provably ended (a live one
    is between its own two renames). One rename: killed at any point, the checkpoint is at one name or
    the other. Errors are ignored (another process recovered it first...)."""
    if os.path.lexists(path):
        return
    leftovers = _killed_saves(path)
    if leftovers and _dead(leftovers[0].name):
        try:
            os.rename(leftovers[0], path)
        except OSError:
            return
        _sync_directory(path.parent)  # the rename on disk before any leftover's removal


def _sync_directory(directory: Path) -> None:
    """fsync ``directory`` (its entries: renames, new names), where the system allows. Errors are ignored."""
    try:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _remove_entry(path: Path) -> None:
    """Remove the file or directory ``path``, a directory's manifest first (a removal cut short never
    leaves what looks like a complete checkpoint). Errors are ignored."""
    try:
        if path.is_dir() and not path.is_symlink():
            try:
                os.unlink(path / _COMPLETE[0])
            except OSError:
                pass
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except OSError:
        pass


def _remove_dead_temporaries(directory: Path) -> None:
    """Remove the temporary files in ``directory`` of save_checkpoint calls whose process has ended (killed).

    Only files this machine's processes wrote (same boot and pid namespace) whose writer is provably gone
    are removed; a live writer's file, or any other file, is never touched. Errors are ignored. The
    temporary directories of :func:`halfadam.distributed.save_checkpoint` (same names) are removed too,
    except a complete checkpoint of a name that has none: a save killed between its two renames left
    the last complete checkpoint there (:func:`_recover` renames it back).
    """
    if _writer_scope() is None:
        return
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in filter(_dead, names):
        match = _DIR_NAME.match(name)
        if match and not os.path.lexists(directory / match[1]) and _complete(directory / name):
            continue
        _remove_entry(directory / name)
