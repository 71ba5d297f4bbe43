"""Shared test helpers."""

from pathlib import Path

import pytest

GOLDEN_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "golden"


@pytest.fixture(scope="session")
def golden():
    """The real mindformers AdamW trajectories (../shared/golden beside the repository)."""
    import json

    import numpy as np

    npz, meta = GOLDEN_DIR / "mindformers_adamw.npz", GOLDEN_DIR / "mindformers_adamw.json"
    if not npz.exists():
        pytest.skip(f"golden data not found at {GOLDEN_DIR}")
    with np.load(npz) as data:
        arrays = {k: data[k] for k in data.files}
    return arrays, json.loads(meta.read_text())
