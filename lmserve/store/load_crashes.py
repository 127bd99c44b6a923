"""Loads that crashed the server process: a marker left while llama.cpp opens a model, so that the server started
again after the crash refuses that model with a clear error instead of crashing again, in a loop.

llama.cpp runs in the server process; weights it aborts or segfaults on while loading end the process (the
supervisor, lmserve/supervisor.py, starts it again). Before llama.cpp opens a model, `LoadCrashes.loading` writes
a marker naming the model, its weights (path, size, modification time) and this process (pid and start time); the
marker goes when the load returns, however it ends. A marker whose process is gone is a load that crashed: those
weights are refused until they change or WINDOW has passed. The supervisor adds the signal that ended the process
(`died`), so the error can name it.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lmserve.errors import EngineFailure

DIRECTORY = "load-crashes"
"""The markers' folder in the model store."""
WINDOW = 600.0
"""Seconds after a crash during which the same weights are refused."""


class LoadCrashes:
    """The markers of the loads in progress, and of those that crashed their process, in one folder."""

    def __init__(self, directory: Path, window: float = WINDOW) -> None:
        self.directory = directory
        self.window = window

    @classmethod
    def of_store(cls, store_root: Path) -> LoadCrashes:
        """The markers of the model store at `store_root`."""
        return cls(store_root / DIRECTORY)

    @contextlib.contextmanager
    def loading(self, name: str, weights: Path) -> Iterator[None]:
        """Mark the load of model `name` from `weights` while it runs; raise EngineFailure, loading nothing, when
        loading these weights crashed a server process within the window."""
        identity = _identity(weights)
        for marker, record in self._dead():
            weights_then = record.get("weights") or [None]
            if time.time() - float(record.get("time") or 0) >= self.window or (
                    weights_then[0] == identity[0] and weights_then != identity):
                marker.unlink(missing_ok=True)  # the window has passed, or these weights have changed since
                continue
            if weights_then != identity:
                continue  # other weights
            died = f" ({record['signal']})" if record.get("signal") else ""
            when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(record["time"])))
            raise EngineFailure(f"loading it crashed the server process{died} at {when}; it is not loaded again "
                                f"until its weights change or {_minutes(self.window)} have passed")
        self.directory.mkdir(parents=True, exist_ok=True)
        pid = os.getpid()
        marker = self.directory / f"{pid}-{time.monotonic_ns()}.json"
        marker.write_text(json.dumps({"model": name, "weights": identity, "pid": pid, "start": _start_time(pid),
                                      "time": time.time()}))
        try:
            yield
        finally:
            marker.unlink(missing_ok=True)

    def died(self, pid: int, signal: str) -> None:
        """Record that process `pid`, which may have been loading, died of `signal` (`SIGSEGV`)."""
        for marker, record in self._records():
            if record.get("pid") == pid and not record.get("signal"):
                with contextlib.suppress(OSError):
                    marker.write_text(json.dumps({**record, "signal": signal}))

    def _records(self) -> Iterator[tuple[Path, dict[str, Any]]]:
        """Every marker and what it says (an unreadable one is removed)."""
        for marker in sorted(self.directory.glob("*.json")):
            try:
                record = json.loads(marker.read_text())
            except (OSError, ValueError):
                marker.unlink(missing_ok=True)
                continue
            if isinstance(record, dict):
                yield marker, record

    def _dead(self) -> Iterator[tuple[Path, dict[str, Any]]]:
        """The markers whose process is gone: loads that crashed it."""
        for marker, record in self._records():
            pid = record.get("pid")
            if not isinstance(pid, int) or _start_time(pid) != record.get("start"):
                yield marker, record


def _identity(weights: Path) -> list[object]:
    """What tells these weights from changed ones: the path, the size and the modification time."""
    try:
        stat = weights.stat()
    except OSError:
        return [str(weights)]
    return [str(weights), stat.st_size, stat.st_mtime_ns]


def _start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, from /proc), or None when it is gone or a zombie; where
    there is no /proc, -1 for this process and None for any other."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return -1 if pid == os.getpid() and not Path("/proc").is_dir() else None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:g} minutes"
