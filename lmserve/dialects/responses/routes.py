"""The OpenAI Responses API: `/v1/responses` routes, and the translators from its wire format to lmserve's records.

A request is parsed into a wire model (schemas.py); its input items, after those of what it continues (the
chain of `previous_response_id`, read from the store, or the items of its `conversation`), become the chat messages
of one `ChatRequest`; its tools, those lmserve runs, the chat request's tools (tools.py). The service's
chunks are turned into output items and stream events by one `OutputBuilder` (output.py). A finished
response is stored (lmserve/store/responses.py) unless the request says `store: false`; its input and output items
are added to its conversation (lmserve/store/conversations.py).

Fields that would change the answer but that lmserve cannot honour are refused with a 400 naming them
(`background`, `prompt`: a stored prompt template, `moderation`); advisory ones are accepted without effect
(`prompt_cache_key`, `safety_identifier`, `service_tier`, `max_tool_calls`, `stream_options`,
`context_management`, `client_metadata` …).
"""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from lmserve.chat.audio import is_audio
from lmserve.chat.media import MediaPolicy
from lmserve.config import ServerConfig
from lmserve.dialects.responses import schemas as wire
from lmserve.dialects.responses.output import (
    Framer,
    OutputBuilder,
    finished_response,
    response_usage,
    run_whole,
    stream_events,
)
from lmserve.dialects.responses.tools import ToolSet, ignored_header, offered_tools
from lmserve.dialects.responses.translate import (
    Item,
    Save,
    conversation_id,
    input_item_page,
    input_records,
    load_images,
    parse_items,
    refuse_unserved,
    response_head,
    to_chat_request,
    to_messages,
)
from lmserve.dialects.shared.errors import invalid_from_validation
from lmserve.dialects.shared.json_body import JsonBodyRoute
from lmserve.dialects.shared.state import ConversationsDep, MediaDep, ResponsesDep, ServiceDep
from lmserve.dialects.shared.streaming import SSE_HEADERS, GenerationResponse, guarded_errors, until_disconnect
from lmserve.errors import InvalidRequest
from lmserve.service import Service
from lmserve.store.conversations import ConversationNotFound, ConversationStore
from lmserve.store.responses import ResponseNotFound, ResponseStore, StoredResponse, new_response_id
from lmserve.types import ChatRequest

log = logging.getLogger(__name__)

# ---- routes ---------------------------------------------------------------------------------------

def responses_store(config: ServerConfig) -> ResponseStore:
    """The store of responses under the model store: `<LMSERVE_MODELS>/responses` (made on the first save)."""
    return ResponseStore(Path(config.models_dir).expanduser() / "responses", max_count=config.responses_max,
                         ttl=config.responses_ttl)


router = APIRouter(prefix="/v1", route_class=JsonBodyRoute)


async def earlier(store: ResponseStore, conversations: ConversationStore | None,
                  body: wire.ResponseRequest) -> list[Item]:
    """The items the request continues: its previous response's conversation, or its conversation's items."""
    if body.previous_response_id is not None:
        try:
            return (await asyncio.to_thread(store.get, body.previous_response_id)).conversation
        except ResponseNotFound:
            raise ResponseNotFound(body.previous_response_id, param="previous_response_id") from None
    conversation = conversation_id(body.conversation)
    if conversation is None:
        return []
    if conversations is None:
        raise InvalidRequest("conversations are not kept by this server", param="conversation")
    try:
        return (await asyncio.to_thread(conversations.get, conversation)).items
    except ConversationNotFound:
        raise ConversationNotFound(conversation, param="conversation") from None


async def chat_request(service: Service, policy: MediaPolicy, body: wire.ResponseRequest, context: list[Item],
                       own: list[Item], offered: ToolSet) -> ChatRequest:
    try:
        items = parse_items(context + own)
    except ValidationError as exc:  # a stored record that no longer reads: say which
        raise invalid_from_validation(exc.errors(include_url=False)) from None
    messages, refs = to_messages(body.instructions, items, first_own=len(context), shown=offered.shown)
    images = sum(fmt is None for message in refs for _, _, fmt in message)
    if images:
        service.generation.check_images(body.model, images, param="input")
    if any(refs):
        for message, data in zip(messages, await load_images(refs, policy), strict=True):
            message.images = [item for item in data if not is_audio(item)]
            message.audio = [item for item in data if is_audio(item)]
    return to_chat_request(body, messages, offered)


def saver(store: ResponseStore, conversations: ConversationStore | None, body: wire.ResponseRequest, own: list[Item],
          context: list[Item]) -> Save:
    async def save(response: dict[str, Any]) -> None:
        if body.store is not False:
            record = StoredResponse(response=response, input=own, context=context)
            await asyncio.to_thread(store.save, record)
        conversation = conversation_id(body.conversation)
        if conversation is None or conversations is None:
            return
        try:
            await asyncio.to_thread(partial(conversations.add_items, skip_known=True), conversation,
                                    own + response["output"])
        except ConversationNotFound:
            log.warning("conversation %s was deleted before its response %s ended", conversation, response["id"])

    return save


@router.post("/responses", response_model=None)
async def create(service: ServiceDep, policy: MediaDep, store: ResponsesDep, conversations: ConversationsDep,
                 body: wire.ResponseRequest, request: Request) -> Response:
    refuse_unserved(body)
    offered = offered_tools(body.tools)
    if offered.ignored:
        log.warning("/v1/responses: tools of types lmserve does not run are left out: %s",
                    ", ".join(dict.fromkeys(kind[:64] for kind in offered.ignored)))
    context = await earlier(store, conversations, body)
    own = input_records(body.input)
    chat = await chat_request(service, policy, body, context, own, offered)
    generation = await service.generation.chat(chat)
    head = response_head(body, generation.model, generation.sampling, new_response_id(), int(time.time()))
    save, builder = saver(store, conversations, body, own, context), OutputBuilder(offered.origin)
    headers = ignored_header(offered.ignored)
    if body.stream:
        framer = Framer()
        frames = stream_events(generation, head, framer, save, builder)
        return GenerationResponse(generation, guarded_errors(frames, framer.error),
                                  headers={**SSE_HEADERS, **headers})
    final = await until_disconnect(run_whole(generation, builder), request.receive)
    response = finished_response(head, builder, final, response_usage(generation, final))
    await save(response)
    return JSONResponse(response, headers=headers)


@router.get("/responses/{response_id}")
async def retrieve(store: ResponsesDep, response_id: str, stream: bool = False) -> dict[str, Any]:
    if stream:
        raise InvalidRequest("streaming a stored response again is not supported", param="stream")
    return (await asyncio.to_thread(store.get, response_id)).response


@router.delete("/responses/{response_id}")
async def delete(store: ResponsesDep, response_id: str) -> dict[str, Any]:
    await asyncio.to_thread(store.delete, response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.get("/responses/{response_id}/input_items")
async def input_items(store: ResponsesDep, response_id: str, limit: int = 20, order: str = "desc",
                      after: str | None = None) -> dict[str, Any]:
    record = await asyncio.to_thread(store.get, response_id)
    return input_item_page(record.input, limit=limit, order=order, after=after)
