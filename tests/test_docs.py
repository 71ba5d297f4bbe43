"""The documentation site: ``mkdocs build --strict`` passes, and the API reference has no gaps.

The API pages (docs/api/*.md) render the public API with mkdocstrings, which hides an object
without a docstring (``show_if_no_docstring: false`` in mkdocs.yml). So every object those pages
name, every public name such a module exports (``__all__``) and every public method or property of
such a class must have a docstring: these tests read them as mkdocstrings does (griffe, from the
source), and fail naming what lacks one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
API_PAGES = sorted((ROOT / "docs" / "api").glob("*.md"))


def test_mkdocs_build_strict(tmp_path):
    """The site builds with every warning an error (broken links and anchors, griffe's warnings)."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr}\n{result.stdout}"
    for page in ["index.html", "api/adamw/index.html", "api/schedules/index.html", "state-modes/index.html"]:
        assert (tmp_path / page).is_file(), page
    front = (tmp_path / "index.html").read_text(encoding="utf-8")
    assert "Which state mode?" in front, "the front page is not the README (docs/_ext/readme.py)"


def _identifiers() -> list[str]:
    """The objects the API pages render (their ``::: identifier`` lines)."""
    found = []
    for page in API_PAGES:
        found += re.findall(r"^::: *([\w.]+)\s*$", page.read_text(encoding="utf-8"), flags=re.M)
    return found


@pytest.fixture(scope="module")
def package():
    import griffe  # installed with mkdocstrings[python] (the test extra)

    return griffe.load("halfadam", search_paths=[str(ROOT / "src")])


def _resolve(obj):
    return obj.final_target if obj.is_alias else obj


def _missing(obj, public: str, seen: set) -> list[str]:
    """Public paths (as the API pages name them: ``halfadam.GradScaler.step``) of ``obj`` and of its
    public API (a module's exports, a class's methods and properties, inherited ones included)
    without a docstring."""
    if public in seen:
        return []
    seen.add(public)
    missing = [] if obj.docstring and obj.docstring.value.strip() else [public]
    if obj.is_module:
        for name in obj.exports or []:
            missing += _missing(_resolve(obj[str(name)]), f"{public}.{name}", seen)
    elif obj.is_class:
        for name, member in obj.all_members.items():
            member = _resolve(member)
            if not name.startswith("_") and (member.is_function or (member.is_attribute and "property" in member.labels)):
                missing += _missing(member, f"{public}.{name}", seen)
    return missing


def test_api_pages_cover_the_public_api(package):
    """Every name of ``halfadam.__all__`` is on an API page, directly or in a module page."""
    rendered = set(_identifiers())
    assert rendered, "no ::: identifiers in docs/api/*.md"
    for name in package.exports:
        assert f"halfadam.{name}" in rendered, f"halfadam.{name} has no API page in docs/api/"


def test_api_docstrings(package):
    seen: set = set()
    missing = []
    for identifier in _identifiers():
        obj = package if identifier == "halfadam" else package[identifier[len("halfadam."):]]
        missing += _missing(_resolve(obj), identifier, seen)
    assert not missing, ("public API without a docstring (the API reference would not show it):\n  "
                         + "\n  ".join(sorted(missing)))
