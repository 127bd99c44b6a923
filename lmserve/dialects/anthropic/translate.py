"""Anthropic Messages requests as the service's records: a ChatRequest from a body (system, content blocks, tool_use and
tool_result blocks, thinking), its images, tools and options."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lmserve import options as opts
from lmserve.chat.media import MediaPolicy, decode_base64, load_all, load_url
from lmserve.chat.structured import schema_grammar
from lmserve.dialects.anthropic import schemas as wire
from lmserve.dialects.shared.streaming import dumps
from lmserve.errors import InvalidRequest, TemplateRejected
from lmserve.types import (
    EFFORTS,
    IMAGE_PLACEHOLDER,
    ChatRequest,
    Message,
    RequestOptions,
    SamplingParams,
    ToolCall,
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
