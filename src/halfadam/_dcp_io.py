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

Nothing read runs code from the checkpoint or changes anything outside what it returns: ``.metadata`` is
unpickled by :class:`_MetadataUnpickler`, which admits only the classes DCP's metadata is made of
(:data:`_METADATA_GLOBALS`) and gives state only to new instances of them, and then checked
(:func:`check_metadata`); the non-tensor items (a group's ``lr``, the extra data) by
:class:`SafeLoadPlanner` with ``torch.load(weights_only=True)`` (DCP's own planner uses
``weights_only=False``). Tensors DCP reads with ``weights_only=True`` itself. The reader opens only
regular files inside the checkpoint directory (:func:`open_inside`: no ``..``, no absolute name, no
link out of it, no FIFO), with a manifest or without.

A save goes to a new sibling directory (:func:`new_sibling`) that :func:`swap_in` exchanges with the
old checkpoint once it is complete, so a save killed at any point leaves the old or the new one.

Failures raise :class:`halfadam.checkpoint.CheckpointError` naming the file (inside DCP they reach
the caller as DCP's ``CheckpointException``; :func:`halfadam.distributed.load_checkpoint` unwraps it).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import io
import os
import pickle
import re
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Dict, Iterator, List, Optional

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import (_MEM_FORMAT_ENCODING, BytesStorageMetadata, ChunkStorageMetadata,
                                                   Metadata, MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.storage import WriteResult

from ._tempfiles import (_COMPLETE, _killed_saves, _make_parents, _recover, _remove_dead_temporaries, _remove_entry,
                         _sync_directory, _writer_tag)
from .state_dict import CheckpointError

__all__ = ["MANIFEST", "ChecksummedWriter", "ChecksummedReader", "SafeLoadPlanner", "sha256_of", "read_manifest",
           "load_object", "new_sibling", "check_present", "swap_in"]

#: The manifest's file name inside the checkpoint directory.
MANIFEST, _METADATA = _COMPLETE  # a complete checkpoint's two files (their names stated in _tempfiles)


def open_inside(directory: Any, path: Any) -> BinaryIO:
    """The file ``path`` of the checkpoint directory ``directory``, opened for reading, where it is a
    regular file inside ``directory`` (a link is followed: what it names must be so too). A FIFO is
    never opened (that would block), a device or a socket neither.

    Raises:
        CheckpointError: ``path`` lies outside ``directory`` (``..``, an absolute name, a link out of
            it) or is not a regular file (naming it and what it is).
        OSError: the file cannot be opened (``FileNotFoundError``, naming ``path``: it is missing).
    """
    real, top = os.path.realpath(path), os.path.realpath(directory)
    try:
        inside = os.path.commonpath([real, top]) == top and real != top
    except ValueError:  # another drive (Windows)
        inside = False
    if not inside:
        link = f" (a link to {real})" if os.path.islink(path) else ""
        raise CheckpointError(f"{path}: lies outside the checkpoint directory {directory}{link}; refusing to read it")
    try:
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path)) from None
    _check_regular(path, mode)
    fd = os.open(real, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        _check_regular(path, os.fstat(fd).st_mode)  # replaced by a FIFO since: O_NONBLOCK kept it from blocking
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _check_regular(path: Any, mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                                             (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"),
                                             (stat.S_ISBLK, "a device")) if test(mode)), "not a file")
        raise CheckpointError(f"{path}: is {kind}, not a regular file; a checkpoint's files are regular files, "
                              f"refusing to read it")


def sha256_of(path: Path, inside: Any = None) -> str:
    """The SHA-256 of the file at ``path``, as 64 hex digits (read in 1 MiB chunks); ``inside``: the
    checkpoint directory it must be a regular file in (:func:`open_inside`, which raises)."""
    digest = hashlib.sha256()
    with open(path, "rb") if inside is None else open_inside(inside, path) as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_manifest(directory: Path) -> Optional[Dict[str, str]]:
    """``{file name: sha256 hex}`` from ``directory``'s manifest, or ``None`` if it has none.

    Raises:
        CheckpointError: the manifest is not in the ``<64 hex digits>  <name>`` line format, or not
            a regular file inside ``directory`` (:func:`open_inside`).
    """
    path = Path(directory) / MANIFEST
    if not os.path.lexists(path):
        return None
    if not path.is_file():
        raise CheckpointError(f"{path}: the checkpoint's manifest is not a file")
    with open_inside(directory, path) as f:
        text = f.read().decode("utf-8", errors="replace")
    entries = {}
    for n, line in enumerate(text.splitlines(), 1):
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


#: The classes whose instances a ``.metadata`` file may give state to (pickle's BUILD): DCP's metadata
#: dataclasses (their attributes, a dict; ``TensorProperties``: its own ``__setstate__``, a tuple).
#: Nothing else is BUILD's target: not a class (``pathlib.PosixPath`` itself), not an enum member or a
#: dtype (shared by the whole process).
_BUILT = frozenset([Metadata, MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata,
                    ChunkStorageMetadata, BytesStorageMetadata, _StorageInfo])


_LEAVES = (str, bytes, int, float, bool, type(None))


def _plain(args: Any) -> bool:
    """Whether ``args`` (a call's) are plain values or flat lists or tuples of them (``torch.Size``'s)."""
    return type(args) is tuple and all(type(a) in _LEAVES or type(a) in (list, tuple) and all(
        type(x) in _LEAVES for x in a) for a in args)


def _plain_key(key: Any) -> bool:
    """Whether ``key`` is a string, an int or a ``MetadataIndex`` of a string and ints (cheap to hash:
    a tuple of tuples of ... sharing its items, a few hundred bytes of pickle, hashes for ever)."""
    return type(key) in (str, int) or type(key) is MetadataIndex and type(key.fqn) is str and (
        key.offset is None or _dims(key.offset))


class _MetadataUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """pickle's own (pure-Python) unpickler, restricted so that unpickling changes nothing outside the
    objects it returns, calls nothing but DCP's metadata classes and ends: it resolves only
    :data:`_METADATA_GLOBALS` and torch's dtypes, layouts and memory formats (any other global:
    ``posix.system``, ``builtins.eval``...); gives state (BUILD) only to new instances of
    :data:`_BUILT`'s classes, and only plain attributes; calls those with plain values only (:func:`_plain`);
    keys dicts by plain keys only (:func:`_plain_key`); refuses sets, persistent ids and the extension
    registry (:data:`_CHECKS`). Each refusal raises CheckpointError naming ``path`` before anything of
    it is done. (The C unpickler's opcodes cannot be overridden.)"""

    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]  # _CHECKS' opcodes: checked first

    def __init__(self, file: Any, path: Any) -> None:
        super().__init__(file)
        self.path = path

    def refuse(self, what: str) -> None:
        raise CheckpointError(f"{self.path}: {what}, which DCP's metadata never does; refusing to load it")

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (
                module == "torch" and isinstance(getattr(torch, name, None),
                                                 (torch.dtype, torch.layout, torch.memory_format))):
            return super().find_class(module, name)
        raise CheckpointError(f"{self.path}: holds a reference to {module}.{name}, which a halfadam checkpoint "
                              f"never contains; refusing to load it")

    def persistent_load(self, pid: Any) -> Any:
        name = repr(pid[:40]) if type(pid) is str else f"a {type(pid).__name__}"
        raise CheckpointError(f"{self.path}: holds a persistent id ({name}), which DCP's metadata never contains; "
                              f"refusing to load it")

    def _instantiate(self, klass: Any, args: Any) -> None:  # protocol 0 and 1's INST and OBJ
        self.check_call(klass, tuple(args))
        super()._instantiate(klass, args)

    def check_call(self, what: Any, args: Any) -> None:
        if not _plain(args):
            self.refuse(f"calls {getattr(what, '__qualname__', type(what).__name__)} with other than plain values")

    def check_build(self) -> None:
        target, state = self.stack[-2], self.stack[-1]
        if type(target) not in _BUILT:
            self.refuse(f"sets attributes of the class {target.__module__}.{target.__qualname__}"
                        if isinstance(target, type) else
                        f"sets attributes of a {type(target).__module__}.{type(target).__qualname__}")
        if type(target) is TensorProperties:  # (dtype, layout, requires_grad, memory format's code, pin_memory)
            ok = type(state) is tuple and all(type(x) in _LEAVES or isinstance(
                x, (torch.dtype, torch.layout, _MEM_FORMAT_ENCODING)) for x in state)
        else:  # attributes (a newer torch's fields too), none of pickle's own (a __setstate__ of an admitted global)
            ok = type(state) is dict and all(type(k) is str and not (k.startswith("__") and k.endswith("__"))
                                             for k in state)
        if not ok:
            self.refuse(f"gives a {type(target).__name__} a state other than its attributes")

    def check_keys(self, keys: Any) -> None:
        if not all(_plain_key(k) for k in keys):
            self.refuse("keys a dict by other than a string, an int or a MetadataIndex")


#: The opcodes :class:`_MetadataUnpickler` checks before pickle's own code runs them: each its check,
#: given the unpickler (the stack: ``stack[-1]`` the top; SETITEMS and DICT: the items since the MARK).
_CHECKS = {
    pickle.BUILD: _MetadataUnpickler.check_build,
    pickle.REDUCE: lambda u: u.check_call(u.stack[-2], u.stack[-1]),
    pickle.NEWOBJ: lambda u: u.check_call(u.stack[-2], u.stack[-1]),
    pickle.SETITEM: lambda u: u.check_keys([u.stack[-2]]),
    pickle.SETITEMS: lambda u: u.check_keys(u.stack[::2]),
    pickle.DICT: lambda u: u.check_keys(u.stack[::2]),
    pickle.NEWOBJ_EX: lambda u: u.refuse("makes an object with keyword arguments"),
    **{op: lambda u: u.refuse("uses pickle's extension registry") for op in (pickle.EXT1, pickle.EXT2, pickle.EXT4)},
    **{op: lambda u: u.refuse("holds a set") for op in (pickle.EMPTY_SET, pickle.FROZENSET, pickle.ADDITEMS)},
}


def _checked(check: Any, run: Any) -> Any:
    def checked(unpickler: Any) -> None:
        check(unpickler)
        run(unpickler)
    return checked


_MetadataUnpickler.dispatch.update({op[0]: _checked(check, _MetadataUnpickler.dispatch[op[0]])
                                    for op, check in _CHECKS.items()})


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
        raise CheckpointError(f"{where}: cannot be read (corrupt?): {_one_line(exc)}") from None


def _one_line(exc: BaseException) -> str:
    """``exc``'s type and the last line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[-1][:200] if lines else ''}"


def _key_name(key: Any) -> str:
    """A metadata key (a string, an int or a MetadataIndex: :func:`_plain_key`) for a message."""
    fqn = key.fqn if isinstance(key, MetadataIndex) else key
    return repr(fqn[:200]) if isinstance(fqn, str) else f"(a {type(key).__name__})"


def _dims(value: Any, rank: Optional[int] = None) -> bool:
    """Whether ``value`` is a tuple (``torch.Size``) of ints >= 0, of ``rank`` of them where given."""
    return isinstance(value, tuple) and all(type(d) is int and d >= 0 for d in value) and (
        rank is None or len(value) == rank)


def check_metadata(metadata: Any, path: Any) -> None:
    """Check that ``metadata`` (unpickled from the file ``path``) is DCP's metadata as DCP writes it:
    a ``Metadata`` whose items are keyed by strings and are bytes or tensors (a dtype, a size and
    chunks of ints >= 0 in as many dimensions), each item and chunk with its storage entry (a file
    name, an offset and a length), each file a plain name inside the checkpoint directory (no
    absolute name, no ``..``: a load opens no file outside it).

    Raises:
        CheckpointError: naming ``path`` and what is wrong (a file name: the name and the item).
    """
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP's checkpoint metadata")
    items, storage = metadata.state_dict_metadata, metadata.storage_data
    if not (isinstance(items, dict) and isinstance(storage, dict)
            and isinstance(metadata.storage_meta, (StorageMeta, type(None)))):
        raise CheckpointError(f"{path}: is malformed: its state_dict_metadata and storage_data must be dicts and "
                              f"its storage_meta a StorageMeta")
    for index, info in storage.items():
        if not (isinstance(index, MetadataIndex) and isinstance(index.fqn, str)
                and (index.offset is None or _dims(index.offset)) and isinstance(info, _StorageInfo)
                and isinstance(info.relative_path, str) and _dims((info.offset, info.length))
                and isinstance(info.transform_descriptors, (list, tuple, type(None)))):
            raise CheckpointError(f"{path}: is malformed: its storage entry {_key_name(index)} is not an item's "
                                  f"place in a file (a file name, an offset and a length)")
        name = Path(info.relative_path)
        if not name.parts or name.anchor or ".." in name.parts:
            raise CheckpointError(f"{path}: names the data file {info.relative_path!r} (for its item {index.fqn}), "
                                  f"which does not lie inside the checkpoint directory; refusing to load it")
    for fqn, meta in items.items():
        if not isinstance(fqn, str):
            raise CheckpointError(f"{path}: is malformed: its key {_key_name(fqn)} is not a string")
        if isinstance(meta, BytesStorageMetadata):
            places = [MetadataIndex(fqn)]
        elif (isinstance(meta, TensorStorageMetadata) and isinstance(meta.properties, TensorProperties)
              and isinstance(meta.properties.dtype, torch.dtype) and _dims(meta.size)
              and isinstance(meta.chunks, list) and all(isinstance(c, ChunkStorageMetadata) and _dims(c.offsets, len(
                  meta.size)) and _dims(c.sizes, len(meta.size)) for c in meta.chunks)):
            places = [MetadataIndex(fqn, chunk.offsets) for chunk in meta.chunks]
        else:
            raise CheckpointError(f"{path}: is malformed: its item {fqn[:200]!r} is neither bytes nor a tensor (a "
                                  f"dtype, a size and chunks of ints >= 0 in as many dimensions)")
        if any(place not in storage for place in places):
            raise CheckpointError(f"{path}: is malformed: its item {fqn[:200]!r} (or one of its chunks) has no "
                                  f"storage entry, no place in a file")


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

    Where ``path`` does not exist, a save killed between swap_in's two renames may have left the last
    complete checkpoint beside it: the newest such is renamed to ``path`` first (one rename), and only
    then are the other leftovers removed; a complete one is kept while ``path`` is missing.

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
    _recover(path)
    _remove_dead_temporaries(path.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=f"{_writer_tag()}.tmp", dir=path.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    return tmp


def check_present(path: Any, where: str) -> None:
    """Check that the checkpoint directory ``path`` exists, before a load reads it (``where``: the
    message's start, ``cannot load the checkpoint <path>``).

    Raises:
        CheckpointError: ``<where>: no such directory``, naming the newest complete checkpoint that a
            save to it left beside it, killed between :func:`swap_in`'s two renames, if one did (a load
            renames nothing: the next save to ``path`` renames it back, :func:`new_sibling`).
    """
    if os.path.exists(path):
        return
    leftovers = _killed_saves(Path(os.path.realpath(path)))
    hint = f"; a save to it that did not finish (killed?) left the complete checkpoint {leftovers[0]}: load " \
           f"that directory, or rename it to {path} (the next save_checkpoint to {path} does so itself once " \
           f"that save's process has ended)" if leftovers else ""
    raise CheckpointError(f"{where}: no such directory{hint}")


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


def swap_in(tmp: Path, path: Path) -> None:
    """Make the complete checkpoint directory ``tmp`` (of :func:`new_sibling`) the one at ``path``,
    then remove the old one.

    With an old checkpoint there, the two are exchanged in one step (``renameat2``), so ``path`` holds
    the whole old or the whole new checkpoint at every moment; ``tmp`` then holds the old one until it
    is removed. Where the file system cannot exchange, the old one is renamed aside first, so for the
    moment between the two renames ``path`` does not exist (the old checkpoint then lies in
    ``.<name>.old.<pid>-....tmp``); killed there, the next save to ``path`` first renames the new one
    back (:func:`new_sibling`), and a load names it (:func:`check_present`). The parent directory is
    fsync'ed after the swap.
    """
    tmp, path = Path(tmp), Path(path)
    old: Optional[Path] = tmp
    if not path.exists():
        os.rename(tmp, path)
        old = None
    elif not _exchange(tmp, path):
        old = path.with_name(f".{path.name}.old{_writer_tag()}.tmp")
        _remove_entry(old)
        os.rename(path, old)
        try:
            os.rename(tmp, path)
        except BaseException:
            os.rename(old, path)
            raise
    _sync_directory(path.parent)
    if old is not None:
        _remove_entry(old)


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


class _InsideFileSystem(FileSystem):
    """DCP's local file system, whose streams (a reader's: for reading) open only regular files inside
    the checkpoint directory ``directory`` (:func:`open_inside`)."""

    def __init__(self, directory: Any) -> None:
        super().__init__()
        self.directory = directory

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[BinaryIO]:
        if mode != "rb":
            raise ValueError(f"a checkpoint's reader opens its files for reading only, got mode {mode!r}")
        with open_inside(self.directory, path) as stream:
            yield stream


class ChecksummedReader(FileSystemReader):
    """DCP's ``FileSystemReader`` that checks the files against :data:`MANIFEST` before reading them,
    and opens only regular files inside the checkpoint directory (:func:`open_inside`).

    ``manifest``: ``{file name: sha256}`` read from the directory's manifest, or ``None``.
    ``.metadata`` is checked in :meth:`read_metadata`, before it is unpickled (and what it holds
    after: :func:`check_metadata`); the data files of this rank's load plan in
    :meth:`prepare_local_plan`, before DCP reads any of them. Without a manifest no file's content is
    checked; the files opened are still only regular files inside the directory.

    Raises (inside DCP's load):
        CheckpointError: a file that is missing, that the manifest does not list, or whose SHA-256
            differs from the manifest's (the message names the file); a malformed manifest; a file
            outside the directory or not a regular file (a FIFO...).
    """

    def __init__(self, path: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self.fs = _InsideFileSystem(self.path)
        self.manifest = read_manifest(Path(self.path))
        self._checked: set = set()

    def reset(self, checkpoint_id: Any = None) -> None:
        super().reset(checkpoint_id)
        self.fs.directory = self.path
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
            if not path.exists():
                raise CheckpointError(f"{path}: missing (the manifest {directory / MANIFEST} lists it)")
            if sha256_of(path, inside=directory) != expected:
                raise CheckpointError(f"{path}: its SHA-256 differs from the manifest's: the file is corrupt or "
                                      f"truncated (or was rewritten since the save)")
            self._checked.add(name)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's, checked against the manifest first, unpickled by :class:`_MetadataUnpickler` and then
        checked by :func:`check_metadata`.

        Raises CheckpointError naming the file: it is missing, fails the manifest, is not a regular file
        inside the directory, cannot be unpickled (corrupt, truncated), names a global that DCP's
        metadata never holds or does what its unpickling never does, or is not DCP's ``Metadata`` as
        DCP writes it (:func:`check_metadata`)."""
        rank = kwargs.get("rank")
        self.check([_METADATA if rank is None else f"__{rank}{_METADATA}"])
        path = self._get_metadata_path(rank)
        try:
            with self.fs.create_stream(path, "rb") as f:
                metadata = _MetadataUnpickler(f, path).load()
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing (every DCP checkpoint has one: is {self.path} a checkpoint "
                                  f"directory?)") from None
        except (CheckpointError, OSError):
            raise
        except Exception as exc:
            raise CheckpointError(f"{path}: cannot be unpickled (corrupt or truncated?): {_one_line(exc)}") from None
        check_metadata(metadata, path)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def check_objects(self, metadata: Metadata) -> None:
        """Check every data file of the checkpoint (``metadata``: its metadata) as a load does (against
        the manifest where there is one; a regular file inside the directory) and read every non-tensor
        item as a load reads it (:func:`load_object`), keeping nothing: CheckpointError for one a load
        would refuse."""
        directory = Path(self.path)
        self.check({info.relative_path for info in metadata.storage_data.values()})
        check_extents(directory, metadata.storage_data)
        for fqn, meta in metadata.state_dict_metadata.items():
            if isinstance(meta, BytesStorageMetadata):
                info = metadata.storage_data[MetadataIndex(fqn)]
                with open_inside(directory, directory / info.relative_path) as f:
                    f.seek(info.offset)
                    blob = io.BytesIO(f.read(info.length))
                load_object(blob, f"{directory / info.relative_path} (its item {fqn})")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        self.check({self.storage_data[item.storage_index].relative_path for item in plan.items})
        check_extents(Path(self.path), {item.storage_index: self.storage_data[item.storage_index]
                                        for item in plan.items})
        return super().prepare_local_plan(plan)


def check_extents(directory: Path, storage: Dict[MetadataIndex, Any]) -> None:
    """Check that each item of ``storage`` (``.metadata``'s places: a file name, an offset and a length)
    lies within its file, a regular file inside ``directory`` (:func:`open_inside`), before any item is read:
    a declared length is never allocated nor read past the file's end (a truncated file without a manifest
    fails here too).

    Raises:
        CheckpointError: naming the file, the item and both sizes; or what :func:`open_inside` raises.
    """
    sizes: Dict[str, int] = {}
    for index, info in storage.items():
        name = info.relative_path
        if name not in sizes:
            with open_inside(directory, directory / name) as f:
                sizes[name] = os.fstat(f.fileno()).st_size
        if info.offset + info.length > sizes[name]:
            raise CheckpointError(f"{directory / name}: its item {index.fqn} lies at bytes {info.offset:,} to "
                                  f"{info.offset + info.length:,} (.metadata), past the file's {sizes[name]:,} bytes: "
                                  f"the file is truncated, or .metadata is not its checkpoint's")
