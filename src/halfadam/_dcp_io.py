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

Nothing read runs code from the checkpoint: ``.metadata`` is unpickled by :class:`_MetadataUnpickler`,
which admits only the classes DCP's metadata is made of (:data:`_METADATA_GLOBALS`), and the non-tensor
items (a group's ``lr``, the extra data) by :class:`SafeLoadPlanner` with ``torch.load(weights_only=True)``
(DCP's own planner uses ``weights_only=False``). Tensors DCP reads with ``weights_only=True`` itself.

A save goes to a new sibling directory (:func:`new_sibling`) that :func:`swap_in` exchanges with the
old checkpoint once it is complete, so a save killed at any point leaves the old or the new one.

Failures raise :class:`halfadam.checkpoint.CheckpointError` naming the file (inside DCP they reach
the caller as DCP's ``CheckpointException``; :func:`halfadam.distributed.load_checkpoint` unwraps it).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import io
import os
import pickle
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.storage import WriteResult

from ._tempfiles import _make_parents, _remove_dead_temporaries, _writer_tag
from .state_dict import CheckpointError

__all__ = ["MANIFEST", "ChecksummedWriter", "ChecksummedReader", "SafeLoadPlanner", "sha256_of", "read_manifest",
           "load_object", "new_sibling", "swap_in"]

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


# ---------------------------------------------------------------------------- what a load unpickles
#: The globals a ``.metadata`` file may name: DCP's metadata dataclasses, the storage layer's
#: ``_StorageInfo``, ``torch.Size``, the layout helper and the checkpoint's path (``StorageMeta``),
#: found by recording what the unpickler was asked for over checkpoints of every state mode, of a
#: torch optimizer and of plain ``dcp.save`` (torch 2.13). torch's dtypes, layouts and memory formats
#: (``torch.float32``...) are admitted too.
_METADATA_GLOBALS = frozenset(
    [("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")]
    + [("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
       ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")]
    + [(module, name) for module in ("pathlib", "pathlib._local")
       for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")])


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only :data:`_METADATA_GLOBALS` and torch's dtypes, layouts and
    memory formats; any other global (``posix.system``, ``builtins.eval``...) raises CheckpointError
    naming ``path``, before anything is called."""

    def __init__(self, file: Any, path: Any) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (
                module == "torch" and isinstance(getattr(torch, name, None),
                                                 (torch.dtype, torch.layout, torch.memory_format))):
            return super().find_class(module, name)
        raise CheckpointError(f"{self.path}: holds a reference to {module}.{name}, which a halfadam checkpoint "
                              f"never contains; refusing to load it")


def load_object(value: io.BytesIO, where: str) -> Any:
    """A non-tensor item of a DCP checkpoint (``torch.save`` bytes): ``torch.load(weights_only=True)``,
    which also admits ``io.BytesIO`` (how DCP saves :func:`halfadam.distributed.save_checkpoint`'s extra
    data). Raises CheckpointError naming ``where`` (its file and key) for anything else."""
    try:
        with torch.serialization.safe_globals([io.BytesIO]):
            return torch.load(value, weights_only=True)
    except Exception as exc:
        found = re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) ([\w.]+)", str(exc))
        if found:
            raise CheckpointError(f"{where}: holds a reference to {found[1]}, which a halfadam checkpoint never "
                                  f"contains; refusing to load it") from None
        raise CheckpointError(f"{where}: cannot be read (corrupt?): {type(exc).__name__}: "
                              f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}") from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's ``DefaultLoadPlanner`` whose non-tensor items load with :func:`load_object` (DCP's own:
    ``torch.load(weights_only=False)``, which runs whatever code the bytes name).

    ``directory``: the checkpoint's, for the messages (they name the file and the item's key); every
    other argument is DCP's own.
    """

    def __init__(self, directory: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.directory = Path(directory)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        file = self.metadata.storage_data[read_item.storage_index].relative_path
        obj = load_object(value, f"{self.directory / file} (its item {read_item.storage_index.fqn})")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


# ---------------------------------------------------------------------------- where a save writes
def new_sibling(path: Path) -> Path:
    """A new, empty directory beside the checkpoint directory ``path`` to write its next version in:
    ``.<name>.<random>.<pid>-<start>-<scope>.tmp``, named as :func:`halfadam.checkpoint.save_checkpoint`'s
    temporary files, so that it and :func:`swap_in`'s leftovers of a killed save are removed by the next
    save in that directory (once their process has provably ended). Makes the parent directories.

    Raises:
        CheckpointError: ``path`` is a file, or a directory holding files that are not a DCP
            checkpoint's (a save replaces the whole directory).
        OSError: the directory cannot be made.
    """
    path = Path(path)
    if path.is_dir():
        foreign = sorted(n for n in os.listdir(path) if n not in (_METADATA, MANIFEST) and
                         not n.endswith((".distcp", ".tmp")) and not (n.startswith("__") and n.endswith(_METADATA)))
        if foreign:
            raise CheckpointError(f"{path} holds {foreign[0]!r}, which is not a file of a DCP checkpoint: a save "
                                  f"replaces the whole directory; save the checkpoint elsewhere")
    elif path.exists():
        raise CheckpointError(f"{path} is a file, not a checkpoint directory")
    _make_parents(path)
    _remove_dead_temporaries(path.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=f"{_writer_tag()}.tmp", dir=path.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    return tmp


def _exchange(a: Path, b: Path) -> bool:
    """Swap the directory entries ``a`` and ``b`` in one step (Linux's ``renameat2(RENAME_EXCHANGE)``);
    ``False`` where the system or the file system lacks it."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def swap_in(tmp: Path, path: Path) -> None:
    """Make the complete checkpoint directory ``tmp`` (of :func:`new_sibling`) the one at ``path``,
    then remove the old one.

    With an old checkpoint there, the two are exchanged in one step (``renameat2``), so ``path`` holds
    the whole old or the whole new checkpoint at every moment; ``tmp`` then holds the old one until it
    is removed. Where the file system cannot exchange, the old one is renamed aside first, so for the
    moment between the two renames ``path`` does not exist (the old checkpoint then lies in
    ``.<name>.old.<pid>-....tmp``). The parent directory is fsync'ed after the swap.
    """
    tmp, path = Path(tmp), Path(path)
    old: Optional[Path] = tmp
    if not path.exists():
        os.rename(tmp, path)
        old = None
    elif not _exchange(tmp, path):
        old = path.with_name(f".{path.name}.old{_writer_tag()}.tmp")
        _remove_tree(old)
        os.rename(path, old)
        try:
            os.rename(tmp, path)
        except BaseException:
            os.rename(old, path)
            raise
    try:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
    if old is not None:
        _remove_tree(old)


class ChecksummedWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` (every argument is its own) that ends the checkpoint with :data:`MANIFEST`.

    The manifest names every data file the ranks wrote and ``.metadata``; it replaces an older
    manifest in the directory only once the new files are all written, so a save that dies half-way
    leaves files that fail the check instead of a checkpoint that loads mixed.
    """

    def write_data(self, plan: Any, planner: Any) -> Any:
        """DCP's, with the ``OSError`` (a full disk...) that ``torch.save`` turned into its "enforce fail
        at inline_container.cc ... unexpected pos" raised as itself (its message crosses ranks)."""
        try:
            return super().write_data(plan, planner)
        except RuntimeError as exc:
            if isinstance(exc.__context__, OSError):
                raise exc.__context__ from None
            raise

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
        """DCP's, checked against the manifest first and unpickled by :class:`_MetadataUnpickler`.

        Raises CheckpointError naming the file: it fails the manifest, names a global that DCP's
        metadata never holds, or is not DCP's ``Metadata``."""
        rank = kwargs.get("rank")
        self.check([_METADATA if rank is None else f"__{rank}{_METADATA}"])
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP's checkpoint metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def check_objects(self, metadata: Metadata) -> None:
        """Read every non-tensor item of the checkpoint (``metadata``: its metadata) as a load reads it
        (:func:`load_object`), keeping nothing: CheckpointError for one a load would refuse."""
        directory = Path(self.path)
        for fqn, meta in metadata.state_dict_metadata.items():
            if isinstance(meta, BytesStorageMetadata):
                info = metadata.storage_data[MetadataIndex(fqn)]
                with open(directory / info.relative_path, "rb") as f:
                    f.seek(info.offset)
                    blob = io.BytesIO(f.read(info.length))
                load_object(blob, f"{directory / info.relative_path} (its item {fqn})")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        self.check({self.storage_data[item.storage_index].relative_path for item in plan.items})
        return super().prepare_local_plan(plan)
