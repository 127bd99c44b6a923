"""Responses requests as the service's records: input items as stored records and as messages (with their images), the
request's options, sampling, output format, reasoning and tools as a ChatRequest; the head of a response,
conversation ids, pages of input items."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import TypeAdapter

from lmserve import options as opts
from lmserve.chat.audio import decode_base64 as decode_audio
from lmserve.chat.media import MediaPolicy, load_all, load_url
from lmserve.chat.structured import json_object_grammar, schema_grammar
from lmserve.dialects.responses import schemas as wire
from lmserve.dialects.responses.output import new_item_id
from lmserve.dialects.responses.tools import Choice, ToolSet, chat_tools, offered_tools
from lmserve.dialects.shared.pages import item_page
from lmserve.errors import InvalidRequest
from lmserve.parsing import chat_role
from lmserve.types import (
    AUDIO_PLACEHOLDER,
    EFFORTS,
    IMAGE_PLACEHOLDER,
    ChatRequest,
    Message,
    RequestOptions,
    SamplingParams,
    ToolCall,
)

log = logging.getLogger(__name__)

Item = dict[str, Any]
Save = Callable[[dict[str, Any]], Awaitable[None]]
"""Keeps a finished response (in the store, in its conversation)."""
Shown = Callable[[str, str | None], str]
"""A function's name and namespace → the name the model sees (ToolSet.shown)."""
ImageRef = tuple[str, str, str | None]
"""Where an image or clip is in the request, its URL (an image) or base64 (a clip), and a clip's format (None: an
image)."""
"""(where the image is in the request, its URL)."""

_ITEMS: TypeAdapter[list[wire.InputItem]] = TypeAdapter(list[wire.InputItem])


# ---- requests → records ---------------------------------------------------------------------------


def input_records(raw: str | list[wire.InputItem] | None) -> list[Item]:
    """The request's own input as stored items (what `GET …/input_items` lists): each with an id and a status, a
    string input as one user message, message content as a list of parts typed for the role."""
    if raw is None:
        return []
    if isinstance(raw, str):
        return [_message_record(wire.MessageItem(role="user", content=raw))]
    records: list[Item] = []
    for item in raw:
        if isinstance(item, wire.MessageItem):
            records.append(_message_record(item))
            continue
        prefix = {"function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}[item.type]
        record = item.model_dump(mode="json", by_alias=True, exclude_none=True)
        record["id"] = item.id or new_item_id(prefix)
        if item.type != "reasoning":
            record["status"] = "completed"
        records.append(record)
    return records


def _message_record(item: wire.MessageItem) -> Item:
    """A message as stored: its parts typed for its role (an assistant writes output_text and refusals, the others
    send input_text and input_image)."""
    is_assistant = item.role == "assistant"
    parts: list[wire.ContentPart] = (
        [wire.InputText(type="input_text", text=item.content)] if isinstance(item.content, str) else item.content)
    content: list[Item] = []
    for part in parts:
        if isinstance(part, wire.InputImage):
            content.append({"type": "input_image", "image_url": part.image_url, "file_id": part.file_id,
                            "detail": part.detail or "auto"})
        elif isinstance(part, wire.InputAudio):
            content.append({"type": "input_audio", "input_audio": part.input_audio.model_dump()})
        elif is_assistant and isinstance(part, wire.Refusal):
            content.append({"type": "refusal", "refusal": part.refusal})
        else:
            text = part.refusal if isinstance(part, wire.Refusal) else part.text
            content.append({"type": "output_text", "text": text, "annotations": []} if is_assistant else
                           {"type": "input_text", "text": text})
    return {"id": item.id or new_item_id("msg"), "type": "message", "role": item.role, "status": "completed",
            "content": content}


def parse_items(records: list[Item]) -> list[wire.InputItem]:
    """Stored items read back as wire models (the same shapes a request sends)."""
    return _ITEMS.validate_python(records)


def to_messages(instructions: str | None, items: list[wire.InputItem], first_own: int = 0,
                shown: Shown | None = None) -> tuple[list[Message], list[list[ImageRef]]]:
    """Chat messages for `instructions` (a system message) and the conversation's items, and each message's images
    (where, URL). Consecutive function calls join the assistant message before them, each under the name the model
    sees (`shown`: a namespaced function's may differ from its own); a call's output is a `tool` message; a
    reasoning item's text is the thinking of the assistant turn that follows it. `first_own` is the index of the
    request's first own item (for messages)."""
    messages: list[Message] = []
    images: list[list[ImageRef]] = []
    if instructions:
        messages.append(Message("system", instructions))
        images.append([])
    names: dict[str, str] = {}
    thinking = ""
    for index, item in enumerate(items):
        where = f"input[{index - first_own}]" if index >= first_own else f"the earlier conversation's item {index}"
        if isinstance(item, wire.ReasoningItem):
            thinking += "".join(part.text for part in item.content or ())
        elif isinstance(item, wire.MessageItem):
            text, refs = _content(item.content, where)
            role = chat_role(item.role)
            messages.append(Message(role, text, thinking=thinking if role == "assistant" else ""))
            images.append(refs)
            thinking = ""
        elif isinstance(item, wire.FunctionCallItem):
            name = shown(item.name, item.namespace) if shown else item.name
            names[item.call_id] = name
            call = ToolCall(name, item.arguments, item.call_id)
            if messages and messages[-1].role == "assistant" and not thinking:
                messages[-1].tool_calls.append(call)
            else:
                messages.append(Message("assistant", "", tool_calls=[call], thinking=thinking))
                images.append([])
            thinking = ""
        elif isinstance(item, wire.FunctionCallOutputItem):
            text, refs = _content(item.output, where)
            if refs:
                raise InvalidRequest(f"{where}: images in a function call's output are not supported", param="input")
            messages.append(Message("tool", text, tool_call_id=item.call_id, name=names.get(item.call_id)))
            images.append([])
    return messages, images


def _content(content: str | list[wire.ContentPart], where: str) -> tuple[str, list[ImageRef]]:
    """Text parts in order (a newline between two texts), each image an IMAGE_PLACEHOLDER and each audio clip an
    AUDIO_PLACEHOLDER where it stood."""
    if isinstance(content, str):
        return content, []
    out = ""
    refs: list[ImageRef] = []
    previous_is_text = False
    for j, part in enumerate(content):
        if isinstance(part, wire.InputImage):
            if not part.image_url:
                raise InvalidRequest(f"{where}.content[{j}]: input_image needs an image_url (file_id is not "
                                     "supported)", param="input")
            out += IMAGE_PLACEHOLDER
            refs.append((f"{where}.content[{j}].image_url", part.image_url, None))
            previous_is_text = False
            continue
        if isinstance(part, wire.InputAudio):
            out += AUDIO_PLACEHOLDER
            refs.append((f"{where}.content[{j}].input_audio", part.input_audio.data, part.input_audio.format))
            previous_is_text = False
            continue
        text = part.refusal if isinstance(part, wire.Refusal) else part.text
        out += ("\n" if previous_is_text else "") + text
        previous_is_text = True
    return out, refs


async def load_images(refs: list[list[ImageRef]], policy: MediaPolicy) -> list[list[bytes]]:
    """Each message's images and clips as checked bytes (data URIs and base64 decoded, http(s) URLs fetched under
    `policy`), in order."""
    return await load_all([[(where, load_url(source, policy) if fmt is None else _clip(source, fmt, policy))
                            for where, source, fmt in message] for message in refs], param="input")


async def _clip(data: str, fmt: str, policy: MediaPolicy) -> bytes:
    return decode_audio(data, fmt, policy)


def to_options(body: wire.ResponseRequest) -> RequestOptions:
    """The request's options (extra fields that name an option, such as `seed` or `top_k`, included);
    `max_output_tokens` is the reply's token limit."""
    fields = dict(body.model_extra or {})
    fields.pop("max_tokens", None)
    fields.pop("max_completion_tokens", None)
    fields.update(temperature=body.temperature, top_p=body.top_p, max_completion_tokens=body.max_output_tokens)
    return RequestOptions(opts.from_openai(fields))


def to_sampling(body: wire.ResponseRequest) -> SamplingParams:
    """What the request asks beyond its options: `text.format` sets the output grammar; the log-probabilities."""
    return SamplingParams(grammar=format_grammar(body.text.format if body.text else None),
                          logprobs=output_logprobs(body))


LOGPROBS_INCLUDE = "message.output_text.logprobs"


def output_logprobs(body: wire.ResponseRequest) -> int | None:
    """`SamplingParams.logprobs`: the alternatives per token (`top_logprobs`, 0 by default) when `include` asks for
    the output text's log-probabilities or `top_logprobs` is given; None otherwise."""
    if LOGPROBS_INCLUDE in (body.include or ()) or body.top_logprobs is not None:
        return body.top_logprobs or 0
    return None


def format_grammar(text_format: wire.TextFormat | wire.JsonObjectFormat | wire.JsonSchemaFormat | None) -> str | None:
    """The grammar `text.format` asks for (json_object: any object; json_schema: its schema), or None."""
    if isinstance(text_format, wire.JsonObjectFormat):
        return json_object_grammar()
    if isinstance(text_format, wire.JsonSchemaFormat):
        return schema_grammar(text_format.schema_, param="text.format")
    return None


def think(reasoning: wire.ReasoningConfig | None) -> bool | str | None:
    """`reasoning.effort` as ChatRequest.think (types.EFFORTS); None leaves it to the model."""
    if reasoning is None or reasoning.effort is None:
        return None
    return EFFORTS[reasoning.effort]


def refuse_unserved(body: wire.ResponseRequest) -> None:
    """A 400 for a field that would change the answer but that lmserve cannot honour."""
    if body.background:
        raise InvalidRequest("background responses are not supported", param="background")
    if body.prompt is not None:
        raise InvalidRequest("stored prompt templates (`prompt`) are not served by lmserve: send the prompt's text "
                             "in `instructions` or `input` instead", param="prompt")
    if body.moderation is not None:
        raise InvalidRequest("moderation is not served by lmserve: leave out `moderation`", param="moderation")
    if body.conversation is not None and body.previous_response_id is not None:
        raise InvalidRequest("Mutually exclusive parameters: Ensure you are only providing one of: "
                             "'previous_response_id' or 'conversation'.", param="conversation")


def to_chat_request(body: wire.ResponseRequest, messages: list[Message], offered: ToolSet | None = None,
                    ) -> ChatRequest:
    """The engine-neutral chat request of a Responses request whose conversation is `messages` and whose tools
    lmserve runs are `offered` (by default, those of `body.tools`). The route has refused what is not served
    (`refuse_unserved`)."""
    if not messages or all(m.role == "system" for m in messages):
        raise InvalidRequest("Missing required parameter: 'input'.", param="input")
    choice: Choice | None = body.tool_choice
    tools, forced = chat_tools(offered if offered is not None else offered_tools(body.tools), choice)
    return ChatRequest(model=body.model, messages=messages, sampling=to_sampling(body), tools=tools,
                       forced_tool=forced, parallel_tool_calls=body.parallel_tool_calls is not False,
                       think=think(body.reasoning), reasoning_budget=body.reasoning_budget, options=to_options(body))


# ---- records → responses --------------------------------------------------------------------------


def response_head(body: wire.ResponseRequest, model: str, sampling: SamplingParams, response_id: str,
                  created_at: int) -> dict[str, Any]:
    """The response object before any output: the request's settings echoed (the tools as sent, those left out
    included), status in_progress."""
    conversation = conversation_id(body.conversation)
    text_format = body.text.format if body.text and body.text.format else wire.TextFormat(type="text")
    choice = body.tool_choice if body.tool_choice is not None else "auto"
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "model": model,
        "output": [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
        "store": body.store is not False,
        "temperature": sampling.temperature,
        "text": {"format": text_format.model_dump(mode="json", by_alias=True, exclude_none=True)},
        "tool_choice": choice if isinstance(choice, str) else choice.model_dump(mode="json", exclude_none=True),
        "tools": [tool.model_dump(mode="json", exclude_none=True) for tool in body.tools or []],
        "top_logprobs": body.top_logprobs,
        "top_p": sampling.top_p,
        "truncation": "disabled",
        "usage": None,
        "user": body.user,
        "conversation": {"id": conversation} if conversation else None,
        "prompt_cache_key": body.prompt_cache_key,
        "safety_identifier": body.safety_identifier,
        "service_tier": "default",
        "max_tool_calls": body.max_tool_calls,
    }


def conversation_id(conversation: str | wire.ConversationRef | None) -> str | None:
    """The id `conversation` gives (as a string or as `{"id": …}`), or None."""
    return conversation.id if isinstance(conversation, wire.ConversationRef) else conversation


def input_item_page(items: list[Item], *, limit: int, order: str, after: str | None) -> dict[str, Any]:
    """A page of input items: `limit` of them in `order` ("asc" or "desc", the default), after the item `after`."""
    return item_page(items, limit=limit, order=order, after=after, noun="input item")
