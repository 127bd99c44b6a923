"""The route table's edges: request validation, error bodies, authentication, health."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from api_wire import API_KEY, assert_openai_error
from fastapi import FastAPI
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute

from lmserve.service import Service

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "fake", "messages": USER, "max_tokens": 4, **fields}


BAD_CHAT_REQUESTS: list[tuple[str, Any, str | None]] = [
    # (case, body (bytes sent as is, dict as JSON), expected param)
    ("malformed json", b'{"model": "fake", "messages": [', None),
    ("not an object", b"[1, 2]", None),
    ("empty body", b"", None),
    ("missing model", {"messages": USER}, "model"),
    ("model not a string", chat(model=5), "model"),
    ("missing messages", {"model": "fake"}, "messages"),
    ("empty messages", chat(messages=[]), "messages"),
    ("bad role", chat(messages=[{"role": "robot", "content": "hi"}]), "messages"),
    ("missing role", chat(messages=[{"content": "hi"}]), "messages"),
    ("user content null", chat(messages=[{"role": "user", "content": None}]), "messages"),
    ("unknown content part", chat(messages=[{"role": "user", "content": [{"type": "audio"}]}]), "messages"),
    ("temperature not a number", chat(temperature="hot"), "temperature"),
    ("temperature too high", chat(temperature=2.5), "temperature"),
    ("top_p negative", chat(top_p=-0.1), "top_p"),
    ("min_p above one", chat(min_p=1.5), "min_p"),
    ("repeat_penalty zero", chat(repeat_penalty=0), "repeat_penalty"),
    ("max_tokens negative", chat(max_tokens=-1), "max_tokens"),
    ("n=0", chat(n=0), "n"),
    ("n above 128", chat(n=129), "n"),
    ("bad logit_bias key", chat(logit_bias={"abc": 1}), "logit_bias"),
    ("logit_bias out of range", chat(logit_bias={"5": 1000}), "logit_bias"),
    ("stop of wrong type", chat(stop=5), "stop"),
    ("stop list of wrong type", chat(stop=[1, 2]), "stop"),
    ("too many stops", chat(stop=[str(i) for i in range(17)]), "stop"),
    ("stream not a bool", chat(stream="maybe"), "stream"),
    ("top_logprobs without logprobs", chat(top_logprobs=2), "top_logprobs"),
    ("top_logprobs too high", chat(top_logprobs=50), "top_logprobs"),
    ("bad tool", chat(tools=[{"type": "function"}]), "tools"),
    ("bad tool_choice", chat(tool_choice="sometimes"), "tool_choice"),
    ("bad response_format", chat(response_format={"type": "yaml"}), "response_format"),
    ("image not base64", chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}]}]), "messages"),
    ("image of no vision model", chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]), "messages"),
    ("image url scheme", chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]), "messages"),
]  # fmt: skip


def _send(client: httpx.AsyncClient, path: str, body: Any) -> Any:
    if isinstance(body, bytes):
        return client.post(path, content=body, headers={"content-type": "application/json"})
    return client.post(path, json=body)


@pytest.mark.asyncio
@pytest.mark.parametrize(("case", "body", "param"), BAD_CHAT_REQUESTS, ids=[c[0] for c in BAD_CHAT_REQUESTS])
async def test_bad_chat_request_is_400(client: httpx.AsyncClient, case: str, body: Any, param: str | None) -> None:
    response = await _send(client, CHAT, body)
    assert response.status_code == 400, response.text
    error = assert_openai_error(response.json(), error_type="invalid_request_error")
    assert error["param"] == param


BAD_COMPLETIONS: list[tuple[str, dict[str, Any], str]] = [
    ("missing prompt", {"model": "fake"}, "prompt"),
    ("a token id outside the vocabulary", {"model": "fake", "prompt": [1, 2, 300]}, "prompt"),
    ("a negative token id", {"model": "fake", "prompt": [[1], [-1]]}, "prompt"),
    ("booleans as token ids", {"model": "fake", "prompt": [True, 2]}, "prompt"),
    ("texts and token ids mixed", {"model": "fake", "prompt": ["a", [2]]}, "prompt"),
    ("an empty token id prompt", {"model": "fake", "prompt": [[1], []]}, "prompt"),
    ("token ids with a suffix", {"model": "fake", "prompt": [1, 2], "suffix": "b"}, "suffix"),
    ("suffix", {"model": "fake", "prompt": "a", "suffix": "b"}, "suffix"),
    ("empty prompt", {"model": "fake", "prompt": ""}, "prompt"),
    ("n=0", {"model": "fake", "prompt": "a", "n": 0}, "n"),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(("case", "body", "param"), BAD_COMPLETIONS, ids=[c[0] for c in BAD_COMPLETIONS])
async def test_bad_completion_request_is_400(
    client: httpx.AsyncClient, case: str, body: dict[str, Any], param: str
) -> None:
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert assert_openai_error(response.json())["param"] == param


@pytest.mark.asyncio
async def test_context_overflow_is_400(client: httpx.AsyncClient) -> None:
    response = await client.post(CHAT, json=chat(messages=[{"role": "user", "content": "x" * 3000}]))
    assert response.status_code == 400
    error = assert_openai_error(response.json(), error_type="invalid_request_error")
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "messages"


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", CHAT, {"model": "nope", "messages": USER}),
        ("POST", CHAT, {"model": "nope", "messages": USER, "stream": True}),
        ("POST", "/v1/completions", {"model": "nope", "prompt": "hi"}),
        ("GET", "/v1/models/nope", None),
        ("GET", "/v1/models/org/nope:Q4_K_M", None),
    ],
)
async def test_unknown_model_is_404(client: httpx.AsyncClient, method: str, path: str, body: Any) -> None:
    response = await client.request(method, path, json=body)
    assert response.status_code == 404
    assert response.headers["content-type"] == "application/json"
    error = assert_openai_error(response.json(), error_type="not_found_error")
    assert error["code"] == "model_not_found"
    assert error["param"] == "model"


@pytest.mark.asyncio
async def test_unknown_route_is_404_in_openai_shape(client: httpx.AsyncClient) -> None:
    response = await client.get("/v1/nothing-here")
    assert response.status_code == 404
    assert_openai_error(response.json(), error_type="not_found_error")


@pytest.mark.asyncio
async def test_unknown_native_route_is_404_in_native_shape(client: httpx.AsyncClient) -> None:
    response = await client.get("/api/nothing-here")
    assert response.status_code == 404
    body = response.json()
    assert set(body) == {"error"} and isinstance(body["error"], str)


@pytest.mark.asyncio
async def test_wrong_method_is_405_in_openai_shape(client: httpx.AsyncClient) -> None:
    response = await client.put(CHAT)  # (GET lists the stored chat completions)
    assert response.status_code == 405
    assert_openai_error(response.json(), error_type="invalid_request_error")


@pytest.mark.asyncio
async def test_unexpected_exception_is_500_with_body(
    client: httpx.AsyncClient, service: Service, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def explode(*_: Any) -> None:
        raise RuntimeError("kaboom")

    monkeypatch.setattr(service.generation, "chat", explode)
    response = await client.post(CHAT, json=chat())
    assert response.status_code == 500
    error = assert_openai_error(response.json(), error_type="server_error")
    assert "kaboom" not in error["message"]
    assert any(r.exc_info and "kaboom" in str(r.exc_info[1]) for r in caplog.records)


@pytest.mark.asyncio
async def test_health(client: httpx.AsyncClient) -> None:
    response = await client.get("/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


AUTH_CASES: list[tuple[str, dict[str, str], int]] = [
    ("no header", {}, 401),
    ("wrong key", {"Authorization": "Bearer wrong"}, 401),
    ("wrong scheme", {"Authorization": f"Basic {API_KEY}"}, 401),
    ("key without scheme", {"Authorization": API_KEY}, 401),
    ("empty bearer", {"Authorization": "Bearer "}, 401),
    ("Key scheme", {"Authorization": f"Key {API_KEY}"}, 200),
    ("Bearer scheme", {"Authorization": f"Bearer {API_KEY}"}, 200),
    ("lowercase scheme", {"Authorization": f"bearer {API_KEY}"}, 200),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(("case", "headers", "status"), AUTH_CASES, ids=[c[0] for c in AUTH_CASES])
async def test_auth(secured_client: httpx.AsyncClient, case: str, headers: dict[str, str], status: int) -> None:
    response = await secured_client.get("/v1/models", headers=headers)
    assert response.status_code == status
    if status == 401:
        assert_openai_error(response.json(), error_type="authentication_error")


@pytest.mark.asyncio
async def test_auth_guards_chat_and_unknown_routes(secured_client: httpx.AsyncClient) -> None:
    for path in (CHAT, "/v1/nothing-here"):
        response = await secured_client.post(path, json=chat())
        assert response.status_code == 401
        assert_openai_error(response.json(), error_type="authentication_error")
    native = await secured_client.get("/api/tags")
    assert native.status_code == 401
    assert isinstance(native.json()["error"], str)


@pytest.mark.asyncio
async def test_health_needs_no_key(secured_client: httpx.AsyncClient) -> None:
    response = await secured_client.get("/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


@pytest.mark.asyncio
async def test_authorized_chat(secured_client: httpx.AsyncClient) -> None:
    response = await secured_client.post(CHAT, json=chat(), headers={"Authorization": f"Key {API_KEY}"})
    assert response.status_code == 200
    assert response.json()["choices"][0]["finish_reason"] == "length"


def test_no_route_hops_to_a_worker_thread_for_its_handler_or_dependencies(app: FastAPI) -> None:
    """FastAPI runs a plain function handler or dependency on a worker thread: a hop per request (and per
    dependency) that cost more than the rest of a short request's handling. Every one is a coroutine."""
    def calls(dependant: Dependant) -> list[Callable[..., Any]]:
        return [dependant.call, *(call for dep in dependant.dependencies for call in calls(dep))] \
            if dependant.call is not None else []

    plain = [f"{route.path}: {call.__name__}" for route in app.routes if isinstance(route, APIRoute)
             for call in calls(route.dependant) if not inspect.iscoroutinefunction(call)]
    assert plain == []
