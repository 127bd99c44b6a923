"""Stored chat completions (the `openai` client's `chat.completions.list / retrieve / update / delete /
messages.list`): the routes over the completions store.

A chat completion made with `store: true` is kept (chat_records.py, lmserve/store/completions.py); these
routes read, list, re-label and delete what was kept:

    GET    /v1/chat/completions                     list: model, metadata[key]=value, after, limit, order
    GET    /v1/chat/completions/{id}                one, as it was returned, with its metadata
    POST   /v1/chat/completions/{id}                replace its metadata (nothing else changes)
    DELETE /v1/chat/completions/{id}                {id, object: "chat.completion.deleted", deleted: true}
    GET    /v1/chat/completions/{id}/messages       the request's messages: after, limit, order

Lists are ordered by creation time, oldest first unless `order=desc` (the OpenAI default), 20 a page (at most
100). An unknown id is a 404, a bad parameter a 400, both in the OpenAI error shape.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request

from lmserve.config import ServerConfig
from lmserve.dialects.openai import schemas
from lmserve.dialects.shared.json_body import JsonBodyRoute
from lmserve.dialects.shared.pages import checked_order, item_page, list_body
from lmserve.dialects.shared.state import CompletionsDep
from lmserve.errors import InvalidRequest
from lmserve.store.completions import CompletionStore

_METADATA_KEY = "metadata["


def completions_store(config: ServerConfig) -> CompletionStore:
    """The store of chat completions under the model store: `<LMSERVE_MODELS>/chat-completions` (made on the first
    save)."""
    return CompletionStore(Path(config.models_dir).expanduser() / "chat-completions", max_count=config.completions_max,
                           ttl=config.completions_ttl)


def metadata_filter(request: Request) -> dict[str, str]:
    """The `metadata[key]=value` pairs of the query (each must match); a key given twice is a 400."""
    pairs: dict[str, str] = {}
    for name, value in request.query_params.multi_items():
        if name == "metadata":
            raise InvalidRequest("filter by metadata as metadata[key]=value", param="metadata")
        if not name.startswith(_METADATA_KEY):
            continue
        if not name.endswith("]") or len(name) == len(_METADATA_KEY) + 1:
            raise InvalidRequest(f"'{name[:100]}' is not metadata[key]", param="metadata")
        key = name[len(_METADATA_KEY):-1]
        if key in pairs:
            raise InvalidRequest(f"metadata[{key[:64]}] is given twice", param="metadata")
        pairs[key] = value
    return pairs


router = APIRouter(prefix="/v1", route_class=JsonBodyRoute)


@router.get("/chat/completions")
async def list_completions(store: CompletionsDep, request: Request, model: str | None = None, after: str | None = None,
                           limit: int = 20, order: str = "asc") -> dict[str, Any]:
    ordering = checked_order(limit, order)
    metadata = metadata_filter(request)
    page = await asyncio.to_thread(store.page, model=model, metadata=metadata, after=after, limit=limit,
                                   order=ordering)
    return list_body([record.completion for record in page.records], page.has_more)


@router.get("/chat/completions/{completion_id}")
async def retrieve(store: CompletionsDep, completion_id: str) -> dict[str, Any]:
    return (await asyncio.to_thread(store.get, completion_id)).completion


@router.post("/chat/completions/{completion_id}")
async def update(store: CompletionsDep, completion_id: str, body: schemas.ChatCompletionUpdate) -> dict[str, Any]:
    record = await asyncio.to_thread(store.update_metadata, completion_id, body.metadata or {})
    return record.completion


@router.delete("/chat/completions/{completion_id}")
async def delete(store: CompletionsDep, completion_id: str) -> dict[str, Any]:
    await asyncio.to_thread(store.delete, completion_id)
    return {"id": completion_id, "object": "chat.completion.deleted", "deleted": True}


@router.get("/chat/completions/{completion_id}/messages")
async def messages(store: CompletionsDep, completion_id: str, after: str | None = None, limit: int = 20,
                   order: str = "asc") -> dict[str, Any]:
    record = await asyncio.to_thread(store.get, completion_id)
    return item_page(record.messages, limit=limit, order=order, after=after, noun="message of this completion")
