"""Files (the `openai` client's `files.create / list / retrieve / content / delete`): the routes over the file store.

    POST   /v1/files                   multipart: `file`, `purpose`, optional `expires_after[anchor]=created_at`
                                       and `expires_after[seconds]` (3600 to 2592000) → the file object
    GET    /v1/files                   list: purpose, after, limit (1 to 10000, default 10000), order (desc)
    GET    /v1/files/{id}              the file object
    GET    /v1/files/{id}/content      the bytes (application/jsonl for a .jsonl name, else octet-stream)
    DELETE /v1/files/{id}              {id, object: "file", deleted: true}

An upload is bounded by LMSERVE_FILES_MAX_UPLOAD, not LMSERVE_MAX_BODY (app.py's guard): the form is spooled by
the framework (to disk beyond 1 MiB), then copied into the store in chunks off the event loop; past the limit it is a
413. An unknown id is a 404, a bad parameter a 400, each in the OpenAI error shape.
"""

from __future__ import annotations

import asyncio
import os
from functools import partial
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, File, Form, Query, UploadFile
from fastapi.responses import FileResponse

from lmserve.config import ServerConfig
from lmserve.dialects.shared.pages import list_body
from lmserve.dialects.shared.state import FilesDep
from lmserve.errors import InvalidRequest
from lmserve.store.files import CHUNK, FileNotFound, FileStore, UploadPurpose

FILES_PATH = "/v1/files"
MAX_FILES_PAGE = 10000
MIN_EXPIRY, MAX_EXPIRY = 3600, 30 * 86400
"""The bounds OpenAI sets on `expires_after[seconds]`."""
JSONL_TYPE = "application/jsonl"


def files_store(config: ServerConfig) -> FileStore:
    """The file store under the model store: `<LMSERVE_MODELS>/files` (made on the first upload)."""
    return FileStore(Path(config.models_dir).expanduser() / "files", max_upload=config.files_max_upload,
                     max_count=config.files_max_count, max_bytes=config.files_max_bytes, ttl=config.files_ttl)


def expiry(anchor: str | None, seconds: int | None) -> int | None:
    """The seconds an upload asks to be kept (`expires_after`), or None; both parts or neither."""
    if anchor is None and seconds is None:
        return None
    if anchor is None or seconds is None:
        missing = "anchor" if anchor is None else "seconds"
        raise InvalidRequest(f"Missing required parameter: 'expires_after[{missing}]'.",
                             param=f"expires_after[{missing}]")
    return seconds


def content_response(store: FileStore, file_id: str) -> FileResponse:
    """The bytes of file `file_id`, streamed from disk; FileNotFound (a 404) when there are none."""
    stored = store.get(file_id)
    path = store.content_path(file_id)
    try:
        stat = os.stat(path)
    except FileNotFoundError:  # deleted or pruned meanwhile
        raise FileNotFound(file_id) from None
    media_type = JSONL_TYPE if stored.filename.endswith(".jsonl") else "application/octet-stream"
    return FileResponse(path, media_type=media_type, filename=stored.filename, stat_result=stat)


router = APIRouter(prefix="/v1")


@router.post("/files")
async def create_file(
    store: FilesDep,
    file: Annotated[UploadFile, File(description="the file's bytes, with its name")],
    purpose: Annotated[UploadPurpose, Form()],
    expires_anchor: Annotated[Literal["created_at"] | None, Form(alias="expires_after[anchor]")] = None,
    expires_seconds: Annotated[int | None, Form(alias="expires_after[seconds]", ge=MIN_EXPIRY,
                                                le=MAX_EXPIRY)] = None,
) -> dict[str, Any]:
    kept = expiry(expires_anchor, expires_seconds)
    chunks = iter(partial(file.file.read, CHUNK), b"")
    stored = await asyncio.to_thread(store.create, file.filename or "", purpose, chunks, expires_after=kept)
    return stored.to_openai()


@router.get("/files")
async def list_files(store: FilesDep, purpose: str | None = None, after: str | None = None,
                     limit: Annotated[int, Query(ge=1, le=MAX_FILES_PAGE)] = MAX_FILES_PAGE,
                     order: Literal["asc", "desc"] = "desc") -> dict[str, Any]:
    found, has_more = await asyncio.to_thread(store.list, purpose=purpose, after=after, limit=limit, order=order)
    return list_body([stored.to_openai() for stored in found], has_more)


@router.get("/files/{file_id}")
async def retrieve_file(store: FilesDep, file_id: str) -> dict[str, Any]:
    return (await asyncio.to_thread(store.get, file_id)).to_openai()


@router.get("/files/{file_id}/content", response_class=FileResponse, responses={200: {
    "description": "the file's bytes", "content": {"application/octet-stream": {}, JSONL_TYPE: {}}}})
async def file_content(store: FilesDep, file_id: str) -> FileResponse:
    return await asyncio.to_thread(content_response, store, file_id)


@router.delete("/files/{file_id}")
async def delete_file(store: FilesDep, file_id: str) -> dict[str, Any]:
    await asyncio.to_thread(store.delete, file_id)
    return {"id": file_id, "object": "file", "deleted": True}
