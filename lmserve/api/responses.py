"""The OpenAI Responses API: `/v1/responses` routes, and the translators between its wire format and lmserve's records.

A request is parsed into a wire model (responses_schemas.py); its input items, after those of the conversation it
continues (`previous_response_id`, read from the store), become the chat messages of one `ChatRequest`. The
service's chunks are turned into output items (reasoning, the assistant's message, function calls) by one
`OutputBuilder`, which also writes the typed events of a streamed answer, so a streamed and a whole answer carry the
same items. A finished response is stored (lmserve/store/responses.py) unless the request says `store: false`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import TypeAdapter, ValidationError

from lmserve import options as opts
from lmserve.api import responses_schemas as wire
from lmserve.api.logprobs import token_entries
from lmserve.api.openai import parse_body
from lmserve.api.pages import item_page
from lmserve.api.streaming import GenerationResponse, dumps, guarded_errors, until_disconnect
from lmserve.api.wire_errors import INTERNAL_ERROR, invalid_from_validation
from lmserve.chat.media import MediaPolicy, load_all, load_url
from lmserve.chat.structured import json_object_grammar, schema_grammar
from lmserve.config import ServerConfig
from lmserve.errors import EngineFailure, InvalidRequest, LmserveError
from lmserve.parsing import chat_role
from lmserve.service import Generation, Service
from lmserve.store.responses import ResponseNotFound, ResponseStore, StoredResponse, new_response_id
from lmserve.types import EFFORTS, IMAGE_PLACEHOLDER, ChatRequest, Chunk, Message, SamplingParams, ToolCall, Usage

log = logging.getLogger(__name__)

Item = dict[str, Any]
Event = dict[str, Any]
ImageRef = tuple[str, str]
"""(where the image is in the request, its URL)."""

_ITEMS: TypeAdapter[list[wire.InputItem]] = TypeAdapter(list[wire.InputItem])


def responses_store(config: ServerConfig) -> ResponseStore:
    """The store of responses under the model store: `<LMSERVE_MODELS>/responses` (made on the first save)."""
    return ResponseStore(Path(config.models_dir).expanduser() / "responses", max_count=config.responses_max,
                         ttl=config.responses_ttl)


def new_item_id(prefix: str) -> str:
    """An output or input item id: `msg_…`, `fc_…`, `fco_…`, `rs_…`."""
    return f"{prefix}_{secrets.token_hex(16)}"


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


def to_messages(instructions: str | None, items: list[wire.InputItem],
                first_own: int = 0) -> tuple[list[Message], list[list[ImageRef]]]:
    """Chat messages for `instructions` (a system message) and the conversation's items, and each message's images
    (where, URL). Consecutive function calls join the assistant message before them; a call's output is a `tool`
    message; a reasoning item's text is the thinking of the assistant turn that follows it. `first_own` is the index
    of the request's first own item (for messages)."""
    messages: list[Message] = []
    images: list[list[ImageRef]] = []
    if instructions:
        messages.append(Message("system", instructions))
        images.append([])
    names: dict[str, str] = {}
    thinking = ""
    for index, item in enumerate(items):
        where = f"input[{index - first_own}]" if index >= first_own else f"previous_response_id's item {index}"
        if isinstance(item, wire.ReasoningItem):
            thinking += "".join(part.text for part in item.content or ())
        elif isinstance(item, wire.MessageItem):
            text, refs = _content(item.content, where)
            role = chat_role(item.role)
            messages.append(Message(role, text, thinking=thinking if role == "assistant" else ""))
            images.append(refs)
            thinking = ""
        elif isinstance(item, wire.FunctionCallItem):
            names[item.call_id] = item.name
            call = ToolCall(item.name, item.arguments, item.call_id)
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
    """Text parts in order (a newline between two texts), each image an IMAGE_PLACEHOLDER where it stood."""
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
            refs.append((f"{where}.content[{j}].image_url", part.image_url))
            previous_is_text = False
            continue
        text = part.refusal if isinstance(part, wire.Refusal) else part.text
        out += ("\n" if previous_is_text else "") + text
        previous_is_text = True
    return out, refs


async def load_images(refs: list[list[ImageRef]], policy: MediaPolicy) -> list[list[bytes]]:
    """Each message's images as checked bytes (data URIs decoded, http(s) URLs fetched under `policy`)."""
    return await load_all([[(where, load_url(url, policy)) for where, url in message] for message in refs],
                          param="input")


def to_sampling(body: wire.ResponseRequest, defaults: SamplingParams | None = None) -> SamplingParams:
    """The request's sampling (extra fields that name an option, such as `seed` or `top_k`, included) over
    `defaults`; `max_output_tokens` is the reply's token limit; `text.format` sets the output grammar."""
    fields = dict(body.model_extra or {})
    fields.pop("max_tokens", None)
    fields.pop("max_completion_tokens", None)
    fields.update(temperature=body.temperature, top_p=body.top_p, max_completion_tokens=body.max_output_tokens)
    sampling = opts.sampling(opts.from_openai(fields), base=defaults)
    sampling.grammar = format_grammar(body.text.format if body.text else None)
    sampling.logprobs = output_logprobs(body)
    return sampling


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


def chat_tools(body: wire.ResponseRequest) -> tuple[list[dict[str, Any]], str | None]:
    """The tools as the chat request carries them (OpenAI chat shape), and the forced one ("*": any, or a name)."""
    choice = body.tool_choice
    if not body.tools or choice == "none":
        if choice not in (None, "auto", "none"):
            raise InvalidRequest("tool_choice requires tools", param="tool_choice")
        return [], None
    tools = [{"type": "function", "function": tool.model_dump(exclude_none=True, exclude={"type"})}
             for tool in body.tools]
    if choice in (None, "auto"):
        return tools, None
    if choice == "required":
        return tools, "*"
    assert isinstance(choice, wire.FunctionChoice)
    if choice.name not in {tool.name for tool in body.tools}:
        raise InvalidRequest(f"tool_choice names '{choice.name}', which is not among the tools", param="tool_choice")
    return tools, choice.name


def think(reasoning: wire.ReasoningConfig | None) -> bool | str | None:
    """`reasoning.effort` as ChatRequest.think (types.EFFORTS); None leaves it to the model."""
    if reasoning is None or reasoning.effort is None:
        return None
    return EFFORTS[reasoning.effort]


def to_chat_request(body: wire.ResponseRequest, messages: list[Message],
                    defaults: SamplingParams | None = None) -> ChatRequest:
    """The engine-neutral chat request of a Responses request whose conversation is `messages`."""
    if body.background:
        raise InvalidRequest("background responses are not supported", param="background")
    if not messages or all(m.role == "system" for m in messages):
        raise InvalidRequest("Missing required parameter: 'input'.", param="input")
    tools, forced = chat_tools(body)
    return ChatRequest(model=body.model, messages=messages, sampling=to_sampling(body, defaults), tools=tools,
                       forced_tool=forced, parallel_tool_calls=body.parallel_tool_calls is not False,
                       think=think(body.reasoning), reasoning_budget=body.reasoning_budget)


# ---- records → responses --------------------------------------------------------------------------


def response_head(body: wire.ResponseRequest, model: str, sampling: SamplingParams, response_id: str,
                  created_at: int) -> dict[str, Any]:
    """The response object before any output: the request's settings echoed, status in_progress."""
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
        "tool_choice": choice if isinstance(choice, str) else choice.model_dump(mode="json"),
        "tools": [tool.model_dump(mode="json", exclude_none=True) for tool in body.tools or []],
        "top_logprobs": body.top_logprobs,
        "top_p": sampling.top_p,
        "truncation": "disabled",
        "usage": None,
        "user": body.user,
    }


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
    `include`) go with its text: to the delta event and the message's output_text part.
    """

    def __init__(self) -> None:
        self.items: list[Item] = []
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
        item = {"id": new_item_id("fc"), "type": "function_call", "call_id": call.id or new_item_id("call"),
                "name": call.name, "arguments": "", "status": "in_progress"}
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


def _usage(generation: Generation, final: Chunk) -> Usage:
    return final.usage if final.usage is not None else Usage(prompt_tokens=generation.num_prompt_tokens)


def _status(final: Chunk) -> Literal["completed", "incomplete"]:
    return "incomplete" if final.finish_reason == "length" else "completed"


async def run_whole(generation: Generation, builder: OutputBuilder) -> Chunk:
    """Feed the whole generation to `builder`; the final chunk. An engine failure is an EngineFailure."""
    try:
        async for chunk in generation:
            builder.push(chunk)
            if chunk.finish_reason is not None:
                if chunk.finish_reason in ("error", "abort"):
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
                        save: Callable[[dict[str, Any]], Awaitable[None]]) -> AsyncIterator[bytes]:
    """created, in_progress, the items' events, then completed (or incomplete; failed when the engine fails).
    The finished response is saved (`save`) before the last event, so a client that reads it can retrieve it."""
    builder = OutputBuilder()
    yield framer({"type": "response.created", "response": head})
    yield framer({"type": "response.in_progress", "response": head})
    async for chunk in generation:
        for event in builder.push(chunk):
            yield framer(event)
        if chunk.finish_reason is None:
            continue
        if chunk.finish_reason in ("error", "abort"):
            error = {"code": "server_error", "message": chunk.error or "the generation failed"}
            yield framer({"type": "response.failed", "response": {**head, "status": "failed", "error": error}})
            return
        for event in builder.finish(_status(chunk)):
            yield framer(event)
        response = finished_response(head, builder, chunk, _usage(generation, chunk))
        await save(response)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        yield framer({"type": kind, "response": response})
        return


def input_item_page(items: list[Item], *, limit: int, order: str, after: str | None) -> dict[str, Any]:
    """A page of input items: `limit` of them in `order` ("asc" or "desc", the default), after the item `after`."""
    return item_page(items, limit=limit, order=order, after=after, noun="input item")


# ---- routes ---------------------------------------------------------------------------------------


def responses_router(service: Service, store: ResponseStore, media: MediaPolicy | None = None) -> APIRouter:
    """POST /v1/responses; GET and DELETE /v1/responses/{id}; GET /v1/responses/{id}/input_items."""
    router = APIRouter(prefix="/v1")
    policy = media or MediaPolicy()

    async def previous(response_id: str | None) -> list[Item]:
        if response_id is None:
            return []
        try:
            return (await asyncio.to_thread(store.get, response_id)).conversation
        except ResponseNotFound:
            raise ResponseNotFound(response_id, param="previous_response_id") from None

    @router.post("/responses", response_model=None)
    async def create(request: Request) -> Response:
        body = await parse_body(request, wire.ResponseRequest)
        context = await previous(body.previous_response_id)
        own = input_records(body.input)
        try:
            items = parse_items(context + own)
        except ValidationError as exc:  # a stored record that no longer reads: say which
            raise invalid_from_validation(exc.errors(include_url=False)) from None
        messages, refs = to_messages(body.instructions, items, first_own=len(context))
        if any(refs):
            service.generation.check_images(body.model, sum(map(len, refs)), param="input")
            for message, data in zip(messages, await load_images(refs, policy), strict=True):
                message.images = data
        chat = to_chat_request(body, messages, await service.sampling_defaults(body.model))
        generation = await service.generation.chat(chat)
        response_id = new_response_id()
        head = response_head(body, generation.model, chat.sampling, response_id, int(time.time()))

        async def save(response: dict[str, Any]) -> None:
            if body.store is not False:
                record = StoredResponse(response=response, input=own, context=context)
                await asyncio.to_thread(store.save, record)

        if body.stream:
            framer = Framer()
            frames = stream_events(generation, head, framer, save)
            return GenerationResponse(generation, guarded_errors(frames, framer.error))
        builder = OutputBuilder()
        final = await until_disconnect(run_whole(generation, builder), request.receive)
        response = finished_response(head, builder, final, _usage(generation, final))
        await save(response)
        return JSONResponse(response)

    @router.get("/responses/{response_id}")
    async def retrieve(response_id: str, stream: bool = False) -> dict[str, Any]:
        if stream:
            raise InvalidRequest("streaming a stored response again is not supported", param="stream")
        return (await asyncio.to_thread(store.get, response_id)).response

    @router.delete("/responses/{response_id}")
    async def delete(response_id: str) -> dict[str, Any]:
        await asyncio.to_thread(store.delete, response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @router.get("/responses/{response_id}/input_items")
    async def input_items(response_id: str, limit: int = 20, order: str = "desc",
                          after: str | None = None) -> dict[str, Any]:
        record = await asyncio.to_thread(store.get, response_id)
        return input_item_page(record.input, limit=limit, order=order, after=after)

    return router
