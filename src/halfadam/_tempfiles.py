"""Temporary files and directories of halfadam's saves: names that say which process wrote them, and
the removal of those whose writer has provably ended (a save killed mid-way).

A name ends in ``.<pid>-<start>-<scope>.tmp``: the writer's pid, its start time (clock ticks after
boot, from /proc) and a hash of this boot and pid namespace. Used by
:func:`halfadam.checkpoint.save_checkpoint` (a file) and :func:`halfadam.distributed.save_checkpoint`
(a directory).
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import re
import shutil
from pathlib import Path
from typing import Optional

#: save_checkpoint's temporary files: ``.<name>.<random>.<pid>-<start>-<scope>.tmp`` (see _writer_tag).
_TMP_NAME = re.compile(r"^\..+\.([1-9][0-9]{0,9})-([0-9]+)-([0-9a-f]{8})\.tmp$")


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


def _remove_dead_temporaries(directory: Path) -> None:
    """Remove the temporary files in ``directory`` of save_checkpoint calls whose process has ended (killed).

    Only files this machine's processes wrote (same boot and pid namespace) whose writer is provably gone
    are removed; a live writer's file, or any other file, is never touched. Errors are ignored. The
    temporary directories of :func:`halfadam.distributed.save_checkpoint` (same names) are removed too.
    """
    scope = _writer_scope()
    if scope is None:
        return
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        match = _TMP_NAME.match(name)
        if match and match[3] == scope and _writer_gone(int(match[1]), match[2]):
            try:
                if (directory / name).is_dir() and not (directory / name).is_symlink():
                    shutil.rmtree(directory / name, ignore_errors=True)
                else:
                    os.unlink(directory / name)
            except OSError:
                pass
