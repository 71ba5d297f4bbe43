"""Print the codebase measures of issue 26 and exit non-zero when one fails.

- no class over 400 lines and no function over 80 (docstrings and comments count; the Triton
  and C++ kernels aside: ``kernels/triton.py``'s ``@triton.jit`` functions and ``adam_cpu.cpp``);
- every module imports only from its own layer or lower ones (``LAYERS``, bottom first; an import
  inside a function counts too);
- the README's front page is at most 200 lines.

Usage: ``python tools/measures.py`` (from the repository root).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "halfadam"
MAX_CLASS, MAX_FUNCTION, MAX_README = 400, 80, 200

# Bottom first. A module may import from its own layer or from any layer below it.
LAYERS = [
    ["_dtensor", "_codes_20261201", "_tempfiles", "functional", "kernels.cpp"],
    ["hyperparams", "schedules"],
    ["encodings", "kernels.triton", "kernels"],
    ["buckets"],
    ["param_groups", "state", "state_checks"],
    ["executions", "selfcheck"],
    ["state_dict", "_dcp_io"],
    ["optimizer", "sgd", "lion"],
    ["distributed"],
    ["handover"],
    ["scaler"],
    ["checkpoint"],
    ["__init__"],
    ["cli", "bench", "doctor", "__main__"],
]


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def is_module(name: str) -> bool:
    path = PACKAGE.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def layer_of(name: str) -> int | None:
    for i, layer in enumerate(LAYERS):
        for member in layer:
            if name == member or name.startswith(member + "."):
                return i
    return None


def imported_modules(tree: ast.AST, name: str) -> list[tuple[int, str]]:
    # the package a relative import starts from: the module itself when it is a package's __init__
    parts = [] if name == "__init__" else name.split(".")
    package = parts if parts and (PACKAGE.joinpath(*parts) / "__init__.py").exists() else parts[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("halfadam"):
                target = node.module[len("halfadam."):] if node.module != "halfadam" else "__init__"
            else:
                continue
            for alias in node.names:  # "from .kernels import cpp" imports the module kernels.cpp
                sub = ".".join(filter(None, [target, alias.name]))
                found.append((node.lineno, sub if is_module(sub) else (target or "__init__")))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "halfadam":
                    found.append((node.lineno, "__init__"))
                elif alias.name.startswith("halfadam."):
                    found.append((node.lineno, alias.name[len("halfadam."):]))
    return found


def is_kernel(path: Path, node: ast.AST) -> bool:
    if path.name != "triton.py" or not isinstance(node, ast.FunctionDef):
        return False
    return any("jit" in ast.unparse(d) for d in node.decorator_list)


def upward_imports(name: str, source: str) -> list[str]:
    """The imports of module ``name`` (its ``source``) that reach a higher layer than its own."""
    mine = layer_of(name)
    if mine is None:
        return [f"module without a layer: {name} (add it to LAYERS in tools/measures.py)"]
    found = []
    for lineno, target in imported_modules(ast.parse(source), name):
        theirs = layer_of(target)
        if theirs is not None and theirs > mine:
            found.append(f"upward import: {name}:{lineno} (layer {mine}) imports {target} (layer {theirs})")
    return found


def main() -> int:
    failures = []
    rows = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                limit = MAX_CLASS if isinstance(node, ast.ClassDef) else MAX_FUNCTION
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                rows.append((lines, kind, f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"))
                if lines > limit and not is_kernel(path, node):
                    failures.append(f"{kind} over {limit} lines: {path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines})")
        failures += upward_imports(module_name(path), source)
    readme = (ROOT / "README.md").read_text().splitlines()
    if len(readme) > MAX_README:
        failures.append(f"README.md has {len(readme)} lines (at most {MAX_README})")
    print(f"largest classes and functions (limits {MAX_CLASS} / {MAX_FUNCTION} lines):")
    for lines, kind, where in sorted(rows, reverse=True)[:12]:
        print(f"  {lines:5d}  {kind:8s} {where}")
    print(f"README.md: {len(readme)} lines (limit {MAX_README})")
    for f in failures:
        print("FAIL", f)
    print("all measures hold" if not failures else f"{len(failures)} measures fail")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
