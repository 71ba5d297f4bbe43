"""MkDocs hook: the site's front page (docs/index.md) is the repository's README.md.

README.md links into this folder as ``docs/<page>.md`` (and shows ``docs/loss.png``), which is right on
GitHub; on the site the front page lives inside docs/, so those links lose their ``docs/`` prefix.
Every other link is left as it is, so ``mkdocs build --strict`` checks the README's links too.
"""

from __future__ import annotations

import re
from pathlib import Path

_DOCS_LINK = re.compile(r"(\]\(|<img [^>]*src=\")docs/")


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri != "index.md":
        return markdown
    readme = Path(config.config_file_path).parent / "README.md"
    return _DOCS_LINK.sub(r"\1", readme.read_text(encoding="utf-8"))
