"""tests/lanes.py: which lanes a test is in, and which modules `-m` lets the run skip without importing them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.lanes import LANES, imported_by, lanes, skipped_module

FAST = "not model and not server and not slow"


def _module(tmp_path: Path, source: str, name: str = "test_mod.py") -> Path:
    path = tmp_path / name
    path.write_text(source)
    return path


def test_top_level_imports_are_read_without_importing(tmp_path: Path) -> None:
    path = _module(tmp_path, "import subprocess\nfrom tests.test_server import Server\nfrom . import near\n"
                             "def f():\n    import vllm\n")
    assert imported_by(path) == {"subprocess", "tests.test_server", "tests.test_server.Server"}


@pytest.mark.parametrize(("source", "markexpr", "skipped"), [
    ("import subprocess\n", FAST, True),  # every test is a server test
    ("from tests.hf_repos import smollm2_repo\n", FAST, True),  # vLLM: model
    ("import schemathesis\n", FAST, True),
    ("from tests.tiny_lfm2 import write\n", FAST, False),  # a GGUF writer alone is fast (llama.cpp makes it model)
    ("import json\n", FAST, False),  # a fixture may still make a test fast or not: collected
    ("import subprocess\n", "", False),  # no -m: everything runs
    ("import json\n", "server", False),  # a fixture may put a test in the server lane
    ("import subprocess\n", "not server or asyncio", False),  # names something other than a lane
    ("import subprocess\n", "not model", False),
])
def test_a_module_is_skipped_only_when_m_deselects_it_whatever_its_fixtures(
        tmp_path: Path, source: str, markexpr: str, skipped: bool) -> None:
    assert skipped_module(_module(tmp_path, source), markexpr) is skipped


def test_files_that_are_not_test_modules_are_collected_as_pytest_decides(tmp_path: Path) -> None:
    assert not skipped_module(_module(tmp_path, "import subprocess\n", "helper.py"), FAST)


@pytest.mark.slow  # it reads the whole run's collection, which `make test-fast` does not have
def test_every_collected_test_is_in_at_least_the_lanes_its_modules_imports_give(request: pytest.FixtureRequest) -> None:
    static_of: dict[Path, set[str]] = {}
    checked = 0
    for item in request.session.items:
        static = static_of.setdefault(item.path, lanes(imported_by(item.path), set(), item.path.name))
        marked = {lane for lane in LANES if item.get_closest_marker(lane)}
        assert static <= marked, item.nodeid
        checked += 1
    assert checked > 1000 or len({item.path for item in request.session.items}) < 10
