"""The one mapping of errors to HTTP: every error becomes a body in the dialect of its route
(lmserve/dialects/table.py), from lmserve's own errors, request validation, Starlette's HTTP errors, a client that
went away, and (CatchAllMiddleware) anything unexpected, as a 500 that names no internals."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lmserve.dialects.shared.errors import INTERNAL_ERROR, invalid_from_validation
from lmserve.dialects.shared.streaming import ClientGone, dumps
from lmserve.dialects.table import error_body
from lmserve.errors import LmserveError

log = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499


class BodyTooLarge(StarletteHTTPException):
    """A request body grew past the limit while it was read (raised from the receive channel)."""

    code = "request_too_large"

    def __init__(self, limit: int, variable: str = "LMSERVE_MAX_BODY") -> None:
        super().__init__(413, f"Request body is larger than the limit of {limit} bytes ({variable}).")


ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}


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
    if isinstance(exc, BodyTooLarge):
        err.code = BodyTooLarge.code
    err.type = ERROR_TYPES.get(exc.status_code, "invalid_request_error" if exc.status_code < 500 else "server_error")
    response = error_response(path, err)
    if exc.headers:
        response.headers.update(exc.headers)
    return response


async def _client_gone(request: Request, exc: Exception) -> Response:
    log.info("%s %s: client disconnected, generation aborted", request.method, request.url.path)
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def send_error(send: Send, path: str, err: LmserveError, headers: dict[str, str] | None = None) -> None:
    body = dumps(error_body(path, err)).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": err.status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


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


def install(app: FastAPI) -> None:
    """The app's handlers of lmserve's errors, request validation, Starlette's HTTP errors and a client gone."""
    app.add_exception_handler(LmserveError, _lmserve_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(ClientGone, _client_gone)
