"""Healing: the first restart of a failed engine at once, later ones backing off, a pause after too many failures
within the window (the refusal says how many, in what time, and the last cause), and a fresh start after it; and
on a real llama.cpp engine whose thread dies mid-stream, in-process."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, NoReturn

import httpx
import pytest

from lmserve.config import ServerConfig
from lmserve.engine.llamacpp.backend import LlamaCppBackend
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.http.app import create_app
from lmserve.parsing import format_duration
from lmserve.server import build_service
from lmserve.service.healing import FAILURE_WINDOW, MAX_FAILURES, RESTART_BACKOFF, Healing, stopped


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_key_that_never_failed_may_start_now_and_is_not_refused() -> None:
    clock = Clock()
    healing = Healing(clock)
    assert healing.restart_at("a") == clock.now
    assert not healing.is_recovering("a")
    assert healing.refusal("a", "a") is None


def test_the_first_restart_is_at_once_and_each_later_one_waits_twice_as_long() -> None:
    assert MAX_FAILURES >= 3  # room for two restarts before the pause
    clock = Clock()
    healing = Healing(clock)
    healing.failed("a", "died")
    assert healing.restart_at("a") == clock.now and healing.is_recovering("a")
    clock.now += 10
    healing.failed("a", "died again")
    assert healing.restart_at("a") == clock.now + RESTART_BACKOFF
    if MAX_FAILURES > 3:
        healing.failed("a", "and again")
        assert healing.restart_at("a") == clock.now + 2 * RESTART_BACKOFF
    assert healing.refusal("a", "a") is None
    assert healing.restart_at("b") == clock.now  # other keys are untouched


def test_max_failures_within_the_window_pause_restarts_until_the_oldest_leaves_it() -> None:
    clock = Clock()
    healing = Healing(clock)
    first = clock.now
    for i in range(MAX_FAILURES):
        assert not healing.is_pausing("a")
        healing.failed("a", f"EngineCore process died (SIGKILL) #{i}")
        clock.now += 1
    assert healing.is_pausing("a")
    assert healing.restart_at("a") == first + FAILURE_WINDOW
    refusal = healing.refusal("smol", "a")
    assert refusal is not None and refusal.status == 503
    assert refusal.message == (
        f"the engine serving 'smol' failed {MAX_FAILURES} times within 5m "
        f"(last: EngineCore process died (SIGKILL) #{MAX_FAILURES - 1}); lmserve stopped restarting it for now "
        f"and tries again in {format_duration(FAILURE_WINDOW - MAX_FAILURES)}: see the server log for the cause")
    clock.now = first + FAILURE_WINDOW
    assert healing.refusal("smol", "a") is None  # the oldest failure left the window: a restart may run again
    clock.now += FAILURE_WINDOW
    assert not healing.is_recovering("a")  # all forgotten


def test_the_error_of_a_request_whose_engine_stopped_says_why_and_that_it_restarts() -> None:
    error = stopped("smol", "EngineCore process died (SIGKILL)")
    assert error.status == 503 and error.code == "engine_stopped"
    assert error.message == ("the engine serving 'smol' stopped (EngineCore process died (SIGKILL)); it is being "
                             "restarted: retry shortly")


DEVICE_LOST = "ggml: the device is lost"


async def break_when_generating(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a sequence of `engine` (a BatchingEngine over llama.cpp) has generated a few tokens, make its backend
    unusable: every decode and slot release raises, so the next step fails and its thread ends."""
    assert isinstance(engine, BatchingEngine) and isinstance(engine.backend, LlamaCppBackend)
    while not any(len(seq.output) >= 3 for seq in list(engine.scheduler.running)):
        await asyncio.sleep(0.01)

    def lost(*args: object, **kwargs: object) -> NoReturn:
        raise RuntimeError(DEVICE_LOST)

    monkeypatch.setattr(engine.backend, "step", lost)
    monkeypatch.setattr(engine.backend, "release", lost)


async def test_a_llama_cpp_engine_whose_thread_dies_ends_its_stream_with_the_cause_and_a_new_one_answers(
    tmp_path: Path, model_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The embedded model on llama.cpp, served in-process: its engine thread dies mid-stream; the stream ends with
    the cause, /health is 503 until the next request loads the model again, which answers."""
    config = ServerConfig(models_dir=str(tmp_path), ctx_size=512, parallel=2, threads=1)
    service, name = build_service(config)
    app = create_app(service, config)
    chat = {"model": name, "messages": [{"role": "user", "content": "Tell a long story."}]}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test",
                                     timeout=300) as client:
            assert (await client.post("/v1/chat/completions", json={**chat, "max_tokens": 2})).status_code == 200
            [resident] = service.residency.running()
            engine = resident.model.engine
            streamed = asyncio.ensure_future(client.post("/v1/chat/completions", json={
                **chat, "stream": True, "max_tokens": 400, "ignore_eos": True}))
            await break_when_generating(engine, monkeypatch)
            response = await streamed
            events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
            assert any(e.get("choices") and e["choices"][0]["delta"].get("content") for e in events[:-1])
            assert events[-1]["error"]["message"] == (
                f"the engine serving '{name}' stopped (its engine thread failed: RuntimeError: {DEVICE_LOST}); it is "
                "being restarted: retry shortly")
            health = await client.get("/health")
            assert (health.status_code, health.json()["status"]) == (503, "restarting")
            again = await client.post("/v1/chat/completions", json={**chat, "max_tokens": 4})
            assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"]
            assert (await client.get("/health")).json() == {"status": "ok"}
            [resident] = service.residency.running()
            assert resident.model.engine is not engine and resident.model.engine.failure is None
    finally:
        service.close()
