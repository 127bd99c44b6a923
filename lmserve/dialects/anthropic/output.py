"""The service's records as Anthropic Messages answers: a whole message (message_body) or the Messages stream's events
(message_events), usage in Anthropic's accounting, stop reasons."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from lmserve.dialects.anthropic.errors import anthropic_error
from lmserve.dialects.anthropic.translate import STOP_REASONS, Head
from lmserve.dialects.shared.errors import INTERNAL_ERROR
from lmserve.dialects.shared.streaming import dumps
from lmserve.errors import EngineFailure, LmserveError
from lmserve.service import Generation
from lmserve.types import (
    Chunk,
    ToolCall,
    Usage,
)

log = logging.getLogger(__name__)

# ---- records → responses --------------------------------------------------------------------------


def make_head(model: str) -> Head:
    """Fields of a message shared by the response and the stream's message_start."""
    return {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant", "model": model}


def usage_body(usage: Usage) -> dict[str, Any]:
    """Anthropic usage: input_tokens exclude what was read from the cache (cache_read_input_tokens)."""
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
    }


def stop_reason(final: Chunk, usage: Usage, max_tokens: int | None) -> str:
    """end_turn, max_tokens, stop_sequence or tool_use; a "length" finish short of max_tokens is the context
    filling up: model_context_window_exceeded."""
    if final.stop_string is not None:
        return "stop_sequence"
    if final.finish_reason == "length" and max_tokens is not None and usage.completion_tokens < max_tokens:
        return "model_context_window_exceeded"
    return STOP_REASONS.get(str(final.finish_reason), "end_turn")


def tool_use_id(call: ToolCall) -> str:
    """The call's id in Anthropic's form: toolu_…"""
    return call.id if call.id.startswith("toolu_") else "toolu_" + (call.id.removeprefix("call_") or uuid.uuid4().hex)


def tool_input(call: ToolCall) -> dict[str, Any]:
    """The call's arguments as an object (the parsers give the JSON text of one)."""
    try:
        parsed = json.loads(call.arguments or "{}")
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        log.warning("tool call %s: arguments are not a JSON object: %r", call.name, call.arguments)
        return {}
    return parsed


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": tool_use_id(call), "name": call.name, "input": tool_input(call)}


def thinking_block(thinking: str) -> dict[str, Any]:
    """A thinking block; its `signature` is empty (lmserve signs nothing)."""
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def content_blocks(reasoning: str, text: str, calls: list[ToolCall]) -> list[dict[str, Any]]:
    """Thinking, then text, then tool_use blocks. Text that is only whitespace beside other blocks is left out,
    and so is the whitespace before a call; a reply with nothing at all still has one (empty) text block."""
    blocks: list[dict[str, Any]] = []
    if reasoning:
        blocks.append(thinking_block(reasoning))
    if text.strip():
        blocks.append({"type": "text", "text": text.rstrip() if calls else text})
    blocks += [tool_use_block(call) for call in calls]
    return blocks or [{"type": "text", "text": text}]


def message_body(head: Head, blocks: list[dict[str, Any]], reason: str, stop_sequence: str | None,
                 usage: Usage) -> dict[str, Any]:
    return {**head, "content": blocks, "stop_reason": reason, "stop_sequence": stop_sequence,
            "usage": usage_body(usage)}


def sse(event: str, data: dict[str, Any]) -> bytes:
    """One Server-Sent Event with its `event:` line, as the Messages stream has them."""
    return f"event: {event}\ndata: {dumps(data)}\n\n".encode()


PING = sse("ping", {"type": "ping"})


def error_event(exc: Exception) -> bytes:
    """An error after the stream started: one `error` event, then the stream ends."""
    err = exc if isinstance(exc, LmserveError) else LmserveError(INTERNAL_ERROR)
    return sse("error", anthropic_error(err))


class Blocks:
    """The content blocks of a stream: opened as their kind of output starts, closed when another starts.

    As in `content_blocks`: text that is only whitespace is held until real text follows, so a reply that is
    thinking and tool calls has no whitespace text block, and whitespace at the end of a text block is held until
    more text follows, so that the whitespace before a call is dropped; `finish` gives a reply with no block one.
    """

    def __init__(self) -> None:
        self.count = 0
        self.open: str | None = None
        self.held = ""

    def thinking(self, text: str) -> Iterator[bytes]:
        yield from self._switch("thinking", thinking_block(""))
        yield self._delta({"type": "thinking_delta", "thinking": text})

    def text(self, text: str) -> Iterator[bytes]:
        text, self.held = self.held + text, ""
        if self.open != "text":
            if not text.strip():
                self.held = text
                return
            yield from self._switch("text", {"type": "text", "text": ""})
        body = text.rstrip()
        self.held = text[len(body):]
        if body:
            yield self._delta({"type": "text_delta", "text": body})

    def tool_use(self, call: ToolCall) -> Iterator[bytes]:
        yield from self._switch("tool_use", {**tool_use_block(call), "input": {}})
        yield self._delta({"type": "input_json_delta", "partial_json": dumps(tool_input(call))})
        yield from self._close()

    def finish(self) -> Iterator[bytes]:
        if self.count == 0:
            yield from self._switch("text", {"type": "text", "text": ""})
        if self.open == "text" and self.held:
            yield self._delta({"type": "text_delta", "text": self.held})
        yield from self._close()

    def _switch(self, kind: str, block: dict[str, Any]) -> Iterator[bytes]:
        if self.open == kind:
            return
        yield from self._close()
        self.open = kind
        self.count += 1
        self.held = ""
        yield sse("content_block_start", {"type": "content_block_start", "index": self.count - 1,
                                          "content_block": block})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self.count - 1, "delta": delta})

    def _close(self) -> Iterator[bytes]:
        if self.open is not None:
            self.open = None
            yield sse("content_block_stop", {"type": "content_block_stop", "index": self.count - 1})


async def message_events(generation: Generation, head: Head,
                         extra: dict[str, Any] | None = None) -> AsyncIterator[bytes]:
    """The Messages stream: message_start, ping, each block's start / deltas / stop, message_delta (stop reason,
    usage and the `extra` fields, e.g. context_management), message_stop; an `error` event if the generation
    fails."""
    start_usage = {**usage_body(Usage(prompt_tokens=generation.num_prompt_tokens)), "output_tokens": 0}
    message = {**head, "content": [], "stop_reason": None, "stop_sequence": None, "usage": start_usage}
    yield sse("message_start", {"type": "message_start", "message": message})
    yield PING
    blocks = Blocks()
    async for chunk in generation:
        if chunk.reasoning:
            for frame in blocks.thinking(chunk.reasoning):
                yield frame
        if chunk.text:
            for frame in blocks.text(chunk.text):
                yield frame
        for call in chunk.tool_calls:
            for frame in blocks.tool_use(call):
                yield frame
        if chunk.finish_reason is None:
            continue
        if chunk.is_failed:
            yield error_event(EngineFailure(chunk.error or "the generation failed"))
            return
        for frame in blocks.finish():
            yield frame
        usage = chunk.usage or Usage(prompt_tokens=generation.num_prompt_tokens)
        delta = {"stop_reason": stop_reason(chunk, usage, generation.sampling.max_tokens),
                 "stop_sequence": chunk.stop_string}
        yield sse("message_delta", {"type": "message_delta", "delta": delta, "usage": usage_body(usage),
                                    **(extra or {})})
        yield sse("message_stop", {"type": "message_stop"})
        return
