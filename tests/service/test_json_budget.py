"""The closing stream: a constrained reply ends within its token limit as a valid document, whatever the chunking.

A scripted engine (one token per byte, as the fake backend's vocabulary) plays a model that loops inside an
unbounded array; the stream must keep tokens only while the closing still fits, then end with it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any, cast

import jsonschema
import pytest

from lmserve.chat.structured import schema_grammar
from lmserve.chat.tools import get_parser
from lmserve.chat.tools.forcing import ANY_TOOL, forced_call_grammar
from lmserve.engine.protocol import Engine
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.errors import InvalidRequest
from lmserve.service.json_budget import ClosingStream, check_budget, close_in_budget, minimum_tokens
from lmserve.types import ChatRequest, Chunk, Message, SamplingParams, TokenLogprob, Usage
from tests.service.test_reasoning import OPENS_THINKING, RecordingBackend, service_with

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"topic": {"type": "string"}, "items": {"type": "array", "items": {"type": "string"}}},
    "required": ["topic", "items"],
    "additionalProperties": False,
}
LOOP = '{"topic": "countries", "items": [' + ", ".join(f'"Land {i}"' for i in range(100))
SHORTEST = '{"topic":"","items":[]}'


class ByteEngine:
    """Tokens are UTF-8 bytes; nothing else of an engine is needed."""

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return list(text.encode())

    def detokenize(self, tokens: list[int]) -> str:
        return bytes(tokens).decode("utf-8", "replace")

    def token_bytes(self, token: int) -> bytes:
        return bytes([token])


class ScriptedStream:
    """Emits `script` one token at a time, `per_chunk` tokens' text per chunk, up to `limit` tokens; the output
    tokens run `ahead` of the text shown, as llama.cpp's engine thread may."""

    def __init__(self, script: str, limit: int, *, per_chunk: int = 1, ahead: int = 0, finish: str = "length",
                 logprobs: bool = False) -> None:
        self.data = list(script.encode())[:limit]
        self.limit = limit
        self.per_chunk = per_chunk
        self.ahead = ahead
        self.finish = finish
        self.logprobs = logprobs
        self.output: list[int] = []
        self.aborted = False

    @property
    def prompt_tokens(self) -> list[int]:
        return [1, 2, 3]

    @property
    def output_tokens(self) -> list[int]:
        return self.output

    def abort(self) -> None:
        self.aborted = True

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        shown = 0
        while shown < len(self.data) and not self.aborted:
            end = min(len(self.data), shown + self.per_chunk)
            self.output = self.data[: min(len(self.data), end + self.ahead)]
            text = bytes(self.data[shown:end]).decode()
            entries = [TokenLogprob(t, chr(t), bytes([t]), -0.5) for t in self.data[shown:end]] if self.logprobs else []
            shown = end
            if shown == len(self.data):
                usage = Usage(prompt_tokens=3, completion_tokens=len(self.data), cached_tokens=2)
                yield Chunk(text=text, finish_reason=self.finish, usage=usage,  # type: ignore[arg-type]
                            logprobs=entries)
                return
            yield Chunk(text=text, logprobs=entries)


ENGINE = cast(Engine, ByteEngine())


def sampling(limit: int | None, schema: Any = SCHEMA) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=limit, grammar=schema_grammar(schema))


def collect(stream: ClosingStream) -> list[Chunk]:
    async def chunks() -> list[Chunk]:
        return [chunk async for chunk in stream]

    return asyncio.run(chunks())


def run(limit: int, script: str = LOOP, **kwargs: Any) -> tuple[str, Chunk, ScriptedStream]:
    inner = ScriptedStream(script, limit, **kwargs)
    stream = close_in_budget(ENGINE, inner, sampling(limit))
    assert isinstance(stream, ClosingStream)
    chunks = collect(stream)
    assert chunks[-1].finish_reason is not None
    return "".join(c.text for c in chunks), chunks[-1], inner


@pytest.mark.parametrize("limit", [len(SHORTEST), len(SHORTEST) + 1, 30, 47, 100, 333])
def test_a_looping_reply_is_closed_within_the_limit(limit: int) -> None:
    text, final, inner = run(limit)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert final.finish_reason == "length"
    assert final.usage is not None and final.usage.completion_tokens == len(text.encode()) <= limit
    assert text.startswith(LOOP[: len(text) - 30]) or limit < 60
    assert inner.aborted or len(inner.output) == limit


def test_the_model_text_is_kept_up_to_the_last_token_that_leaves_room() -> None:
    text, _, _ = run(60)
    assert text == '{"topic": "countries", "items": ["Land 0", "Land 1", "Lan"]}'  # 1 token left: not enough
    assert len(text) == 60


@pytest.mark.parametrize(("per_chunk", "ahead"), [(1, 0), (3, 0), (1, 2), (7, 5), (1000, 0)])
def test_the_close_does_not_depend_on_the_chunking(per_chunk: int, ahead: int) -> None:
    assert run(61, per_chunk=per_chunk, ahead=ahead)[0] == run(61)[0]


@pytest.mark.parametrize(("per_chunk", "ahead"), [(1, 0), (3, 0), (1, 2), (7, 5), (1000, 0)])
def test_the_kept_tokens_keep_their_logprobs_and_the_closing_has_none(per_chunk: int, ahead: int) -> None:
    inner = ScriptedStream(LOOP, 60, per_chunk=per_chunk, ahead=ahead, logprobs=True)
    stream = close_in_budget(ENGINE, inner, sampling(60))
    assert isinstance(stream, ClosingStream)
    chunks = collect(stream)
    spelled = "".join(e.text for chunk in chunks for e in chunk.logprobs)
    assert spelled == '{"topic": "countries", "items": ["Land 0", "Land 1", "Lan'  # the closing '"]}' was not sampled
    assert "".join(c.text for c in chunks) == spelled + '"]}'


def test_a_close_on_the_last_chunk_keeps_the_engine_usage() -> None:
    _, final, inner = run(40, per_chunk=1000)
    assert final.usage == Usage(prompt_tokens=3, completion_tokens=40, cached_tokens=2)
    assert not inner.aborted


def test_a_reply_that_ends_in_time_passes_unchanged() -> None:
    done = '{"topic": "x", "items": []}'
    text, final, inner = run(100, done, finish="stop")
    assert (text, final.finish_reason) == (done, "stop")
    assert not inner.aborted


def test_text_outside_the_grammar_passes_through() -> None:
    text, final, _ = run(30, "not json at all, really not, no braces")
    assert (text, final.finish_reason) == ("not json at all, really not, n", "length")


def test_a_limit_below_the_minimal_document_is_refused_naming_it() -> None:
    assert minimum_tokens(ENGINE, sampling(10)) == len(SHORTEST)
    check_budget(ENGINE, sampling(len(SHORTEST)))
    check_budget(ENGINE, sampling(None))
    with pytest.raises(InvalidRequest) as caught:
        check_budget(ENGINE, sampling(len(SHORTEST) - 1))
    assert caught.value.param == "max_tokens"
    assert f"at least {len(SHORTEST)}" in caught.value.message and "num_predict" in caught.value.message


def test_only_grammars_closed_at_the_limit_with_a_limit_are_wrapped() -> None:
    inner = ScriptedStream(LOOP, 10)
    assert close_in_budget(ENGINE, inner, sampling(None)) is inner
    assert close_in_budget(ENGINE, inner, SamplingParams(max_tokens=10)) is inner
    cut = SamplingParams(max_tokens=10, grammar=schema_grammar(SCHEMA), closes_at_limit=False)
    assert close_in_budget(ENGINE, inner, cut) is inner
    assert minimum_tokens(ENGINE, cut) is None


def test_a_limit_too_small_for_any_document_gives_the_shortest() -> None:
    text, final, inner = run(5)
    assert text == SHORTEST and final.finish_reason == "length" and inner.aborted


@pytest.mark.parametrize("limit", [28, 40, 64])
def test_a_thinking_model_keeps_room_for_the_answer_and_closes_it(limit: int) -> None:
    schema = {"type": "object", "properties": {"countries": {"type": "array", "items": {"type": "string"}}},
              "required": ["countries"]}
    # the fake ignores grammars and says this in both phases: a thinking that never closes, then a looping answer
    backend = RecordingBackend(script='{"countries": [' + ", ".join(f'"c{i}"' for i in range(40)))
    engine = BatchingEngine(backend)

    async def ask_it() -> tuple[str, Chunk]:
        service = service_with(engine, OPENS_THINKING)
        request = ChatRequest("m", [Message("user", "hi")], sampling(limit, schema))
        generation = await service.generation.chat(request)
        return await generation.collect()

    try:
        text, final = asyncio.run(ask_it())
    finally:
        engine.close()
    (first, _), (second, _) = backend.started
    close_tag = len("\n</think>\n\n")
    assert first.max_tokens == limit - len('{"countries":[]}') - close_tag  # the thinking leaves room
    assert second.max_tokens is not None and second.max_tokens >= len('{"countries":[]}')
    jsonschema.validate(json.loads(text), schema)
    assert final.finish_reason == "length"
    assert final.usage is not None and final.usage.completion_tokens <= limit


# ---- forced tool calls: the call format's markers closed too, and a complete call parsed ----

TOOL: dict[str, Any] = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "note": {"type": "string"}},
    "required": ["city", "note"]}}}
CALL_LOOPS = {  # a model that never ends its call's first argument
    "hermes": '<tool_call>{"name": "get_weather", "arguments": {"city": "' + "Paris " * 80,
    "json": '[{"name": "get_weather", "arguments": {"city": "' + "Paris " * 80,
    "lfm2": '<|tool_call_start|>[{"name": "get_weather", "arguments": {"city": "' + "Paris " * 80,
}

PLAIN = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: "
"""A template that renders no tools: the service puts them, and lmserve's JSON call shape, in the prompt."""


def forced_sampling(fmt: str, limit: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=limit, grammar=forced_call_grammar(get_parser(fmt), [TOOL],
                                                                                        ANY_TOOL))


@pytest.mark.parametrize("fmt", sorted(CALL_LOOPS))
def test_a_forced_call_cut_by_the_limit_is_closed_into_one_complete_call(fmt: str) -> None:
    minimum = minimum_tokens(ENGINE, forced_sampling(fmt, 1), special=True)
    assert minimum is not None
    for limit in range(minimum, minimum + 70, 3):
        inner = ScriptedStream(CALL_LOOPS[fmt], limit, per_chunk=2)
        stream = close_in_budget(ENGINE, inner, forced_sampling(fmt, limit), special=True)
        chunks = collect(cast(ClosingStream, stream))
        text = "".join(c.text for c in chunks)
        content, [call] = get_parser(fmt).parse(text)
        assert not content.strip() and call.name == "get_weather"
        arguments = json.loads(call.arguments)
        jsonschema.validate(arguments, TOOL["function"]["parameters"])
        assert limit < minimum + 10 or arguments["city"].startswith("Paris")  # the model's own text, closed
        final = chunks[-1]
        assert final.finish_reason == "length" and final.usage is not None
        assert final.usage.completion_tokens == len(text.encode()) <= limit


def test_a_limit_below_the_minimal_call_is_refused_naming_it() -> None:
    shortest = '<tool_call>{"name":"get_weather","arguments":{"city":"","note":""}}</tool_call>'
    assert minimum_tokens(ENGINE, forced_sampling("hermes", 1), special=True) == len(shortest)
    with pytest.raises(InvalidRequest) as caught:
        check_budget(ENGINE, forced_sampling("hermes", len(shortest) - 1), special=True,
                     what="call tool_choice allows")
    assert caught.value.param == "max_tokens"
    assert f"the shortest call tool_choice allows, {shortest}, takes {len(shortest)} tokens" in caught.value.message


@pytest.mark.parametrize("stream", [False, True])
def test_the_service_finishes_a_closed_forced_call_with_tool_calls(stream: bool) -> None:
    backend = RecordingBackend(script=CALL_LOOPS["json"])  # the fake ignores grammars: it says this, then ends
    engine = BatchingEngine(backend)

    async def ask_it(limit: int) -> tuple[str, Chunk]:
        service = service_with(engine, PLAIN)
        request = ChatRequest("m", [Message("user", "hi")], SamplingParams(temperature=0, max_tokens=limit),
                              tools=[TOOL], forced_tool=ANY_TOOL)
        generation = await service.generation.chat(request)
        if not stream:
            return await generation.collect()
        chunks = [chunk async for chunk in generation]
        calls = [call for chunk in chunks for call in chunk.tool_calls]
        return "".join(c.text for c in chunks), replace(chunks[-1], tool_calls=calls)

    try:
        for limit in (60, 90, 200):  # the shortest call takes 58 bytes
            text, final = asyncio.run(ask_it(limit))
            assert text == "" and final.finish_reason == "tool_calls", (limit, text)
            [call] = final.tool_calls
            jsonschema.validate(json.loads(call.arguments), TOOL["function"]["parameters"])
            assert final.usage is not None and final.usage.completion_tokens <= limit
        with pytest.raises(InvalidRequest) as caught:
            asyncio.run(ask_it(10))
        assert caught.value.param == "max_tokens" and "call tool_choice allows" in caught.value.message
    finally:
        engine.close()


def test_a_thinking_model_keeps_room_for_the_forced_call_and_closes_it() -> None:
    backend = RecordingBackend(script=CALL_LOOPS["json"])  # both phases: a thinking that never closes, then the call
    engine = BatchingEngine(backend)

    async def ask_it() -> tuple[str, Chunk]:
        service = service_with(engine, OPENS_THINKING)
        request = ChatRequest("m", [Message("user", "hi")], SamplingParams(temperature=0, max_tokens=120),
                              tools=[TOOL], forced_tool=ANY_TOOL)
        generation = await service.generation.chat(request)
        return await generation.collect()

    try:
        text, final = asyncio.run(ask_it())
    finally:
        engine.close()
    (first, _), _ = backend.started
    assert first.max_tokens == 120 - 58 - len("\n</think>\n\n")  # the thinking leaves room for the shortest call
    assert text == "" and final.finish_reason == "tool_calls"
    [call] = final.tool_calls
    jsonschema.validate(json.loads(call.arguments), TOOL["function"]["parameters"])
    assert final.usage is not None and final.usage.completion_tokens <= 120
