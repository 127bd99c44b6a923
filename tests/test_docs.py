"""The documentation: docs/ builds with mkdocs-material in strict mode, every page is in mkdocs.yml's nav, and the
README stays a short front door that links every page."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.docs_pages import DOCS

ROOT = DOCS.parent
README = ROOT / "README.md"
PAGES = sorted(path.name for path in DOCS.glob("*.md"))


def nav_pages(entry: Any) -> list[str]:
    """The pages an entry of mkdocs.yml's `nav` names: a page, a titled page or a titled section of entries."""
    if isinstance(entry, str):
        return [entry]
    if isinstance(entry, list):
        return [page for item in entry for page in nav_pages(item)]
    assert isinstance(entry, dict), entry
    return [page for value in entry.values() for page in nav_pages(value)]


def test_the_site_builds_strictly_without_warnings(tmp_path: Path) -> None:
    environment = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's notice about its successor, not ours
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=environment, capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    assert {page.removesuffix(".md") for page in PAGES} - {"index"} <= {p.name for p in (tmp_path / "site").iterdir()}


def test_every_page_is_in_the_nav_once() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    listed = nav_pages(config["nav"])
    assert sorted(listed) == PAGES


def test_the_readme_links_every_page() -> None:
    linked = set(re.findall(r"\]\(docs/([^)#]+\.md)\)", README.read_text(encoding="utf-8")))
    assert sorted(linked) == PAGES


def test_the_readme_is_a_short_front_door() -> None:
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 250


NAMED_PATH = re.compile(r"(?<![\w./-])((?:lmserve|tests|bench|deploy)/[\w./-]*\w/?)")
"""A path in the repository as the pages name it (`lmserve/dialects/table.py`, `bench/README.md`)."""


def test_every_path_the_docs_name_exists() -> None:
    """Code moves; the pages that name where it lives move with it."""
    for page in [README, *sorted(DOCS.glob("*.md"))]:
        missing = {path for path in NAMED_PATH.findall(page.read_text(encoding="utf-8")) if not (ROOT / path).exists()}
        assert not missing, f"{page.name} names paths that do not exist: {sorted(missing)}"
