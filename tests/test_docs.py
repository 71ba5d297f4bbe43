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
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
API_PAGES = sorted((ROOT / "docs" / "api").glob("*.md"))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built once for this module by ``mkdocs build --strict``: every warning an error
    (broken links and anchors, griffe's warnings, a formula docs/_ext/mathml.py cannot render)."""
    site_dir = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr}\n{result.stdout}"
    return site_dir


def test_mkdocs_build_strict(site):
    """The site builds with every warning an error, and has its pages."""
    for page in ["index.html", "api/adamw/index.html", "api/schedules/index.html", "state-modes/index.html"]:
        assert (site / page).is_file(), page
    front = (site / "index.html").read_text(encoding="utf-8")
    assert "Which state mode?" in front, "the front page is not the README (docs/_ext/readme.py)"


# ---- offline: nothing is loaded from another host ---------------------------------------------

# <link rel=...> values that name a related page rather than load something into this one
_NAV_RELS = {"canonical", "alternate", "prev", "next", "author", "license", "help", "bookmark"}
_CSS_URL = re.compile(r"""url\(\s*(?:"([^"]*)"|'([^']*)'|([^)'"\s]*))\s*\)""", re.I)
_CSS_IMPORT = re.compile(r"""@import\s+(?:url\(\s*)?["']?([^"')\s;]+)""", re.I)
_URL_IN_TEXT = re.compile(r"(?:https?:)?//[\w.-]+\.[a-z]{2,}", re.I)


def _remote(url: str) -> bool:
    """Whether loading ``url`` asks another host: an absolute URL (any scheme but ``data:`` and
    ``blob:``) or a scheme-relative ``//host/...``; a relative URL or a fragment stays on the site."""
    url = url.strip()
    if url.startswith("//"):
        return True
    scheme = re.match(r"([a-zA-Z][a-zA-Z0-9+.-]*):", url)
    return bool(scheme) and scheme.group(1).lower() not in {"data", "blob"}


def _css_remote(css: str) -> list[str]:
    """The remote URLs a stylesheet loads (``url(...)``, ``@import``); ``data:`` URLs, whose SVG
    carries an ``xmlns="http://..."`` that is a name and not a load, are fine."""
    urls = [next(g for g in m.groups() if g is not None) for m in _CSS_URL.finditer(css)]
    urls += _CSS_IMPORT.findall(css)
    return [u for u in urls if _remote(u)]


class _Loads(HTMLParser):
    """What an HTML page loads from other hosts: ``src``/``srcset``/``data``/``poster`` of any
    element, ``href`` of any ``<link>`` that is not a page relation (stylesheets, fonts, preload,
    preconnect, icons), SVG ``<use>``/``<image>`` hrefs, ``url()``/``@import`` in ``<style>`` and
    ``style=``, and any URL in an inline ``<script>``. ``<a href>`` to another site is a link, not
    a load."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.remote: list[str] = []
        self._in: str | None = None
        self.mermaid = False

    def handle_starttag(self, tag, attrs):
        attrs = {k.lower(): (v or "") for k, v in attrs}
        urls = [attrs[k] for k in ("src", "data", "poster") if k in attrs]
        urls += [part.split()[0] for part in attrs.get("srcset", "").split(",") if part.split()]
        if tag == "link" and not set(attrs.get("rel", "").lower().split()) <= _NAV_RELS:
            urls.append(attrs.get("href", ""))
        if tag in {"use", "image", "script", "iframe", "embed"}:
            urls += [attrs[k] for k in ("href", "xlink:href") if k in attrs]
        self.remote += [f"<{tag}> {u}" for u in urls if _remote(u)]
        self.remote += [f"<{tag} style=> {u}" for u in _css_remote(attrs.get("style", ""))]
        self.mermaid |= "mermaid" in attrs.get("class", "").split()
        self._in = tag if tag in {"style", "script"} else None

    def handle_endtag(self, tag):
        self._in = None

    def handle_data(self, data):
        if self._in == "style":
            self.remote += [f"<style> {u}" for u in _css_remote(data)]
        elif self._in == "script":
            self.remote += [f"<script> {u}" for u in _URL_IN_TEXT.findall(data)]


def test_site_loads_nothing_from_other_hosts(site):
    """Offline, the site renders as online: no page, stylesheet or script of the site's own loads a
    script, style, font or image from another host (MathJax from a CDN, Google fonts: the math is
    MathML made at build time by docs/_ext/mathml.py, the fonts are the system's, ``font: false``).

    Material's bundle (assets/javascripts/bundle.*.js) loads one thing remotely on its own:
    mermaid, from unpkg, on a page with a mermaid diagram; so no page may have one. Its search
    worker and lunr languages are files of the site."""
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 20, f"only {len(pages)} pages built"
    found: dict[str, list[str]] = {}  # what is loaded -> the files that load it
    for page in pages:
        parser = _Loads()
        parser.feed(page.read_text(encoding="utf-8"))
        rel = page.relative_to(site).as_posix()
        if parser.mermaid:
            parser.remote.append("a mermaid diagram (material loads mermaid from unpkg)")
        for what in parser.remote:
            found.setdefault(what, []).append(rel)
    stylesheets = sorted(site.rglob("*.css"))
    assert any(p.name.startswith("main.") for p in stylesheets), "material's stylesheet is missing"
    for css in stylesheets:
        for url in _css_remote(css.read_text(encoding="utf-8")):
            found.setdefault(f"CSS {url}", []).append(css.relative_to(site).as_posix())
    for js in sorted(site.rglob("*.js")):
        rel = js.relative_to(site).as_posix()
        if not rel.startswith("assets/"):  # the site's own scripts (extra_javascript), not material's
            for url in _URL_IN_TEXT.findall(js.read_text(encoding="utf-8")):
                found.setdefault(f"JS {url}", []).append(rel)
    if found:
        pytest.fail("the site loads from other hosts (it would not render offline):\n" + "\n".join(
            f"  {what}  ({len(set(files))} files: {', '.join(sorted(set(files))[:3])}, ...)"
            for what, files in sorted(found.items())), pytrace=False)


def test_math_is_mathml(site):
    """The formulas of the docstrings (``.. math::``, docs/_ext/rst_roles.py) are MathML in the
    built pages, not LaTeX left for a script: the AdamW update rule and the schedules."""
    adamw = (site / "api" / "adamw" / "index.html").read_text(encoding="utf-8")
    schedules = (site / "api" / "schedules" / "index.html").read_text(encoding="utf-8")
    for name, text, count in [("AdamW", adamw, 1), ("schedules", schedules, 7)]:
        blocks = re.findall(r'<div class="arithmatex">(.*?)</div>', text, flags=re.S)
        assert len(blocks) == count, f"{name}: {len(blocks)} formulas, expected {count}"
        for block in blocks:
            assert block.startswith('<math xmlns="http://www.w3.org/1998/Math/MathML" display="block">'), block[:200]
            assert "\\" not in block, f"{name}: LaTeX left in a formula: {block[:300]}"
    assert re.search(r'<link rel="stylesheet" href="(\.\./)*stylesheets/mathml\.css">', adamw), \
        "docs/stylesheets/mathml.css (the tables' alignment in Chromium) is not on the page"
    update = re.search(r'<div class="arithmatex">(.*?)</div>', adamw, flags=re.S).group(1)
    # three aligned rows: w <- w (1 - lr wd); m <- ..., v <- ...; w <- w - lr/(1 - beta1^t) m / (...)
    assert update.count("<mtr>") == 3 and update.count('<mtd columnalign="right">') == 3, update
    assert update.count("<mo>&#x02190;</mo>") == 4, "four arrows (w, m, v, w)"
    assert update.count("<msqrt>") == 2 and update.count("<mfrac>") == 2, update
    assert "<mi>&#x003F5;</mi>" in update, "epsilon"
    assert "<mtext>lr</mtext>" in update and "<mtext>wd</mtext>" in update



# ---- the API pages: public bases, typed parameters, wrapped signatures ------------------------

def _text(fragment: str) -> str:
    import html

    return html.unescape(re.sub(r"<[^>]+>", "", fragment))


def _api_html(site: Path) -> dict[str, str]:
    pages = {p.parent.name: p.read_text(encoding="utf-8") for p in sorted((site / "api").glob("*/index.html"))}
    assert len(pages) == len(API_PAGES) - 1, sorted(pages)  # docs/api/index.md is api/index.html
    return pages


def test_api_pages_show_no_private_base(site):
    """No class lists a private base (``Bases: _Engine``): docs/_ext/public_bases.py shows its
    public bases instead, so AdamW, Adam and AdamFP16 show torch's Optimizer."""
    shown = {}
    for name, text in _api_html(site).items():
        for bases in re.findall(r'<p class="doc doc-class-bases">(.*?)</p>', text, flags=re.S):
            titles = re.findall(r'title="([^"]+)"', bases)
            shown.setdefault(name, []).append((" ".join(_text(bases).split()), titles))
            private = [t for t in titles + _text(bases).replace(",", " ").split()[1:] if
                       t.rsplit(".", 1)[-1].startswith("_")]
            assert not private, f"api/{name}: a private base is shown: {_text(bases).strip()} {titles}"
    for page in ["adamw", "adam", "adamfp16"]:
        assert shown.get(page) == [("Bases: Optimizer", ["torch.optim.Optimizer"])], (page, shown.get(page))
    assert ("Bases: ValueError", ["ValueError"]) in shown["checkpoint-error"], "a public base stays shown"


def test_api_parameters_have_types(site):
    """Every row of every Parameters table on the API pages has a type (from the signature's
    annotations): no empty type column."""
    untyped, rows = [], 0
    for name, text in _api_html(site).items():
        for table in re.findall(r"<table>(.*?)</table>", text, flags=re.S):
            head = [_text(h).strip() for h in re.findall(r"<th[^>]*>(.*?)</th>", table, flags=re.S)]
            if head[:2] != ["Name", "Type"]:
                continue
            for row in re.findall(r'<tr class="doc-section-item">(.*?)</tr>', table, flags=re.S):
                cells = [" ".join(_text(c).split()) for c in re.findall(r"<td[^>]*>(.*?)</td>", row, flags=re.S)]
                rows += 1
                if not cells[1]:
                    untyped.append(f"api/{name}: {cells[0]}")
    assert rows > 50, f"only {rows} parameter rows on the API pages"
    assert not untyped, "parameters without a type (annotate the signature):\n  " + "\n  ".join(untyped)


def test_api_signatures_wrapped(site):
    """Signatures are formatted (black, ``line_length: 88`` in mkdocs.yml): no line of a signature
    is longer than 88 characters, and AdamW's puts one parameter on each line."""
    long, signatures = [], {}
    for name, text in _api_html(site).items():
        for sig in re.findall(r'<div class="doc-signature highlight"><pre[^>]*>(.*?)</pre>', text, flags=re.S):
            sig = _text(sig).strip()
            signatures.setdefault(name, []).append(sig)
            long += [f"api/{name}: {line}" for line in sig.splitlines() if len(line) > 88]
    assert sum(map(len, signatures.values())) > 50, signatures.keys()
    assert not long, ("signature lines over 88 characters (is black installed? the test extra has it):\n  "
                      + "\n  ".join(long))
    adamw = signatures["adamw"][0].splitlines()
    assert adamw[0] == "AdamW(" and adamw[-1] == ")", adamw
    for parameter in ["params: Iterable[Tensor]", "lr: float | Tensor", "betas: tuple[float, float] = (0.9, 0.999),",
                      "weight_decay: float | Callable[[int], float] = 0.0,", "state_mode: str = \"fp32\",",
                      "fused: bool | None = None"]:
        assert any(line.strip().startswith(parameter) for line in adamw), (parameter, adamw)


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


def _mathml_hook():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_mathml_hook", ROOT / "docs" / "_ext" / "mathml.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mathml_hook_refuses_what_it_cannot_render():
    """docs/_ext/mathml.py: ``aligned`` (latex2mathml has none) becomes an aligned table; a command
    latex2mathml does not know is an error (a warning, so ``--strict`` fails), not raw LaTeX."""
    hook = _mathml_hook()
    table = hook.to_mathml(r"\begin{aligned} a &= b \\ c &= d \end{aligned}", display=True)
    assert table.count("<mtr>") == 2 and table.count('<mtd columnalign="right">') == 2, table
    assert "&=" not in table and "\\" not in table, table
    inline = hook.to_mathml(r"\eta_\text{init} + \tfrac12", display=False)
    assert 'display="inline"' in inline and "<mtext>init</mtext>" in inline, inline
    with pytest.raises(ValueError, match=r"\\notacommand"):
        hook.to_mathml(r"x \notacommand y", display=True)


# -- issue 46, item 11: what a new user reading the pages found untrue

def _user_pages():
    """The README and every docs page a user reads (docs/research, the prototypes' logs, aside)."""
    return [ROOT / "README.md"] + [p for p in sorted((ROOT / "docs").rglob("*.md")) if "research" not in p.parts]


def _digits_table(text: str) -> str:
    return text.split("`halfadam train --task digits`", 1)[1].split("```", 2)[1]


def test_cli_page_digits_table_is_the_front_pages():
    """docs/cli.md says it copies the front page's digits table (which test_cli checks against the command)."""
    assert _digits_table((ROOT / "docs" / "cli.md").read_text()) == _digits_table((ROOT / "README.md").read_text())


def test_state_mode_lists_name_every_mode():
    """Where a page lists what ``--state-mode`` takes, it names every preset, and the example takes them all."""
    import halfadam.encodings

    presets = list(halfadam.encodings.PRESETS)
    assert len(presets) == 5
    example = (ROOT / "examples" / "distributed_train.py").read_text()
    assert "choices=tuple(halfadam.encodings.PRESETS)" in example
    found = 0
    for page in _user_pages():
        for after in page.read_text().split("`--state-mode`")[1:]:
            listing = " ".join(after.split(")", 1)[0].split())
            if "any of" in listing or "," in listing:  # a list of the modes, not a single example
                found += 1
                assert all(re.search(rf"\b{m}\b", listing) for m in presets), (page.name, listing)
    assert found, "no page lists the --state-mode values"


def test_checkpoint_samples_save_the_scaler():
    """A code sample that trains with a GradScaler and saves a checkpoint saves the scaler's state too (a
    resumed float16 run would otherwise restart its loss scale at 65536 and skip steps)."""
    samples = 0
    for page in _user_pages():
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S):
            if "GradScaler(" not in block:
                continue
            for call in re.findall(r"save_checkpoint\((.*?)\)\s*(?:#|\n)", block):
                samples += 1
                assert "scaler" in call, (page.name, call)
    assert samples >= 2  # docs/distributed.md's and docs/offload.md's


def test_front_page_cpu_column_names_its_instruction_sets():
    """The README's CPU-step figures depend on the instruction set: the column gives AVX-512's and AVX2's."""
    front = (ROOT / "README.md").read_text()
    section = front.split("## Which state mode?", 1)[1].split("\n## ", 1)[0]
    header, _, *rows = [line for line in section.splitlines() if line.startswith("|")]
    assert len(rows) == 5, rows
    column = header.split("|").index(next(c for c in header.split("|") if "CPU step" in c))
    assert "AVX-512" in header and "AVX2" in header, header
    for row in rows:
        assert re.fullmatch(r" \d+\.\dx / \d+\.\dx ", row.split("|")[column]), row


def test_front_page_timings_say_their_conditions():
    """The set-up commands' timings hold on two idle cores: each says so (CI's and users' machines are shared)."""
    setup = (ROOT / "README.md").read_text().split("## Set-up", 1)[1].split("\n## ", 1)[0]
    timings = re.findall(r"\d+(?:-\d+)? min(?:utes)? on 2 [^,;)]*", setup)
    assert len(timings) == 2 and all("idle" in t for t in timings), timings
