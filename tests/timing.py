"""The suite's clock: every test's time recorded, and the run's wall time and slowest modules printed at its end.

A test's time is its setup, call and teardown together, so a module's time (the sum of its tests') includes the servers
and engines it starts. Each run writes build/test-times/last-run.json; tests/durations.json is the snapshot kept in
the repository that the scheduler (tests/scheduling.py) orders modules by, refreshed by `make durations`.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAST_RUN = ROOT / "build" / "test-times" / "last-run.json"
SNAPSHOT = ROOT / "tests" / "durations.json"
SLOWEST = 15
DRIFT = 0.5
"""A module whose time moved by more than this fraction (and DRIFT_S) of the snapshot's is said to have drifted."""
DRIFT_S = 30.0


def test_id(nodeid: str) -> str:
    """A report's node id without the `@group` suffix xdist's loadgroup adds."""
    head, _, tail = nodeid.rpartition("@")
    return head if head and "::" in head and "]" not in tail and "/" not in tail else nodeid


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def load_snapshot(path: Path = SNAPSHOT) -> dict[str, tuple[float, int]]:
    """(seconds, tests) per module file from a kept snapshot or a run's record ({} when there is none)."""
    try:
        modules = json.loads(path.read_text())["modules"]
        return {str(k): (float(v["seconds"]), int(v["tests"])) for k, v in modules.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


class SuiteClock:
    """Sums each test's phases as their reports arrive (on xdist's controller: every worker's reports)."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.tests: dict[str, float] = defaultdict(float)
        self.workers: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        nodeid = test_id(report.nodeid)
        self.tests[nodeid] += report.duration
        worker = getattr(getattr(report, "node", None), "gateway", None)
        if worker is not None:
            self.workers[module_of(nodeid)] = str(worker.id)

    def modules(self) -> dict[str, tuple[float, int]]:
        """(seconds, tests) per module, the slowest first."""
        seconds: dict[str, float] = defaultdict(float)
        tests: dict[str, int] = defaultdict(int)
        for nodeid, duration in self.tests.items():
            seconds[module_of(nodeid)] += duration
            tests[module_of(nodeid)] += 1
        return {path: (seconds[path], tests[path]) for path in sorted(seconds, key=lambda path: -seconds[path])}

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.tests:
            return
        wall = time.monotonic() - self.started
        modules = self.modules()
        LAST_RUN.parent.mkdir(parents=True, exist_ok=True)
        LAST_RUN.write_text(json.dumps({"wall_s": round(wall, 1), "modules": module_table(modules),
                                        "workers": self.workers, "tests": _rounded(self.tests)}, indent=1) + "\n")
        write = terminalreporter.write_line
        terminalreporter.section("suite clock")
        busy = sum(seconds for seconds, _ in modules.values())
        write(f"wall time {_clock(wall)} ({wall:.0f} s); the tests' own time {busy:.0f} s; "
              f"every test's time in {_shown(LAST_RUN)}")
        write(f"the {SLOWEST} slowest modules:")
        for path, (seconds, tests) in list(modules.items())[:SLOWEST]:
            write(f"  {seconds:7.1f} s  {tests:4d} tests  {path}  [{self.workers.get(path, '-')}]")
        drifted = drifted_modules(modules, load_snapshot())
        if drifted:
            write(f"{len(drifted)} modules drifted from tests/durations.json (e.g. {', '.join(drifted[:3])}): "
                  "`make durations` refreshes it")


def drifted_modules(measured: dict[str, tuple[float, int]], snapshot: dict[str, tuple[float, int]]) -> list[str]:
    """Modules run whole that the snapshot lacks, or whose time moved by more than DRIFT of it and DRIFT_S."""
    drifted = []
    for path, (seconds, tests) in measured.items():
        if path not in snapshot:
            drifted.append(path)
            continue
        known, known_tests = snapshot[path]
        if tests >= known_tests and abs(seconds - known) > max(DRIFT * known, DRIFT_S):
            drifted.append(path)
    return drifted


def module_table(modules: dict[str, tuple[float, int]]) -> dict[str, dict[str, float]]:
    return {path: {"seconds": round(seconds, 1), "tests": tests} for path, (seconds, tests) in modules.items()}


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _rounded(values: dict[str, float]) -> dict[str, float]:
    return {key: round(value, 2) for key, value in values.items()}


def _clock(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def register(config: pytest.Config) -> None:
    """Start the clock in the process that sees every report: xdist's controller, or the only process."""
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(SuiteClock(), "lmserve-suite-clock")


def refresh_snapshot() -> None:
    """`make durations`: the last run's module times become tests/durations.json (a module it did not run keeps
    its own)."""
    measured = load_snapshot(LAST_RUN)
    if not measured:
        raise SystemExit(f"no run recorded in {LAST_RUN}: run `make test` first")
    modules = load_snapshot()
    for path, (seconds, tests) in measured.items():
        if tests >= modules.get(path, (0.0, 0))[1]:  # run whole, not a part picked by -k
            modules[path] = (seconds, tests)
    modules = dict(sorted(modules.items(), key=lambda item: -item[1][0]))
    SNAPSHOT.write_text(json.dumps({"modules": module_table(modules)}, indent=1) + "\n")
    print(f"{SNAPSHOT.relative_to(ROOT)}: {len(modules)} modules, {sum(s for s, _ in modules.values()):.0f} s")


if __name__ == "__main__":
    refresh_snapshot()
