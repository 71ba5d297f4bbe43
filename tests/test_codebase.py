"""The codebase's measures (tools/measures.py): rooms of one concern each, layers importing only downwards."""

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _measures():
    spec = importlib.util.spec_from_file_location("measures", ROOT / "tools" / "measures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_measures_hold():
    """No class over 400 lines, no function over 80 (the kernels aside), no upward import, a README of
    at most 200 lines: the script prints what fails and exits non-zero."""
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "measures.py")], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "all measures hold" in result.stdout, result.stdout + result.stderr


def test_an_upward_import_is_found():
    """The layer check reads relative, absolute and in-function imports, and knows a module from a name."""
    m = _measures()
    assert m.upward_imports("encodings", "from .optimizer import AdamW\n") == [
        "upward import: encodings:1 (layer 2) imports optimizer (layer 7)"]
    assert m.upward_imports("state", "def f():\n    import halfadam.scaler\n")[0].startswith(
        "upward import: state:2")
    assert m.upward_imports("kernels.triton", "from .. import encodings\nfrom ..encodings import BLOCK\n") == []
    assert m.upward_imports("param_groups", "from .kernels import cpp\n") == []  # kernels.cpp is layer 0
    assert m.upward_imports("cli.train", "import halfadam\nfrom halfadam.distributed import local\n") == []
    assert m.upward_imports("nowhere", "") == ["module without a layer: nowhere (add it to LAYERS in tools/measures.py)"]
