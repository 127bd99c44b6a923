"""OpenAI's Batch API routes over the server's batch runner (lmserve/service/batch_runner.py):

    POST /v1/batches                     create: input_file_id (purpose "batch"), endpoint, completion_window,
                                         metadata, output_expires_after
    GET  /v1/batches                     list, newest first: after, limit (1 to 100, default 20)
    GET  /v1/batches/{id}                one
    POST /v1/batches/{id}/cancel         stop it: lines in flight are dropped, what finished is kept
"""

from __future__ import annotations

from typing import Annotated, Any, cast

from fastapi import APIRouter, Depends, Request

from lmserve.dialects.shared.json_body import JsonBodyRoute
from lmserve.dialects.shared.pages import list_body
from lmserve.service.batch_runner import BatchCreate, BatchService


async def app_batches(request: Request) -> BatchService:
    return cast(BatchService, request.app.state.batches)


BatchesDep = Annotated[BatchService, Depends(app_batches)]
"""The app's batch runner (lmserve/http/app.py puts it on the app's state)."""

router = APIRouter(prefix="/v1", route_class=JsonBodyRoute)


@router.post("/batches")
async def create_batch(body: BatchCreate, batches: BatchesDep) -> dict[str, Any]:
    return (await batches.create(body)).to_openai()


@router.get("/batches")
async def list_batches(batches: BatchesDep, after: str | None = None, limit: int = 20) -> dict[str, Any]:
    records, has_more = await batches.page(after, limit)
    return list_body([record.to_openai() for record in records], has_more)


@router.get("/batches/{batch_id}")
async def retrieve_batch(batch_id: str, batches: BatchesDep) -> dict[str, Any]:
    return (await batches.get(batch_id)).to_openai()


@router.post("/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, batches: BatchesDep) -> dict[str, Any]:
    return (await batches.cancel(batch_id)).to_openai()

