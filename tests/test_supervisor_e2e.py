"""End to end: `lmserve serve` survives a native crash of llama.cpp (the server process is started again on the same
port), refuses a model whose load crashed it, stops gracefully on SIGTERM, and gives up on a server that keeps
crashing or cannot start."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from lmserve.engine.lifeline import descendants
from tests.test_server import MODEL, QUESTION, Server, free_port, lmserve
from tests.tiny_gguf import write_crashing_llama

BACK_WITHIN = 60.0
"""Seconds the service may be down after a crash (the issue's bound)."""


def chat(server: Server, model: str = MODEL) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/chat/completions", timeout=120,
                      json={"model": model, "messages": QUESTION, "temperature": 0, "max_tokens": 8})


def answer_again(server: Server) -> httpx.Response:
    """The first answer to a chat after a crash, trying until BACK_WITHIN has passed."""
    deadline = time.monotonic() + BACK_WITHIN
    while True:
        try:
            return chat(server)
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def llama_process(server: Server) -> int:
    """The process of `server` that has llama.cpp loaded."""
    [pid] = [pid for pid in [server.process.pid, *descendants(server.process.pid)]
             if "libllama" in Path(f"/proc/{pid}/maps").read_text()]
    return pid


def children(pid: int) -> list[int]:
    return [child for child in descendants(pid) if Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[1]
            == str(pid)]


def test_a_segfault_in_the_llama_cpp_process_is_survived_on_the_same_port_and_sigterm_ends_both() -> None:
    server = Server()
    try:
        first = chat(server).json()["choices"][0]["message"]["content"]
        crashed = llama_process(server)
        assert crashed != server.process.pid  # the supervisor itself has no engine
        os.kill(crashed, signal.SIGSEGV)
        again = answer_again(server)
        assert again.status_code == 200, again.text
        assert again.json()["model"] == MODEL
        assert again.json()["choices"][0]["message"]["content"] == first
        restarted = llama_process(server)
        assert restarted != crashed
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=60) == 0
        assert not Path(f"/proc/{restarted}").exists()
    finally:
        out = server.stop()
    assert "lmserve: the server process died of SIGSEGV; starting it again (crash 1 of 5 in 10 minutes)" in out
    assert out.count("lmserve listening on") == 2


def test_a_model_whose_load_crashes_the_server_is_refused_after_the_restart(tmp_path: Path) -> None:
    server = Server()
    try:
        weights = write_crashing_llama(tmp_path / "crashing.gguf")
        created = httpx.post(server.base_url + "/api/create", timeout=60,
                             json={"model": "crasher", "modelfile": f"FROM {weights}", "stream": False})
        assert created.status_code == 200, created.text
        with pytest.raises(httpx.TransportError):  # the request whose load crashed the process is lost
            chat(server, "crasher")
        assert answer_again(server).status_code == 200
        refused = chat(server, "crasher")
        assert refused.status_code == 500
        message = refused.json()["error"]["message"]
        assert message.startswith("model 'crasher:latest' failed to load: loading it crashed the server process "
                                  "(SIGABRT) at ")
        assert message.endswith("; it is not loaded again until its weights change or 10 minutes have passed")
        assert chat(server).status_code == 200  # the other model serves on
    finally:
        out = server.stop()
    assert "died of SIGABRT; starting it again (crash 1 of 5" in out
    assert "crash 2" not in out


def test_a_server_that_keeps_crashing_is_given_up_on() -> None:
    server = Server("-np", "1")
    crashed: set[int] = set()
    while server.process.poll() is None:
        for pid in set(children(server.process.pid)) - crashed:
            os.kill(pid, signal.SIGKILL)
            crashed.add(pid)
        time.sleep(0.05)
    out = server.stop()
    assert server.process.returncode == 1
    assert len(crashed) == 6
    assert out.count("lmserve: the server process died of SIGKILL; starting it again") == 5
    assert out.rstrip().endswith("lmserve: the server process died of SIGKILL, its 6th crash in 10 minutes; not "
                                 "starting it again")


def test_a_server_that_cannot_start_is_not_started_again(tmp_path: Path) -> None:
    done = lmserve("serve", "no-such-model", "--port", str(free_port()), env={"LMSERVE_MODELS": str(tmp_path)})
    assert done.returncode == 1
    assert done.stderr.startswith("lmserve: ") and done.stderr.count("\n") == 1
    assert "starting it again" not in done.stderr
