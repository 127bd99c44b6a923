"""The output of a Responses request: the service's chunks as output items (reasoning, the assistant's message,
function calls), the finished response object, and the typed events of a streamed answer.

One `OutputBuilder` makes both the items and the events, so a streamed and a whole answer carry the same items. A
call to a namespace tool's function comes back with the function's own name and its `namespace` (`origin` maps the
name the model saw to them).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

from lmserve.dialects.shared.errors import INTERNAL_ERROR
from lmserve.dialects.shared.logprobs import token_entries
from lmserve.dialects.shared.streaming import dumps
from lmserve.errors import EngineFailure, LmserveError
from lmserve.service import Generation
from lmserve.types import Chunk, ToolCall, Usage

Item = dict[str, Any]
Event = dict[str, Any]
Origin = Callable[[str], tuple[str, str | None]]
"""A called function's name as the model saw it → (its name, its namespace or None)."""


def new_item_id(prefix: str) -> str:
    """An output or input item id: `msg_…`, `fc_…`, `fco_…`, `rs_…`."""
    return f"{prefix}_{secrets.token_hex(16)}"


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.total_tokens,
    }


class OutputBuilder:
    """Chunks in, output items and stream events out.

    One item is open at a time (reasoning or the message); a new kind of piece closes it and opens the next, and a
    function call is an item of its own. Whitespace-only text waits until real text comes, so a reply that is only
    calls (or only thinking then calls) has no empty message; a reply with no items at all gets one message.
    Events have no sequence numbers yet (`Framer` adds them). A chunk's log-probabilities (asked for with
    `include`) go with its text: to the delta event and the message's output_text part. `origin` names a call's
    function and namespace from the name the model used (by default: that name, no namespace).
    """

    def __init__(self, origin: Origin | None = None) -> None:
        self.items: list[Item] = []
        self._origin = origin or _plain
        self._open: Item | None = None
        self._pieces: list[str] = []
        self._logprobs: list[Item] = []
        self._pending = ""
        self._pending_logprobs: list[Item] = []

    @property
    def _index(self) -> int:
        return len(self.items)

    def push(self, chunk: Chunk) -> list[Event]:
        events: list[Event] = []
        if chunk.reasoning:
            events += self._reasoning(chunk.reasoning)
        if chunk.text:
            events += self._text(chunk.text, token_entries(chunk.logprobs))
        for call in chunk.tool_calls:
            events += self._call(call)
        return events

    def finish(self, status: Literal["completed", "incomplete"]) -> list[Event]:
        """Close what is open (with `status`); a reply without a message or a call gets its (maybe empty) message."""
        events: list[Event] = []
        if not any(item["type"] in ("message", "function_call") for item in self.items) and (
                self._open is None or self._open["type"] != "message"):
            events += self._close("completed")
            events += self._open_message()
            if self._pending:
                events += self._delta(self._pending, self._pending_logprobs)
                self._pending, self._pending_logprobs = "", []
        return events + self._close(status)

    # pieces

    def _reasoning(self, delta: str) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open["type"] != "reasoning":
            events += self._close("completed")
            self._open = {"id": new_item_id("rs"), "type": "reasoning", "summary": [], "content": [],
                          "status": "in_progress"}
            events.append(self._item_event("response.output_item.added", self._open))
            events.append(self._part_event("response.content_part.added", {"type": "reasoning_text", "text": ""}))
        self._pieces.append(delta)
        events.append({"type": "response.reasoning_text.delta", **self._where(), "delta": delta})
        return events

    def _text(self, delta: str, logprobs: list[Item]) -> list[Event]:
        if self._open is not None and self._open["type"] == "message":
            return self._delta(delta, logprobs)
        if not (self._pending + delta).strip():
            self._pending += delta
            self._pending_logprobs += logprobs
            return []
        events = self._close("completed") + self._open_message()
        events += self._delta(self._pending + delta, self._pending_logprobs + logprobs)
        self._pending, self._pending_logprobs = "", []
        return events

    def _call(self, call: ToolCall) -> list[Event]:
        events = self._close("completed")
        self._pending, self._pending_logprobs = "", []
        name, namespace = self._origin(call.name)
        item: Item = {"id": new_item_id("fc"), "type": "function_call", "call_id": call.id or new_item_id("call"),
                      "name": name, **({"namespace": namespace} if namespace else {}), "arguments": "",
                      "status": "in_progress"}
        where = {"item_id": item["id"], "output_index": self._index}
        events.append(self._item_event("response.output_item.added", item))
        events.append({"type": "response.function_call_arguments.delta", **where, "delta": call.arguments})
        events.append({"type": "response.function_call_arguments.done", **where, "arguments": call.arguments})
        done = {**item, "arguments": call.arguments, "status": "completed"}
        events.append(self._item_event("response.output_item.done", done))
        self.items.append(done)
        return events

    # the open item

    def _open_message(self) -> list[Event]:
        self._open = {"id": new_item_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                      "content": []}
        return [self._item_event("response.output_item.added", self._open),
                self._part_event("response.content_part.added", _output_text(""))]

    def _delta(self, delta: str, logprobs: list[Item]) -> list[Event]:
        self._pieces.append(delta)
        self._logprobs += logprobs
        return [{"type": "response.output_text.delta", **self._where(), "delta": delta, "logprobs": logprobs}]

    def _close(self, status: Literal["completed", "incomplete"]) -> list[Event]:
        item = self._open
        if item is None:
            return []
        text = "".join(self._pieces)
        if item["type"] == "reasoning":
            part: Item = {"type": "reasoning_text", "text": text}
            events = [{"type": "response.reasoning_text.done", **self._where(), "text": text}]
        else:
            part = _output_text(text, self._logprobs)
            events = [{"type": "response.output_text.done", **self._where(), "text": text,
                       "logprobs": self._logprobs}]
        events.append(self._part_event("response.content_part.done", part))
        done = {**item, "content": [part], "status": status}
        events.append(self._item_event("response.output_item.done", done))
        self.items.append(done)
        self._open, self._pieces, self._logprobs = None, [], []
        return events

    def _where(self) -> Event:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": self._index, "content_index": 0}

    def _item_event(self, kind: str, item: Item) -> Event:
        return {"type": kind, "output_index": self._index, "item": item}

    def _part_event(self, kind: str, part: Item) -> Event:
        return {"type": kind, **self._where(), "part": part}


def _plain(name: str) -> tuple[str, str | None]:
    return name, None


def _output_text(text: str, logprobs: list[Item] | None = None) -> Item:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def finished_response(head: dict[str, Any], builder: OutputBuilder, final: Chunk, usage: Usage) -> dict[str, Any]:
    """The response object once its generation ended (status completed, or incomplete at max_output_tokens)."""
    is_cut = final.finish_reason == "length"
    return {
        **head,
        "status": "incomplete" if is_cut else "completed",
        "completed_at": int(time.time()),
        "incomplete_details": {"reason": "max_output_tokens"} if is_cut else None,
        "output": builder.items,
        "usage": usage_body(usage),
    }


def response_usage(generation: Generation, final: Chunk) -> Usage:
    """The usage of a finished generation (its final chunk's, or the prompt's size alone when it has none)."""
    return final.usage if final.usage is not None else Usage(prompt_tokens=generation.num_prompt_tokens)


def _status(final: Chunk) -> Literal["completed", "incomplete"]:
    return "incomplete" if final.finish_reason == "length" else "completed"


async def run_whole(generation: Generation, builder: OutputBuilder) -> Chunk:
    """Feed the whole generation to `builder`; the final chunk. An engine failure is an EngineFailure."""
    try:
        async for chunk in generation:
            builder.push(chunk)
            if chunk.finish_reason is not None:
                if chunk.is_failed:
                    raise EngineFailure(chunk.error or "the generation failed")
                builder.finish(_status(chunk))
                return chunk
    finally:
        generation.abort()
    raise EngineFailure("the generation ended without a result")


class Framer:
    """Numbers events (`sequence_number` from 0) and encodes each as one SSE event named by its type."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, event: Event) -> bytes:
        numbered = {**event, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return f"event: {event['type']}\ndata: {dumps(numbered)}\n\n".encode()

    def error(self, exc: Exception) -> bytes:
        """An `error` event: what an unexpected failure after the stream started becomes."""
        err = exc if isinstance(exc, LmserveError) else LmserveError(INTERNAL_ERROR)
        return self({"type": "error", "code": err.code or err.type, "message": err.message, "param": err.param})


async def stream_events(generation: Generation, head: dict[str, Any], framer: Framer,
                        save: Callable[[dict[str, Any]], Awaitable[None]],
                        builder: OutputBuilder | None = None) -> AsyncIterator[bytes]:
    """created, in_progress, the items' events (made by `builder`), then completed (or incomplete; failed when the
    engine fails). The finished response is saved (`save`) before the last event, so a client that reads it can
    retrieve it."""
    builder = builder or OutputBuilder()
    yield framer({"type": "response.created", "response": head})
    yield framer({"type": "response.in_progress", "response": head})
    async for chunk in generation:
        for event in builder.push(chunk):
            yield framer(event)
        if chunk.finish_reason is None:
            continue
        if chunk.is_failed:
            error = {"code": "server_error", "message": chunk.error or "the generation failed"}
            yield framer({"type": "response.failed", "response": {**head, "status": "failed", "error": error}})
            return
        for event in builder.finish(_status(chunk)):
            yield framer(event)
        response = finished_response(head, builder, chunk, response_usage(generation, chunk))
        await save(response)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        yield framer({"type": kind, "response": response})
        return
