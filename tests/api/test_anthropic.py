"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) over the fake engine, checked with the
official `anthropic` client in strict mode and against its types."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anthropic
import httpx
import httpx2
import pytest
import pytest_asyncio
import schemathesis
import test_schemathesis as fuzzing
from anthropic.types import Message as AnthropicMessage
from anthropic.types import RawMessageStreamEvent
from api_wire import API_KEY
from fastapi import FastAPI
from hypothesis import HealthCheck, settings
from PIL import Image
from pydantic import TypeAdapter
from schemathesis.checks import not_a_server_error
from test_schemathesis import fuzzed_app  # noqa: F401  (the fixture: a fresh app over the fake engine)

from lmserve import options as opts
from lmserve.chat.template import ChatTemplate
from lmserve.config import ServerConfig
from lmserve.dialects.anthropic import schemas as wire
from lmserve.dialects.anthropic.output import Blocks, message_events
from lmserve.dialects.anthropic.translate import to_chat_request
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.fake import PIXELS_PER_IMAGE_TOKEN, FakeBackend
from lmserve.http.app import create_app
from lmserve.service import Service, static_service
from lmserve.service.residency import LoadedModel
from lmserve.types import Chunk, FinishReason, Message, SamplingParams, ToolCall, Usage

MESSAGES = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
USER = [{"role": "user", "content": "Say something."}]
EVENTS: TypeAdapter[RawMessageStreamEvent] = TypeAdapter(RawMessageStreamEvent)

HERMES_TEMPLATE = "{# hermes-style: <tool_call> #}" + (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>'
WEATHER = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                     "required": ["city"]},
}


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "fake", "max_tokens": 16, "messages": USER, **fields}


def expected(prompt_tokens: int, num_tokens: int) -> str:
    return FakeBackend.expected(prompt_tokens, num_tokens)


def assert_anthropic_error(response: httpx.Response, status: int, error_type: str) -> str:
    """The Anthropic error shape: {"type": "error", "error": {"type", "message"}}; returns the message."""
    assert response.status_code == status, response.text
    payload = response.json()
    assert set(payload) == {"type", "error"} and payload["type"] == "error"
    assert set(payload["error"]) == {"type", "message"}
    assert payload["error"]["type"] == error_type
    assert isinstance(payload["error"]["message"], str) and payload["error"]["message"]
    return str(payload["error"]["message"])


def sse_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each event of a Messages stream; every event has one `event:` and one `data:` line."""
    assert text.endswith("\n\n")
    out = []
    for raw in text[:-2].split("\n\n"):
        event, data = raw.split("\n")
        assert event.startswith("event: ") and data.startswith("data: "), raw
        payload = json.loads(data[len("data: "):])
        assert payload["type"] == event[len("event: "):]
        out.append((event[len("event: "):], payload))
    return out


def png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), "red").save(buf, "PNG")
    return buf.getvalue()


def image_block(data: bytes) -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                        "data": base64.b64encode(data).decode()}}


@pytest_asyncio.fixture
async def claude(app: FastAPI) -> AsyncIterator[anthropic.AsyncAnthropic]:
    """The official client over the app, in strict mode (every response must match its types)."""
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app), base_url="http://test") as http:
        yield anthropic.AsyncAnthropic(base_url="http://test", api_key="unused", http_client=http, max_retries=0,
                                       _strict_response_validation=True)


def scripted_app(script: str, template: str = HERMES_TEMPLATE) -> tuple[FastAPI, BatchingEngine]:
    engine = BatchingEngine(FakeBackend(script=script))
    model = LoadedModel(name="fake", engine=engine, template=ChatTemplate(template), template_source=template)
    return create_app(static_service([model]), ServerConfig()), engine


@pytest.fixture
def scripted(request: pytest.FixtureRequest) -> Iterator[FastAPI]:
    """An app whose fake model answers exactly `request.param` (a hermes tool-call template)."""
    app, engine = scripted_app(request.param)
    yield app
    engine.close()


@pytest_asyncio.fixture
async def scripted_claude(scripted: FastAPI) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(scripted), base_url="http://test") as http:
        yield anthropic.AsyncAnthropic(base_url="http://test", api_key="unused", http_client=http, max_retries=0,
                                       _strict_response_validation=True)


# ---- messages.create ------------------------------------------------------------------------------


async def test_message_body_matches_anthropic_types(client: httpx.AsyncClient) -> None:
    response = await client.post(MESSAGES, json=body(max_tokens=12))
    assert response.status_code == 200
    payload = response.json()
    message = AnthropicMessage.model_validate(payload)
    assert set(payload) == {"id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"}
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == "fake"
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert payload["usage"] == {"input_tokens": message.usage.input_tokens, "output_tokens": 12,
                                "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    assert payload["content"] == [{"type": "text", "text": expected(message.usage.input_tokens, 12)}]


async def test_create_with_the_official_client(claude: anthropic.AsyncAnthropic) -> None:
    message = await claude.messages.create(model="fake", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert message.stop_reason == "max_tokens"
    [block] = message.content
    assert block.type == "text" and block.text == expected(message.usage.input_tokens, 5)
    assert message.usage.output_tokens == 5


async def test_the_end_of_the_turn_is_end_turn() -> None:
    engine = BatchingEngine(FakeBackend(eog_after=3))
    try:
        model = LoadedModel(name="fake", engine=engine, template=ChatTemplate(None))
        app = create_app(static_service([model]), ServerConfig())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
            payload = (await client.post(MESSAGES, json=body(stop_sequences=["zzz"]))).json()
    finally:
        engine.close()
    assert payload["stop_reason"] == "end_turn" and payload["stop_sequence"] is None
    assert payload["usage"]["output_tokens"] == 3


@pytest.mark.parametrize(("stops", "hit"), [(["fox"], "fox"), (["zzz", "lazy"], "lazy"), (["dog.", "lazy"], "lazy")])
async def test_a_stop_sequence_is_reported(client: httpx.AsyncClient, stops: list[str], hit: str) -> None:
    payload = (await client.post(MESSAGES, json=body(max_tokens=100, stop_sequences=stops))).json()
    full = expected(payload["usage"]["input_tokens"], 100)
    assert payload["stop_reason"] == "stop_sequence"
    assert payload["stop_sequence"] == hit
    assert payload["content"][0]["text"] == full[: full.index(hit)]


async def test_system_as_a_string_or_blocks_is_the_same_prompt(client: httpx.AsyncClient) -> None:
    async def count(**fields: Any) -> int:
        response = await client.post(COUNT, json={"model": "fake", "messages": USER, **fields})
        assert response.status_code == 200, response.text
        return int(response.json()["input_tokens"])

    bare = await count()
    as_string = await count(system="Be brief.\nBe kind.")
    as_blocks = await count(system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}])
    assert as_string == as_blocks > bare


async def test_sampling_fields_and_metadata_are_accepted(client: httpx.AsyncClient) -> None:
    fields = {"temperature": 0, "top_p": 0.9, "top_k": 5, "metadata": {"user_id": "u-1"}}
    response = await client.post(MESSAGES, json=body(**fields))
    assert response.status_code == 200, response.text


# ---- count_tokens ---------------------------------------------------------------------------------


async def test_count_tokens_is_the_prompt_of_create(claude: anthropic.AsyncAnthropic) -> None:
    messages: Any = [{"role": "user", "content": "How many?"}]
    counted = await claude.messages.count_tokens(model="fake", messages=messages, system="Count.")
    message = await claude.messages.create(model="fake", max_tokens=2, messages=messages, system="Count.")
    usage = message.usage
    assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)


async def test_count_tokens_counts_image_positions() -> None:
    engine = BatchingEngine(FakeBackend(vision=True))
    try:
        model = LoadedModel(name="seer", engine=engine, template=ChatTemplate(None))
        app = create_app(static_service([model]), ServerConfig())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
            async def count(content: Any) -> int:
                request = {"model": "seer", "messages": [{"role": "user", "content": content}]}
                response = await client.post(COUNT, json=request)
                assert response.status_code == 200, response.text
                return int(response.json()["input_tokens"])

            text = await count([{"type": "text", "text": "What is it?"}])
            with_image = await count([image_block(png(64, 32)), {"type": "text", "text": "What is it?"}])
            created = await client.post(MESSAGES, json={"model": "seer", "max_tokens": 2, "messages": [
                {"role": "user", "content": [image_block(png(64, 32)), {"type": "text", "text": "What is it?"}]}]})
    finally:
        engine.close()
    assert with_image - text == 64 * 32 // PIXELS_PER_IMAGE_TOKEN
    assert created.status_code == 200 and created.json()["usage"]["input_tokens"] == with_image


# ---- streaming ------------------------------------------------------------------------------------


async def test_the_stream_has_the_messages_event_sequence(client: httpx.AsyncClient) -> None:
    async with client.stream("POST", MESSAGES, json=body(max_tokens=6, stream=True)) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        text = (await response.aread()).decode()
    events = sse_events(text)
    for _, payload in events:
        if payload["type"] != "ping":
            EVENTS.validate_python(payload)
    names = [name for name, _ in events]
    assert names[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["id"].startswith("msg_") and start["content"] == [] and start["stop_reason"] is None
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    deltas = [p["delta"] for name, p in events if name == "content_block_delta"]
    assert all(d["type"] == "text_delta" for d in deltas)
    input_tokens = start["usage"]["input_tokens"]
    assert "".join(d["text"] for d in deltas) == expected(input_tokens, 6)
    final = events[-2][1]
    assert final["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert final["usage"]["output_tokens"] == 6


async def test_the_stream_helper_gives_the_text_and_the_final_message(claude: anthropic.AsyncAnthropic) -> None:
    messages: Any = [{"role": "user", "content": "hi"}]
    whole = await claude.messages.create(model="fake", max_tokens=7, messages=messages)
    async with claude.messages.stream(model="fake", max_tokens=7, messages=messages) as stream:
        pieces = [piece async for piece in stream.text_stream]
        final = await stream.get_final_message()
    assert "".join(pieces) == whole.content[0].text  # type: ignore[union-attr]
    assert [b.to_dict() for b in final.content] == [{"type": "text", "text": whole.content[0].text}]  # type: ignore[union-attr]
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 7
    prompt = whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == prompt


async def test_a_streamed_stop_sequence_is_reported(claude: anthropic.AsyncAnthropic) -> None:
    messages: Any = [{"role": "user", "content": "hi"}]
    async with claude.messages.stream(model="fake", max_tokens=100, messages=messages,
                                      stop_sequences=["lazy"]) as stream:
        final = await stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "lazy"
    assert "lazy" not in final.content[0].text  # type: ignore[union-attr]


class StubGeneration:
    """A generation that yields given chunks (thinking before the service fills Chunk.reasoning itself)."""

    model = "fake"
    num_prompt_tokens = 4
    sampling = SamplingParams(max_tokens=64)

    def __init__(self, chunks: list[Chunk]) -> None:
        self.chunks = chunks
        self.output_tokens: list[int] = []

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        for chunk in self.chunks:
            yield chunk


async def stream_of(chunks: list[Chunk], service: Service) -> list[tuple[str, dict[str, Any]]]:
    frames = message_events(StubGeneration(chunks), {"id": "msg_1", "type": "message",  # type: ignore[arg-type]
                                                     "role": "assistant", "model": "fake"})
    return sse_events(b"".join([frame async for frame in frames]).decode())


async def test_thinking_text_and_tool_use_are_blocks_in_that_order(service: Service) -> None:
    call = ToolCall("get_weather", '{"city":"Paris"}', "call_abc")
    final = Chunk(finish_reason="tool_calls", usage=Usage(4, 9, 0))
    events = await stream_of([Chunk(reasoning="Let me "), Chunk(reasoning="think."), Chunk(text="\n"),
                              Chunk(text="Checking."), Chunk(tool_calls=[call]), final], service)
    for _, payload in events:
        if payload["type"] != "ping":
            EVENTS.validate_python(payload)
    starts = [p["content_block"] for name, p in events if name == "content_block_start"]
    assert starts == [{"type": "thinking", "thinking": "", "signature": ""}, {"type": "text", "text": ""},
                      {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {}}]
    deltas = [(p["index"], p["delta"]) for name, p in events if name == "content_block_delta"]
    assert deltas == [(0, {"type": "thinking_delta", "thinking": "Let me "}),
                      (0, {"type": "thinking_delta", "thinking": "think."}),
                      (1, {"type": "text_delta", "text": "\nChecking."}),
                      (2, {"type": "input_json_delta", "partial_json": '{"city":"Paris"}'})]
    assert [p["index"] for name, p in events if name == "content_block_stop"] == [0, 1, 2]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


async def test_whitespace_beside_a_call_is_no_block_and_an_empty_reply_is_one_empty_block(service: Service) -> None:
    call = ToolCall("get_weather", "{}", "call_abc")
    events = await stream_of([Chunk(text="\n"), Chunk(tool_calls=[call]), Chunk(finish_reason="tool_calls")], service)
    assert [p["content_block"]["type"] for n, p in events if n == "content_block_start"] == ["tool_use"]
    events = await stream_of([Chunk(finish_reason="stop", usage=Usage(4, 0, 0))], service)
    names = [name for name, _ in events]
    assert names == ["message_start", "ping", "content_block_start", "content_block_stop", "message_delta",
                     "message_stop"]
    assert events[-2][1]["delta"]["stop_reason"] == "end_turn"


@pytest.mark.parametrize("reason", ["error", "abort"])
async def test_a_failed_generation_ends_the_stream_with_an_error_event(service: Service, reason: FinishReason) -> None:
    events = await stream_of([Chunk(text="Hi"), Chunk(finish_reason=reason, error="engine died")], service)
    assert events[-1] == ("error", {"type": "error", "error": {"type": "api_error", "message": "engine died"}})


def test_the_block_order_is_thinking_text_tool_use() -> None:
    blocks = Blocks()
    frames = [*blocks.text("  "), *blocks.thinking("hm"), *blocks.finish()]
    events = sse_events(b"".join(frames).decode())
    assert [p["content_block"]["type"] for n, p in events if n == "content_block_start"] == ["thinking"]


OPENS_THINKING = (  # a generation prompt that opens the thinking (Qwen3 style)
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n<think>\n"
)


@pytest.mark.parametrize("stream", [False, True])
async def test_the_thinking_is_a_thinking_block_before_the_text(stream: bool) -> None:
    app, engine = scripted_app("I should greet.\n</think>\n\nHello there.", OPENS_THINKING)
    try:
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app), base_url="http://test") as http:
            client = anthropic.AsyncAnthropic(base_url="http://test", api_key="unused", http_client=http,
                                              max_retries=0, _strict_response_validation=True)
            kwargs: Any = {"model": "fake", "max_tokens": 100, "messages": USER,
                           "thinking": {"type": "adaptive"}}  # no budget: one phase (the fake replays its script)
            if stream:
                async with client.messages.stream(**kwargs) as events:
                    message: AnthropicMessage = await events.get_final_message()
            else:
                message = await client.messages.create(**kwargs)
    finally:
        engine.close()
    assert [block.to_dict() for block in message.content] == [
        {"type": "thinking", "thinking": "I should greet.", "signature": ""},
        {"type": "text", "text": "Hello there."},
    ]
    assert message.stop_reason == "end_turn"


# ---- tools ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("scripted", ["Let me check. " + CALL], indirect=True)
async def test_a_forced_tool_use_round_trip(scripted_claude: anthropic.AsyncAnthropic) -> None:
    asked: Any = [{"role": "user", "content": "Weather in Paris?"}]
    reply = await scripted_claude.messages.create(model="fake", max_tokens=200, messages=asked, tools=[WEATHER],
                                                  tool_choice={"type": "tool", "name": "get_weather"})
    assert reply.stop_reason == "tool_use"
    call = reply.content[-1]
    assert call.type == "tool_use" and call.id.startswith("toolu_")
    assert call.name == "get_weather" and call.input == {"city": "Paris", "days": 2}
    history: Any = [*asked, {"role": "assistant", "content": reply.content},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                  "content": "Sunny, 21 C"}]}]
    answer = await scripted_claude.messages.create(model="fake", max_tokens=200, messages=history, tools=[WEATHER])
    assert answer.stop_reason == "tool_use"  # the script always calls; the point is that the history is taken
    counted = await scripted_claude.messages.count_tokens(model="fake", messages=history, tools=[WEATHER])
    bare = await scripted_claude.messages.count_tokens(model="fake", messages=history[:-1], tools=[WEATHER])
    assert counted.input_tokens - bare.input_tokens >= len("Sunny, 21 C")


@pytest.mark.parametrize("scripted", ["Let me check. " + CALL], indirect=True)
async def test_a_streamed_tool_use_is_the_same_block(scripted_claude: anthropic.AsyncAnthropic) -> None:
    asked: Any = [{"role": "user", "content": "Weather in Paris?"}]
    whole = await scripted_claude.messages.create(model="fake", max_tokens=200, messages=asked, tools=[WEATHER])
    async with scripted_claude.messages.stream(model="fake", max_tokens=200, messages=asked,
                                               tools=[WEATHER]) as stream:
        final = await stream.get_final_message()
    assert [b.type for b in final.content] == [b.type for b in whole.content] == ["text", "tool_use"]
    assert final.content[0].text == whole.content[0].text == "Let me check."  # type: ignore[union-attr]
    assert final.content[1].input == whole.content[1].input == {"city": "Paris", "days": 2}  # type: ignore[union-attr]
    assert final.stop_reason == "tool_use"


def test_the_history_becomes_messages() -> None:
    request = wire.MessagesRequest.model_validate(body(system="Sys.", messages=[
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}, {"type": "text", "text": "Paris."}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "They want weather.", "signature": "sig"},
            {"type": "redacted_thinking", "data": "xyz"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Sunny"}]},
            {"type": "text", "text": "And tomorrow?"}]},
    ], tools=[WEATHER]))
    chat = to_chat_request(request)
    assert chat.messages == [
        Message("system", "Sys."),
        Message("user", "Weather?\nParis."),
        Message("assistant", "Checking.", tool_calls=[ToolCall("get_weather", '{"city":"Paris"}', "toolu_1")],
                thinking="They want weather."),
        Message("tool", "Sunny", tool_call_id="toolu_1", name="get_weather"),
        Message("user", "And tomorrow?"),
    ]
    assert chat.tools == [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                                             "parameters": WEATHER["input_schema"]}}]
    assert chat.forced_tool is None and chat.parallel_tool_calls


@pytest.mark.parametrize(("choice", "forced", "has_tools", "parallel"), [
    ({"type": "auto"}, None, True, True),
    ({"type": "any"}, "*", True, True),
    ({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}, "get_weather", True, False),
    ({"type": "none"}, None, False, True),
])
def test_tool_choice(choice: dict[str, Any], forced: str | None, has_tools: bool, parallel: bool) -> None:
    chat = to_chat_request(wire.MessagesRequest.model_validate(body(tools=[WEATHER], tool_choice=choice)))
    assert chat.forced_tool == forced and bool(chat.tools) == has_tools and chat.parallel_tool_calls == parallel


@pytest.mark.parametrize(("thinking", "think", "budget"), [
    (None, None, None),
    ({"type": "enabled", "budget_tokens": 2048}, True, 2048),
    ({"type": "adaptive"}, True, None),
    ({"type": "disabled"}, False, None),
])
def test_the_thinking_config(thinking: dict[str, Any] | None, think: bool | None, budget: int | None) -> None:
    chat = to_chat_request(wire.MessagesRequest.model_validate(body(thinking=thinking)))
    assert (chat.think, chat.reasoning_budget) == (think, budget)


@pytest.mark.parametrize(("thinking", "effort", "think"), [
    ({"type": "enabled", "budget_tokens": 100}, "low", "low"),
    ({"type": "adaptive"}, "max", "high"),
    ({"type": "disabled"}, "high", False),
    (None, "medium", None),
])
def test_the_effort_is_the_thinking_effort(thinking: dict[str, Any] | None, effort: str, think: Any) -> None:
    request = body(thinking=thinking, output_config={"effort": effort})
    assert to_chat_request(wire.MessagesRequest.model_validate(request)).think == think


def test_an_output_format_is_enforced_by_a_grammar() -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    request = body(output_config={"format": {"type": "json_schema", "schema": schema}})
    grammar = to_chat_request(wire.MessagesRequest.model_validate(request)).sampling.grammar
    assert grammar is not None and "root ::=" in grammar


def test_sampling_fields_become_sampling_params() -> None:
    request = wire.MessagesRequest.model_validate(body(max_tokens=33, temperature=0.5, top_p=0.8, top_k=7,
                                                       stop_sequences=["END"]))
    sampling = opts.sampling(to_chat_request(request).options.values)
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.top_k, sampling.stop) == (
        33, 0.5, 0.8, 7, ["END"])


# ---- errors and auth ------------------------------------------------------------------------------


@pytest.mark.parametrize(("fields", "where"), [
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "developer", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "document"),
    ({"temperature": 1.5}, "temperature"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]}, "nope"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "x", "input": {}}]}]},
     "assistant message"),
    ({"messages": [{"role": "user", "content": [image_block(png(8, 8))]}]}, "vision"),
    ({"thinking": {"type": "sometimes"}}, "thinking"),
])
async def test_bad_input_is_400_in_the_anthropic_shape(client: httpx.AsyncClient, fields: dict[str, Any],
                                                       where: str) -> None:
    request = {k: v for k, v in body(**fields).items() if v is not None}
    message = assert_anthropic_error(await client.post(MESSAGES, json=request), 400, "invalid_request_error")
    assert where in message


async def test_bad_json_and_unknown_models_and_methods(client: httpx.AsyncClient) -> None:
    response = await client.post(MESSAGES, content=b"{nope", headers={"content-type": "application/json"})
    assert_anthropic_error(response, 400, "invalid_request_error")
    assert_anthropic_error(await client.post(MESSAGES, json=body(model="nope")), 404, "not_found_error")
    assert_anthropic_error(await client.post(COUNT, json={"model": "nope", "messages": USER}), 404, "not_found_error")
    assert_anthropic_error(await client.get(MESSAGES), 405, "invalid_request_error")
    assert_anthropic_error(await client.post("/v1/messages/batches", json={}), 404, "not_found_error")


async def test_the_official_client_raises_typed_errors(claude: anthropic.AsyncAnthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        await claude.messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert missing.value.body == {"type": "error", "error": {"type": "not_found_error",
                                                             "message": missing.value.body["error"]["message"]}}  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError):
        await claude.messages.create(model="fake", max_tokens=5, messages=[])


@pytest.mark.parametrize(("headers", "status"), [
    ({}, 401),
    ({"x-api-key": "wrong"}, 401),
    ({"x-api-key": API_KEY}, 200),
    ({"Authorization": f"Bearer {API_KEY}"}, 200),
    ({"x-api-key": "wrong", "Authorization": f"Bearer {API_KEY}"}, 200),
])
async def test_x_api_key_auth(secured_client: httpx.AsyncClient, headers: dict[str, str], status: int) -> None:
    response = await secured_client.post(MESSAGES, json=body(), headers=headers)
    if status == 401:
        assert_anthropic_error(response, 401, "authentication_error")
    else:
        assert response.status_code == 200, response.text


async def test_x_api_key_opens_the_other_routes_too(secured_client: httpx.AsyncClient) -> None:
    assert (await secured_client.get("/v1/models", headers={"x-api-key": API_KEY})).status_code == 200
    assert (await secured_client.get("/v1/models", headers={"x-api-key": "wrong"})).status_code == 401


async def test_the_official_client_sends_its_key(secured_app: FastAPI) -> None:
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(secured_app), base_url="http://test") as http:
        keyed = anthropic.AsyncAnthropic(base_url="http://test", api_key=API_KEY, http_client=http, max_retries=0)
        message = await keyed.messages.create(model="fake", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
        assert message.usage.output_tokens == 3
        wrong = anthropic.AsyncAnthropic(base_url="http://test", api_key="wrong", http_client=http, max_retries=0)
        with pytest.raises(anthropic.AuthenticationError):
            await wrong.messages.create(model="fake", max_tokens=3, messages=[{"role": "user", "content": "hi"}])


# ---- fuzzing: no generated body gets a 5xx --------------------------------------------------------

MESSAGES_ROUTES = fuzzing.schema.include(path_regex="^/v1/messages")
"""The fuzzed operations of tests/api/test_schemathesis.py (same hooks: the served model's name, capped output)
narrowed to this dialect's routes."""


@MESSAGES_ROUTES.parametrize()
@settings(max_examples=60, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors_on_the_messages_routes(case: schemathesis.Case, fuzzed_app: FastAPI) -> None:  # noqa: F811
    fuzzing.serve_valid_coverage_cases(case)
    fuzzing.cap_output(case.body)
    case.call_and_validate(app=fuzzed_app, checks=[not_a_server_error])
