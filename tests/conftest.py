"""Shared test helpers."""

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run under Triton's interpreter, on CPU tensors (Triton reads the
# variable at each launch; spawned processes of the distributed tests inherit it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

#: Whether the triton package is installed (CI installs it: the Triton kernels are tested on the CPU).
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="the triton package is not installed")

#: Tests that spawn gloo processes on 127.0.0.1 (halfadam.distributed.launch, torchrun).
needs_gloo = pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")

#: The real mindformers AdamW trajectories, kept in the repository.
GOLDEN_DIR = Path(__file__).resolve().parent / "golden"


def load_golden(directory: Path = GOLDEN_DIR):
    """``(arrays, meta)`` from ``directory``; FileNotFoundError if a file is missing (never a silent skip)."""
    import numpy as np

    npz, meta = directory / "mindformers_adamw.npz", directory / "mindformers_adamw.json"
    with np.load(npz) as data:
        arrays = {k: data[k] for k in data.files}
    return arrays, json.loads(meta.read_text())


@pytest.fixture(scope="session")
def golden():
    """The real mindformers AdamW trajectories (tests/golden)."""
    return load_golden()


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module: its tiny tensors are much slower with OpenMP threads competing
    for two cores."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def assert_same_runs(run_a, run_b, what) -> None:
    """Two ``(params, optimizer)`` runs hold the same parameters and state tensors, bit for bit
    (:func:`same_bits`)."""
    (pa, oa), (pb, ob) = run_a, run_b
    for p, q in zip(pa, pb):
        assert same_bits(p, q), what
    for p, q in zip(pa, pb):
        sa, sb = oa.state[p], ob.state[q]
        assert sa.keys() == sb.keys(), what
        for k in sa:
            assert same_bits(sa[k], sb[k]), (what, k)


def same_bits(a, b) -> bool:
    """Bit for bit, except a nan's payload (the README's one exception: eager torch and the C++/Triton
    kernels write different nan patterns); every nan must be a nan on both sides."""
    a, b = a.detach().cpu(), b.detach().cpu()
    if not a.is_floating_point():
        return torch.equal(a, b)
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a.view(ints)[~nan], b.view(ints)[~nan])
