"""OpenTelemetry traces (lmserve/http/tracing.py): the app over the engine loop and the fake backend, exporting with
the real OTLP exporter to a real collector in the test (an HTTP server decoding OTLP's protobuf messages): a streamed
chat's span continues the caller's `traceparent`, is named for its route, carries the model, engine, tokens, time to
first token and finish reason, and has queue, prefill and decode children inside it; without an endpoint nothing is
installed."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
from fastapi import FastAPI

from lmserve.config import ServerConfig
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.http.app import create_app
from lmserve.http.tracing import TracingMiddleware, traces_endpoint
from lmserve.service import Service
from tests.otlp_collector import Collector, attributes

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


@pytest.fixture
def collector() -> Iterator[Collector]:
    server = Collector().start()
    yield server
    server.stop()


@pytest_asyncio.fixture
async def traced(service: Service, collector: Collector) -> AsyncIterator[tuple[httpx.AsyncClient, FastAPI]]:
    app = create_app(service, ServerConfig(otlp_traces_endpoint=collector.url))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
        yield client, app
    app.state.tracing.shutdown()


def spans_of(app: FastAPI, collector: Collector, count: int) -> list[Any]:
    app.state.tracing.force_flush()
    return collector.wait_for(lambda spans: len(spans) >= count, 10)


@pytest.mark.asyncio
async def test_a_streamed_chat_is_a_span_of_its_route_continuing_the_callers_trace_with_its_generations_parts(
        traced: tuple[httpx.AsyncClient, FastAPI], collector: Collector, engine: BatchingEngine) -> None:
    client, app = traced
    body = {"model": "fake", "stream": True, "max_tokens": 12, "messages": [{"role": "user", "content": "hi"}]}
    async with client.stream("POST", "/v1/chat/completions", json=body,
                             headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}) as response:
        assert response.status_code == 200
        assert "[DONE]" in "".join([part async for part in response.aiter_text()])
    spans = spans_of(app, collector, 4)
    assert collector.paths == ["/v1/traces"]
    [server] = [span for span in spans if span.name == "POST /v1/chat/completions"]
    assert (server.trace_id.hex(), server.parent_span_id.hex()) == (TRACE_ID, PARENT_ID)
    found = attributes(server)
    assert found["http.route"] == "/v1/chat/completions" and found["http.response.status_code"] == 200
    assert found["gen_ai.request.model"] == "fake" and found["lmserve.engine"] == engine.info.engine
    assert found["gen_ai.usage.completion_tokens"] == 12 and found["gen_ai.usage.prompt_tokens"] > 0
    assert found["gen_ai.response.finish_reasons"] == ["length"]
    assert 0 < found["gen_ai.latency.time_to_first_token"] <= found["gen_ai.latency.e2e"]
    children = {span.name: span for span in spans if span.parent_span_id == server.span_id}
    assert {"prefill", "decode"} <= set(children) <= {"queue", "prefill", "decode"}
    for child in children.values():
        assert child.trace_id == server.trace_id
        assert server.start_time_unix_nano <= child.start_time_unix_nano <= child.end_time_unix_nano
        assert child.end_time_unix_nano <= server.end_time_unix_nano
    assert children["prefill"].end_time_unix_nano == children["decode"].start_time_unix_nano


@pytest.mark.asyncio
async def test_a_request_without_a_caller_trace_starts_one_named_for_its_route_template(
        traced: tuple[httpx.AsyncClient, FastAPI], collector: Collector) -> None:
    client, app = traced
    assert (await client.get("/v1/models/fake")).status_code == 200
    [span] = spans_of(app, collector, 1)
    assert span.parent_span_id == b"" and len(span.trace_id) == 16
    assert span.name.startswith("GET /v1/models/{") and "gen_ai.request.model" not in attributes(span)


def test_without_an_endpoint_nothing_is_installed(service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    app = create_app(service, ServerConfig())
    assert app.state.tracing is None
    assert all(middleware.cls is not TracingMiddleware for middleware in app.user_middleware)


def test_the_endpoint_from_the_flag_or_otels_variables() -> None:
    assert traces_endpoint(None, {}) is None
    assert traces_endpoint("http://collector:4318", {}) == "http://collector:4318/v1/traces"
    assert traces_endpoint("collector:4318", {}) == "http://collector:4318/v1/traces"
    assert traces_endpoint("https://c.example/otlp/traces", {}) == "https://c.example/otlp/traces"
    assert traces_endpoint(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}) == "http://c:4318/v1/traces"
    assert traces_endpoint(None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/t",
                                  "OTEL_EXPORTER_OTLP_ENDPOINT": "http://d:4318"}) == "http://c:4318/t"
