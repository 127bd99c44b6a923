"""The OpenAI Conversations API (the `openai` client's `conversations.create / retrieve / update / delete` and
`conversations.items.create / list / retrieve / delete`): routes over the conversation store
(lmserve/store/conversations.py).

    POST   /v1/conversations                          a new one: its first items (at most 20) and metadata
    GET    /v1/conversations/{id}                     {id, object: "conversation", created_at, metadata}
    POST   /v1/conversations/{id}                     replace its metadata
    DELETE /v1/conversations/{id}                     {id, object: "conversation.deleted", deleted: true}
    GET    /v1/conversations/{id}/items               its items: after, limit, order (newest first by default)
    POST   /v1/conversations/{id}/items               add items (at most 20) at the end: the list of those added
    GET    /v1/conversations/{id}/items/{item_id}     one item
    DELETE /v1/conversations/{id}/items/{item_id}     remove one item: the conversation

Items are kept as a response's input items are (each with an id and a status, messages' parts typed for their
role). `POST /v1/responses` with `conversation` reads the items before its input and adds its input and output
items after it (translate.py). `include` (extra data of hosted tools' items) is accepted and adds nothing: no
item here has such data. An unknown id is a 404, a bad body or parameter a 400, both in the OpenAI error shape.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from fastapi import APIRouter

from lmserve.config import ServerConfig
from lmserve.dialects.responses import schemas as wire
from lmserve.dialects.responses.translate import input_records
from lmserve.dialects.shared.json_body import JsonBodyRoute
from lmserve.dialects.shared.pages import item_page, list_body
from lmserve.dialects.shared.state import ConversationsDep
from lmserve.store.conversations import ConversationStore


def conversations_store(config: ServerConfig) -> ConversationStore:
    """The store of conversations under the model store: `<LMSERVE_MODELS>/conversations` (made on the first save),
    at most as many as stored responses (`responses_max`); no retention time."""
    return ConversationStore(Path(config.models_dir).expanduser() / "conversations", max_count=config.responses_max)


router = APIRouter(prefix="/v1", route_class=JsonBodyRoute)


@router.post("/conversations")
async def create(store: ConversationsDep, body: wire.ConversationCreate | None = None) -> dict[str, Any]:
    items = input_records(body.items) if body and body.items else []
    metadata = body.metadata if body and body.metadata else {}
    return (await asyncio.to_thread(store.create, items, metadata)).resource()


@router.get("/conversations/{conversation_id}")
async def retrieve(store: ConversationsDep, conversation_id: str) -> dict[str, Any]:
    return (await asyncio.to_thread(store.get, conversation_id)).resource()


@router.post("/conversations/{conversation_id}")
async def update(store: ConversationsDep, conversation_id: str, body: wire.ConversationUpdate) -> dict[str, Any]:
    return (await asyncio.to_thread(store.update_metadata, conversation_id, body.metadata)).resource()


@router.delete("/conversations/{conversation_id}")
async def delete(store: ConversationsDep, conversation_id: str) -> dict[str, Any]:
    await asyncio.to_thread(store.delete, conversation_id)
    return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}


@router.get("/conversations/{conversation_id}/items")
async def list_items(store: ConversationsDep, conversation_id: str, limit: int = 20, order: str = "desc",
                     after: str | None = None) -> dict[str, Any]:
    record = await asyncio.to_thread(store.get, conversation_id)
    return item_page(record.items, limit=limit, order=order, after=after, noun="item of this conversation")


@router.post("/conversations/{conversation_id}/items")
async def add_items(store: ConversationsDep, conversation_id: str, body: wire.ConversationItems) -> dict[str, Any]:
    items = input_records(body.items)
    await asyncio.to_thread(store.add_items, conversation_id, items)
    return list_body(items, has_more=False)


@router.get("/conversations/{conversation_id}/items/{item_id}")
async def retrieve_item(store: ConversationsDep, conversation_id: str, item_id: str) -> dict[str, Any]:
    return (await asyncio.to_thread(store.get, conversation_id)).item(item_id)


@router.delete("/conversations/{conversation_id}/items/{item_id}")
async def delete_item(store: ConversationsDep, conversation_id: str, item_id: str) -> dict[str, Any]:
    return (await asyncio.to_thread(store.delete_item, conversation_id, item_id)).resource()
