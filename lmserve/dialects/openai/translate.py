"""OpenAI requests as the service's records: a ChatRequest from a chat completion body (messages, images, tools,
response_format, reasoning), a CompletionRequest from a completion body, their options."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from lmserve import options as opts
from lmserve.chat.audio import decode_base64
from lmserve.chat.audio import load_url as load_audio_url
from lmserve.chat.media import MediaPolicy, load_all, load_url
from lmserve.chat.structured import json_object_grammar, schema_grammar
from lmserve.dialects.openai import schemas
from lmserve.dialects.openai.completions import Prompt, single_prompt
from lmserve.dialects.shared import logprobs as logprob_wire
from lmserve.dialects.shared.streaming import (
    dumps,
)
from lmserve.errors import InvalidRequest
from lmserve.parsing import chat_role
from lmserve.types import (
    AUDIO_PLACEHOLDER,
    EFFORTS,
    IMAGE_PLACEHOLDER,
    ChatRequest,
    Infill,
    LoraRef,
    Message,
    RequestOptions,
    SamplingParams,
    ToolCall,
)
from lmserve.types import CompletionRequest as EngineCompletionRequest

log = logging.getLogger(__name__)

Head = dict[str, Any]


# ---- requests → records ---------------------------------------------------------------------------


def to_options(req: schemas.SamplingFields) -> RequestOptions:
    """The body's sampling fields (lmserve/options.py names and checks them; the service puts them over the model's
    and the server's). Fields that would change the reply but that lmserve does not do (best_of, load-time options
    …) are refused with a 400 naming them. `n` is the dialect's own (`chat_choices`, `completion_choices`)."""
    lora = None if req.lora is None else tuple(LoraRef(pick.id, pick.name, pick.scale) for pick in req.lora)
    return RequestOptions(opts.from_openai(req.model_dump(exclude_unset=True, exclude={"n", "lora"})), lora=lora)


def to_chat_request(req: schemas.ChatCompletionRequest, images: list[list[bytes]] | None = None, *,
                    add_generation_prompt: bool = True, policy: MediaPolicy | None = None) -> ChatRequest:
    """The engine-neutral chat request. Tools are passed as the JSON objects the template expects.

    `images[i]` are message i's parts given by URL (images, then `audio_url` clips), already loaded (see
    `load_images`); without them, such parts are refused. `input_audio` parts are decoded and checked here, under
    `policy`'s limits. `add_generation_prompt` false renders the chat without the assistant turn's opening
    (/tokenize).
    """
    if images is None:
        if has_images(req):
            raise InvalidRequest("this request's images and audio URLs were not loaded", param="messages")
        images = [[] for _ in req.messages]
    messages = [_to_message(i, m, images[i], policy or MediaPolicy()) for i, m in enumerate(req.messages)]
    tools = [] if not req.tools or req.tool_choice == "none" else [t.model_dump(exclude_none=True) for t in req.tools]
    forced = _forced_tool(req.tool_choice, tools)
    sampling = SamplingParams(grammar=response_grammar(req.response_format),
                              logprobs=logprob_wire.asked(req.logprobs, req.top_logprobs))
    return ChatRequest(model=req.model, messages=messages, sampling=sampling, tools=tools, forced_tool=forced,
                       parallel_tool_calls=req.parallel_tool_calls is not False, think=to_think(req),
                       reasoning_budget=req.reasoning_budget, add_generation_prompt=add_generation_prompt,
                       options=to_options(req))


def to_think(req: schemas.ChatCompletionRequest) -> bool | str | None:
    """`reasoning_effort` as lmserve's `think` (types.EFFORTS), else
    `chat_template_kwargs.enable_thinking`; None leaves it to the model."""
    if req.reasoning_effort is not None:
        return EFFORTS[req.reasoning_effort]
    enable = (req.chat_template_kwargs or {}).get("enable_thinking")
    if enable is None:
        return None
    if not isinstance(enable, bool):
        raise InvalidRequest("chat_template_kwargs.enable_thinking must be true or false",
                             param="chat_template_kwargs")
    return enable


def response_grammar(response_format: schemas.ResponseFormat | None) -> str | None:
    """The grammar that enforces `response_format` (json_object: any object, or its `schema` (llama-server's
    extension); json_schema: its schema)."""
    if response_format is None or isinstance(response_format, schemas.TextFormat):
        return None
    if isinstance(response_format, schemas.JsonObjectFormat):
        if response_format.schema_ is not None:
            return schema_grammar(response_format.schema_, param="response_format")
        return json_object_grammar()
    if response_format.json_schema.schema_ is None:
        raise InvalidRequest("Missing required parameter: 'response_format.json_schema.schema'.",
                             param="response_format")
    return schema_grammar(response_format.json_schema.schema_, param="response_format")


def _forced_tool(choice: str | schemas.NamedToolChoice | None, tools: list[dict[str, Any]]) -> str | None:
    """tool_choice "required" → "*" (any tool); a named choice → that name, which must be among the tools."""
    if choice in (None, "auto", "none"):
        return None
    if not tools:
        raise InvalidRequest("tool_choice requires tools", param="tool_choice")
    if choice == "required":
        return "*"
    assert isinstance(choice, schemas.NamedToolChoice)
    name = choice.function.name
    if name not in {t["function"]["name"] for t in tools}:
        raise InvalidRequest(f"tool_choice names '{name}', which is not among the tools", param="tool_choice")
    return name


def _to_message(index: int, m: schemas.ChatMessage, loaded: list[bytes], policy: MediaPolicy) -> Message:
    text = _content(m.content)
    calls = [ToolCall(c.function.name, _arguments(c.function.arguments), c.id) for c in m.tool_calls or ()]
    role = chat_role(m.role)
    images = loaded[:len(_image_parts(index, m))]
    fetched = iter(loaded[len(images):])
    return Message(role=role, content=text, images=images, tool_calls=calls, tool_call_id=m.tool_call_id, name=m.name,
                   thinking=m.reasoning_content or "", audio=_audio(index, m, fetched, policy))


def _audio(index: int, m: schemas.ChatMessage, fetched: Iterator[bytes], policy: MediaPolicy) -> list[bytes]:
    """The message's audio parts in order: `input_audio` decoded from base64 and checked (a 400 naming the part),
    `audio_url` as loaded (`fetched`, in order)."""
    if not isinstance(m.content, list):
        return []
    return [_clip(part, f"messages[{index}].content[{j}].input_audio", policy)
            if isinstance(part, schemas.AudioPart) else next(fetched)
            for j, part in enumerate(m.content) if isinstance(part, schemas.AudioPart | schemas.AudioUrlPart)]


def _clip(part: schemas.AudioPart, where: str, policy: MediaPolicy) -> bytes:
    try:
        return decode_base64(part.input_audio.data, part.input_audio.format, policy, param=where)
    except InvalidRequest as exc:
        raise InvalidRequest(f"{where}: {exc.message}", param=where) from None


def _arguments(arguments: str | dict[str, Any]) -> str:
    return arguments if isinstance(arguments, str) else dumps(arguments)


def _content(content: str | list[schemas.ContentPart] | None) -> str:
    """Text (and refusal) parts in order, a newline between two texts; each image part is an IMAGE_PLACEHOLDER and
    each audio part an AUDIO_PLACEHOLDER where it stood (their bytes are carried apart: `load_images`, `_audio`)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out = ""
    previous_is_text = False
    for part in content:
        if isinstance(part, schemas.ImagePart | schemas.AudioPart | schemas.AudioUrlPart):
            out += IMAGE_PLACEHOLDER if isinstance(part, schemas.ImagePart) else AUDIO_PLACEHOLDER
            previous_is_text = False
            continue
        text = part.text if isinstance(part, schemas.TextPart) else part.refusal
        out += ("\n" if previous_is_text else "") + text
        previous_is_text = True
    return out


def _image_parts(index: int, m: schemas.ChatMessage) -> list[tuple[str, str]]:
    return [(f"messages[{index}].content[{j}].image_url.url", part.image_url.url)
            for j, part in enumerate(m.content) if isinstance(part, schemas.ImagePart)] \
        if isinstance(m.content, list) else []


def _audio_url_parts(index: int, m: schemas.ChatMessage) -> list[tuple[str, str]]:
    return [(f"messages[{index}].content[{j}].audio_url.url", part.audio_url.url)
            for j, part in enumerate(m.content) if isinstance(part, schemas.AudioUrlPart)] \
        if isinstance(m.content, list) else []


def image_urls(req: schemas.ChatCompletionRequest) -> list[list[tuple[str, str]]]:
    """Per message, its image parts as (where, url)."""
    return [_image_parts(i, m) for i, m in enumerate(req.messages)]


def has_images(req: schemas.ChatCompletionRequest) -> bool:
    """Whether any part is given by URL and must be loaded first (images; `audio_url` clips)."""
    return any(_image_parts(i, m) or _audio_url_parts(i, m) for i, m in enumerate(req.messages))


async def load_images(req: schemas.ChatCompletionRequest, policy: MediaPolicy) -> list[list[bytes]]:
    """Each message's parts given by URL as checked bytes, its images then its `audio_url` clips: data URIs decoded,
    http(s) URLs fetched (concurrently) under `policy`.

    Any refusal is a 400 naming the part and saying why (see chat/media.py, chat/audio.py).
    """
    return await load_all([[(where, load_url(url, policy)) for where, url in _image_parts(i, m)]
                           + [(where, load_audio_url(url, policy)) for where, url in _audio_url_parts(i, m)]
                           for i, m in enumerate(req.messages)], param="messages")


def to_completion_request(req: schemas.CompletionRequest, prompt: Prompt | None = None) -> EngineCompletionRequest:
    """The engine-neutral completion of `prompt` (one of the request's prompts; None: its only one); with a `suffix`,
    fill-in-the-middle (the prompt is the text before the gap)."""
    prompt = single_prompt(req.prompt) if prompt is None else prompt
    logprobs = logprob_wire.legacy_asked(req.logprobs)
    sampling = SamplingParams(logprobs=logprobs, prompt_logprobs=logprobs if req.echo else None)
    tokens = prompt if isinstance(prompt, list) else None
    text = prompt if isinstance(prompt, str) else ""
    if req.suffix and tokens is not None:
        raise InvalidRequest("a suffix (fill-in-the-middle) needs the prompt as text, not token ids", param="suffix")
    infill = Infill(text, req.suffix) if req.suffix else None
    return EngineCompletionRequest(model=req.model, prompt="" if infill else text, sampling=sampling,
                                   options=to_options(req), infill=infill, prompt_tokens=tokens)
