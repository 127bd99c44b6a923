"""The supervisor of `lmserve serve`: the server runs in a child process, started again when a signal ends it.

llama.cpp runs inside the server process, so a native crash in it (an abort, a segfault) ends the whole process.
`lmserve serve` therefore binds the listening socket itself and runs the server — `python -m lmserve serve` with
the same arguments — as its child, which serves on the inherited socket (lmserve/listening.py). When the child
dies of a signal (SIGSEGV, SIGABRT, SIGKILL from the out-of-memory killer …) the supervisor logs one line and
starts it again after a short pause; connections that arrive meanwhile wait in the socket's backlog. More than
MAX_CRASHES crashes within CRASH_WINDOW end the supervisor with status 1 and the reason. A child that exits with a
status (0 after a graceful stop; 1 after a configuration error it has already printed) is not started again: the
supervisor exits with that status.

SIGTERM and SIGINT are forwarded to the child, once per signal received: the child runs in its own process group,
so a Ctrl-C in a terminal reaches the supervisor alone (uvicorn takes a second SIGINT as "quit now"). The child
gets SIGTERM when the supervisor dies (Linux's parent-death signal), so a SIGKILLed supervisor leaves no server
behind. The supervisor imports neither the web framework nor an engine: it stays small.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

from lmserve.config import ServerConfig
from lmserve.listening import LISTEN_FD, BindError, bind_socket

MAX_CRASHES = 5
"""The most crashes within CRASH_WINDOW after which the server is started again; one more ends the supervisor."""
CRASH_WINDOW = 600.0
"""Seconds over which crashes are counted."""
FIRST_BACKOFF = 0.5
"""Seconds before the first restart; each further crash in the window doubles it, up to MAX_BACKOFF."""
MAX_BACKOFF = 8.0
_PR_SET_PDEATHSIG = 1


class Crashes:
    """The server's recent crashes: how many fall within the window, and the pause before the next start."""

    def __init__(self, window: float = CRASH_WINDOW) -> None:
        self.window = window
        self._times: list[float] = []

    def record(self, now: float) -> int:
        """Count a crash at `now`; the number of crashes within the window, this one included."""
        self._times = [*(t for t in self._times if now - t < self.window), now]
        return len(self._times)


def backoff(count: int) -> float:
    """Seconds to wait before starting the server again after the `count`-th crash in the window."""
    return float(min(FIRST_BACKOFF * 2 ** (count - 1), MAX_BACKOFF))


def describe_window(seconds: float) -> str:
    """`10 minutes`, `1 hour`, `90 seconds`."""
    for unit, size in (("hour", 3600), ("minute", 60)):
        if seconds >= size and seconds % size == 0:
            count = int(seconds // size)
            return f"{count} {unit}" + ("s" if count > 1 else "")
    return f"{seconds:g} seconds"


def signal_name(number: int) -> str:
    """`SIGSEGV` for 11; `signal 77` for a number Python does not name."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def serve_supervised(config: ServerConfig, argv: Sequence[str]) -> int:
    """`lmserve serve ARGV…` under the supervisor: bind the port, then run and watch the server process.

    Returns the exit status: the server's own, or 1 with one `lmserve: …` line when the port cannot be bound or the
    server crashed too often."""
    from lmserve.store.load_crashes import LoadCrashes

    try:
        sock = bind_socket(config.host, config.port)
    except BindError as exc:
        print(f"lmserve: {exc}", file=sys.stderr)
        return 1
    crashes = LoadCrashes.of_store(Path(config.models_dir).expanduser())
    with sock:
        return supervise([sys.executable, "-m", "lmserve", *argv], sock, on_crash=crashes.died)


class _Supervision:
    """The child being watched, and the stop signal once one has come."""

    def __init__(self) -> None:
        self.child: subprocess.Popen[bytes] | None = None
        self.stop: int | None = None

    def forward(self, number: int, frame: FrameType | None) -> None:
        self.stop = number
        if self.child is not None and self.child.returncode is None:
            self.child.send_signal(number)


def supervise(command: list[str], sock: socket.socket, *, on_crash: Callable[[int, str], None] | None = None,
              clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> int:
    """Run `command` with the listening socket `sock` (its descriptor in LISTEN_FD) until it exits with a status,
    starting it again each time a signal ends it (at most MAX_CRASHES times in CRASH_WINDOW). `on_crash` is told
    the pid and the signal's name of each crashed process. Returns the exit status for the supervisor."""
    watch = _Supervision()
    previous = {number: signal.signal(number, watch.forward) for number in (signal.SIGTERM, signal.SIGINT)}
    crashes = Crashes()
    try:
        while True:
            watch.child = _start(command, sock)
            if watch.stop is not None:  # a signal came while it was being started
                watch.child.send_signal(watch.stop)
            code = watch.child.wait()
            if code >= 0:
                return code
            name = signal_name(-code)
            if watch.stop is not None:
                return 128 - code
            count = crashes.record(clock())
            if on_crash is not None:
                on_crash(watch.child.pid, name)
            window = describe_window(crashes.window)
            if count > MAX_CRASHES:
                print(f"lmserve: the server process died of {name}, its {count}th crash in {window}; not starting "
                      "it again", file=sys.stderr, flush=True)
                return 1
            print(f"lmserve: the server process died of {name}; starting it again (crash {count} of {MAX_CRASHES} "
                  f"in {window})", file=sys.stderr, flush=True)
            sleep(backoff(count))
            if watch.stop is not None:
                return 0
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _start(command: list[str], sock: socket.socket) -> subprocess.Popen[bytes]:
    """Start the server process: its own process group, the socket inherited, SIGTERM when this process dies."""
    env = dict(os.environ, **{LISTEN_FD: str(sock.fileno())})
    return subprocess.Popen(command, env=env, pass_fds=(sock.fileno(),), process_group=0,
                            preexec_fn=_die_with_parent(os.getpid()))


def _die_with_parent(parent: int) -> Callable[[], None] | None:
    """What the child runs before exec so that it gets SIGTERM when `parent` dies (Linux; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before the fork: the child only calls it

    def arm() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), signal.SIGTERM)

    return arm
