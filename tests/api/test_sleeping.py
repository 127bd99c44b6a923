"""POST /sleep, POST /wake_up and GET /is_sleeping (http/sleeping.py) in process, on the fake engine: the levels, a
request that wakes the model, and the refusals in OpenAI's error shape: a bad level, a model not loaded, one busy,
no API key."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from api_wire import API_KEY, assert_openai_error

from lmserve.config import ServerConfig
from lmserve.http.app import create_app
from lmserve.service import Service
from lmserve.service.residency import Residency
from lmserve.types import LoadOptions
from tests.api.test_health import USER, Engines, RestartingCatalog

pytestmark = pytest.mark.asyncio


@pytest.fixture
async def client() -> AsyncIterator[tuple[httpx.AsyncClient, Engines]]:
    engines = Engines()
    service = Service(RestartingCatalog(engines), Residency(engines.plan, keep_alive=None))
    service.residency.release(await service.residency.acquire("fake", LoadOptions()))
    app = create_app(service, ServerConfig(api_key=API_KEY))
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test", headers=headers) as client:
        yield client, engines
    service.close()
    for engine in engines.opened:
        engine.close()


async def chat(client: httpx.AsyncClient, max_tokens: int = 3) -> httpx.Response:
    return await client.post("/v1/chat/completions", json={"model": "fake", "messages": USER, "max_tokens": max_tokens})


async def test_level_1_sleeps_and_a_chat_wakes_the_model(client: tuple[httpx.AsyncClient, Engines]) -> None:
    http, _ = client
    slept = await http.post("/sleep")  # level 1 unless asked, as vLLM's
    assert (slept.status_code, slept.json()) == (200, {"sleeping": {"fake": 1}})
    assert (await http.get("/is_sleeping")).json() == {"is_sleeping": True, "sleeping": {"fake": 1}}
    assert (await http.get("/health")).status_code == 200
    assert (await chat(http)).status_code == 200
    assert (await http.get("/is_sleeping", params={"model": "fake"})).json()["is_sleeping"] is False


async def test_level_2_closes_the_engine_and_wake_up_opens_another(client: tuple[httpx.AsyncClient, Engines]) -> None:
    http, engines = client
    opened = len(engines.opened)
    assert (await http.post("/sleep", params={"level": 2, "model": "fake"})).json() == {"sleeping": {"fake": 2}}
    assert (await http.get("/api/ps")).json()["models"] == []
    woken = await http.post("/wake_up", params={"model": "fake"})
    assert (woken.status_code, woken.json()) == (200, {"woken": ["fake"], "sleeping": {}})
    assert len(engines.opened) == opened + 1
    assert [model["name"] for model in (await http.get("/api/ps")).json()["models"]] == ["fake"]


@pytest.mark.parametrize(("params", "status", "param", "says"), [
    ({"level": 3}, 400, "level", "less than or equal to 2"),
    ({"level": "deep"}, 400, "level", "valid integer"),
    ({"model": "nobody"}, 404, "model", "model 'nobody' not found"),
])
async def test_a_bad_request_is_a_4xx_naming_why(client: tuple[httpx.AsyncClient, Engines], params: dict[str, object],
                                                 status: int, param: str, says: str) -> None:
    http, _ = client
    refused = await http.post("/sleep", params=params)
    assert refused.status_code == status, refused.text
    error = assert_openai_error(refused.json())
    assert error["param"] == param and says in str(error["message"])


async def test_a_model_serving_requests_is_a_409_and_sleeps_once_they_are_done(
    client: tuple[httpx.AsyncClient, Engines],
) -> None:
    http, _ = client
    running = asyncio.ensure_future(chat(http, max_tokens=200))
    await asyncio.sleep(0.1)
    busy = await http.post("/sleep")
    assert busy.status_code == 409 and "serving requests" in assert_openai_error(busy.json())["message"]
    assert (await running).status_code == 200
    assert (await http.post("/sleep")).status_code == 200


async def test_the_routes_need_the_api_key(client: tuple[httpx.AsyncClient, Engines]) -> None:
    http, _ = client
    for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")):
        response = await http.request(method, path, headers={"Authorization": ""})
        assert response.status_code == 401, path
