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
        assert polite.wait(20) == -signal.SIGTERM
        assert stubborn.wait(20) == -signal.SIGKILL  # it ignored SIGTERM: killed after the grace period
        assert time.monotonic() - started < 20  # (not the 60 s of its sleep; 1 s grace, slack for a loaded machine)
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


def exit_after_watching(child_ends: bool) -> tuple[subprocess.CompletedProcess[str], int]:
    """A Python process that watches a child of its own and exits (`-X dev`: warnings shown); the child's pid."""
    script = ("import subprocess; from lmserve.engine.lifeline import LIFELINE; "
              "child = subprocess.Popen(['sleep', '60']); LIFELINE.watch([child.pid]); print(child.pid, flush=True); "
              + ("child.kill(); child.wait()" if child_ends else "child.returncode = 0"))  # or forgotten, running
    done = subprocess.run([sys.executable, "-X", "dev", "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done, int(done.stdout)


def ended_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while start_time(pid) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    return start_time(pid) is None


def test_a_normal_exit_after_the_watched_processes_ended_closes_the_guardian_cleanly() -> None:
    done, _ = exit_after_watching(child_ends=True)
    assert "ResourceWarning" not in done.stderr, done.stderr  # the guardian was waited for and its pipe closed


def test_a_process_that_exits_leaving_a_watched_process_running_has_the_guardian_end_it() -> None:
    _, child = exit_after_watching(child_ends=False)
    assert ended_within(child, 10)
