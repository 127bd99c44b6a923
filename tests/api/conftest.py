"""Fixtures: a real Service over the engine loop and the fake backend, served in-process over ASGI."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import pytest_asyncio
from api_wire import API_KEY
from fastapi import FastAPI

from lmserve.chat.template import ChatTemplate
from lmserve.config import ServerConfig
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.fake import FakeBackend
from lmserve.http.app import create_app
from lmserve.service import Service, static_service
from lmserve.service.residency import LoadedModel


@pytest.fixture
def engine() -> Iterator[BatchingEngine]:
    engine = BatchingEngine(FakeBackend(num_ctx=2048, num_parallel=4))
    yield engine
    engine.close()


@pytest.fixture
def service(engine: BatchingEngine) -> Service:
    model = LoadedModel(name="fake", engine=engine, template=ChatTemplate(None), aliases=("fake-alias",))
    return static_service([model])


@pytest.fixture
def app(service: Service) -> FastAPI:
    return create_app(service, ServerConfig())


@pytest.fixture
def secured_app(service: Service) -> FastAPI:
    return create_app(service, ServerConfig(api_key=API_KEY))


@pytest_asyncio.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
        yield client


@pytest_asyncio.fixture
async def secured_client(secured_app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(secured_app), base_url="http://test") as client:
        yield client
