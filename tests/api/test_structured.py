"""Structured output at the edge: response_format / format → the sampling grammar, and refusals as 400s."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from lmserve.chat.structured import json_object_grammar, schema_grammar
from lmserve.dialects.native.translate import format_grammar
from lmserve.dialects.native.translate import to_sampling_params as native_sampling
from lmserve.dialects.openai import schemas
from lmserve.dialects.openai.translate import to_chat_request
from lmserve.errors import InvalidRequest

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
USER = [{"role": "user", "content": "hi"}]


def chat_req(**fields: Any) -> schemas.ChatCompletionRequest:
    return schemas.ChatCompletionRequest.model_validate({"model": "m", "messages": USER, **fields})


@pytest.mark.parametrize(("response_format", "grammar"), [
    (None, None),
    ({"type": "text"}, None),
    ({"type": "json_object"}, json_object_grammar()),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}, schema_grammar(SCHEMA)),
])  # fmt: skip
def test_openai_response_format_becomes_the_grammar(response_format: Any, grammar: str | None) -> None:
    fields = {} if response_format is None else {"response_format": response_format}
    assert to_chat_request(chat_req(**fields)).sampling.grammar == grammar


def test_openai_json_schema_without_schema_is_refused() -> None:
    with pytest.raises(InvalidRequest, match=r"'response_format\.json_schema\.schema'") as info:
        to_chat_request(chat_req(response_format={"type": "json_schema", "json_schema": {"name": "n"}}))
    assert info.value.param == "response_format"


@pytest.mark.parametrize(("fmt", "grammar"), [
    (None, None), ("", None), ("json", json_object_grammar()), (SCHEMA, schema_grammar(SCHEMA, param="format")),
])  # fmt: skip
def test_native_format_becomes_the_grammar(fmt: Any, grammar: str | None) -> None:
    assert format_grammar(fmt) == grammar
    assert native_sampling(fmt, None).grammar == grammar


def test_native_format_other_strings_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="'yaml'") as info:
        format_grammar("yaml")
    assert info.value.param == "format"


async def test_openai_unsupported_keyword_is_a_400_naming_it(client: httpx.AsyncClient) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 5}}}
    body = {"model": "fake", "messages": USER,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "response_format"
    assert error["type"] == "invalid_request_error"
    assert "'multipleOf'" in error["message"] and "#/properties/n" in error["message"]


async def test_openai_json_mode_with_ignore_eos_is_a_400(client: httpx.AsyncClient) -> None:
    body = {"model": "fake", "messages": USER, "response_format": {"type": "json_object"}, "ignore_eos": True}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "ignore_eos"


async def test_openai_json_mode_is_accepted(client: httpx.AsyncClient) -> None:
    body = {"model": "fake", "messages": USER, "response_format": {"type": "json_object"}, "max_tokens": 3}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200


@pytest.mark.parametrize("route", ["/api/generate", "/api/chat"])
@pytest.mark.parametrize(("fmt", "fragment"), [
    ("yaml", "'yaml'"), ({"type": "string", "format": "email"}, "'format'"), ({"not": {}}, "'not'"),
])  # fmt: skip
async def test_native_bad_format_is_a_400(client: httpx.AsyncClient, route: str, fmt: Any, fragment: str) -> None:
    body: dict[str, Any] = {"model": "fake", "format": fmt, "stream": False}
    body.update({"prompt": "hi"} if route == "/api/generate" else {"messages": USER})
    r = await client.post(route, json=body)
    assert r.status_code == 400
    assert fragment in r.json()["error"]


@pytest.mark.parametrize("route", ["/api/generate", "/api/chat"])
async def test_native_format_is_accepted(client: httpx.AsyncClient, route: str) -> None:
    body: dict[str, Any] = {"model": "fake", "format": SCHEMA, "stream": False, "options": {"num_predict": 16}}
    body.update({"prompt": "hi"} if route == "/api/generate" else {"messages": USER})
    r = await client.post(route, json=body)
    assert r.status_code == 200
