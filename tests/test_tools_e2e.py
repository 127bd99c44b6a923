"""Forced and automatic tool calls through a real server with the real model, read by the official clients."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import ollama
import openai
import pytest

from tests.test_server import MODEL, Server
from tests.tiny_lfm2 import write_tiny_lfm2

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                                                    "required": ["tz"]}},
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server("-np", "2", "-c", "1024", "--tool-call-parser", "hermes")
    yield srv
    srv.stop()


@pytest.fixture
def client(server: Server) -> Iterator[openai.OpenAI]:
    with server.client() as c:
        yield c


def check_call(call: Any, tool: dict[str, Any]) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_required_forces_a_valid_call(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",  # type: ignore[arg-type,list-item]
                                           temperature=0, max_tokens=120)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls or []
    check_call(call, WEATHER)


def test_a_named_choice_calls_that_function(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=named,  # type: ignore[arg-type,list-item]
                                           temperature=0.7, seed=3, max_tokens=120)
    [call] = reply.choices[0].message.tool_calls or []
    check_call(call, TIME)


def test_the_stream_helper_rebuilds_the_same_call(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "tool_choice": "required",
                              "temperature": 0, "max_tokens": 120}
    whole = client.chat.completions.create(**kwargs)
    with client.chat.completions.stream(**kwargs) as stream:
        streamed = stream.get_final_completion()
    pick = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls or []]  # type: ignore[union-attr]
    got = [(c.function.name, c.function.arguments) for c in streamed.choices[0].message.tool_calls or []]  # type: ignore[union-attr]
    assert got == pick and len(got) == 1


def test_none_never_yields_calls(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none",  # type: ignore[arg-type,list-item]
                                           temperature=0, max_tokens=30)
    assert not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    "tool_choice",
    [{"type": "function", "function": {"name": "nope"}}],
)
def test_a_named_choice_outside_the_tools_is_400(client: openai.OpenAI, tool_choice: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=tool_choice)  # type: ignore[arg-type,list-item]


def test_native_chat_with_a_tool_result_in_the_history(server: Server) -> None:
    messages = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                          "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18 degrees and sunny", "tool_name": "get_weather"},
    ]
    with ollama.Client(host=server.base_url) as c:
        reply = c.chat(model=MODEL, messages=messages, tools=[WEATHER], options={"temperature": 0, "num_predict": 30})
    assert reply.done


@pytest.fixture(scope="module")
def lfm2_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path: Path = write_tiny_lfm2(tmp_path_factory.mktemp("lfm2") / "tiny-lfm2.gguf")
    srv = Server("-m", str(path), "-np", "2", "-c", "512")
    yield srv
    srv.stop()


UNIT: dict[str, Any] = {  # only enum arguments: random weights still finish the call in a few tokens
    "type": "function",
    "function": {"name": "set_unit", "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"],
        "additionalProperties": False}},
}


def test_lfm2_format_is_detected_and_forced_calls_parse(lfm2_server: Server) -> None:
    with lfm2_server.client() as client:
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, messages=ASK, tools=[UNIT],  # type: ignore[arg-type,list-item]
                                               tool_choice="required", temperature=0, max_tokens=160)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls or []
        check_call(call, UNIT)
        assert "<|tool_call_start|>" not in (choice.message.content or "")
    with ollama.Client(host=lfm2_server.base_url) as native:
        assert "tools" in (native.show(model).capabilities or [])
