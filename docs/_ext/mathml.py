r"""MkDocs hook: the site's math as MathML, rendered at build time (no MathJax, no CDN, works offline).

pymdownx.arithmatex (``generic: true`` in mkdocs.yml) marks the math of the pages and of the
docstrings mkdocstrings renders: ``$...$`` and ``\(...\)`` become ``<span class="arithmatex">\(...\)</span>``,
``$$...$$``, ``\[...\]`` and ``.. math::`` blocks (docs/_ext/rst_roles.py) become
``<div class="arithmatex">\[...\]</div>``. This hook converts the LaTeX inside them to MathML with
latex2mathml (the ``docs`` extra), which current browsers render natively.

latex2mathml has no ``aligned`` environment; ``split`` (the same alignment at ``&``, one row per
``\\``) takes its place. A formula that latex2mathml cannot render (an unknown command comes out
as ``<mi>\foo</mi>``, an unsupported environment's ``&`` as a bare ``&``) is a warning, so
``mkdocs build --strict`` fails on it instead of showing raw LaTeX.
"""

from __future__ import annotations

import html
import logging
import re

from latex2mathml.converter import convert

log = logging.getLogger("mkdocs.hooks.mathml")

_MATH = re.compile(
    r'<(?P<tag>div|span) class="arithmatex">\s*(?P<open>\\\[|\\\()(?P<tex>.*?)(?:\\\]|\\\))\s*</(?P=tag)>',
    re.S)
_ALIGNED = re.compile(r"\\(begin|end)\{aligned\}")
_TEXT = re.compile(r">([^<]*)<")  # the text of every MathML element
_BARE_AMP = re.compile(r"&(?!#?\w+;)")


def to_mathml(tex: str, display: bool) -> str:
    """One formula (LaTeX, without its delimiters) as a ``<math>`` element; ValueError naming what
    latex2mathml left unrendered."""
    tex = _ALIGNED.sub(r"\\\1{split}", tex.strip())
    mathml = convert(tex, display="block" if display else "inline")
    mathml = mathml.replace('width="negativethinmathspace"', 'width="-0.1667em"')  # \! (a negative thin space)
    left = [t for t in _TEXT.findall(mathml) if "\\" in t or _BARE_AMP.search(t)]
    if left:
        raise ValueError("latex2mathml left unrendered: " + ", ".join(left))
    return mathml


def on_page_content(content, page, config, files):
    def render(match: re.Match) -> str:
        display = match["open"] == "\\["
        tex = html.unescape(match["tex"])
        try:
            mathml = to_mathml(tex, display)
        except Exception as error:  # noqa: BLE001 - any failure leaves the LaTeX and warns
            log.warning("%s: a formula is shown as raw LaTeX (%s):\n%s", page.file.src_uri, error, tex)
            return match[0]
        return f'<{match["tag"]} class="arithmatex">{mathml}</{match["tag"]}>'

    return _MATH.sub(render, content)
