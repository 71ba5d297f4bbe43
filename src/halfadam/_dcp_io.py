"""Distributed-checkpoint files with a SHA-256 manifest: DCP's storage writer and reader, extended.

``torch.distributed.checkpoint`` writes a directory of ``.distcp`` data files and one ``.metadata``
file, with no checksum: a flipped bit may load as a wrong value without an error. The writer here is
DCP's :class:`~torch.distributed.checkpoint.FileSystemWriter` that, once every rank's files are
written, also writes :data:`MANIFEST` (the coordinator, last, atomically): one line per file of the
checkpoint, ``<sha256 hex>  <file name>``, the format of ``sha256sum``, so that
``sha256sum -c halfadam.sha256`` in the directory checks it too. The reader is DCP's
:class:`~torch.distributed.checkpoint.FileSystemReader` that checks ``.metadata`` before unpickling
it, and on each rank the data files its load plan reads before any of them is read (DCP plans
collectively, so a failure on one rank fails the load on all, before any rank reads a tensor). A
directory without a manifest (written by plain ``dcp.save``, or before halfadam wrote one) is read
unchecked.

Failures raise :class:`halfadam.checkpoint.CheckpointError` naming the file (inside DCP they reach
the caller as DCP's ``CheckpointException``; :func:`halfadam.distributed.load_checkpoint` unwraps it).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Dict, List, Optional

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.storage import WriteResult

from .state_dict import CheckpointError

__all__ = ["MANIFEST", "ChecksummedWriter", "ChecksummedReader", "sha256_of", "read_manifest"]

#: The manifest's file name inside the checkpoint directory.
MANIFEST = "halfadam.sha256"
_METADATA = ".metadata"


def sha256_of(path: Path) -> str:
    """The SHA-256 of the file at ``path``, as 64 hex digits (read in 1 MiB chunks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_manifest(directory: Path) -> Optional[Dict[str, str]]:
    """``{file name: sha256 hex}`` from ``directory``'s manifest, or ``None`` if it has none.

    Raises:
        CheckpointError: the manifest is not in the ``<64 hex digits>  <name>`` line format.
    """
    path = Path(directory) / MANIFEST
    if not path.exists():
        return None
    if not path.is_file():
        raise CheckpointError(f"{path}: the checkpoint's manifest is not a file")
    entries = {}
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        digest, sep, name = line.strip().partition(" ")
        name = name.lstrip(" ").removeprefix("*").removeprefix("./")  # sha256sum's text and binary forms
        digest = digest.lower()
        if not sep or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest) or not name:
            raise CheckpointError(f"{path}: line {n} is not '<sha256>  <file>': {line[:80]!r}")
        entries[name] = digest
    return entries


class ChecksummedWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` (every argument is its own) that ends the checkpoint with :data:`MANIFEST`.

    The manifest names every data file the ranks wrote and ``.metadata``; it replaces an older
    manifest in the directory only once the new files are all written, so a save that dies half-way
    leaves files that fail the check instead of a checkpoint that loads mixed.
    """

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        super().finish(metadata, results)
        directory = Path(self.path)
        names = sorted({wr.storage_data.relative_path for rank in results for wr in rank}) + [_METADATA]
        lines = "".join(f"{sha256_of(directory / name)}  {name}\n" for name in names)
        tmp = directory / f"{MANIFEST}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(lines)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / MANIFEST)


class ChecksummedReader(FileSystemReader):
    """DCP's ``FileSystemReader`` that checks the files against :data:`MANIFEST` before reading them.

    ``manifest``: ``{file name: sha256}`` read from the directory's manifest, or ``None``.
    ``.metadata`` is checked in :meth:`read_metadata`, before it is unpickled; the data files of this
    rank's load plan in :meth:`prepare_local_plan`, before DCP reads any of them. Without a manifest
    nothing is checked.

    Raises (inside DCP's load):
        CheckpointError: a file that is missing, that the manifest does not list, or whose SHA-256
            differs from the manifest's (the message names the file); a malformed manifest.
    """

    def __init__(self, path: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self.manifest = read_manifest(Path(self.path))
        self._checked: set = set()

    def reset(self, checkpoint_id: Any = None) -> None:
        super().reset(checkpoint_id)
        self.manifest, self._checked = read_manifest(Path(self.path)), set()

    def check(self, names: Any) -> None:
        """Check the files ``names`` (names inside the checkpoint directory) against the manifest;
        each file once per reader. Raises CheckpointError naming the first that fails."""
        if self.manifest is None:
            return
        directory = Path(self.path)
        for name in sorted(set(names) - self._checked):
            path = directory / name
            expected = self.manifest.get(name)
            if expected is None:
                raise CheckpointError(f"{path}: not listed in the checkpoint's manifest {directory / MANIFEST} "
                                      f"(a file from another save?)")
            if not path.is_file():
                raise CheckpointError(f"{path}: missing (the manifest {directory / MANIFEST} lists it)")
            if sha256_of(path) != expected:
                raise CheckpointError(f"{path}: its SHA-256 differs from the manifest's: the file is corrupt or "
                                      f"truncated (or was rewritten since the save)")
            self._checked.add(name)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        self.check([_METADATA if rank is None else f"__{rank}{_METADATA}"])
        return super().read_metadata(*args, **kwargs)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        self.check({self.storage_data[item.storage_index].relative_path for item in plan.items})
        return super().prepare_local_plan(plan)
