"""A results page with more than one model: each further model is a marked section of the page.

``docs/results.md`` is rendered for the default model by ``--suite results``; a suite with a
``section`` (``--suite results-gemma3``) renders its own page and writes it, headings demoted
one level, between ``<!-- kvcake-section NAME -->`` and ``<!-- /kvcake-section NAME -->`` at the
end of the same file. Regenerating the main page keeps the sections that follow it, and
regenerating a section replaces only that section.
"""

from __future__ import annotations

import re
from pathlib import Path


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- kvcake-section {name} -->", f"<!-- /kvcake-section {name} -->"


def _sections(text: str) -> str:
    """Everything from the first section marker on ('' if none)."""
    i = text.find("<!-- kvcake-section ")
    return "" if i < 0 else text[i:]


def keep_sections(doc: Path, page: str) -> str:
    """``page`` (the main page) followed by the sections ``doc`` already has."""
    old = doc.read_text() if doc.is_file() else ""
    tail = _sections(old)
    return page.rstrip("\n") + "\n\n" + tail if tail else page


def write_section(doc: Path, name: str, title: str, page: str) -> None:
    """Put ``page`` (a whole rendered page) into ``doc`` as section ``name`` under ``title``."""
    begin, end = _markers(name)
    body = re.sub(r"^(#+) ", r"#\1 ", page, flags=re.MULTILINE)  # demote every heading
    body = re.sub(r"^## Evaluation results\n", "", body, count=1)
    block = f"{begin}\n# {title}\n\n{body.strip()}\n{end}\n"
    old = doc.read_text() if doc.is_file() else ""
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        new = head + block + rest.split(end, 1)[1].lstrip("\n")
    else:
        new = old.rstrip("\n") + "\n\n" + block
    doc.write_text(new)
