"""The golden mindformers data ships with the repository: the contract tests never skip for want of it."""

import json

import pytest

from conftest import GOLDEN_DIR, load_golden


def test_golden_data_is_in_the_repository():
    assert GOLDEN_DIR == (GOLDEN_DIR.parents[1] / "tests" / "golden")
    assert (GOLDEN_DIR / "mindformers_adamw.npz").is_file() and (GOLDEN_DIR / "mindformers_adamw.json").is_file()
    arrays, meta = load_golden()
    assert meta == json.loads((GOLDEN_DIR / "mindformers_adamw.json").read_text()) and arrays


def test_missing_golden_data_is_an_error_not_a_skip(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_golden(tmp_path)
