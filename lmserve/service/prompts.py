"""Prompts: a chat request rendered with the model's template, its images and clips marked, tokenized for the engine.

Tools are never dropped: when the model's template does not render the request's tools (found once per template by
rendering a probe tool), they go in the system prompt with lmserve's JSON call shape (`chat.tools.tools_prompt`),
and earlier assistant calls are written into their turns' text in that shape.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Hashable
from dataclasses import replace
from typing import Any, cast

from lmserve.chat.audio import is_audio, to_clip
from lmserve.chat.media import to_bitmap
from lmserve.chat.reasoning import ReasoningFormat, drop_thinking
from lmserve.chat.tools import tools_prompt
from lmserve.engine.protocol import PromptImage
from lmserve.errors import InvalidRequest, LmserveError
from lmserve.service.residency import LoadedModel, Prompter
from lmserve.types import AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, ChatRequest, Message, ToolCall

_PROBE_NAME = "lmserve_probe_tool_5c1e"
_PROBE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {"name": _PROBE_NAME, "description": "probe", "parameters": {"type": "object", "properties": {}}},
}


def conversation(model: LoadedModel, request: ChatRequest) -> list[Message]:
    """The Modelfile's MESSAGEs, then the request's (images and clips as markers), with the model's SYSTEM if none;
    with the tools in the system prompt when the template does not render them."""
    messages = list(model.messages) + [
        with_media_markers(model, m, f"messages[{i}]") for i, m in enumerate(request.messages)
    ]
    if model.system is not None and not any(m.role in ("system", "developer") for m in messages):
        messages.insert(0, Message(role="system", content=model.system))
    if request.tools and not renders_tools(model.template):
        messages = with_tools_prompt(messages, request.tools, fold_calls="tool_calls" not in _source(model))
    return messages


def renders_tools(template: Prompter) -> bool:
    """Whether `template` puts the request's tools in the prompt (a probe tool's name shows in a rendering; found
    once per template). A template that fails to render with tools counts as one that does not render them."""
    return _renders_tools(cast(Hashable, template))


@functools.lru_cache(maxsize=64)
def _renders_tools(template: Hashable) -> bool:  # prompters hash by identity
    try:
        text = cast(Prompter, template).render([Message("user", "hi")], tools=[_PROBE_TOOL], add_generation_prompt=True)
    except LmserveError:
        return False
    return _PROBE_NAME in text


def with_tools_prompt(messages: list[Message], tools: list[dict[str, Any]], *, fold_calls: bool) -> list[Message]:
    """`messages` with the tools and the JSON call shape in the system prompt (merged into a leading system
    message, else a new one first); with `fold_calls`, earlier assistant calls written into their text."""
    block = tools_prompt(tools)
    out = [_with_calls_text(m) if fold_calls and m.tool_calls else m for m in messages]
    if out and out[0].role in ("system", "developer"):
        head = out[0]
        return [replace(head, content=f"{head.content}\n\n{block}" if head.content else block), *out[1:]]
    return [Message(role="system", content=block), *out]


def _with_calls_text(message: Message) -> Message:
    text = json.dumps([{"name": c.name, "arguments": _arguments(c)} for c in message.tool_calls], ensure_ascii=False)
    return replace(message, content=f"{message.content}\n{text}" if message.content else text)


def _arguments(call: ToolCall) -> Any:
    try:
        return json.loads(call.arguments)
    except ValueError:
        return call.arguments


def _source(model: LoadedModel) -> str:
    return model.template_source or model.engine.info.chat_template or ""


def render_chat(model: LoadedModel, request: ChatRequest, max_messages: int,
                reasoning: ReasoningFormat | None = None) -> str:
    """The prompt text of a chat request; 400 for no messages or more than `max_messages`.

    With the model's `reasoning` format, earlier assistant turns lose their thinking unless the template handles
    thinking itself (it names the close tag: it keeps or drops it as the model was trained).
    """
    if not request.messages:
        raise InvalidRequest("messages must contain at least one message", param="messages")
    if len(request.messages) > max_messages:
        raise InvalidRequest(f"{len(request.messages)} messages is more than this server accepts ({max_messages})",
                             param="messages")
    messages = conversation(model, request)
    source = _source(model)
    if reasoning is not None and reasoning.end not in source:
        messages = [replace(m, content=drop_thinking(reasoning, m.content)) if m.role == "assistant" else m
                    for m in messages]
    return _render(model, messages, request, add_generation_prompt=request.add_generation_prompt)


def _render(model: LoadedModel, messages: list[Message], request: ChatRequest, *, add_generation_prompt: bool) -> str:
    tools: list[dict[str, Any]] | None = request.tools if request.tools and renders_tools(model.template) else None
    return model.template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                 think=request.think)


def system_checkpoint(model: LoadedModel, request: ChatRequest, tokens: list[int]) -> list[int]:
    """Where the system prompt ends in `tokens`, for a model whose memory cannot be cut (its state there is
    snapshotted, so other conversations with that system prompt start from it); [] when unknown."""
    if model.engine.info.can_cut_memory:
        return []
    messages = conversation(model, request)
    count = next((i for i, m in enumerate(messages) if m.role not in ("system", "developer")), len(messages))
    if count == 0 or count == len(messages):
        return []
    try:  # some templates refuse a conversation without a user turn: then there is no checkpoint
        head = _render(model, messages[:count], request, add_generation_prompt=False)
    except LmserveError:
        return []
    prefix = tokenize(model, head)
    return [len(prefix)] if tokens[: len(prefix)] == prefix else []


def placed(message: Message, where: str) -> str:
    """`message`'s text with a placeholder where each of its images and clips goes: its own placeholders, else its
    images' and then its clips' before the text; 400 when a kind's placeholders do not match its count."""
    param = "messages" if where.startswith("messages") else "images"
    prefix = ""
    for placeholder, items, what in ((IMAGE_PLACEHOLDER, message.images, "images"),
                                     (AUDIO_PLACEHOLDER, message.audio, "audio clips")):
        places = message.content.count(placeholder)
        if items and places == 0:
            prefix += placeholder * len(items)
        elif items and places != len(items):
            raise InvalidRequest(f"{where} has {len(items)} {what} but {places} placeholders "
                                 f"(U+{ord(placeholder):04X}) in its text", param=param)
    return prefix + message.content


def media_of(message: Message) -> list[bytes]:
    """`message`'s images and audio clips in the order its text places them (see `placed`)."""
    if not message.audio:
        return list(message.images)
    images, clips = iter(message.images), iter(message.audio)
    where = placed(message, "message")
    return [next(images) if char == IMAGE_PLACEHOLDER else next(clips)
            for char in where if char in (IMAGE_PLACEHOLDER, AUDIO_PLACEHOLDER)
            and (message.images if char == IMAGE_PLACEHOLDER else message.audio)]


def with_media_markers(model: LoadedModel, message: Message, where: str) -> Message:
    """`message` with the model's media marker where each image and clip goes (see `placed`); 400 when the model
    cannot see images or hear audio it was sent."""
    if not message.images and not message.audio:
        return message
    param = "messages" if where.startswith("messages") else "images"
    info = model.engine.info
    if message.images and info.image_marker is None:
        raise InvalidRequest(
            f"{where} contains an image, but model '{model.name}' has no vision projector (it cannot see images)",
            param=param,
        )
    if message.audio and info.audio_marker is None:
        why = f": {info.audio_missing}" if info.audio_missing else ""
        raise InvalidRequest(f"{where} contains an audio clip, but model '{model.name}' has no audio encoder (it "
                             f"cannot hear audio){why}", param=param)
    content = placed(message, where)
    if message.images:
        content = content.replace(IMAGE_PLACEHOLDER, cast(str, info.image_marker))
    if message.audio:
        content = content.replace(AUDIO_PLACEHOLDER, cast(str, info.audio_marker))
    return replace(message, content=content)


def tokenize(model: LoadedModel, prompt: str) -> list[int]:
    return model.engine.tokenize(prompt, add_special=True, parse_special=True)


async def tokenize_prompt(model: LoadedModel, prompt: str, media: list[bytes]) -> tuple[list[int], list[PromptImage]]:
    """The prompt's tokens and, with images or audio clips (`media`, in the order of their markers), their places
    (decoded, resampled and preprocessed off the event loop)."""
    if not media:
        return tokenize(model, prompt), []
    rate = model.engine.info.audio_rate

    def prepare() -> tuple[list[int], list[PromptImage]]:
        decoded = [to_clip(item, rate) if is_audio(item) else to_bitmap(item) for item in media]
        return model.engine.tokenize_media(prompt, decoded)

    return await asyncio.to_thread(prepare)
