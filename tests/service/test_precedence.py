"""Option precedence, resolved once in the service: request → the model's Modelfile PARAMETERs → its recommended
sampling → the server's defaults, from per-model settings read once per version of the model's manifest."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from lmserve.config import ServerConfig
from lmserve.engine.protocol import Engine
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.fake import FakeBackend
from lmserve.http.app import create_app
from lmserve.service import Service
from lmserve.service.catalog import ModelSettings, StoreCatalog
from lmserve.service.precedence import Precedence
from lmserve.service.residency import LoadPlan, Residency
from lmserve.store.modelfile import Modelfile
from lmserve.store.store import Store
from lmserve.types import LoadOptions, RequestOptions, SamplingParams
from tests.tiny_gguf import write_tiny_llama

USER = [{"role": "user", "content": "hi"}]
STREAMED: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"messages": USER}),
    ("/v1/completions", {"prompt": "hi"}),
    ("/api/chat", {"messages": USER}),
    ("/api/generate", {"prompt": "hi"}),
    ("/v1/messages", {"messages": USER, "max_tokens": 4}),
    ("/v1/responses", {"input": "hi", "store": False}),
]  # fmt: skip


def model(parameters: dict[str, Any], recommended: dict[str, Any]) -> ModelSettings:
    def never(options: LoadOptions) -> LoadPlan:
        raise AssertionError("not planned")

    return ModelSettings("m:latest", parameters, recommended, has_vision=False, plan=never)


MODELFILE = {"temperature": 0.2, "top_k": 5, "num_ctx": 512, "stop": ["<end>"]}
RECOMMENDED = {"temperature": 0.6, "min_p": 0.1, "top_k": 20}
SAMPLING: list[tuple[RequestOptions, dict[str, Any]]] = [
    # (what the request set, the fields it samples with that are not SamplingParams' own defaults; the Modelfile's
    # num_ctx is the context the request runs within)
    (RequestOptions(),
     {"temperature": 0.2, "top_k": 5, "min_p": 0.1, "stop": ["<end>"], "max_tokens": 9, "context_limit": 512}),
    (RequestOptions({"temperature": 1.0, "stop": ["x"]}),
     {"temperature": 1.0, "top_k": 5, "min_p": 0.1, "stop": ["x"], "max_tokens": 9, "context_limit": 512}),
    (RequestOptions({"num_predict": None}),
     {"temperature": 0.2, "top_k": 5, "min_p": 0.1, "stop": ["<end>"], "context_limit": 512}),
    (RequestOptions(defaults="native"),  # the local runner's defaults under what the model says
     {"temperature": 0.2, "top_k": 5, "min_p": 0.1, "stop": ["<end>"], "max_tokens": 9, "top_p": 0.9,
      "repeat_penalty": 1.1, "context_limit": 512}),
]  # fmt: skip


@pytest.mark.parametrize(("asked", "expected"), SAMPLING)
def test_sampling_is_the_request_over_the_modelfile_over_the_weights_over_the_server(
    asked: RequestOptions, expected: dict[str, Any]
) -> None:
    base = SamplingParams(grammar="root ::= \"x\"", logprobs=2)
    params = Precedence(n_predict=9).sampling(model(MODELFILE, RECOMMENDED), asked, base)
    assert params == SamplingParams(**{"grammar": base.grammar, "logprobs": 2, **expected})
    assert base == SamplingParams(grammar=base.grammar, logprobs=2)  # the request's record is not changed


@pytest.mark.parametrize(("asked", "expected"), [
    (RequestOptions(), LoadOptions(num_ctx=512, num_threads=2)),
    (RequestOptions({"num_ctx": 1024, "temperature": 0.5}), LoadOptions(num_ctx=1024, num_threads=2)),
    (RequestOptions({"num_gpu": 3}, "native"), LoadOptions(num_ctx=512, num_threads=2, num_gpu_layers=3)),
])  # fmt: skip
def test_load_options_are_the_request_over_the_modelfile_over_the_server(
    asked: RequestOptions, expected: LoadOptions
) -> None:
    server = LoadOptions(num_ctx=4096, num_threads=2)
    assert Precedence(server).load(model(MODELFILE, RECOMMENDED), asked) == expected


class StoreSpy:
    """Counts what a request costs the store: manifest reads, lock takings, cheap manifest checks."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts = {"reads": 0, "locks": 0, "checks": 0}
        for method, kind in (("_load", "reads"), ("_lock", "locks"), ("stamp", "checks")):
            monkeypatch.setattr(Store, method, self._counted(getattr(Store, method), kind))

    def _counted(self, method: Callable[..., Any], kind: str) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.counts[kind] += 1
            return method(*args, **kwargs)

        return counted

    def reset(self) -> None:
        self.counts = dict.fromkeys(self.counts, 0)


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    opened: list[Engine] = []
    yield opened
    for engine in opened:
        engine.close()


@pytest.fixture
def service(tmp_path: Path, engines: list[Engine]) -> Iterator[Service]:
    weights = tmp_path / "tiny.gguf"
    write_tiny_llama(weights)

    def open_fake(path: Path, options: LoadOptions) -> Engine:
        engine = BatchingEngine(FakeBackend(num_ctx=2048, num_parallel=4))
        engines.append(engine)
        return engine

    catalog = StoreCatalog(Store(tmp_path / "store"), open_fake)
    catalog.create("tiny", Modelfile(from_=str(weights), parameters={"temperature": 0.0}))
    service = Service(catalog, Residency(catalog.plan, keep_alive=None))
    yield service
    service.close()


@pytest_asyncio.fixture
async def client(service: Service) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(service, ServerConfig())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
        yield client


async def streamed(client: httpx.AsyncClient, route: str, body: dict[str, Any]) -> None:
    async with client.stream("POST", route, json={"model": "tiny", "stream": True, **body}) as r:
        assert r.status_code == 200, await r.aread()
        await r.aread()


@pytest.mark.parametrize(("route", "body"), STREAMED)
async def test_a_warm_streamed_request_reads_no_manifest_and_takes_no_lock(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch, route: str, body: dict[str, Any]
) -> None:
    await streamed(client, route, body)  # loads the model and reads its settings
    spy = StoreSpy(monkeypatch)
    await streamed(client, route, body)
    assert spy.counts["reads"] == 0 and spy.counts["locks"] == 0, spy.counts
    assert spy.counts["checks"] <= 1, spy.counts


async def generated(client: httpx.AsyncClient, **options: Any) -> int:
    r = await client.post("/api/generate", json={"model": "tiny", "prompt": "hi", "stream": False,
                                                 "options": options})
    assert r.status_code == 200, r.text
    count: int = r.json()["eval_count"]
    return count


async def test_a_model_created_again_is_seen_by_the_next_request(client: httpx.AsyncClient) -> None:
    assert await generated(client, num_predict=3) == 3
    r = await client.post("/api/create", json={"model": "tiny", "from": "tiny", "parameters": {"num_predict": 5}})
    assert r.status_code == 200, r.text
    assert await generated(client) == 5
    r = await client.post("/api/create", json={"model": "tiny", "from": "tiny", "parameters": {"num_predict": 2}})
    assert r.status_code == 200, r.text
    assert await generated(client) == 2
    assert await generated(client, num_predict=4) == 4  # the request's own option wins over the model's


async def test_a_deleted_model_is_not_found_by_the_next_request(client: httpx.AsyncClient) -> None:
    assert await generated(client, num_predict=1) == 1
    r = await client.request("DELETE", "/api/delete", json={"model": "tiny"})
    assert r.status_code == 200, r.text
    r = await client.post("/api/generate", json={"model": "tiny", "prompt": "hi", "stream": False})
    assert r.status_code == 404, r.text


async def test_a_smaller_or_equal_num_ctx_reloads_nothing_and_limits_the_request(
        client: httpx.AsyncClient, engines: list[Engine]) -> None:
    assert await generated(client, num_predict=2) == 2  # loads at the automatic context (2048 on the fake)
    for num_ctx in (2048, 1000, 64, 2047):
        assert await generated(client, num_predict=2, num_ctx=num_ctx) == 2
    assert len(engines) == 1
    r = await client.post("/api/generate", json={"model": "tiny", "prompt": "hi", "stream": False, "raw": True,
                                                 "options": {"num_ctx": 5, "num_predict": 50}})
    assert r.status_code == 200 and r.json()["done_reason"] == "length", r.text
    assert r.json()["prompt_eval_count"] + r.json()["eval_count"] == 5  # the reply ends where the context does
    r = await client.post("/api/generate", json={"model": "tiny", "prompt": "hi " * 20, "stream": False,
                                                 "options": {"num_ctx": 8}})
    assert r.status_code == 400 and "context is 8 tokens" in r.json()["error"], r.text
    assert len(engines) == 1


def test_within_context_caps_the_reply_and_refuses_a_prompt_that_does_not_fit() -> None:
    from lmserve.errors import ContextOverflow
    from lmserve.service.precedence import within_context

    info = BatchingEngine(FakeBackend(num_ctx=100, num_parallel=1))
    try:
        unlimited = SamplingParams(context_limit=None, max_tokens=None)
        assert within_context(info.info, 10, unlimited) is unlimited
        assert within_context(info.info, 10, SamplingParams(context_limit=100)).max_tokens is None  # the engine's
        assert within_context(info.info, 10, SamplingParams(context_limit=50)).max_tokens == 40
        assert within_context(info.info, 10, SamplingParams(context_limit=50, max_tokens=5)).max_tokens == 5
        with pytest.raises(ContextOverflow):
            within_context(info.info, 50, SamplingParams(context_limit=50))
    finally:
        info.close()
