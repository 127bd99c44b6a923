"""The lifeline's guardian ends the processes it watches once the server's pipe closes, and only those."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from lmserve.engine.lifeline import descendants, guard, start_time


def test_the_guardian_ends_watched_processes_and_spares_a_reused_pid() -> None:
    polite = subprocess.Popen(["sleep", "60"])
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                                 "signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        assert stubborn.stdout is not None and stubborn.stdout.readline() == b"ready\n"
        lines = [f"{p.pid} {start_time(p.pid)}" for p in (polite, stubborn)] + [f"{bystander.pid} 1"]
        started = time.monotonic()
        guard(lines, grace=1.0)
        assert polite.wait(5) == -signal.SIGTERM
        assert stubborn.wait(5) == -signal.SIGKILL  # it ignored SIGTERM: killed after the grace period
        assert time.monotonic() - started < 5
        assert bystander.poll() is None  # its start time differs: a pid reused by another process is left alone
    finally:
        for process in (polite, stubborn, bystander):
            process.kill()
            process.communicate()


def test_descendants_include_grandchildren() -> None:
    parent = subprocess.Popen(["sh", "-c", "sleep 60 & wait"])
    try:
        deadline = time.monotonic() + 5
        while len(descendants(parent.pid)) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert parent.pid in descendants(os.getpid())
        assert len(descendants(parent.pid)) == 1
    finally:
        for child in descendants(parent.pid):
            os.kill(child, signal.SIGKILL)
        parent.kill()
        parent.wait()
