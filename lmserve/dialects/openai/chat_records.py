"""What a `store: true` chat completion keeps: the reply (whole, or assembled from its stream), its metadata and the
request's messages, saved in the completions store (lmserve/store/completions.py).

The route asks `keeper(store, body, head)` for a `Keeper` (None when nothing is to be kept); it gives the reply a
time-stamped id the store can keep. A whole reply is saved as returned (`Keeper.whole`); a streamed one is assembled
from the very frames the client gets (`Keeper.stream`), so every field a frame carries (content, thinking, tool
call deltas, logprobs, several choices) is kept as a client would assemble it. A stream always asks for usage (the
record has it); a client that did not ask gets its frames without it. The record is saved before `[DONE]`, so a
client that read the stream to the end finds it; a stream cut short or ending in an error saves nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from lmserve.dialects.openai import schemas
from lmserve.dialects.shared.streaming import SSE_DONE, sse_json
from lmserve.store.completions import CompletionStore, StoredCompletion, new_completion_id

log = logging.getLogger(__name__)

ECHOED = ("seed", "temperature", "top_p", "presence_penalty", "frequency_penalty", "tools", "tool_choice",
          "response_format")
"""Request fields a stored completion shows again (as OpenAI's stored completions do; null when not sent)."""


def keeper(store: CompletionStore | None, body: schemas.ChatCompletionRequest, head: dict[str, Any]) -> Keeper | None:
    """A Keeper for a request that asked to be stored (and a server with a store), else None. The reply's id in
    `head` becomes one the store can keep (time-stamped, as long as the others)."""
    if store is None or not body.store:
        return None
    head["id"] = new_completion_id()
    return Keeper(store, body)


def stored_messages(completion_id: str, messages: list[schemas.ChatMessage]) -> list[dict[str, Any]]:
    """The request's messages as `GET /v1/chat/completions/{id}/messages` lists them: ids `<completion id>-<i>`, the
    text as `content`, and the parts sent (text and images) as `content_parts` when the content was a list."""
    items = []
    for i, message in enumerate(messages):
        content: str | None
        parts: list[dict[str, Any]] | None = None
        if isinstance(message.content, list):
            parts = [part.model_dump(mode="json", exclude_none=True) for part in message.content]
            content = "\n".join(part.text for part in message.content if isinstance(part, schemas.TextPart))
        else:
            content = message.content
        item: dict[str, Any] = {"id": f"{completion_id}-{i}", "role": message.role, "content": content,
                                "name": message.name, "content_parts": parts}
        if message.tool_calls:
            item["tool_calls"] = [call.model_dump(mode="json") for call in message.tool_calls]
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        items.append(item)
    return items


class Keeper:
    """Saves one chat completion, with its request's metadata and messages."""

    def __init__(self, store: CompletionStore, body: schemas.ChatCompletionRequest) -> None:
        self.store = store
        self.body = body

    def record(self, completion: dict[str, Any]) -> StoredCompletion:
        """The stored form of `completion`: as returned, plus the metadata and the echoed request fields."""
        sent = self.body.model_dump(mode="json", include=set(ECHOED), by_alias=True, exclude_unset=True)
        echoed = {name: sent.get(name) for name in ECHOED}
        kept = {**completion, **echoed, "input_user": self.body.user, "metadata": dict(self.body.metadata or {})}
        return StoredCompletion(completion=kept, messages=stored_messages(str(completion["id"]), self.body.messages),
                                requested_model=self.body.model)

    async def whole(self, completion: dict[str, Any]) -> None:
        """Save a whole (not streamed) reply."""
        await asyncio.to_thread(self.store.save, self.record(completion))

    async def stream(self, frames: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """Pass the SSE `frames` of a reply on (without usage unless the client asked for it), assembling the reply;
        save it just before `[DONE]`."""
        assembly = StreamAssembly()
        wants_usage = self.body.include_usage
        async for frame in frames:
            if frame == SSE_DONE:
                completion = assembly.completion()
                if completion is not None:
                    await self.whole(completion)
                yield frame
                continue
            event = _payload(frame)
            if event is None:
                yield frame
                continue
            assembly.add(event)
            if wants_usage or "usage" not in event:
                yield frame
            elif event.get("choices") or event["usage"] is None:  # the usage it did not ask for: not sent
                yield sse_json({key: value for key, value in event.items() if key != "usage"})


def _payload(frame: bytes) -> dict[str, Any] | None:
    """The JSON object of a one-event SSE frame (`data: {…}`), or None for anything else."""
    if not frame.startswith(b"data: {"):
        return None
    try:
        event = json.loads(frame[6:])
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


class StreamAssembly:
    """A chat completion put together from its `chat.completion.chunk` events, as a client assembles them."""

    def __init__(self) -> None:
        self.head: dict[str, Any] = {}
        self.choices: dict[int, dict[str, Any]] = {}
        self.usage: dict[str, Any] | None = None
        self.failed = False

    def add(self, event: dict[str, Any]) -> None:
        """Take in one event: a chunk (its choices' deltas, its usage) or an error (nothing is kept then)."""
        if "error" in event:
            self.failed = True
            return
        if not self.head:
            self.head = {key: value for key, value in event.items() if key not in ("choices", "usage")}
        if event.get("usage") is not None:
            self.usage = event["usage"]
        for choice in event.get("choices") or ():
            self._add_choice(choice)

    def _add_choice(self, delta_choice: dict[str, Any]) -> None:
        index = int(delta_choice.get("index") or 0)
        choice = self.choices.setdefault(index, {"index": index, "text": [], "reasoning": [], "calls": {},
                                                 "logprobs": None, "finish_reason": None})
        delta = delta_choice.get("delta") or {}
        if delta.get("content"):
            choice["text"].append(delta["content"])
        if delta.get("reasoning_content"):
            choice["reasoning"].append(delta["reasoning_content"])
        for call in delta.get("tool_calls") or ():
            kept = choice["calls"].setdefault(int(call.get("index") or 0),
                                              {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            kept["id"] = call.get("id") or kept["id"]
            function = call.get("function") or {}
            kept["function"]["name"] += function.get("name") or ""
            kept["function"]["arguments"] += function.get("arguments") or ""
        if delta_choice.get("logprobs"):
            choice["logprobs"] = _merge_logprobs(choice["logprobs"], delta_choice["logprobs"])
        if delta_choice.get("finish_reason") is not None:
            choice["finish_reason"] = delta_choice["finish_reason"]

    def completion(self) -> dict[str, Any] | None:
        """The whole `chat.completion`, or None when the stream failed or had no chunk."""
        if self.failed or not self.head:
            return None
        choices = [_finished(self.choices[index]) for index in sorted(self.choices)]
        return {**self.head, "object": "chat.completion", "choices": choices, "usage": self.usage}


def _finished(choice: dict[str, Any]) -> dict[str, Any]:
    text = "".join(choice["text"])
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    if choice["reasoning"]:
        message["reasoning_content"] = "".join(choice["reasoning"])
    if choice["calls"]:
        message["tool_calls"] = [choice["calls"][i] for i in sorted(choice["calls"])]
        message["content"] = text.strip() or None
    return {"index": choice["index"], "message": message, "logprobs": choice["logprobs"],
            "finish_reason": choice["finish_reason"]}


def _merge_logprobs(kept: dict[str, Any] | None, more: dict[str, Any]) -> dict[str, Any]:
    """The logprobs of a choice so far, with one chunk's appended (each list field is concatenated)."""
    merged = dict(kept or {})
    for key, value in more.items():
        if isinstance(value, list):
            merged[key] = [*(merged.get(key) or []), *value]
        elif key not in merged:
            merged[key] = value
    return merged
