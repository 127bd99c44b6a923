"""End to end: the `lmserve` command as a user runs it, in a real process against a real server, under Python's
development mode (`-X dev`: every ResourceWarning shown, "Exception ignored" for errors in finalizers).

What a new user meets first: `lmserve run … | head` ends quietly; no command leaves warnings behind at exit; the
server a client command starts writes its log into the model store (LMSERVE_MODELS); `serve` stops on Ctrl-C or
SIGTERM without noise.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from lmserve.cli import STDOUT_CLOSED
from tests.test_server import MODEL, Server, free_port, wait_healthy

NOISE = ("Traceback", "Exception ignored", "ResourceWarning")
THIRD_PARTY = "ResourceWarning: unclosed file <_io.TextIOWrapper name='/dev/null'"
"""llama-cpp-python opens /dev/null twice when it is imported (llama_cpp/_utils.py) and never closes it: the one
warning `serve` prints at exit in development mode that is not lmserve's own."""
GREEDY = "greedy:latest"
"""The served model at temperature 0: its story has many paragraphs, every time."""
STORY = "Write a long story about a dragon."


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server("-np", "2", "-c", "1024")
    created = httpx.post(srv.base_url + "/api/create", timeout=60,
                         json={"model": GREEDY, "from": MODEL, "parameters": {"temperature": 0}, "stream": False})
    assert created.status_code == 200, created.text
    yield srv
    srv.stop()


def environment(**variables: str) -> dict[str, str]:
    """This process's environment without LMSERVE_* variables, plus `variables`."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("LMSERVE_")}
    return {**environ, **variables}


def lmserve(*args: str, env: dict[str, str], stdout: int = subprocess.PIPE) -> subprocess.Popen[str]:
    """`lmserve ARGS…` in development mode, stdin empty, stdout (unless given) and stderr piped; Ctrl-C (SIGINT)
    interrupts it as in a terminal, even when this process was started with SIGINT ignored."""
    return subprocess.Popen([sys.executable, "-X", "dev", "-m", "lmserve", *args], stdout=stdout,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def noise(stderr: str, *, allowed: str = "\0") -> list[str]:
    """The lines of `stderr` that are a traceback, an "Exception ignored" or a ResourceWarning (but `allowed`)."""
    return [line for line in stderr.splitlines() if any(word in line for word in NOISE) and allowed not in line]


def test_run_piped_into_head_ends_quietly_with_the_status_of_sigpipe(server: Server) -> None:
    with lmserve("run", GREEDY, STORY, env=environment(LMSERVE_HOST=server.base_url)) as process:
        assert process.stdout is not None and process.stderr is not None
        first = process.stdout.readline()  # what `head -n 1` reads before it exits
        process.stdout.close()
        stderr = process.stderr.read()
    assert (process.returncode, stderr) == (STDOUT_CLOSED, "")
    assert first.startswith("Once upon a time")


@pytest.mark.parametrize("args", [["list"], ["show", MODEL], ["ps"], ["run", MODEL, "Say hi."]])
def test_a_command_whose_stdout_is_closed_ends_quietly(server: Server, args: list[str]) -> None:
    read, write = os.pipe()
    os.close(read)  # nobody reads: the first write fails with EPIPE
    try:
        process = lmserve(*args, env=environment(LMSERVE_HOST=server.base_url), stdout=write)
    finally:
        os.close(write)
    _, stderr = process.communicate(timeout=60)
    assert (process.returncode, stderr) == (STDOUT_CLOSED, "")


@pytest.mark.parametrize(
    "args",
    [["list"], ["ps"], ["show", MODEL], ["show", MODEL, "--parameters"], ["run", MODEL, "Say hi."],
     ["cp", MODEL, "copy:1"], ["rm", "copy:1"], ["pull", MODEL], ["stop", MODEL], ["show", "no-such-model"]],
)  # fmt: skip
def test_client_commands_leave_no_warnings_at_exit(server: Server, args: list[str]) -> None:
    process = lmserve(*args, env=environment(LMSERVE_HOST=server.base_url))
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == (1 if "no-such-model" in args else 0), stderr
    assert noise(stderr) == []


def test_a_server_started_by_the_cli_logs_into_the_model_store(tmp_path: Path) -> None:
    store = tmp_path / "store"
    env = environment(LMSERVE_HOST=f"127.0.0.1:{free_port()}", LMSERVE_MODELS=str(store))
    process = lmserve("list", env=env)
    stdout, stderr = process.communicate(timeout=120)
    started = served_from(store)
    try:
        log = store / "server.log"
        assert process.returncode == 0, stderr
        assert f"starting it in the background (log: {log})" in stderr
        assert noise(stderr) == []  # no "subprocess … is still running" for the server left running
        assert MODEL in stdout
        assert f"lmserve listening on http://{env['LMSERVE_HOST']}" in log.read_text()
    finally:
        for pid in started:
            os.kill(pid, signal.SIGTERM)
    for pid in started:
        wait_gone(pid)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serve_stops_on_a_signal_without_noise(tmp_path: Path, sig: signal.Signals) -> None:
    port = free_port()
    process = lmserve("serve", "--port", str(port), "-c", "512", "-np", "1",
                      env=environment(LMSERVE_MODELS=str(tmp_path)), stdout=subprocess.DEVNULL)
    wait_healthy(process, f"http://127.0.0.1:{port}")
    reply = httpx.post(f"http://127.0.0.1:{port}/api/generate", timeout=60,
                       json={"model": MODEL, "prompt": "Hi", "stream": False, "options": {"num_predict": 3}})
    assert reply.status_code == 200
    process.send_signal(sig)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0
    assert noise(stderr, allowed=THIRD_PARTY) == []


def test_ctrl_c_while_serve_pulls_its_model_ends_it_without_a_traceback(tmp_path: Path) -> None:
    port = free_port()
    with socket.socket() as hub:
        hub.bind(("127.0.0.1", 0))
        hub.listen()
        hub.settimeout(60)
        env = environment(LMSERVE_MODELS=str(tmp_path), LMSERVE_HF_ENDPOINT=f"http://127.0.0.1:{hub.getsockname()[1]}")
        process = lmserve("serve", "example/never-answers", "--port", str(port), env=env)
        connection, _ = hub.accept()  # the pull has asked the hub, which never answers
        with connection:
            process.send_signal(signal.SIGINT)
            stdout, stderr = process.communicate(timeout=60)
    assert (process.returncode, stdout) == (130, "")
    assert "Traceback" not in stderr and "Exception ignored" not in stderr
    assert f"laddr=('127.0.0.1', {port})" not in stderr  # serve's listening socket is closed


# ---- helpers ---------------------------------------------------------------------------------------------------


def served_from(store: Path) -> list[int]:
    """The pids of `lmserve serve` processes whose model store is `store` (the one a client command started)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in cmdline and f"LMSERVE_MODELS={store}".encode() in environ:
            found.append(int(entry.name))
    return found


def wait_gone(pid: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
