"""The hand-written CPU kernel (``implementation="cpp"``): built on first use, cached, optional.

``adam_cpu.cpp`` (beside this module) holds ``adam_step(params, grads, state, offsets, block_offsets,
row_lengths, coefficients, grad_scale, l2, optimized_update, step, positions, rule=0)``: one step of an
update rule (0 Adam/AdamW; 1 SGD, whose two flags are weight decay on and nesterov; 2 Lion: the
rules of :class:`halfadam.functional.Rule`, their moments in the ``exp_avg``/``exp_avg_sq`` slots) over a list of float16/bfloat16/float32 parameters whose state lives in flat buffers (``state``:
:attr:`halfadam.buckets.Bucket.flat`, or one shard's own state tensors flattened; ``offsets``: each
parameter's first element in the per-element buffers, ``block_offsets``: its first block in the
per-block ones; ``row_lengths``: the elements of each of its rows of blocks, each row cut into blocks
of 128, the last one shorter where 128 does not divide it (:attr:`~halfadam.buckets.Bucket.row_lengths`;
the numel: one row); ``positions``: each parameter's first element's index in its whole parameter,
the random bits' positions, or empty for 0), in one call (no gathering of gradients
or parameters, no per-tensor Python), in every state format (the encodings of
:mod:`halfadam.encodings`, bit for bit, 8-bit moments and their ``*_scale`` bytes included);
``first_invalid(params, grads)``, the optimizer's per-gradient checks in one call (the index of the
first pair they would reject); and, for tests, ``encode_uint8(x, codes, scale, exp_avg, step)`` /
``decode_uint8(codes, scale, exp_avg)``, its 8-bit block encoder and decoder by themselves, and
``available_lanes()`` / ``set_lanes(n)``, the vector widths compiled in and the one to run. Its
equations are :mod:`halfadam.functional`'s, term for term (the file's header states them), vectorised
with AVX-512 (16 lanes) or AVX2 and F16C (8 lanes) where the CPU has them, one element at a time
otherwise and for the tails, split over torch's intra-op threads (``torch.set_num_threads``).

It is compiled by :func:`torch.utils.cpp_extension.load` (gcc or clang, and ninja) with
``-O3 -march=native -ffp-contract=off -fopenmp``, once per build key: the source's bytes, the flags,
torch (version, build and install directory), Python's include directory and extension ABI, the CPU's
flags and the compiler (``CXX`` and the file it names). The key's digest names a directory under
``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``), so every checkout, worktree or
virtual environment with the same key shares one build, and one with another key gets its own. In it:

* ``build/``: the ninja build of a copy of the source (so its command never depends on the checkout);
  wiped before every build, which is therefore always a clean one;
* ``halfadam_cpu_<digest>.so``: the built library, copied there atomically (a temporary file, fsync,
  rename), and ``halfadam_cpu_<digest>.so.sha256``, its checksum, written after it. The process that
  builds imports what it has just built; every other one imports this library, without running ninja,
  and only once its bytes match the checksum and hold a whole ELF library (the program header table,
  every segment and the section header table within the file: the loader maps segments, and one past
  a cut file's end kills the process with SIGBUS on its first read). A missing or damaged one (a crash
  or a full disk while it was written, a copy cut short on a network file system, checksum and all)
  is rebuilt, with one line saying why. The bytes checked are the bytes loaded: on Linux from a copy
  in memory (``memfd_create``), so a library cut or replaced after its check cannot take the process
  down; elsewhere (or where executable memory files are forbidden) from the file. Reading, checksum,
  ELF check and load take about 4 ms against 3 ms for the file loaded in place (2 MB then; 3.5 MB with
  SGD's and Lion's rules; 2-core AMD EPYC, loaded, 2026-12-07; the ELF check 5 us), and the copy holds
  the library's 3.5 MB per process;
* ``halfadam_build_failed.txt``: the reason a build failed, so later processes do not retry it
  (delete it to retry);
* ``halfadam.lock``: held (``flock``) by the process that builds; others wait for it, with one line.

Every build, the first or a rebuild, is announced on the ``halfadam`` logger at WARNING level. The
first takes a minute or two; later processes load the library in well under a second. Where it cannot
be built (no compiler, no ninja, a failed build) :func:`load` returns ``None`` and
:func:`unavailable_reason` says why (also logged), and ``implementation="auto"`` runs the
``torch.compile`` path instead. Set ``HALFADAM_CPP=0`` (or ``false``/``off``/``no``) to never build or
use it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shutil
import struct
import sys
import sysconfig
import threading
from pathlib import Path
from types import ModuleType
from typing import Iterator, Optional, Tuple

import torch


try:
    import fcntl
except ImportError:  # Windows: no lock between processes (cpp_extension's own covers the ninja build)
    fcntl = None  # type: ignore[assignment]

__all__ = ["load", "loaded", "lanes", "library_path", "unavailable_reason", "SOURCE"]

SOURCE = Path(__file__).with_name("adam_cpu.cpp")
# -fopenmp: at::parallel_for is inline OpenMP (ATen/ParallelOpenMP.h); without it the loop runs on one
# thread. The module links libgomp by its soname, so it shares the runtime torch has loaded.
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"]
_FAILED = "halfadam_build_failed.txt"

_log = logging.getLogger("halfadam")
_lock = threading.Lock()
_module: Optional[ModuleType] = None
_reason: Optional[str] = None  # why the kernel is unavailable, once known


class _Unavailable(Exception):
    """The kernel cannot be had (an earlier build failed, or this one did); the reason, already logged."""


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU's flags (Linux), else the processor's name."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build_name(source: bytes) -> str:
    """``halfadam_cpu_<digest>``, the name of the module, of its directory and of its library: a digest
    of everything that changes the built library, and of nothing else (not the checkout's path)."""
    compiler = os.environ.get("CXX", "c++")
    found = shutil.which(compiler)  # the compiler PATH selects, through links (an alternatives switch)
    key = (CFLAGS, torch.__version__, torch.version.git_version, str(Path(torch.__file__).parent),
           sysconfig.get_path("include", scheme="nt" if os.name == "nt" else "posix_prefix"),
           sysconfig.get_config_var("EXT_SUFFIX"), _cpu_signature(), compiler, found and os.path.realpath(found))
    return f"halfadam_cpu_{hashlib.sha256(source + repr(key).encode()).hexdigest()[:16]}"


def load() -> Optional[ModuleType]:
    """The compiled extension module, from the cache or built (rebuilt) on first use in this process;
    ``None`` where it cannot be had, with the reason in :func:`unavailable_reason`. Never raises.

    A build is announced on the ``halfadam`` logger at WARNING level (printed to stderr unless logging
    is configured otherwise), as are a damaged cached library and a failure. A failed build leaves
    ``halfadam_build_failed.txt`` with the reason in its build directory, so later processes do not
    retry it (delete the file to retry).
    """
    global _module, _reason
    if _module is not None or _reason is not None:
        return _module
    with _lock:
        if _module is not None or _reason is not None:
            return _module
        setting = os.environ.get("HALFADAM_CPP", "1")
        if setting.strip().lower() in ("0", "false", "off", "no"):
            _reason = f"disabled (HALFADAM_CPP={setting})"
            return None
        try:
            _module = _load_or_build(SOURCE.read_bytes())
        except _Unavailable as exc:
            _reason = str(exc)
        except Exception as exc:  # no cache directory, no torch.utils.cpp_extension, a library that will not load
            _reason = _describe(exc)
            _log.warning("halfadam: the C++ CPU kernel is unavailable (%s); implementation='auto' runs the "
                         "torch.compile path instead", _reason)
        return _module


def _load_or_build(source: bytes) -> ModuleType:
    """The kernel built from ``source``: the cached library where it passes :func:`_checked`, else built
    (a missing library) or rebuilt (a damaged one, announced with what is wrong) under the directory's
    lock, which only one process holds (the others wait, then find it built).

    Raises :class:`_Unavailable` (logged) where an earlier build failed (its marker file is there) or
    this one fails (writing the marker); ``OSError`` where the cache cannot be read or written;
    ``ImportError`` where a checked library does not load.
    """
    from torch.utils import cpp_extension

    name = _build_name(source)
    directory = Path(cpp_extension._get_build_directory(name, verbose=False))
    library, failed = directory / f"{name}.so", directory / _FAILED
    _raise_if_failed(failed)
    data, problem = _checked(library)
    if problem is None:
        return _import(name, library, data)
    with _exclusive(directory / "halfadam.lock"):
        _raise_if_failed(failed)  # another process's build failed while this one waited...
        data, problem = _checked(library)
        if problem is None:  # ... or succeeded
            return _import(name, library, data)
        if problem != "missing":
            _log.warning("halfadam: the cached C++ CPU kernel %s is unusable (%s); rebuilding it", library, problem)
        try:
            return _build(name, source, directory, library)
        except Exception as exc:  # no compiler or ninja, a failed build
            reason, remembered = _describe(exc), ""
            try:
                failed.write_text(reason + "\n")
                remembered = f"; remembered in {failed} (delete it to retry)"
            except OSError:
                pass
            _log.warning("halfadam: the C++ CPU kernel is unavailable (%s); implementation='auto' runs the "
                         "torch.compile path instead%s", reason, remembered)
            raise _Unavailable(reason) from exc


def _raise_if_failed(failed: Path) -> None:
    """Raises :class:`_Unavailable` (logged) with the reason an earlier build left in ``failed``, if it is there."""
    try:
        text = failed.read_text().strip()
    except FileNotFoundError:
        return
    reason = f"{text} (an earlier build; delete {failed} to retry)"
    _log.warning("halfadam: the C++ CPU kernel is skipped: %s", reason)
    raise _Unavailable(reason)


def _checked(library: Path) -> Tuple[bytes, Optional[str]]:
    """``library``'s bytes and ``None`` where they match the sha256 in ``library.sha256`` and hold a whole
    shared library (:func:`_cut_short`), else what is wrong with them: ``"missing"`` where neither file
    is there (never built). Raises ``OSError`` where one cannot be read."""
    checksum = library.with_name(library.name + ".sha256")
    try:
        data = library.read_bytes()
    except FileNotFoundError:
        return b"", "missing" if not checksum.exists() else "the library is missing"
    try:
        expected = checksum.read_text().strip()
    except FileNotFoundError:
        return data, f"its checksum file {checksum.name} is missing"
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected:
        return data, (f"its sha256 {actual[:16]}... ({len(data)} bytes) is not the one it was written with, "
                      f"{expected[:16]}...")
    return data, _cut_short(data)


def _cut_short(data: bytes) -> Optional[str]:
    """What makes ``data`` no whole ELF shared library: no ELF header, or its program header table, a
    segment or its section header table (the file's last bytes) past its end, which the loader would map
    and the process die of (SIGBUS) on the first read; ``None`` for a whole one, and on macOS and
    Windows (no ELF)."""
    if sys.platform in ("darwin", "win32"):
        return None
    size, wide = len(data), data[4:5] == b"\x02"
    order = ">" if data[5:6] == b"\x02" else "<"
    segment = order + ("8xQ16xQ" if wide else "4xI8xI")  # a program header's p_offset and p_filesz
    if size < (64 if wide else 52) or data[:4] != b"\x7fELF":
        return f"it is no ELF file ({size:,} bytes)"
    # e_phoff and e_shoff, then e_phentsize, e_phnum, e_shentsize and e_shnum
    phoff, shoff = struct.unpack_from(order + ("QQ" if wide else "II"), data, 32 if wide else 28)
    phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "4H", data, 54 if wide else 42)
    if phentsize < struct.calcsize(segment):
        return f"its program headers are {phentsize} bytes long, too short for ELF"
    ends = [("its program header table", phoff + phnum * phentsize)]
    if ends[0][1] <= size:
        ends += [(f"segment {k}", sum(struct.unpack_from(segment, data, phoff + k * phentsize))) for k in range(phnum)]
    ends.append(("its section header table", shoff + shnum * shentsize))
    for what, end in ends:
        if end > size:
            return f"it is cut short: {what} ends at byte {end:,}, past its {size:,} bytes"
    return None


def _build(name: str, source: bytes, directory: Path, library: Path) -> ModuleType:
    """Compiles ``source`` as module ``name`` in a clean ``directory/build`` (announced), installs the
    result as ``library`` with its checksum, and returns the module (imported from the build).

    Raises what :func:`torch.utils.cpp_extension.load` raises (no compiler or ninja, a compile error)
    and ``OSError`` (the directory cannot be written).
    """
    from torch.utils import cpp_extension

    for stale in (library, library.with_name(library.name + ".sha256")):
        stale.unlink(missing_ok=True)
    build = directory / "build"
    shutil.rmtree(build, ignore_errors=True)  # no objects, command lines or lock file of an earlier build
    build.mkdir()
    copy = build / SOURCE.name
    copy.write_bytes(source)
    _log.warning("halfadam: compiling the C++ CPU kernel (once for this source, torch, Python, CPU and compiler, "
                 "a minute or two; cached in %s; HALFADAM_CPP=0 skips it)", directory)
    module = cpp_extension.load(name=name, sources=[str(copy)], build_directory=str(build), extra_cflags=CFLAGS,
                                extra_ldflags=["-fopenmp"], verbose=False)
    data = (build / library.name).read_bytes()
    _write_atomically(library, data, mode=0o755)
    _write_atomically(library.with_name(library.name + ".sha256"), (hashlib.sha256(data).hexdigest() + "\n").encode())
    return module


def _write_atomically(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Writes ``data`` to ``path`` so that ``path`` is always absent, its old content or all of ``data``
    (a temporary file next to it, fsync, rename). Raises ``OSError``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with open(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _import(name: str, library: Path, data: bytes) -> ModuleType:
    """The extension module built as ``name`` (its ``PyInit_<name>``) from ``data``, the checked bytes of
    ``library``: loaded from a copy of them in memory (``memfd_create``: Linux), so that the file cut
    or replaced since the check cannot take the process down; where there is none (another system, a
    kernel without it, or one that forbids executable memory files), from ``library`` itself. Its
    ``__file__`` is ``library``. Raises ``ImportError``."""
    try:
        fd = os.memfd_create(library.name)
    except (AttributeError, OSError):
        return _exec_extension(name, library)
    try:
        with open(fd, "wb", closefd=False) as f:
            f.write(data)
        module = _exec_extension(name, Path(f"/proc/self/fd/{fd}"))
    except (ImportError, OSError):  # vm.memfd_noexec, no /proc
        return _exec_extension(name, library)
    finally:
        os.close(fd)  # the loader's mapping keeps the copy
    module.__file__ = str(library)
    return module


def _exec_extension(name: str, path: Path) -> ModuleType:
    """The extension module ``name`` in the library at ``path``. Raises ``ImportError``."""
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """Holds an exclusive ``flock`` on ``path`` (released by the system if the process dies) while the
    block runs, saying so when another process holds it. No lock where ``fcntl`` is missing (Windows)."""
    if fcntl is None:
        yield
        return
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log.warning("halfadam: waiting for another process that builds the C++ CPU kernel in %s", path.parent)
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _describe(exc: Exception) -> str:
    """``"<type>: <cause>"`` for an exception from a build (its first telling line, not torch's command line)."""
    return f"{type(exc).__name__}: {_first_cause(str(exc))}"


def _first_cause(message: str) -> str:
    """The line of a build log that says what went wrong (a compiler error, a missing program)."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()] or [""]
    for marker in ("error:", "not found", "fatal", "no such file", "error"):
        for line in lines:
            if marker in line.lower() and not line.startswith("["):  # "[1/2] g++ ...": ninja's command echo
                return line[:300]
    return lines[-1][:300]


def lanes() -> int:
    """The lane width the loaded kernel runs (16, 8 or 1; 0 where none is loaded)."""
    if _module is None:
        return 0
    previous = _module.set_lanes(0)  # set_lanes returns the width it replaces
    _module.set_lanes(previous)
    return int(previous)


def library_path() -> Path:
    """Where the library built for this source, torch, Python, CPU and compiler is cached (it may not exist yet)."""
    from torch.utils import cpp_extension

    name = _build_name(SOURCE.read_bytes())
    return Path(cpp_extension._get_build_directory(name, verbose=False)) / f"{name}.so"


def loaded() -> Optional[ModuleType]:
    """The extension module if :func:`load` has built or loaded it in this process (never builds)."""
    return _module


def unavailable_reason() -> Optional[str]:
    """Why :func:`load` returned ``None`` (``None`` if it has not failed, or has not been called)."""
    return _reason
