"""The HTTP application: the whole route table, authentication, and the one mapping of errors to HTTP.

Every error becomes a body in the dialect of its route (wire_errors.error_body): the OpenAI body for
/v1 and everything else, the native body for /api/. Nothing here matches on message text.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lmserve.api.native import native_router
from lmserve.api.openai import openai_router
from lmserve.api.streaming import ClientGone, dumps
from lmserve.api.wire_errors import INTERNAL_ERROR, error_body, invalid_from_validation
from lmserve.config import ServerConfig
from lmserve.errors import AuthenticationFailed, LmserveError
from lmserve.service import Service

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health"})
"""Routes that need no API key."""

CLIENT_CLOSED_REQUEST = 499
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}


def create_app(service: Service, config: ServerConfig, *, preload: Sequence[str] = ()) -> FastAPI:
    """The lmserve application over `service`; `preload` names models loaded at startup and kept loaded."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        for name in preload:
            await service.load(name, keep_alive=-1)
        expiry = asyncio.create_task(service.loaded.run_expiry())
        try:
            yield
        finally:
            expiry.cancel()

    app = FastAPI(title="lmserve", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.include_router(openai_router(service))
    app.include_router(native_router(service))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    app.add_exception_handler(LmserveError, _lmserve_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(ClientGone, _client_gone)
    if config.api_key:
        app.add_middleware(AuthMiddleware, api_key=config.api_key)
    app.add_middleware(CatchAllMiddleware)  # added last: outermost, so it also covers the auth middleware
    return app


# ---- error mapping --------------------------------------------------------------------------------


def error_response(path: str, err: LmserveError) -> JSONResponse:
    headers = {"Retry-After": "1"} if err.status == 503 else None
    return JSONResponse(error_body(path, err), status_code=err.status, headers=headers)


async def _lmserve_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, LmserveError)
    if exc.status >= 500:
        log.error("%s %s failed: %s", request.method, request.url.path, exc.message)
    return error_response(request.url.path, exc)


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return error_response(request.url.path, invalid_from_validation(exc.errors(), strip=1))


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    path = request.url.path
    if exc.status_code == 404:
        err = LmserveError(f"Unknown route: {request.method} {path}", code="unknown_route")
    else:
        err = LmserveError(str(exc.detail))
    err.status = exc.status_code
    err.type = _ERROR_TYPES.get(exc.status_code, "invalid_request_error" if exc.status_code < 500 else "server_error")
    response = error_response(path, err)
    if exc.headers:
        response.headers.update(exc.headers)
    return response


async def _client_gone(request: Request, exc: Exception) -> Response:
    log.info("%s %s: client disconnected, generation aborted", request.method, request.url.path)
    return Response(status_code=CLIENT_CLOSED_REQUEST)


# ---- middleware (pure ASGI: no buffering of streamed bodies, disconnects pass through) --------------


async def send_error(send: Send, path: str, err: LmserveError, headers: dict[str, str] | None = None) -> None:
    body = dumps(error_body(path, err)).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": err.status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


class AuthMiddleware:
    """Every route but OPEN_PATHS needs `Authorization: Key <key>` or `Authorization: Bearer <key>`."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._is_authorized(scope):
            await self.app(scope, receive, send)
            return
        err = AuthenticationFailed("Invalid or missing API key. Send 'Authorization: Bearer <key>' or 'Key <key>'.")
        err.code = "invalid_api_key"
        await send_error(send, scope["path"], err, {"WWW-Authenticate": "Bearer"})

    def _is_authorized(self, scope: Scope) -> bool:
        header = _header(scope, b"authorization")
        scheme, _, key = header.strip().partition(b" ")
        if scheme.lower() not in (b"bearer", b"key"):
            return False
        return hmac.compare_digest(key.strip(), self._key)


def _header(scope: Scope, name: bytes) -> bytes:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return bytes(value)
    return b""


class CatchAllMiddleware:
    """An unexpected exception becomes a logged 500 with an error body, never a bare traceback."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        is_started = False

        async def tracking_send(message: Message) -> None:
            nonlocal is_started
            if message["type"] == "http.response.start":
                is_started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except ClientDisconnect:
            log.info("%s %s: client disconnected", scope.get("method"), scope["path"])
        except Exception:
            log.exception("%s %s failed", scope.get("method"), scope["path"])
            if not is_started:
                err = LmserveError(INTERNAL_ERROR)
                await send_error(send, scope["path"], err)
