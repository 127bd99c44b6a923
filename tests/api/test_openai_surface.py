"""Every property of OpenAI's CreateChatCompletionRequest and CreateCompletionRequest (the OpenAPI document in
../shared/reference/openai-openapi.json) gets a defined answer: taken (200), or a 400 in OpenAI's shape naming it.

Values at the schema's edges are in the table: `max_tokens: 0` (an empty reply, finish "length"), `temperature` 0
and 2, `top_p` 0 (greedy), penalties ±2, int64 seeds, logit_bias ±100. Hints lmserve has no use for (service_tier,
verbosity, prediction, prompt_cache_*, safety_identifier, user) are taken; outputs it cannot make (audio, web
search, moderation, the deprecated functions) are refused by name.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from api_wire import assert_openai_error

CHAT_PROPERTIES = (
    "metadata", "top_logprobs", "temperature", "top_p", "user", "safety_identifier", "prompt_cache_key",
    "prompt_cache_retention", "prompt_cache_options", "messages", "model", "service_tier", "modalities", "verbosity",
    "reasoning_effort", "max_completion_tokens", "frequency_penalty", "presence_penalty", "web_search_options",
    "response_format", "audio", "store", "moderation", "stream", "stop", "logit_bias", "logprobs", "max_tokens", "n",
    "prediction", "seed", "stream_options", "tools", "tool_choice", "parallel_tool_calls", "function_call",
    "functions",
)  # fmt: skip
"""CreateChatCompletionRequest's properties (with CreateModelResponseProperties'), as the reference lists them."""

COMPLETION_PROPERTIES = (
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
    "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user",
)  # fmt: skip
"""CreateCompletionRequest's properties."""

OK = None
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}}}}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
INT64 = 2**63

CHAT_CASES: list[tuple[str, Any, str | None]] = [
    ("messages", [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}], OK),
    ("messages", [], "messages"),
    ("model", "fake-alias", OK),
    ("metadata", {"topic": "tests"}, OK),
    ("top_logprobs", None, OK),
    ("temperature", 0, OK), ("temperature", 2, OK), ("temperature", 2.5, "temperature"),
    ("temperature", -0.1, "temperature"),
    ("top_p", 0, OK), ("top_p", 1, OK), ("top_p", 1.5, "top_p"),
    ("user", "user-1", OK),
    ("safety_identifier", "sid-1", OK), ("safety_identifier", "x" * 65, "safety_identifier"),
    ("prompt_cache_key", "key-1", OK),
    ("prompt_cache_retention", "24h", OK),
    ("prompt_cache_options", {"ttl": "1h"}, OK),
    ("service_tier", "auto", OK), ("service_tier", "priority", OK),
    ("modalities", ["text"], OK), ("modalities", ["text", "audio"], "modalities"),
    ("verbosity", "low", OK), ("verbosity", "loud", "verbosity"),
    ("reasoning_effort", "low", OK), ("reasoning_effort", "extreme", "reasoning_effort"),
    ("max_completion_tokens", 0, OK), ("max_completion_tokens", 3, OK),
    ("max_completion_tokens", -1, "max_completion_tokens"),
    ("frequency_penalty", -2, OK), ("frequency_penalty", 2, OK), ("frequency_penalty", 2.5, "frequency_penalty"),
    ("presence_penalty", -2, OK), ("presence_penalty", 2, OK), ("presence_penalty", -3, "presence_penalty"),
    ("web_search_options", None, OK), ("web_search_options", {}, "web_search_options"),
    ("response_format", {"type": "text"}, OK),
    ("response_format", {"type": "json_object"}, OK),
    ("response_format", {"type": "json_object", "schema": SCHEMA}, OK),
    ("response_format", {"type": "json_schema", "json_schema": {"schema": SCHEMA}}, OK),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}, OK),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "a"}}, "response_format"),
    ("response_format", {"type": "yaml"}, "response_format"),
    ("audio", None, OK), ("audio", {"voice": "alloy", "format": "mp3"}, "audio"),
    ("store", False, OK),
    ("moderation", None, OK), ("moderation", {"model": "omni-moderation-latest"}, "moderation"),
    ("stream", False, OK), ("stream", True, OK),
    ("stop", "\n", OK), ("stop", ["a", "b", "c", "d"], OK), ("stop", 5, "stop"),
    ("logit_bias", {"65": 100, "66": -100}, OK), ("logit_bias", {"65": 101}, "logit_bias"),
    ("logit_bias", {"99999": 1}, "logit_bias"),
    ("logprobs", False, OK),
    ("max_tokens", 0, OK), ("max_tokens", 1, OK), ("max_tokens", -1, "max_tokens"),
    ("n", 1, OK), ("n", 0, "n"),
    ("prediction", {"type": "content", "content": "Hello there"}, OK),
    ("seed", -1, OK), ("seed", INT64 - 1, OK), ("seed", -INT64, OK), ("seed", INT64, "seed"),
    ("stream_options", {"include_usage": True}, OK),
    ("tools", [WEATHER], OK), ("tools", [{"type": "function"}], "tools"),
    ("tool_choice", "none", OK), ("tool_choice", "sometimes", "tool_choice"),
    ("parallel_tool_calls", True, OK),
    ("function_call", None, OK), ("function_call", "auto", "function_call"),
    ("functions", [{"name": "get_weather"}], "functions"),
]  # fmt: skip
"""(property, value, None when taken, else the param of the 400)."""

COMPLETION_CASES: list[tuple[str, Any, str | None]] = [
    ("model", "fake-alias", OK),
    ("prompt", "Once upon a time", OK), ("prompt", ["Once"], OK), ("prompt", [65, 66], OK),
    ("prompt", [[65], [66, 67]], OK), ("prompt", [1, 2000], "prompt"), ("prompt", [[65], ["x"]], "prompt"),
    ("best_of", 1, OK),
    ("echo", True, OK),
    ("frequency_penalty", 2, OK), ("frequency_penalty", -2.5, "frequency_penalty"),
    ("logit_bias", {"65": -100}, OK),
    ("logprobs", None, OK),
    ("max_tokens", 0, OK), ("max_tokens", 16, OK), ("max_tokens", -1, "max_tokens"),
    ("n", 1, OK),
    ("presence_penalty", -2, OK),
    ("seed", INT64 - 1, OK),
    ("stop", ["\n", "."], OK),
    ("stream", True, OK),
    ("stream_options", {"include_usage": True}, OK),
    ("suffix", None, OK), ("suffix", "", OK), ("suffix", " the end.", "suffix"),  # the fake model has no FIM tokens
    ("temperature", 0, OK), ("temperature", 2, OK),
    ("top_p", 0, OK), ("top_p", 1.01, "top_p"),
    ("user", "user-1", OK),
]  # fmt: skip


def test_the_tables_cover_every_property() -> None:
    assert set(CHAT_PROPERTIES) == {name for name, _, _ in CHAT_CASES}
    assert set(COMPLETION_PROPERTIES) == {name for name, _, _ in COMPLETION_CASES}


def _ids(cases: list[tuple[str, Any, str | None]]) -> list[str]:
    return [f"{name}={value!r:.40}" for name, value, _ in cases]


async def _check(client: httpx.AsyncClient, path: str, body: dict[str, Any], param: str | None) -> None:
    if body.get("stream_options"):
        body["stream"] = True
    response = await client.post(path, json=body)
    if param is not None:
        assert response.status_code == 400, response.text
        assert assert_openai_error(response.json(), error_type="invalid_request_error")["param"] == param
        return
    assert response.status_code == 200, response.text
    if body.get("stream"):
        assert response.text.rstrip().endswith("data: [DONE]")


@pytest.mark.asyncio
@pytest.mark.parametrize(("name", "value", "param"), CHAT_CASES, ids=_ids(CHAT_CASES))
async def test_chat_property(client: httpx.AsyncClient, name: str, value: Any, param: str | None) -> None:
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, name: value}
    await _check(client, "/v1/chat/completions", body, param)


@pytest.mark.asyncio
@pytest.mark.parametrize(("name", "value", "param"), COMPLETION_CASES, ids=_ids(COMPLETION_CASES))
async def test_completion_property(client: httpx.AsyncClient, name: str, value: Any, param: str | None) -> None:
    body = {"model": "fake", "prompt": "hi", "max_tokens": 3, name: value}
    await _check(client, "/v1/completions", body, param)


@pytest.mark.asyncio
@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
async def test_zero_tokens_is_an_empty_reply_cut_by_length(client: httpx.AsyncClient, field: str) -> None:
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], field: 0}
    reply = (await client.post("/v1/chat/completions", json=body)).json()
    assert reply["choices"][0]["message"]["content"] == ""
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == 0
    assert reply["usage"]["prompt_tokens"] > 0


@pytest.mark.asyncio
async def test_zero_tokens_with_echo_is_the_prompt(client: httpx.AsyncClient) -> None:
    body = {"model": "fake", "prompt": "Once upon", "max_tokens": 0, "echo": True}
    reply = (await client.post("/v1/completions", json=body)).json()
    assert (reply["choices"][0]["text"], reply["choices"][0]["finish_reason"]) == ("Once upon", "length")
    assert reply["usage"] == {**reply["usage"], "prompt_tokens": 9, "completion_tokens": 0}


@pytest.mark.asyncio
async def test_top_p_zero_is_greedy(client: httpx.AsyncClient) -> None:
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "seed": 3}
    greedy = (await client.post("/v1/chat/completions", json={**body, "temperature": 0})).json()
    top_p_zero = (await client.post("/v1/chat/completions", json={**body, "top_p": 0, "temperature": 1})).json()
    assert top_p_zero["choices"][0]["message"] == greedy["choices"][0]["message"]


@pytest.mark.asyncio
async def test_zero_tokens_for_each_of_n_choices(client: httpx.AsyncClient) -> None:
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0, "n": 2}
    reply = (await client.post("/v1/chat/completions", json=body)).json()
    assert [(c["message"]["content"], c["finish_reason"]) for c in reply["choices"]] == [("", "length")] * 2
    assert reply["usage"]["completion_tokens"] == 0
