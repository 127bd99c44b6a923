"""The supervisor: a server process that a signal ends is started again on the same socket, a few times; one that
exits with a status is not."""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmserve.supervisor import CRASH_WINDOW, MAX_BACKOFF, MAX_CRASHES, Crashes, backoff, describe_window, supervise


@pytest.fixture
def sock() -> Iterator[socket.socket]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


SEGFAULT = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"


def test_crashes_are_counted_within_the_window() -> None:
    crashes = Crashes(window=60)
    assert [crashes.record(t) for t in (0, 10, 59)] == [1, 2, 3]
    assert crashes.record(65) == 3  # the crash at 0 has left the window
    assert crashes.record(200) == 1


def test_the_pause_doubles_up_to_its_cap() -> None:
    assert [backoff(n) for n in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 4.0]
    assert backoff(10) == MAX_BACKOFF


@pytest.mark.parametrize(("seconds", "text"), [(600, "10 minutes"), (3600, "1 hour"), (90, "90 seconds")])
def test_the_window_reads_in_words(seconds: float, text: str) -> None:
    assert describe_window(seconds) == text


def test_a_server_that_keeps_crashing_is_started_again_then_given_up(sock: socket.socket,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    crashed: list[tuple[int, str]] = []
    pauses: list[float] = []
    code = supervise(python(SEGFAULT), sock, on_crash=lambda pid, name: crashed.append((pid, name)),
                     sleep=pauses.append)
    assert code == 1
    assert [name for _, name in crashed] == ["SIGSEGV"] * (MAX_CRASHES + 1)
    assert len({pid for pid, _ in crashed}) == MAX_CRASHES + 1  # a new process each time
    assert pauses == [backoff(n) for n in range(1, MAX_CRASHES + 1)]
    lines = capsys.readouterr().err.splitlines()
    window = describe_window(CRASH_WINDOW)
    assert lines[0] == f"lmserve: the server process died of SIGSEGV; starting it again (crash 1 of {MAX_CRASHES} " \
                       f"in {window})"
    assert lines[-1] == f"lmserve: the server process died of SIGSEGV, its {MAX_CRASHES + 1}th crash in {window}; " \
                        "not starting it again"


def test_a_server_that_exits_with_a_status_is_not_started_again(sock: socket.socket,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert supervise(python("raise SystemExit(1)"), sock, sleep=pytest.fail) == 1
    assert supervise(python("pass"), sock, sleep=pytest.fail) == 0
    assert capsys.readouterr().err == ""


def test_after_a_crash_the_server_runs_again_on_the_same_listening_socket(sock: socket.socket,
                                                                           tmp_path: Path) -> None:
    flag = tmp_path / "crashed-once"
    code = f"""
import os, pathlib, signal, socket
s = socket.socket(fileno=int(os.environ["LMSERVE_LISTEN_FD"]))
assert s.getsockname()[1] == {sock.getsockname()[1]} and s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
flag = pathlib.Path({str(flag)!r})
if not flag.exists():
    flag.touch()
    os.kill(os.getpid(), signal.SIGABRT)
"""
    pauses: list[float] = []
    assert supervise(python(code), sock, sleep=pauses.append) == 0
    assert pauses == [backoff(1)]
