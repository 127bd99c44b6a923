"""The Anthropic Messages API: POST /v1/messages and /v1/messages/count_tokens, and their translators.

A body is parsed into a wire model (anthropic_schemas.py) and translated once into a `ChatRequest`
(`to_chat_request`): `system` becomes the system message, content blocks become text with image placeholders,
`tool_use` blocks become the assistant's tool calls, `tool_result` blocks become tool messages, and earlier
thinking blocks the assistant turn's thinking (`Message.thinking`). The service's chunks are translated back into a
message (`message_body`) or the Messages stream (`message_events`): thinking blocks from `Chunk.reasoning`, text
blocks from `Chunk.text`, `tool_use` blocks from `Chunk.tool_calls`.

Usage follows Anthropic's accounting: `input_tokens` are the prompt tokens that were not read from the cache, and
`cache_read_input_tokens` those that were (their sum is the prompt). The service reports a stop string only as
finish "stop"; which stop sequence ended a reply is found after the answer in the generated tokens
(`Generation.stop_string`).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from lmserve import options as opts
from lmserve.dialects.anthropic import schemas as wire
from lmserve.dialects.anthropic.context import apply_edits
from lmserve.dialects.shared.json_body import JsonBodyRoute
from lmserve.dialects.shared.streaming import GenerationResponse, dumps, guarded_errors, until_disconnect
from lmserve.dialects.shared.errors import INTERNAL_ERROR, anthropic_error
from lmserve.chat.media import MediaPolicy, decode_base64, load_all, load_url
from lmserve.chat.structured import schema_grammar
from lmserve.errors import EngineFailure, InvalidRequest, LmserveError, TemplateRejected
from lmserve.service import Generation, Service
from lmserve.types import (
    EFFORTS,
    IMAGE_PLACEHOLDER,
    ChatRequest,
    Chunk,
    Message,
    RequestOptions,
    SamplingParams,
    ToolCall,
    Usage,
)

log = logging.getLogger(__name__)

Head = dict[str, Any]
ImageSource = wire.Base64Source | wire.UrlSource

STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}
"""The service's finish reasons as Anthropic stop reasons (a stop string's "stop" is "stop_sequence")."""


# ---- requests → records ---------------------------------------------------------------------------


def to_chat_request(
    req: wire.CountTokensRequest, images: list[bytes] | None = None
) -> ChatRequest:
    """The engine-neutral chat request. `images` are the request's images in order, already loaded
    (`load_images`); without them, image blocks are refused."""
    sources = image_sources(req)
    if images is None:
        if sources:
            raise InvalidRequest("this request's images were not loaded", param="messages")
        images = []
    if len(images) != len(sources):
        raise InvalidRequest(f"{len(sources)} images were sent but {len(images)} were loaded", param="messages")
    messages = to_messages(req, iter(images))
    if all(turn.role == "system" for turn in req.messages):
        raise InvalidRequest("messages: at least one user or assistant message is required", param="messages")
    tools = [] if _choice_type(req) == "none" else [_tool(t) for t in req.tools or ()]
    forced, parallel = _forced_tool(req.tool_choice, tools)
    think, budget = _thinking(req.thinking, req.output_config)
    output_format = req.output_config.format if req.output_config is not None else None
    grammar = schema_grammar(output_format.schema_, param="output_config") if output_format is not None else None
    return ChatRequest(model=req.model, messages=messages, sampling=SamplingParams(grammar=grammar), tools=tools,
                       forced_tool=forced, parallel_tool_calls=parallel, think=think, reasoning_budget=budget,
                       options=to_options(req))


def to_options(req: wire.CountTokensRequest) -> RequestOptions:
    """max_tokens, temperature, top_p, top_k and stop_sequences (count_tokens has none)."""
    if not isinstance(req, wire.MessagesRequest):
        return RequestOptions()
    fields = {"max_tokens": req.max_tokens, "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
              "stop": req.stop_sequences}
    return RequestOptions(opts.from_openai(fields))


def to_messages(req: wire.CountTokensRequest, images: Iterator[bytes]) -> list[Message]:
    """`system`, then each turn: a user turn's tool_result blocks are tool messages (in place), its other blocks one
    user message; an assistant turn is one message with its text and tool calls."""
    messages: list[Message] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else _joined([block.text for block in req.system])
        messages.append(Message(role="system", content=system))
    tool_names: dict[str, str] = {}
    for i, turn in enumerate(req.messages):
        if isinstance(turn.content, str):
            messages.append(Message(role=turn.role, content=turn.content))
        elif turn.role == "system":
            messages.append(Message(role="system", content=_system_text(i, turn.content)))
        elif turn.role == "assistant":
            message = _assistant(i, turn.content, images)
            tool_names.update((call.id, call.name) for call in message.tool_calls)
            messages.append(message)
        else:
            messages += _user(i, turn.content, images, tool_names)
    return messages


def _system_text(index: int, blocks: list[wire.ContentBlock]) -> str:
    """A mid-conversation system message's text: its text blocks, a newline between two."""
    texts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, wire.TextBlock):
            raise InvalidRequest(f"messages.{index}.content.{j}: a system message takes text blocks only, "
                                 f"not '{block.type}'", param="messages")
        texts.append(block.text)
    return _joined(texts)


def _assistant(index: int, blocks: list[wire.ContentBlock], images: Iterator[bytes]) -> Message:
    parts: list[wire.TextBlock | wire.ImageBlock] = []
    calls: list[ToolCall] = []
    thoughts: list[str] = []
    for j, block in enumerate(blocks):
        if isinstance(block, wire.ThinkingBlock):
            thoughts.append(block.thinking)
        elif isinstance(block, wire.ToolUseBlock):
            calls.append(ToolCall(block.name, dumps(block.input), block.id))
        elif isinstance(block, wire.ToolResultBlock):
            raise InvalidRequest(f"messages[{index}].content[{j}]: a tool_result block belongs in a user message",
                                 param="messages")
        elif isinstance(block, wire.TextBlock | wire.ImageBlock):
            parts.append(block)
        # redacted_thinking: nothing of it can be shown to the model
    text, message_images = _content(parts, images)
    return Message(role="assistant", content=text, images=message_images, tool_calls=calls,
                   thinking="\n\n".join(t for t in thoughts if t))


def _user(index: int, blocks: list[wire.ContentBlock], images: Iterator[bytes],
          tool_names: dict[str, str]) -> list[Message]:
    messages: list[Message] = []
    parts: list[wire.TextBlock | wire.ImageBlock] = []

    def flush() -> None:
        if parts:
            text, message_images = _content(parts, images)
            messages.append(Message(role="user", content=text, images=message_images))
            parts.clear()

    for j, block in enumerate(blocks):
        if isinstance(block, wire.ToolResultBlock):
            flush()
            result: list[wire.TextBlock | wire.ImageBlock] = (
                list(block.content) if isinstance(block.content, list)
                else [wire.TextBlock(type="text", text=block.content or "")])
            text, message_images = _content(result, images)
            messages.append(Message(role="tool", content=text, images=message_images, tool_call_id=block.tool_use_id,
                                    name=tool_names.get(block.tool_use_id)))
        elif isinstance(block, wire.ToolUseBlock):
            raise InvalidRequest(f"messages[{index}].content[{j}]: a tool_use block belongs in an assistant message",
                                 param="messages")
        elif isinstance(block, wire.TextBlock | wire.ImageBlock):
            parts.append(block)
    flush()
    return messages


def _content(blocks: list[wire.TextBlock | wire.ImageBlock], images: Iterator[bytes]) -> tuple[str, list[bytes]]:
    """Text blocks in order (a newline between two), an IMAGE_PLACEHOLDER where each image block stood; and the
    images, taken in order from `images`."""
    out = ""
    taken: list[bytes] = []
    previous_is_text = False
    for block in blocks:
        if isinstance(block, wire.ImageBlock):
            out += IMAGE_PLACEHOLDER
            taken.append(next(images))
            previous_is_text = False
        else:
            out += ("\n" if previous_is_text else "") + block.text
            previous_is_text = True
    return out, taken


def _joined(texts: list[str]) -> str:
    return "\n".join(texts)


def _tool(tool: wire.Tool) -> dict[str, Any]:
    """An Anthropic tool as the OpenAI-shaped function definition the service and templates take."""
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    function["parameters"] = tool.input_schema
    return {"type": "function", "function": function}


def _choice_type(req: wire.CountTokensRequest) -> str:
    return req.tool_choice.type if req.tool_choice is not None else "auto"


def _forced_tool(choice: wire.ToolChoice | None, tools: list[dict[str, Any]]) -> tuple[str | None, bool]:
    """tool_choice as (the forced tool: "*" for any, a name, None), and whether parallel calls are allowed."""
    if choice is None or isinstance(choice, wire.ToolChoiceNone):
        return None, True
    parallel = not choice.disable_parallel_tool_use
    if isinstance(choice, wire.ToolChoiceAuto):
        return None, parallel
    if not tools:
        raise InvalidRequest(f"tool_choice {choice.type!r} requires tools", param="tool_choice")
    if isinstance(choice, wire.ToolChoiceAny):
        return "*", parallel
    if choice.name not in {t["function"]["name"] for t in tools}:
        raise InvalidRequest(f"tool_choice names '{choice.name}', which is not among the tools", param="tool_choice")
    return choice.name, parallel


def _thinking(
    config: wire.ThinkingConfig | None, output: wire.OutputConfig | None
) -> tuple[bool | str | None, int | None]:
    """`thinking` as (ChatRequest.think, ChatRequest.reasoning_budget); with thinking on, `output_config.effort`
    is its effort (types.EFFORTS)."""
    if config is None or isinstance(config, wire.ThinkingDisabled):
        return (None if config is None else False), None
    effort = output.effort if output is not None else None
    think: bool | str = True if effort is None else EFFORTS[effort]
    return think, config.budget_tokens if isinstance(config, wire.ThinkingEnabled) else None


def image_sources(req: wire.CountTokensRequest) -> list[tuple[str, ImageSource]]:
    """Every image block of the request, in order (tool results' included), as (where, source)."""
    found: list[tuple[str, ImageSource]] = []
    for i, turn in enumerate(req.messages):
        if isinstance(turn.content, str):
            continue
        for j, block in enumerate(turn.content):
            where = f"messages[{i}].content[{j}]"
            if isinstance(block, wire.ImageBlock):
                found.append((f"{where}.source", block.source))
            elif isinstance(block, wire.ToolResultBlock) and isinstance(block.content, list):
                found += [(f"{where}.content[{k}].source", part.source)
                          for k, part in enumerate(block.content) if isinstance(part, wire.ImageBlock)]
    return found


async def load_images(req: wire.CountTokensRequest, policy: MediaPolicy) -> list[bytes]:
    """The request's images as checked bytes: base64 decoded, URLs fetched (concurrently) under `policy`; a
    refusal is a 400 naming the block (see chat/media.py)."""

    async def one(source: ImageSource) -> bytes:
        if isinstance(source, wire.Base64Source):
            if not source.media_type.lower().startswith("image/"):
                raise InvalidRequest(f"media_type {source.media_type!r} is not an image")
            return decode_base64(source.data, policy).data
        if source.url[:7].lower() == "http://" or source.url[:8].lower() == "https://":
            return await load_url(source.url, policy)
        raise InvalidRequest("an image url must be http(s)")

    loaded = await load_all([[(where, one(source)) for where, source in image_sources(req)]], param="messages")
    return loaded[0]


@contextmanager
def system_refusals(req: wire.CountTokensRequest) -> Iterator[None]:
    """A chat template that refuses a request with mid-conversation system messages refuses them in Anthropic's
    words ("role 'system' is not supported on this model"), which Claude Code answers by sending them again as
    user text."""
    try:
        yield
    except TemplateRejected as exc:
        if not any(turn.role == "system" for turn in req.messages):
            raise
        raise InvalidRequest(f"messages: role 'system' is not supported on this model ({exc.message}); send "
                             "the system text in the top-level `system` field", param="messages") from exc


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


# ---- routes ---------------------------------------------------------------------------------------


def anthropic_router(service: Service, media: MediaPolicy | None = None) -> APIRouter:
    """POST /v1/messages and /v1/messages/count_tokens over `service`; images are loaded under `media`."""
    router = APIRouter(prefix="/v1", route_class=JsonBodyRoute)
    policy = media or MediaPolicy()

    async def chat_request(body: wire.CountTokensRequest) -> ChatRequest:
        images = None
        if sources := image_sources(body):
            service.generation.check_images(body.model, len(sources))  # before fetching anything
            images = await load_images(body, policy)
        return to_chat_request(body, images)

    async def edited_request(body: wire.CountTokensRequest) -> tuple[ChatRequest, list[dict[str, Any]]]:
        """The chat request with `context_management`'s edits applied, and the edits applied."""
        return await apply_edits(await chat_request(body), body.context_management, service.generation.count_tokens)

    @router.post("/messages", response_model=None)
    async def messages(body: wire.MessagesRequest, request: Request) -> Response:
        with system_refusals(body):
            chat, edits = await edited_request(body)
            generation = await service.generation.chat(chat)
        head = make_head(generation.model)
        extra = {} if body.context_management is None else {"context_management": {"applied_edits": edits}}
        if body.stream:
            frames = message_events(generation, head, extra)
            return GenerationResponse(generation, guarded_errors(frames, error_event))
        text, final = await until_disconnect(generation.collect(), request.receive)
        usage = final.usage or Usage(prompt_tokens=generation.num_prompt_tokens)
        reason = stop_reason(final, usage, generation.sampling.max_tokens)
        blocks = content_blocks(final.reasoning, text, final.tool_calls)
        return JSONResponse({**message_body(head, blocks, reason, final.stop_string, usage), **extra})

    @router.post("/messages/count_tokens")
    async def messages_count_tokens(body: wire.CountTokensRequest) -> dict[str, int]:
        with system_refusals(body):
            chat, _ = await edited_request(body)
            return {"input_tokens": await service.generation.count_tokens(chat)}

    return router
