"""Griffe extension for the API reference: halfadam's reST-flavoured docstrings as Markdown.

The docstrings are Google style (``Args:``, ``Returns:``, ``Raises:``) with a few reST habits that
Markdown would show literally. Before mkdocstrings renders them, this rewrites, in every docstring
of the package:

* Sphinx roles to code spans: ``:class:`x``` -> ```x```, ``:func:`~a.b``` -> ```b```,
  ``:mod:`text <target>``` -> ```text```; ``` ``code`` ``` is already a Markdown code span;
* the reST escape ``\\ `` (``DTensor``\\ s) to nothing;
* ``.. math::`` blocks to display math (pymdownx.arithmatex: ``\\[ ... \\]``);
* a paragraph ending in ``::`` to one ending in ``:`` followed by a fenced code block;
* simple tables (``====  ====`` borders) to Markdown tables.

It only changes what the site shows; the source docstrings stay as they are.
"""

from __future__ import annotations

import re
import textwrap

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const|term|ref|doc):`([^`]+)`")
_ESCAPE = re.compile(r"(?<=`)\\ ")  # ``DTensor``\ s -> `DTensor`s
_BORDER = re.compile(r"^\s*=+(?: +=+)+\s*$")


def _role(match: re.Match) -> str:
    text = match.group(1)
    explicit = re.fullmatch(r"(.*?)\s*<[^>]+>", text)
    if explicit:
        text = explicit.group(1)
    elif text.startswith("~"):
        text = text[1:].rsplit(".", 1)[-1]
    return f"`{text}`"


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _take_block(lines: list[str], start: int, base: int) -> tuple[list[str], int]:
    """The indented block after line ``start - 1`` (blank lines inside it kept), and the next index."""
    block, i = [], start
    while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > base):
        block.append(lines[i])
        i += 1
    while block and not block[-1].strip():
        block.pop()
        i -= 1
    return block, i


def _table(lines: list[str], start: int) -> tuple[list[str], int]:
    """A reST simple table from its top border at ``start``: Markdown lines and the next index."""
    border = lines[start]
    spans = [m.span() for m in re.finditer(r"=+", border)]
    indent = border[: _indent(border)]
    rows, borders, i = [], 1, start + 1
    while i < len(lines) and borders < 3:
        line = lines[i]
        if _BORDER.match(line):
            borders += 1
        elif line.strip():
            cells = [line[a:(spans[k + 1][0] if k + 1 < len(spans) else None)].strip()
                     for k, (a, _) in enumerate(spans)]
            rows.append(cells)
        i += 1
    if borders < 3 or not rows:  # not a table after all
        return [lines[start]], start + 1
    out = [indent + "| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    out.insert(1, indent + "|" + "---|" * len(spans))
    return out, i


def convert(text: str) -> str:
    """One docstring, reST habits turned into Markdown."""
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if stripped == ".. math::":
            block, i = _take_block(lines, i + 1, _indent(line))
            body = textwrap.dedent("\n".join(block)).strip()
            pad = line[: _indent(line)]
            out += [pad + "\\[", pad + "\\begin{aligned}", *(pad + b for b in body.split("\n")),
                    pad + "\\end{aligned}", pad + "\\]"]
            continue
        if _BORDER.match(line):
            table, i = _table(lines, i)
            out += table
            continue
        if stripped.endswith("::") and not stripped.startswith(".."):
            block, nxt = _take_block(lines, i + 1, _indent(line))
            if any(b.strip() for b in block):
                pad = line[: _indent(line)]
                out.append(line.rstrip()[:-1] if not stripped == "::" else "")
                out += ["", pad + "```python", *(pad + b for b in textwrap.dedent("\n".join(block)).strip("\n").split("\n")),
                        pad + "```"]
                i = nxt
                continue
        out.append(line)
        i += 1
    return _ESCAPE.sub("", _ROLE.sub(_role, "\n".join(out)))


class RstToMarkdown(griffe.Extension):
    """Rewrites every docstring of the loaded package (see the module docstring)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        seen = set()
        stack = [pkg]
        while stack:
            obj = stack.pop()
            if obj.is_alias or id(obj) in seen:
                continue
            seen.add(id(obj))
            if obj.docstring is not None:
                obj.docstring.value = convert(obj.docstring.value)
            stack.extend(obj.members.values())
