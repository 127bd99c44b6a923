"""No orphans: the engine processes a server started end when the server does, however the server ended.

vLLM runs its engine core (and that its workers) as child processes. Its workers watch the engine core, but
the engine core does not watch the server: after a SIGKILL of the server it would run on, holding the model's
memory. `Lifeline` starts a small guardian process (`python -m lmserve.engine.lifeline`) that the server tells,
over a pipe, which processes to look after. When the pipe closes — the server exited, or was killed — the guardian
sends each of them that is still running SIGTERM (vLLM's engine core then stops its workers) and, `grace` seconds
later, SIGKILL.
A process is named by its pid and start time, so a reused pid is never signalled.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

GRACE_SECONDS = 10.0


def start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, from /proc), or None when it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (empty where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class Lifeline:
    """The server's end of the pipe to its guardian process (started on first use)."""

    def __init__(self) -> None:
        self._guardian: subprocess.Popen[bytes] | None = None
        self._watched: set[tuple[int, int]] = set()
        self._lock = threading.Lock()

    def watch(self, pids: list[int]) -> None:
        """Have the guardian end these processes if this one dies first (each is told to it once)."""
        if not pids or not Path("/proc").is_dir():
            return
        with self._lock:
            named = {(pid, start) for pid in pids if (start := start_time(pid)) is not None} - self._watched
            if not named:
                return
            if self._guardian is None:
                self._guardian = subprocess.Popen(  # its own session: a Ctrl-C or a group kill leaves it to clean up
                    [sys.executable, "-m", "lmserve.engine.lifeline"], stdin=subprocess.PIPE, start_new_session=True)
                atexit.register(self.close)
            assert self._guardian.stdin is not None
            self._guardian.stdin.write("".join(f"{pid} {start}\n" for pid, start in sorted(named)).encode())
            self._guardian.stdin.flush()
            self._watched |= named

    def watch_children(self) -> None:
        """Watch every process this one has started so far (call it once an engine's processes are up)."""
        guardian = self._guardian.pid if self._guardian is not None else None
        self.watch([pid for pid in descendants(os.getpid()) if pid != guardian])

    def close(self, wait: float = 5.0) -> None:
        """At a normal exit, once what it watches has ended: close the pipe and give the guardian `wait` seconds
        to exit (it exits at once when its pipe closes, but on a loaded machine a guardian started just before may
        still be starting: 1 s was seen to be too short). While a watched process still runs (an engine whose own
        exit handler has yet to stop it) the pipe is left to close when this process is gone, as after a kill."""
        with self._lock:
            if self._guardian is None or any(start_time(pid) == start for pid, start in self._watched):
                return
            guardian, self._guardian = self._guardian, None
        assert guardian.stdin is not None
        with contextlib.suppress(OSError):
            guardian.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            guardian.wait(wait)

    @contextlib.contextmanager
    def watching(self, every: float = 1.0) -> Iterator[None]:
        """Watch the processes this one starts while the block runs (looked for every `every` seconds) and those
        there at its end: an engine still loading when this process dies leaves none behind either."""
        done = threading.Event()

        def look() -> None:
            while not done.wait(every):
                self.watch_children()

        thread = threading.Thread(target=look, name="lmserve-lifeline", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()
            self.watch_children()


LIFELINE = Lifeline()
"""This process's lifeline (one guardian per server)."""


def guard(lines: list[str], grace: float = GRACE_SECONDS) -> None:
    """The guardian's work once its pipe has closed: end each watched process (`pid start` lines) still running."""
    watched = [(int(pid), int(start)) for pid, start in (line.split() for line in lines if line.strip())]
    running = [pid for pid, start in watched if start_time(pid) == start]
    for pid in running:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(start_time(pid) is not None for pid in running):
        time.sleep(0.2)
    for pid, start in watched:
        if start_time(pid) == start:
            _signal(pid, signal.SIGKILL)


def _signal(pid: int, number: signal.Signals) -> None:
    with contextlib.suppress(OSError):  # it has just exited
        os.kill(pid, number)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    guard(sys.stdin.read().splitlines())  # read() returns when the server closes the pipe: it exited or was killed
