"""Healing: when an engine that died is started again, and when restarting it stops for a while.

A failure is an engine that died (engine/protocol.py `Engine.failure`: its engine process died, its thread failed)
or a restart of one whose load failed, counted per engine instance's weights and load options. The first restart
after a failure runs at once; after each further failure within FAILURE_WINDOW seconds the next waits twice as long
as the one before (RESTART_BACKOFF, then double). MAX_FAILURES within the window stop the restarts until the oldest
of them is older than the window: requests meanwhile get EngineStopped (503) saying how often, in what time, and
the last cause; then a request, or the next due restart, tries again.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from lmserve.errors import EngineStopped
from lmserve.parsing import format_duration

MAX_FAILURES = 3
"""Failures (deaths and failed restarts) of one model within FAILURE_WINDOW after which restarting it pauses."""
FAILURE_WINDOW = 300.0
"""Seconds over which failures are counted."""
RESTART_BACKOFF = 1.0
"""Seconds before the second restart within the window; each later one waits twice as long (the first is at once)."""


@dataclass(slots=True)
class Failures:
    """The recent failures of one engine instance's weights and options."""

    times: list[float] = field(default_factory=list)
    cause: str = ""
    """The last failure's cause."""


class Healing:
    """The failures of each engine instance key, and what they allow: a restart now, later, or not for a while."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._failures: dict[Hashable, Failures] = {}

    def failed(self, key: Hashable, cause: str) -> None:
        """Count a failure of the instance `key` (its engine died, or a restart's load failed)."""
        record = self._recent(key) or self._failures.setdefault(key, Failures())
        record.times.append(self._clock())
        record.cause = cause

    def is_pausing(self, key: Hashable) -> bool:
        """Whether the last failure of `key` is the one that paused its restarts (MAX_FAILURES within the window)."""
        record = self._recent(key)
        return record is not None and len(record.times) == MAX_FAILURES

    def is_recovering(self, key: Hashable) -> bool:
        """Whether `key` failed within the window (a load of it now is a restart)."""
        return self._recent(key) is not None

    def restart_at(self, key: Hashable) -> float:
        """When the next restart of `key` may start (the clock's time; now or earlier: at once)."""
        record = self._recent(key)
        if record is None:
            return self._clock()
        if len(record.times) >= MAX_FAILURES:
            return record.times[-MAX_FAILURES] + FAILURE_WINDOW
        delay = 0.0 if len(record.times) <= 1 else RESTART_BACKOFF * 2 ** (len(record.times) - 2)
        return record.times[-1] + delay

    def refusal(self, name: str, key: Hashable) -> EngineStopped | None:
        """Why `name` (served by `key`) is not restarted now, when it failed too often within the window; else None."""
        record = self._recent(key)
        if record is None or len(record.times) < MAX_FAILURES:
            return None
        wait = max(0.0, self.restart_at(key) - self._clock())
        return EngineStopped(
            f"the engine serving '{name}' failed {len(record.times)} times within {format_duration(FAILURE_WINDOW)} "
            f"(last: {record.cause}); lmserve stopped restarting it for now and tries again in "
            f"{format_duration(round(wait))}: see the server log for the cause")

    def _recent(self, key: Hashable) -> Failures | None:
        """`key`'s failures within the window (older ones forgotten), or None."""
        record = self._failures.get(key)
        if record is None:
            return None
        since = self._clock() - FAILURE_WINDOW
        record.times = [t for t in record.times if t > since]
        if not record.times:
            del self._failures[key]
            return None
        return record


def stopped(name: str, cause: str) -> EngineStopped:
    """The error of a request whose model's engine stopped under it: the cause, and that it is being restarted."""
    return EngineStopped(f"the engine serving '{name}' stopped ({cause}); it is being restarted: retry shortly")
