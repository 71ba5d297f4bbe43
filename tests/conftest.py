"""Shared test helpers."""

from pathlib import Path

import pytest

#: The real mindformers AdamW trajectories, kept in the repository (tests/golden).
GOLDEN_DIR = Path(__file__).resolve().parent / "golden"


@pytest.fixture(scope="session")
def golden():
    """The real mindformers AdamW trajectories (tests/golden); a missing file is an error, not a skip."""
    import json

    import numpy as np

    npz, meta = GOLDEN_DIR / "mindformers_adamw.npz", GOLDEN_DIR / "mindformers_adamw.json"
    with np.load(npz) as data:  # FileNotFoundError when missing: the golden tests must not pass silently
        arrays = {k: data[k] for k in data.files}
    return arrays, json.loads(meta.read_text())
