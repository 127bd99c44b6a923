"""A server that heals, on the vLLM engine, through a real `lmserve serve`: vLLM's EngineCore process SIGKILLed
(as the out-of-memory killer or a GPU fault does) mid-stream ends every stream with its dialect's error event,
/health says why with a 503, the model is started again in the process and answers; an engine core killed while a
model loads is an error for that request, and the server serves on. An engine core paused (SIGSTOP) is stuck for
/health/decode while /health, which only sees failures, stays 200. A model put to sleep at level 2 ends its engine
core and a request starts it again.

One server for the module (a vLLM start costs about a minute): the embedded SmolLM2 as a safetensors repository,
float32 on the CPU build.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from lmserve.engine.lifeline import descendants
from tests.hf_repos import smollm2_repo
from tests.test_server import Server

COUNT = [{"role": "user", "content": "Count from 1 to 500, one number per line."}]
LONG = 1000
"""Tokens asked of each stream: it is still running when the engine core is killed."""
RESTART_SECONDS = 300
"""How long a restart may take on a busy test machine (a vLLM start takes about a minute)."""


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server(str(smollm2_repo()), "--dtype", "float32", "-np", "4")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def model(server: Server) -> str:
    return server.repository_model()


def engine_cores(server: Server) -> set[int]:
    """The server's vLLM EngineCore processes (vLLM titles them `VLLM::EngineCore`)."""
    found = set()
    for pid in descendants(server.process.pid):
        try:
            if "EngineCore" in Path(f"/proc/{pid}/cmdline").read_text():
                found.add(pid)
        except OSError:
            continue
    return found


class Stream(threading.Thread):
    """One streamed request, read line by line in a thread; `started` is set once it has sent `lines_to_start`
    lines (the first tokens are out) or ended."""

    def __init__(self, url: str, body: dict[str, Any], lines_to_start: int = 12) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.lines_to_start = url, body, lines_to_start
        self.status = 0
        self.lines: list[str] = []
        self.started = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=RESTART_SECONDS) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if line:
                        self.lines.append(line)
                    if len(self.lines) >= self.lines_to_start:
                        self.started.set()
        finally:
            self.started.set()

    def last_data(self) -> Any:
        """The JSON of the last event (an SSE `data:` line, or an NDJSON line)."""
        return json.loads(self.lines[-1].removeprefix("data: "))


def wait_for(what: str, done: Any, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {seconds} s")
        time.sleep(0.5)


def test_a_paused_engine_core_is_stuck_for_the_decode_health_check_while_health_stays_200(
    server: Server, model: str,
) -> None:
    url = server.base_url
    reply = httpx.post(url + "/v1/chat/completions", timeout=120,
                       json={"model": model, "messages": COUNT, "max_tokens": 2, "temperature": 0})
    assert reply.status_code == 200, reply.text
    probed = httpx.get(url + "/health/decode", timeout=120)
    assert probed.status_code == 200, probed.text
    assert probed.json()["models"][model]["check"] == "probed"
    [core] = engine_cores(server)
    os.kill(core, signal.SIGSTOP)  # as a hung device: the process lives, no step returns
    try:
        stuck = httpx.get(url + "/health/decode", params={"timeout": 2}, timeout=60)
        health = httpx.get(url + "/health", timeout=10)
    finally:
        os.kill(core, signal.SIGCONT)
    assert (stuck.status_code, health.status_code) == (503, 200)
    assert stuck.json()["status"] == "stuck" and stuck.json()["models"][model]["state"] == "stuck"
    assert stuck.json()["reason"].startswith(f"{model}: no decode step in 2 s")
    again = httpx.get(url + "/health/decode", timeout=120)
    assert again.status_code == 200, again.text
    assert engine_cores(server) == {core}


def test_a_vllm_model_sleeps_at_level_2_with_its_engine_core_gone_and_a_request_wakes_it(
    server: Server, model: str,
) -> None:
    """vLLM on the CPU keeps no weights without its KV cache: level 1 is a 400 saying so; level 2 ends the engine
    core (its memory back to the machine) and the next request starts it again."""
    url = server.base_url
    asked = {"model": model, "messages": COUNT, "max_tokens": 3, "temperature": 0}
    before = httpx.post(url + "/v1/chat/completions", json=asked, timeout=RESTART_SECONDS)
    assert before.status_code == 200, before.text
    cores = engine_cores(server)
    refused = httpx.post(url + "/sleep", params={"level": 1}, timeout=60)
    assert refused.status_code == 400 and "level 2" in refused.json()["error"]["message"], refused.text
    slept = httpx.post(url + "/sleep", params={"level": 2, "model": model}, timeout=120)
    assert slept.status_code == 200 and slept.json() == {"sleeping": {model: 2}}, slept.text
    wait_for("the engine core's exit", lambda: not engine_cores(server) & cores, 60)
    after = httpx.post(url + "/v1/chat/completions", json=asked, timeout=RESTART_SECONDS)
    assert after.status_code == 200, after.text
    assert after.json()["choices"][0]["message"] == before.json()["choices"][0]["message"]
    assert engine_cores(server) and httpx.get(url + "/is_sleeping").json()["is_sleeping"] is False


def test_a_killed_engine_core_ends_each_dialects_stream_with_its_error_and_the_model_comes_back(
    server: Server, model: str,
) -> None:
    url = server.base_url
    streams = {
        "openai": Stream(url + "/v1/chat/completions", {"model": model, "messages": COUNT, "stream": True,
                                                          "max_tokens": LONG, "ignore_eos": True}),
        "anthropic": Stream(url + "/v1/messages", {"model": model, "messages": COUNT, "stream": True,
                                                    "max_tokens": LONG}, lines_to_start=16),
        "native": Stream(url + "/api/chat", {"model": model, "messages": COUNT, "options": {"num_predict": LONG}},
                         lines_to_start=6),
        "responses": Stream(url + "/v1/responses", {"model": model, "input": COUNT, "stream": True,
                                                     "max_output_tokens": LONG}, lines_to_start=16),
    }
    for name, stream in streams.items():
        assert stream.started.wait(RESTART_SECONDS), name
        assert stream.is_alive(), f"the {name} stream ended before the kill: {stream.lines[-3:]}"
    [core] = engine_cores(server)
    os.kill(core, signal.SIGKILL)
    for stream in streams.values():
        stream.join(60)
        assert not stream.is_alive() and stream.status == 200

    def says_why(message: str) -> None:
        assert message.startswith(f"the engine serving '{model}' stopped (EngineCore process died (SIGKILL))")
        assert message.endswith("it is being restarted: retry shortly")

    openai_error = streams["openai"].last_data()["error"]
    assert openai_error["type"] == "server_error"
    says_why(openai_error["message"])
    anthropic = streams["anthropic"]
    assert anthropic.lines[-2] == "event: error"
    says_why(anthropic.last_data()["error"]["message"])
    says_why(streams["native"].last_data()["error"])
    responses = streams["responses"]
    assert responses.lines[-2] == "event: response.failed"
    says_why(responses.last_data()["response"]["error"]["message"])

    health = httpx.get(url + "/health", timeout=10)
    assert health.status_code == 503
    assert health.json()["status"] in ("restarting", "loading")
    assert "EngineCore process died (SIGKILL)" in health.json()["reason"]
    assert httpx.get(url + "/livez", timeout=10).status_code == 200
    wait_for("/health 200", lambda: httpx.get(url + "/health", timeout=10).status_code == 200, RESTART_SECONDS)
    reply = httpx.post(url + "/v1/chat/completions", timeout=120,
                       json={"model": model, "messages": COUNT, "max_tokens": 8, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"]
    assert len(engine_cores(server)) == 1 and core not in engine_cores(server)


def test_an_engine_core_killed_while_a_model_loads_is_an_error_for_that_request_and_the_server_serves_on(
    server: Server, model: str,
) -> None:
    url = server.base_url
    wait_for("/health 200", lambda: httpx.get(url + "/health", timeout=10).status_code == 200, RESTART_SECONDS)
    serving = engine_cores(server)
    result: dict[str, httpx.Response] = {}

    def load_another() -> None:  # a larger context than the loaded 1024 is another engine instance of the weights
        result["reply"] = httpx.post(url + "/api/generate", timeout=RESTART_SECONDS, json={
            "model": model, "prompt": "Hello", "stream": False, "options": {"num_ctx": 1536, "num_predict": 4}})

    loader = threading.Thread(target=load_another, daemon=True)
    loader.start()
    loading: set[int] = set()

    def found_the_new_core() -> bool:
        loading.update(engine_cores(server) - serving)
        return bool(loading)

    wait_for("the loading engine core", found_the_new_core, RESTART_SECONDS)
    for pid in loading:
        os.kill(pid, signal.SIGKILL)
    loader.join(RESTART_SECONDS)
    reply = result["reply"]
    assert reply.status_code == 500
    error = reply.json()["error"]
    assert error.startswith(f"model '{model}' failed to load: vLLM's engine failed while loading (the server's log "
                            "has vLLM's account): RuntimeError: Engine core initialization failed."), error
    assert httpx.get(url + "/livez", timeout=10).status_code == 200
    assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}
    answer = httpx.post(url + "/v1/chat/completions", timeout=120,
                        json={"model": model, "messages": COUNT, "max_tokens": 4, "temperature": 0})
    assert answer.status_code == 200, answer.text
    gguf = httpx.post(url + "/api/generate", timeout=120,
                      json={"model": "smollm2:135m", "prompt": "Hello", "stream": False,
                            "options": {"num_predict": 4}})
    assert gguf.status_code == 200, gguf.text


def test_a_load_that_hangs_fails_its_request_after_the_load_timeout_and_the_server_serves_on() -> None:
    """A server on the embedded GGUF (llama.cpp loads it in a second) with a 20 s load timeout; the repository's
    engine core is stopped (SIGSTOP) as soon as it starts, so its load hangs."""
    server = Server("-np", "1", env={"LMSERVE_LOAD_TIMEOUT": "20s"})
    stopped: set[int] = set()
    try:
        url = server.base_url
        created = httpx.post(url + "/api/create", json={"model": "repo", "from": str(smollm2_repo()),
                                                        "stream": False}, timeout=120)
        assert created.status_code == 200, created.text
        result: dict[str, httpx.Response] = {}

        def load() -> None:
            result["reply"] = httpx.post(url + "/api/generate", timeout=RESTART_SECONDS, json={
                "model": "repo", "prompt": "Hello", "stream": False, "options": {"num_predict": 4}})

        loader = threading.Thread(target=load, daemon=True)
        loader.start()

        def stop_the_core() -> bool:
            for pid in engine_cores(server) - stopped:
                os.kill(pid, signal.SIGSTOP)
                stopped.add(pid)
            return bool(stopped)

        wait_for("the loading engine core", stop_the_core, RESTART_SECONDS)
        loader.join(RESTART_SECONDS)
        reply = result["reply"]
        assert reply.status_code == 500
        assert reply.json()["error"].startswith(
            "model 'repo:latest' did not load within 20s (LMSERVE_LOAD_TIMEOUT): its engine hangs or is too slow to "
            "start")
        assert httpx.get(url + "/livez", timeout=10).status_code == 200
        assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}
        answer = httpx.post(url + "/api/generate", timeout=120, json={
            "model": "smollm2:135m", "prompt": "Hello", "stream": False, "options": {"num_predict": 4}})
        assert answer.status_code == 200, answer.text
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGKILL)
        server.stop()
