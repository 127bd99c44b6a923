"""Error texts a client sees: the field as the client wrote it, what is supported, and what exists."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from api_wire import assert_openai_error

CHAT = "/v1/chat/completions"


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "fake", "messages": [{"role": "user", "content": "hi"}], **fields}


def user_parts(*parts: dict[str, Any]) -> dict[str, Any]:
    return chat(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, *parts]}])


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (chat(response_format={"type": "json_schema"}), "response_format",
         "Missing required parameter: 'response_format.json_schema'."),
        (chat(response_format={"type": "json_schema", "json_schema": {}}), "response_format",
         "Missing required parameter: 'response_format.json_schema.schema'."),  # name is optional (llama-server)
        (chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format",
         "Missing required parameter: 'response_format.json_schema.schema'."),
        (chat(response_format={"type": "yaml"}), "response_format",
         "Invalid value for 'response_format': type 'yaml' is not supported; use 'text', 'json_object' or "
         "'json_schema'"),
        (user_parts({"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}}), "messages",
         "Invalid value for 'messages[0].content[1]': content part type 'input_audio' is not supported; "
         "use 'text', 'image_url' or 'refusal'"),
        (user_parts({"type": "foo"}), "messages",
         "Invalid value for 'messages[0].content[1]': content part type 'foo' is not supported; "
         "use 'text', 'image_url' or 'refusal'"),
        (user_parts({"text": "no type"}), "messages", "Missing required parameter: 'messages[0].content[1].type'."),
        (user_parts({"type": "image_url"}), "messages",
         "Missing required parameter: 'messages[0].content[1].image_url'."),
        (user_parts({"type": "text"}), "messages", "Missing required parameter: 'messages[0].content[1].text'."),
        (chat(tool_choice={"type": "function"}), "tool_choice", "Missing required parameter: 'tool_choice.function'."),
        (chat(messages=[{"role": "user"}]), "messages",
         "Invalid value for 'messages[0]': a user message must have content"),
    ],
)  # fmt: skip
async def test_openai_400s_name_the_field_as_written(
    client: httpx.AsyncClient, body: dict[str, Any], param: str, message: str
) -> None:
    response = await client.post(CHAT, json=body)
    assert response.status_code == 400
    error = assert_openai_error(response.json(), error_type="invalid_request_error")
    assert (error["param"], error["message"]) == (param, message)


NOT_FOUND = "model 'gpt-4o' not found (available: fake)"


@pytest.mark.parametrize(
    ("method", "path", "body", "shape"),
    [
        ("POST", CHAT, chat(model="gpt-4o"), "openai"),
        ("POST", "/v1/completions", {"model": "gpt-4o", "prompt": "hi"}, "openai"),
        ("GET", "/v1/models/gpt-4o", None, "openai"),
        ("POST", "/api/chat", chat(model="gpt-4o"), "native"),
        ("POST", "/api/generate", {"model": "gpt-4o", "prompt": "hi"}, "native"),
        ("POST", "/api/show", {"model": "gpt-4o"}, "native"),
    ],
)  # fmt: skip
async def test_an_unknown_model_is_named_as_written_with_what_exists(
    client: httpx.AsyncClient, method: str, path: str, body: dict[str, Any] | None, shape: str
) -> None:
    response = await client.request(method, path, json=body)
    assert response.status_code == 404
    if shape == "native":
        assert response.json() == {"error": NOT_FOUND}
    else:
        error = assert_openai_error(response.json(), error_type="not_found_error")
        assert (error["message"], error["param"], error["code"]) == (NOT_FOUND, "model", "model_not_found")
