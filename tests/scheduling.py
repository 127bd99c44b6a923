"""Where and when the suite's work runs on xdist's workers (`make test`: `-n 2 --dist loadgroup`).

A unit of work is a module, or the modules that share a server or engine (the `xdist_group` mark tests/conftest.py
gives them, so the server starts once per run): a unit runs whole on one worker. Units go out longest first, by the
seconds tests/durations.json recorded (longest-processing-time-first: the long units start at once, and the short
in-process modules fill the gaps at the end, so both workers stay busy to the end). A module the snapshot does not
know is guessed at UNKNOWN_S a test.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

from tests.timing import load_snapshot, module_of

UNKNOWN_S = 1.0
"""Seconds a test of a module missing from the snapshot is guessed to take."""


def scope_of(nodeid: str) -> str:
    """The unit a test belongs to: its group (the `@name` suffix loadgroup adds to a marked test's id), else its
    module."""
    head, at, group = nodeid.rpartition("@")
    if at and head and "]" not in group and "/" not in group:
        return "group:" + group
    return module_of(nodeid)


def estimate(nodeids: list[str], snapshot: dict[str, tuple[float, int]]) -> float:
    """The seconds a unit's tests are expected to take: each module's recorded time, in proportion to the share of
    its tests this run selected."""
    selected: dict[str, int] = defaultdict(int)
    for nodeid in nodeids:
        selected[module_of(nodeid)] += 1
    total = 0.0
    for module, count in selected.items():
        seconds, tests = snapshot.get(module, (UNKNOWN_S * count, count))
        total += seconds * min(1.0, count / max(tests, 1))
    return total


def longest_first(units: dict[str, dict[str, bool]],
                  snapshot: dict[str, tuple[float, int]]) -> OrderedDict[str, dict[str, bool]]:
    """xdist's work queue (unit -> its tests) reordered: the longest unit first (ties: the order given)."""
    return OrderedDict(sorted(units.items(), key=lambda unit: -estimate(list(unit[1]), snapshot)))


class LongestFirst(LoadScopeScheduling):
    """xdist's scope scheduling, with units by group or module and sent longest first."""

    def __init__(self, config: pytest.Config, log: Any = None) -> None:
        super().__init__(config, log)
        self._snapshot = load_snapshot()
        self._ordered = False

    def _split_scope(self, nodeid: str) -> str:
        return scope_of(nodeid)

    def _assign_work_unit(self, node: Any) -> None:
        if not self._ordered:  # the queue is complete by the first assignment
            self.workqueue = longest_first(self.workqueue, self._snapshot)
            self._ordered = True
        super()._assign_work_unit(node)
