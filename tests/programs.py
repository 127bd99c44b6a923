"""Other people's programs run by a test (agent CLIs, client applications): each in a session of its own, so that
what it started goes with it.

`subprocess.run(..., timeout=...)` kills only the program it started, then waits for the end of its output: a
helper the program left running (a language server, a local daemon) keeps that output open, and the test waits
forever. Here the whole session is killed, at the timeout and after a normal exit alike.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path


def run_program(argv: Sequence[str | Path], *, env: Mapping[str, str], timeout: float,
                cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run `argv` to its end (no input; output captured as text); TimeoutExpired after `timeout` seconds."""
    command = [str(arg) for arg in argv]
    with subprocess.Popen(command, env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True) as process:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            end_session(process.pid)
            out, err = process.communicate()
            raise subprocess.TimeoutExpired(command, timeout, out, err) from None
        finally:
            end_session(process.pid)
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def end_session(leader: int) -> None:
    """SIGKILL every process still in the session `leader` started."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(leader, signal.SIGKILL)
