"""/health (the resident models can answer) and /livez (the process is up), and what a request meets when its
model's engine dies: each dialect's stream ends with its own error event naming the cause, a whole answer is a 503
with Retry-After, /health is 503 while the engine is down and 200 once it is back, and the next request answers
from a new engine. The fake engine dies through its backend's `fault` (engine/slots/fake.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from api_wire import API_KEY, assert_openai_error, sse_events

from lmserve.chat.template import ChatTemplate
from lmserve.config import ServerConfig
from lmserve.engine.protocol import Engine
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.fake import FakeBackend
from lmserve.http.app import create_app
from lmserve.service import Service
from lmserve.service.catalog import StaticCatalog
from lmserve.service.residency import LoadedModel, LoadPlan, Residency, WeightsKey
from lmserve.types import LoadOptions

pytestmark = pytest.mark.asyncio

USER = [{"role": "user", "content": "hello"}]
FAULT = "the device is lost"
STOPPED = (f"the engine serving 'fake' stopped (its engine thread failed: RuntimeError: {FAULT}); it is being "
           "restarted: retry shortly")


class Engines:
    """The model 'fake', on a fresh fake engine each time it is opened (a restart gets a new one)."""

    def __init__(self) -> None:
        self.opened: list[BatchingEngine] = []

    def plan(self, name: str, options: LoadOptions) -> LoadPlan:
        def open_engine() -> Engine:
            engine = BatchingEngine(FakeBackend(num_ctx=2048, step_delay=0.002))
            self.opened.append(engine)
            return engine

        return LoadPlan(WeightsKey("fake", LoadOptions()), open_engine, self.bind)

    @staticmethod
    def bind(engine: Engine) -> LoadedModel:
        return LoadedModel(name="fake", engine=engine, template=ChatTemplate(None))



class RestartingCatalog(StaticCatalog):
    """The fixed model 'fake', loaded through `engines`: a restart opens a new engine."""

    def __init__(self, engines: Engines) -> None:
        super().__init__([engines.bind(engines.plan("fake", LoadOptions()).open())])
        self._engines = engines

    def plan(self, name: str, options: LoadOptions) -> LoadPlan:
        return self._engines.plan(name, options)


def break_later(service: Service, seconds: float) -> None:
    """Make the serving engine's backend unusable in `seconds`: its next step fails and its thread ends."""
    [resident] = service.residency.running()
    engine = resident.model.engine
    assert isinstance(engine, BatchingEngine) and isinstance(engine.backend, FakeBackend)
    asyncio.get_running_loop().call_later(seconds, setattr, engine.backend, "fault", FAULT)


@pytest.fixture
async def healing() -> AsyncIterator[tuple[httpx.AsyncClient, Service, Engines]]:
    engines = Engines()
    catalog = RestartingCatalog(engines)
    service = Service(catalog, Residency(engines.plan, keep_alive=None))
    service.residency.release(await service.residency.acquire("fake", LoadOptions()))
    app = create_app(service, ServerConfig(api_key=API_KEY))
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test", headers=headers) as client:
        yield client, service, engines
    service.close()
    for engine in engines.opened:
        engine.close()


async def test_livez_and_health_answer_without_a_key(secured_client: httpx.AsyncClient) -> None:
    live = await secured_client.get("/livez")
    assert (live.status_code, live.json()) == (200, {"status": "alive"})
    health = await secured_client.get("/health")
    assert (health.status_code, health.json()) == (200, {"status": "ok"})


def openai_stream_error(text: str) -> str:
    events = sse_events(text)
    assert events[-1] != "[DONE]"
    return str(assert_openai_error(json.loads(events[-1]), error_type="server_error")["message"])


def anthropic_stream_error(text: str) -> str:
    name, data = text.rstrip("\n").split("\n\n")[-1].split("\n")
    event = json.loads(data.removeprefix("data: "))
    assert name == "event: error" and event["type"] == "error" and event["error"]["type"] == "api_error"
    return str(event["error"]["message"])


def native_stream_error(text: str) -> str:
    last = json.loads(text.splitlines()[-1])
    assert set(last) == {"error"}
    return str(last["error"])


def responses_stream_error(text: str) -> str:
    name, data = text.rstrip("\n").split("\n\n")[-1].split("\n")
    event = json.loads(data.removeprefix("data: "))
    assert name == "event: response.failed" and event["response"]["status"] == "failed"
    return str(event["response"]["error"]["message"])


STREAMS: list[tuple[str, dict[str, Any], Callable[[str], str]]] = [
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 1500}, openai_stream_error),
    ("/v1/completions", {"prompt": "hello", "max_tokens": 1500}, openai_stream_error),
    ("/v1/messages", {"messages": USER, "max_tokens": 1500}, anthropic_stream_error),
    ("/api/chat", {"messages": USER, "options": {"num_predict": 1500}}, native_stream_error),
    ("/v1/responses", {"input": "hello", "max_output_tokens": 1500}, responses_stream_error),
]


@pytest.mark.parametrize(("path", "body", "error_of"), STREAMS, ids=[s[0] for s in STREAMS])
async def test_an_engine_that_dies_mid_stream_ends_the_stream_with_the_dialects_error_and_the_next_request_answers(
    healing: tuple[httpx.AsyncClient, Service, Engines], path: str, body: dict[str, Any],
    error_of: Callable[[str], str],
) -> None:
    client, service, engines = healing
    break_later(service, 0.1)  # 1500 tokens take the fake at least 3 s
    response = await client.post(path, json={"model": "fake", "stream": True, **body})
    assert response.status_code == 200
    assert error_of(response.text) == STOPPED
    again = await client.post("/v1/chat/completions", json={"model": "fake", "messages": USER, "max_tokens": 3})
    assert again.status_code == 200, again.text
    assert len(engines.opened) == 3  # the catalog's, the one that died, the one that answers now


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat"])
async def test_an_engine_that_dies_under_a_whole_answer_is_a_503_with_retry_after(
    healing: tuple[httpx.AsyncClient, Service, Engines], path: str,
) -> None:
    client, service, _ = healing
    break_later(service, 0.1)
    response = await client.post(path, json={"model": "fake", "messages": USER, "stream": False, "max_tokens": 1500,
                                             "options": {"num_predict": 1500}})
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    body = response.json()
    if path.startswith("/api/"):
        assert body == {"error": STOPPED}
    else:
        assert assert_openai_error(body, error_type="server_error") == {
            "message": STOPPED, "type": "server_error", "param": "model", "code": "engine_stopped"}


async def test_health_is_503_with_the_reason_while_the_engine_is_down_and_200_once_it_is_back(
    healing: tuple[httpx.AsyncClient, Service, Engines],
) -> None:
    client, service, _ = healing
    assert (await client.post("/v1/chat/completions", json={"model": "fake", "messages": USER})).status_code == 200
    assert (await client.get("/health")).json() == {"status": "ok"}
    break_later(service, 0)
    response = await client.post("/api/generate", json={"model": "fake", "prompt": "hi", "stream": False})
    assert response.status_code == 503
    health = await client.get("/health")
    reason = f"its engine stopped (its engine thread failed: RuntimeError: {FAULT}); restarting"
    assert health.status_code == 503 and health.headers["retry-after"] == "1"
    assert health.json() == {"status": "restarting", "reason": f"fake: {reason}",
                             "models": {"fake": {"state": "restarting", "reason": reason}}}
    assert (await client.get("/livez")).status_code == 200
    await asyncio.gather(*service.residency.heal())
    health = await client.get("/health")
    assert (health.status_code, health.json()) == (200, {"status": "ok"})


async def test_decode_health_probes_each_idle_model_and_needs_the_key(secured_client: httpx.AsyncClient) -> None:
    assert (await secured_client.get("/health/decode")).status_code == 401
    headers = {"Authorization": f"Bearer {API_KEY}"}
    nothing_loaded = await secured_client.get("/health/decode", headers=headers)
    assert (nothing_loaded.status_code, nothing_loaded.json()) == (200, {"status": "ok", "models": {}})
    await secured_client.post("/v1/completions", json={"model": "fake-alias", "prompt": "hi", "max_tokens": 1},
                              headers=headers)  # an alias loads its model's name
    response = await secured_client.get("/health/decode", headers=headers)
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok" and set(body["models"]) == {"fake"}
    assert {entry["state"] for entry in body["models"].values()} == {"ok"}
    assert {entry["check"] for entry in body["models"].values()} == {"probed"}
    for timeout in ("0", "-1", "301", "soon"):
        refused = await secured_client.get("/health/decode", params={"timeout": timeout}, headers=headers)
        assert refused.status_code == 400, (timeout, refused.text)
        assert_openai_error(refused.json(), error_type="invalid_request_error")


async def test_decode_health_is_503_naming_a_model_whose_step_never_returns(
        client: httpx.AsyncClient, engine: BatchingEngine) -> None:
    assert isinstance(engine.backend, FakeBackend)
    await client.post("/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 1})
    engine.backend.unpaused.clear()
    try:
        response = await client.get("/health/decode", params={"timeout": "0.3"})
        assert (await client.get("/health")).status_code == 200  # /health only says no engine failed
    finally:
        engine.backend.unpaused.set()
    assert response.status_code == 503 and response.headers["Retry-After"] == "1"
    body = response.json()
    assert body["status"] == "stuck" and body["models"]["fake"]["state"] == "stuck"
    assert body["reason"].startswith("fake: no decode step in 0.3 s")
    assert (await client.get("/health/decode")).json()["status"] == "ok"
