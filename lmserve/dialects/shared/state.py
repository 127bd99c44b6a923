"""What the routes take from the app, as FastAPI dependencies: the service, the media policy, the server's
configuration and the stores. lmserve/http/app.py puts them on the app's state once (the names below); a handler
names what it needs as a parameter (`service: ServiceDep`), so the routers are built once, at import, and each
handler is a plain function a reader can follow and a test can import. The dependencies are coroutines: FastAPI
runs a plain function dependency on a worker thread, a hop per dependency per request that cost more than the rest
of a short request's handling (bench/token_cost.py's profile)."""

from __future__ import annotations

from typing import Annotated, cast

from fastapi import Depends, Request

from lmserve.chat.media import MediaPolicy
from lmserve.config import ServerConfig
from lmserve.service import Service
from lmserve.store.completions import CompletionStore
from lmserve.store.conversations import ConversationStore
from lmserve.store.files import FileStore
from lmserve.store.responses import ResponseStore


async def app_service(request: Request) -> Service:
    return cast(Service, request.app.state.service)


async def app_media(request: Request) -> MediaPolicy:
    return cast(MediaPolicy, request.app.state.media)


async def app_config(request: Request) -> ServerConfig:
    return cast(ServerConfig, request.app.state.config)


async def app_served(request: Request) -> str | None:
    """The model the server was started with (GET /v1/models lists it first), or None."""
    return cast(str | None, request.app.state.served)


async def app_completions(request: Request) -> CompletionStore:
    return cast(CompletionStore, request.app.state.completions)


async def app_responses(request: Request) -> ResponseStore:
    return cast(ResponseStore, request.app.state.responses)


async def app_conversations(request: Request) -> ConversationStore:
    return cast(ConversationStore, request.app.state.conversations)


async def app_files(request: Request) -> FileStore:
    return cast(FileStore, request.app.state.files)


ServiceDep = Annotated[Service, Depends(app_service)]
MediaDep = Annotated[MediaPolicy, Depends(app_media)]
ConfigDep = Annotated[ServerConfig, Depends(app_config)]
ServedDep = Annotated[str | None, Depends(app_served)]
CompletionsDep = Annotated[CompletionStore, Depends(app_completions)]
ResponsesDep = Annotated[ResponseStore, Depends(app_responses)]
ConversationsDep = Annotated[ConversationStore, Depends(app_conversations)]
FilesDep = Annotated[FileStore, Depends(app_files)]
