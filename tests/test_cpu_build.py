"""The C++ kernel's build cache (:mod:`halfadam.kernels.cpp`), in fresh processes: shared by checkouts
of the same version without a rebuild, repaired when damaged, retried once its failure marker is gone.

The suite's own build of the kernel (the one every other test loads) serves these tests too: the
module fixture copies its build directory into a new cache, and each test works on its own copy of
that. Only the damaged-cache test compiles again (and it checks that the build announces itself once).
"""

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import halfadam

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")

COMPILING = "compiling the C++ CPU kernel"

# argv: the checkout halfadam must come from, then "step" (a cpp step, checked against the reference),
# "cut-then-step" (the same, with the library cut to 4 KiB as soon as it has been read) or "load" (print
# what load() gives).
SCRIPT = r"""
import os, sys, torch, halfadam
from halfadam.kernels import cpp as cpu_kernel
assert halfadam.__file__.startswith(sys.argv[1]), halfadam.__file__
if sys.argv[2] == "cut-then-step":
    from pathlib import Path
    read = Path.read_bytes

    def read_then_cut(path):  # the library cut as soon as it has been read (to be checked)
        data = read(path)
        if path.suffix == ".so":
            os.truncate(path, 4096)
        return data
    Path.read_bytes = read_then_cut
if sys.argv[2] == "load":
    print("loaded" if cpu_kernel.load() is not None else f"unavailable: {cpu_kernel.unavailable_reason()}")
    sys.exit(0)

def run(impl):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8).to(torch.bfloat16)
    opt = halfadam.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, implementation=impl)
    for _ in range(3):
        model(torch.randn(4, 16, dtype=torch.bfloat16)).float().square().sum().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], [opt.state[p] for p in model.parameters()]

(p_cpp, s_cpp), (p_ref, s_ref) = run("cpp"), run("reference")
assert cpu_kernel.loaded() is not None
for a, b in zip(p_cpp, p_ref):
    torch.testing.assert_close(a, b, rtol=8e-3, atol=0)  # a rounding of the masters: one bf16 ulp at most
for a, b in zip(s_cpp, s_ref):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-6 * float(b[k].abs().max()) + 1e-12)
print("step ok")
"""


def _run(checkout: Path, cache: Path, mode: str = "step", path: str | None = None):
    """Runs SCRIPT with halfadam from ``checkout`` and the cache ``cache``; the CompletedProcess."""
    env = {k: v for k, v in os.environ.items() if k not in ("HALFADAM_CPP", "CXX", "PYTHONPATH")}
    env.update(PYTHONPATH=str(checkout), TORCH_EXTENSIONS_DIR=str(cache), OMP_NUM_THREADS="1")
    if path is not None:
        env["PATH"] = path
    return subprocess.run([sys.executable, "-c", SCRIPT, str(checkout), mode], env=env, capture_output=True,
                          text=True, timeout=900)


def _library(cache: Path) -> Path:
    """The one installed kernel library in ``cache``."""
    (library,) = cache.glob("halfadam_cpu_*/halfadam_cpu_*.so")
    return library


def _snapshot(cache: Path):
    """Every file under ``cache`` with its inode, mtime and size."""
    return {p.relative_to(cache): (p.stat().st_ino, p.stat().st_mtime_ns, p.stat().st_size)
            for p in cache.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``(checkout_a, checkout_b, cache)``: two copies of the package (same bytes) and a cache holding
    the kernel, which the first checkout's fresh process loads and steps with.

    The cache is a copy of the suite's own build directory (the kernel this process loaded), so the
    fresh process must load it without compiling: the build's name is a digest of the source, the
    compiler and torch, never of the checkout. Where this process has no kernel, or its build depends
    on a ``CXX`` the fresh processes do not get, the first process builds it instead."""
    from halfadam.kernels import cpp as cpu_kernel

    root = tmp_path_factory.mktemp("cpu_build")
    a, b = root / "a", root / "b"
    shutil.copytree(Path(halfadam.__file__).parent, a / "halfadam", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(a, b)
    cache = root / "cache"
    module = cpu_kernel.load() if "CXX" not in os.environ else None
    if module is not None:
        # the build directory is named as the module (the library sits in it, or in its build/ when just built)
        directory = next(d for d in Path(module.__file__).parents if d.name == module.__name__)
        shutil.copytree(directory, cache / directory.name, ignore=shutil.ignore_patterns("*.lock", "build"))
    result = _run(a, cache)
    assert result.returncode == 0 and "step ok" in result.stdout, result.stderr
    assert result.stderr.count(COMPILING) == (0 if module is not None else 1), result.stderr
    return a, b, cache


def _copy(cache: Path, tmp_path: Path) -> Path:
    """A copy of the built cache (a copied digest directory must load as it is)."""
    return Path(shutil.copytree(cache, tmp_path / "cache"))


def _no_ninja(tmp_path: Path) -> str:
    """A PATH with the same compiler (the same build directory) and no ninja: a rebuild fails at once."""
    directory = tmp_path / "bin"
    directory.mkdir()
    (directory / "c++").symlink_to(shutil.which("c++"))
    return str(directory)


def test_two_checkouts_share_one_build(built, tmp_path):
    """Another checkout of the same version, then the first again: both load the cached kernel and step,
    without compiling or writing anything in the cache (the build's command does not name a checkout)."""
    a, b, cache = built
    cache = _copy(cache, tmp_path)
    before = _snapshot(cache)
    for checkout in (b, a):
        result = _run(checkout, cache)
        assert result.returncode == 0 and "step ok" in result.stdout, result.stderr
        assert COMPILING not in result.stderr, result.stderr
        assert _snapshot(cache) == before


def test_damaged_library_is_rebuilt(built, tmp_path):
    """The cached library cut to 4 KiB (a crash while it was written): a cpp step in a new process says
    why, rebuilds and runs (no SIGBUS from loading the cut file); the new library matches its checksum."""
    a, _, cache = built
    cache = _copy(cache, tmp_path)
    library = _library(cache)
    os.truncate(library, 4096)
    result = _run(a, cache)
    assert result.returncode == 0 and "step ok" in result.stdout, (result.returncode, result.stderr)
    assert "is unusable" in result.stderr and "4096 bytes" in result.stderr, result.stderr
    assert result.stderr.count(COMPILING) == 1, result.stderr
    checksum = library.with_name(library.name + ".sha256").read_text().strip()
    assert library.stat().st_size > 4096 and hashlib.sha256(library.read_bytes()).hexdigest() == checksum


def test_deleting_the_failure_marker_retries(built, tmp_path):
    """A rebuild that fails (no ninja on PATH) is remembered: the next process does not retry (nor load
    the damaged library); once halfadam_build_failed.txt is deleted, the next one builds again."""
    a, _, cache = built
    cache = _copy(cache, tmp_path)
    library = _library(cache)
    os.truncate(library, 4096)
    no_ninja = _no_ninja(tmp_path)
    first = _run(a, cache, "load", path=no_ninja)
    assert first.returncode == 0 and "unavailable" in first.stdout and "Ninja is required" in first.stdout, first
    assert "is unusable" in first.stderr and COMPILING in first.stderr, first.stderr
    (marker,) = cache.glob("halfadam_cpu_*/halfadam_build_failed.txt")
    assert marker.parent == library.parent and str(marker) in first.stderr
    second = _run(a, cache, "load", path=no_ninja)
    assert second.returncode == 0 and "an earlier build" in second.stdout, second
    assert COMPILING not in second.stderr, second.stderr
    marker.unlink()
    third = _run(a, cache, "load", path=no_ninja)
    assert third.returncode == 0 and "Ninja is required" in third.stdout and "an earlier build" not in third.stdout
    assert COMPILING in third.stderr, third.stderr


@pytest.mark.parametrize("cut", ["segments", "section headers"])
def test_a_cut_library_that_matches_its_checksum_is_never_loaded(built, tmp_path, cut):
    """The cached library cut short with its checksum rewritten to match (a copy cut on a network file
    system, say): loading it would map segments past the file's end and kill the process with SIGBUS
    (65,536 bytes left), or load a library without its last bytes (64 of them gone: the section header
    table). A new process finds the cut, says so and rebuilds it (here without ninja: the kernel is
    unavailable, with the reason), and lives."""
    a, _, cache = built
    cache = _copy(cache, tmp_path)
    library = _library(cache)
    size = 65536 if cut == "segments" else library.stat().st_size - 64
    os.truncate(library, size)
    library.with_name(library.name + ".sha256").write_text(hashlib.sha256(library.read_bytes()).hexdigest() + "\n")
    result = _run(a, cache, "load", path=_no_ninja(tmp_path))
    assert result.returncode == 0, (result.returncode, result.stderr)  # -7: SIGBUS
    assert "unavailable" in result.stdout and "Ninja is required" in result.stdout, result.stdout
    assert "is unusable (it is cut short: " in result.stderr and f"past its {size:,} bytes" in result.stderr
    assert ("segment" if cut == "segments" else "its section header table") in result.stderr, result.stderr
    assert result.stderr.count(COMPILING) == 1, result.stderr


def test_the_library_is_loaded_from_the_bytes_checked(built, tmp_path):
    """The library cut to 4 KiB as soon as it has been read to be checked (by another process, or on a
    network file system): the process loads the bytes it checked, not the file, and steps (no SIGBUS)."""
    a, _, cache = built
    cache = _copy(cache, tmp_path)
    result = _run(a, cache, "cut-then-step")
    assert result.returncode == 0 and "step ok" in result.stdout, (result.returncode, result.stderr)
    assert _library(cache).stat().st_size == 4096 and COMPILING not in result.stderr
