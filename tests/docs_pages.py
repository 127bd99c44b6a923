"""The documentation's pages (docs/) as the tests read them: one section of a page, so its examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"
HEADING = re.compile(r"(#+) ")


def section(page: str, heading: str) -> str:
    """The text of docs/PAGE under the heading that starts with `heading` (its `#`s left out), up to the next heading
    of the same or a higher level; a line inside a code fence is never a heading."""
    found: list[str] = []
    level = 0
    fenced = False
    for line in (DOCS / page).read_text(encoding="utf-8").splitlines(keepends=True):
        if line.startswith("```"):
            fenced = not fenced
        match = None if fenced else HEADING.match(line)
        if level and match and len(match.group(1)) <= level:
            break
        if level:
            found.append(line)
        elif match and line[match.end():].startswith(heading):
            level = len(match.group(1))
    assert level, f"docs/{page} has no heading starting {heading!r}"
    return "".join(found)
