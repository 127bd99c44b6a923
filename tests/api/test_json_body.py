"""Typed JSON bodies: read as JSON whatever the Content-Type says; a body that is not one is a 400 in the route's
dialect."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

FORM = "application/x-www-form-urlencoded"  # what `curl -d` sends
USER = '[{"role": "user", "content": "hi"}]'


@pytest.mark.parametrize(("path", "body"), [
    ("/api/show", '{"model": "fake"}'),
    ("/api/chat", '{"model": "fake", "messages": ' + USER + ', "stream": false, "options": {"num_predict": 2}}'),
    ("/v1/chat/completions", '{"model": "fake", "messages": ' + USER + ', "max_tokens": 2}'),
    ("/v1/messages", '{"model": "fake", "messages": ' + USER + ', "max_tokens": 2}'),
    ("/tokenize", '{"model": "fake", "content": "hi"}'),
])  # fmt: skip
@pytest.mark.parametrize("content_type", [FORM, "text/plain", None, "application/json; charset=utf-8"])
async def test_a_body_is_json_whatever_its_content_type(
    client: httpx.AsyncClient, path: str, body: str, content_type: str | None
) -> None:
    headers = {"content-type": content_type} if content_type else {}
    r = await client.post(path, content=body.encode(), headers=headers)
    assert r.status_code == 200, r.text


def error_message(path: str, body: Any) -> str:
    """The message of the route's dialect's error body (native, Anthropic or OpenAI), checking its shape."""
    if path.startswith("/api/"):
        assert set(body) == {"error"} and isinstance(body["error"], str)
        return str(body["error"])
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        return str(body["error"]["message"])
    assert body["error"]["type"] == "invalid_request_error"
    return str(body["error"]["message"])


@pytest.mark.parametrize("path", ["/api/chat", "/v1/chat/completions", "/v1/messages", "/v1/responses", "/infill"])
@pytest.mark.parametrize(("content", "says"), [
    (b"{nope", "We could not parse the JSON body of your request: Invalid JSON: key must be a string"),
    (b"", "We could not parse the JSON body of your request: Invalid JSON: EOF while parsing a value"),
    (b'{"model": "fake"', "We could not parse the JSON body of your request: Invalid JSON: EOF"),
    (b"[]", "Invalid request body: Input should be an object"),
    (b"null", "Invalid request body: Input should be an object"),
])  # fmt: skip
async def test_a_body_that_is_not_json_is_a_400_in_the_dialects_shape(
    client: httpx.AsyncClient, path: str, content: bytes, says: str
) -> None:
    r = await client.post(path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert error_message(path, r.json()).startswith(says), r.text


@pytest.mark.parametrize(("path", "param"), [
    ("/v1/chat/completions", "messages"), ("/v1/completions", "prompt"), ("/v1/embeddings", "input"),
])  # fmt: skip
async def test_a_missing_field_is_named(client: httpx.AsyncClient, path: str, param: str) -> None:
    r = await client.post(path, json={"model": "fake"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert r.json()["error"]["message"] == f"Missing required parameter: '{param}'."


async def test_an_optional_body_may_be_left_out(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/conversations")
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "conversation"
