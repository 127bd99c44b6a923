"""Streaming: a client that goes away aborts its generation; engine failures mid-stream; the frame encoders."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
from api_wire import assert_openai_error, sse_events
from fastapi import FastAPI
from starlette.types import Message, Scope

from lmserve.chat.template import ChatTemplate
from lmserve.config import ServerConfig
from lmserve.dialects.shared.streaming import HOLE, TextFrame, dumps, until_disconnect
from lmserve.engine.slots.backend import BatchEntry
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.fake import FakeBackend
from lmserve.http.app import create_app
from lmserve.service import static_service
from lmserve.service.residency import LoadedModel
from lmserve.types import Adapter


@pytest.fixture
def long_engine() -> Iterator[BatchingEngine]:
    """An engine whose generations would run for a long time unless aborted."""
    engine = BatchingEngine(FakeBackend(num_ctx=10_000_000, num_parallel=2))
    yield engine
    engine.close()


@pytest.fixture
def long_app(long_engine: BatchingEngine) -> FastAPI:
    model = LoadedModel(name="fake", engine=long_engine, template=ChatTemplate(None))
    return create_app(static_service([model]), ServerConfig())


def _scope(path: str, spec_version: str) -> Scope:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": spec_version},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
        "client": ("127.0.0.1", 5000),
        "server": ("test", 80),
    }


class FakeClient:
    """An ASGI peer that sends one body, then disconnects when told to (or fails sends, like ASGI spec 2.4)."""

    def __init__(self, body: dict[str, Any], *, fail_sends_after: int | None = None) -> None:
        self.body = json.dumps(body).encode()
        self.is_body_sent = False
        self.gone = asyncio.Event()
        self.messages: list[Message] = []
        self.fail_sends_after = fail_sends_after

    async def receive(self) -> Message:
        if not self.is_body_sent:
            self.is_body_sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if self.gone.is_set() and self.fail_sends_after is not None:
            raise OSError("connection reset")
        self.messages.append(message)
        if self.fail_sends_after is not None and len(self.bodies) >= self.fail_sends_after:
            self.gone.set()

    @property
    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.messages if m["type"] == "http.response.body"]


async def _wait_idle(engine: BatchingEngine, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while engine.num_running or engine.num_waiting:
            await asyncio.sleep(0.01)


async def _wait_running(engine: BatchingEngine, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not engine.num_running:
            await asyncio.sleep(0.005)


def _num_steps(engine: BatchingEngine) -> int:
    backend = engine.backend
    assert isinstance(backend, FakeBackend)
    return len(backend.steps)


async def _assert_aborted(engine: BatchingEngine) -> None:
    await _wait_idle(engine)
    steps = _num_steps(engine)
    await asyncio.sleep(0.05)
    assert _num_steps(engine) == steps  # nothing is decoding any more
    assert steps < 1_000_000  # far from the end of the context: it was aborted, not finished


@pytest.mark.asyncio
@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_disconnect_mid_stream_aborts(
    long_app: FastAPI, long_engine: BatchingEngine, spec_version: str, path: str
) -> None:
    body: dict[str, Any] = {"model": "fake", "stream": True}
    body.update({"messages": [{"role": "user", "content": "go"}]} if "chat" in path else {"prompt": "go"})
    peer = FakeClient(body, fail_sends_after=3)
    await asyncio.wait_for(long_app(_scope(path, spec_version), peer.receive, peer.send), 10)
    assert peer.messages[0]["status"] == 200
    assert b"[DONE]" not in b"".join(peer.bodies)
    await _assert_aborted(long_engine)


@pytest.mark.asyncio
async def test_disconnect_while_collecting_aborts(long_app: FastAPI, long_engine: BatchingEngine) -> None:
    peer = FakeClient({"model": "fake", "messages": [{"role": "user", "content": "go"}]})
    call = asyncio.ensure_future(long_app(_scope("/v1/chat/completions", "2.3"), peer.receive, peer.send))
    await _wait_running(long_engine)
    peer.gone.set()
    await asyncio.wait_for(call, 10)
    assert peer.messages[0]["status"] == 499
    await _assert_aborted(long_engine)


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True])
async def test_cancelled_request_aborts(long_app: FastAPI, long_engine: BatchingEngine, stream: bool) -> None:
    peer = FakeClient({"model": "fake", "messages": [{"role": "user", "content": "go"}], "stream": stream})
    call = asyncio.ensure_future(long_app(_scope("/v1/chat/completions", "2.3"), peer.receive, peer.send))
    await _wait_running(long_engine)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await _assert_aborted(long_engine)


class FailingBackend(FakeBackend):
    """Decodes a few steps, then every step fails."""

    def __init__(self, num_ok_steps: int) -> None:
        super().__init__(num_ctx=2048)
        self.num_ok_steps = num_ok_steps

    def step(self, entries: list[BatchEntry], adapters: tuple[Adapter, ...] = ()) -> list[int | None]:
        if len(self.steps) >= self.num_ok_steps:
            raise RuntimeError("decode failed")
        return super().step(entries, adapters)


@pytest_asyncio.fixture
async def failing_client() -> AsyncIterator[httpx.AsyncClient]:
    engine = BatchingEngine(FailingBackend(num_ok_steps=4))
    model = LoadedModel(name="fake", engine=engine, template=ChatTemplate(None))
    app = create_app(static_service([model]), ServerConfig())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
        yield client
    engine.close()


@pytest.mark.asyncio
async def test_engine_failure_mid_stream_sends_error_event(failing_client: httpx.AsyncClient) -> None:
    request = {"model": "fake", "messages": [{"role": "user", "content": "go"}], "stream": True}
    response = await failing_client.post("/v1/chat/completions", json=request)
    assert response.status_code == 200
    events = sse_events(response.text)
    assert events[-1] != "[DONE]"
    assert_openai_error(json.loads(events[-1]), error_type="server_error")
    assert all("error" not in json.loads(e) for e in events[:-1])


@pytest.mark.asyncio
async def test_engine_failure_without_stream_is_500(failing_client: httpx.AsyncClient) -> None:
    request = {"model": "fake", "messages": [{"role": "user", "content": "go"}]}
    response = await failing_client.post("/v1/chat/completions", json=request)
    assert response.status_code == 500
    assert "decode failed" in assert_openai_error(response.json(), error_type="server_error")["message"]


@pytest.mark.parametrize("text", ["", "plain", 'quo"te\\', "ünï😀", "\n\x00\t", HOLE])
def test_text_frame_equals_full_encoding(text: str) -> None:
    template = {"id": "x", "choices": [{"index": 0, "delta": {"content": HOLE}, "finish_reason": None}]}
    frame = TextFrame(template)(text)
    expected = {"id": "x", "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    assert frame == f"data: {dumps(expected)}\n\n".encode()
    assert json.loads(frame[len(b"data: ") :]) == expected


@pytest.mark.asyncio
async def test_until_disconnect_returns_result() -> None:
    async def never() -> dict[str, Any]:
        await asyncio.Event().wait()
        return {}

    async def work() -> int:
        return 42

    assert await until_disconnect(work(), never) == 42
