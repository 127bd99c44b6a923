"""End to end over a real socket: uvicorn serving the app, a client that hangs up mid-stream."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import pytest_asyncio
import uvicorn

from lmserve.chat.template import ChatTemplate
from lmserve.config import ServerConfig
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.fake import FakeBackend
from lmserve.http.app import create_app
from lmserve.service import static_service
from lmserve.service.residency import LoadedModel


@pytest.fixture
def long_engine() -> Iterator[BatchingEngine]:
    engine = BatchingEngine(FakeBackend(num_ctx=10_000_000, num_parallel=2))
    yield engine
    engine.close()


@pytest_asyncio.fixture
async def base_url(long_engine: BatchingEngine) -> AsyncIterator[str]:
    model = LoadedModel(name="fake", engine=long_engine, template=ChatTemplate(None))
    app = create_app(static_service([model]), ServerConfig())
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    async with asyncio.timeout(10):
        while not server.started:
            await asyncio.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    await task
    sock.close()


async def _first_lines(response: httpx.Response, num_lines: int) -> AsyncIterator[str]:
    count = 0
    async for line in response.aiter_lines():
        yield line
        count += 1
        if count == num_lines:
            return


async def _wait_idle(engine: BatchingEngine) -> None:
    async with asyncio.timeout(5):
        while engine.num_running or engine.num_waiting:
            await asyncio.sleep(0.01)


@pytest.mark.asyncio
async def test_hang_up_mid_stream_aborts(base_url: str, long_engine: BatchingEngine) -> None:
    body = {"model": "fake", "messages": [{"role": "user", "content": "go"}], "stream": True}
    async with (
        httpx.AsyncClient(base_url=base_url) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        events = [line async for line in _first_lines(response, 6) if line]
        assert all(e.startswith("data: {") for e in events)
        assert long_engine.num_running == 1
    await _wait_idle(long_engine)


@pytest.mark.asyncio
async def test_hang_up_while_waiting_aborts(base_url: str, long_engine: BatchingEngine) -> None:
    body = {"model": "fake", "messages": [{"role": "user", "content": "go"}]}
    async with httpx.AsyncClient(base_url=base_url) as client:
        request = asyncio.create_task(client.post("/v1/chat/completions", json=body))
        async with asyncio.timeout(5):
            while not long_engine.num_running:
                await asyncio.sleep(0.01)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
    await _wait_idle(long_engine)
