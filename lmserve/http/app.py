"""The HTTP application: the whole route table, authentication, and the one mapping of errors to HTTP.

Every error becomes a body in the dialect of its route (wire_errors.error_body): the Anthropic body for
/v1/messages, the OpenAI body for the rest of /v1 and everything else, the native body for /api/. Nothing here
matches on message text.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import logging
import re
from collections.abc import AsyncIterator, Sequence

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lmserve.chat.media import MediaPolicy
from lmserve.config import DEFAULT_ORIGINS, ServerConfig, env_name
from lmserve.dialects.anthropic import routes as anthropic_routes
from lmserve.dialects.native import routes as native_routes
from lmserve.dialects.openai import routes as openai_routes
from lmserve.dialects.openai import stored
from lmserve.dialects.openai.stored import completions_store
from lmserve.dialects.responses import conversations
from lmserve.dialects.responses import routes as responses_routes
from lmserve.dialects.responses.conversations import conversations_store
from lmserve.dialects.responses.routes import responses_store
from lmserve.dialects.shared.errors import INTERNAL_ERROR, invalid_from_validation
from lmserve.dialects.shared.streaming import ClientGone, dumps
from lmserve.dialects.table import error_body
from lmserve.endpoints import batches, decisions, files, gateway, infill, rerank, tokens
from lmserve.endpoints.batch_lines import asgi_send
from lmserve.endpoints.batches import BatchService, batch_store
from lmserve.endpoints.files import FILES_PATH, files_store
from lmserve.errors import AuthenticationFailed, LmserveError
from lmserve.http import health
from lmserve.http.access_log import install as install_access_log
from lmserve.http.health import HEALTH_PATH, LIVENESS_PATH
from lmserve.http.metrics import METRICS_PATH, Metrics, MetricsMiddleware
from lmserve.http.openapi import install as install_openapi
from lmserve.http.web import WEB_PREFIX, web_router
from lmserve.service import Service

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({HEALTH_PATH, LIVENESS_PATH, "/"})
"""Routes that need no API key (not /metrics: with a key set, a scraper sends it too)."""
OPEN_PREFIXES = (WEB_PREFIX,)
"""Path prefixes that need no API key: the web page's files (the page asks for the key)."""

CLIENT_CLOSED_REQUEST = 499
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}


def add_routes(app: FastAPI, router: APIRouter) -> None:
    """Add a router's routes to the app as they are. FastAPI's include_router builds each route again (its body model
    and dependencies: half the time of create_app); with no prefix, tags or dependencies to add, they would be the
    same routes. lmserve's routers hold plain routes only (no mounts, lifespans or router-wide dependencies)."""
    app.router.routes.extend(router.routes)


ROUTERS = (openai_routes.router, gateway.router, stored.router, native_routes.router, anthropic_routes.router,
           responses_routes.router, conversations.router, files.router, batches.router, tokens.router, infill.router,
           decisions.router, rerank.router)
"""The module-level routers, in the order their routes are matched (and listed by /openapi.json)."""


def _set_state(app: FastAPI, service: Service, config: ServerConfig, served: str | None) -> None:
    """What the routes take from the app (lmserve/dialects/shared/state.py)."""
    state = app.state
    state.service, state.config, state.served = service, config, served
    state.media = MediaPolicy(allowed_hosts=frozenset(config.image_allow_hosts), max_bytes=config.image_max_bytes)
    state.completions = completions_store(config)
    state.responses = responses_store(config)
    state.conversations = conversations_store(config)
    state.files = files_store(config)  # shared with the batch routes
    # stopped first when the server shuts down (server.py), before the grace runs out
    state.batches = BatchService(batch_store(config), state.files, concurrency=config.batch_concurrency)


def create_app(service: Service, config: ServerConfig, *, preload: Sequence[str] = (),
               served: str | None = None, resume_batches: bool = True) -> FastAPI:
    """The lmserve application over `service`; `preload` names models loaded at startup and kept loaded; `served`
    is the model the server was started with (listed first by GET /v1/models, so the web page starts on it).
    `resume_batches`: run the unfinished batches of the store at startup (not for `lmserve batch`, which runs its
    own file in process)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        for name in preload:
            await service.models.load(name, keep_alive=-1)
        expiry = asyncio.create_task(service.residency.run_expiry())
        send, close_send = asgi_send(app, config.api_key)  # batch lines go through the app's own routes
        await app.state.batches.start(send, resume=resume_batches)
        try:
            yield
        finally:
            await app.state.batches.stop()
            await close_send()
            expiry.cancel()

    app = FastAPI(title="lmserve", docs_url=None, redoc_url=None, lifespan=lifespan)
    _set_state(app, service, config, served)
    for router in ROUTERS:
        add_routes(app, router)
    add_routes(app, web_router())  # GET /: the chat page for a browser, plain text for other clients
    install_openapi(app)  # /openapi.json: one operationId per method

    add_routes(app, health.router)
    metrics = Metrics(service)
    metrics.attach(service)
    app.state.metrics = metrics

    @app.get(METRICS_PATH, include_in_schema=False)
    async def metrics_endpoint() -> Response:
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    app.add_exception_handler(LmserveError, _lmserve_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(ClientGone, _client_gone)
    if config.api_key:
        app.add_middleware(AuthMiddleware, api_key=config.api_key)
    app.add_middleware(GuardMiddleware, config=config)  # outside auth: preflights carry no Authorization
    app.add_middleware(CatchAllMiddleware)  # outside auth and guards, so it also covers them
    app.add_middleware(MetricsMiddleware, metrics=metrics, routes=app.router.routes)  # outermost: sees every status
    install_access_log(app, service.observers)  # one line per request on the console, outside even the metrics
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
    if isinstance(exc, BodyTooLarge):
        err.code = BodyTooLarge.code
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
    """Every route but OPEN_PATHS and OPEN_PREFIXES needs `Authorization: Key <key>`, `Authorization: Bearer <key>`
    or `x-api-key: <key>` (Anthropic's header)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        is_open = path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)
        if scope["type"] != "http" or is_open or self._is_authorized(scope):
            await self.app(scope, receive, send)
            return
        err = AuthenticationFailed("Invalid or missing API key. Send 'Authorization: Bearer <key>' or 'Key <key>' "
                                   "(or 'x-api-key: <key>').")
        err.code = "invalid_api_key"
        await send_error(send, scope["path"], err, {"WWW-Authenticate": "Bearer"})

    def _is_authorized(self, scope: Scope) -> bool:
        api_key = _header(scope, b"x-api-key").strip()
        if api_key and hmac.compare_digest(api_key, self._key):
            return True
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


# ---- guards: DNS rebinding, CORS, request size ------------------------------------------------------

BLOB_PREFIX = "/api/blobs/"
"""Blob uploads are model weights: exempt from the body limit."""
FORM_ALLOWANCE = 1 << 20
"""What a file upload's body (POST /v1/files) may carry beyond LMSERVE_FILES_MAX_UPLOAD: the form around the file
(the file store bounds the file itself)."""
CORS_METHODS = "GET, POST, PUT, DELETE, HEAD, OPTIONS"
CORS_HEADERS = ("Authorization", "Content-Type", "Accept", "User-Agent", "X-Requested-With")
CORS_MAX_AGE = "86400"
_SAFE_METHODS = frozenset({"GET", "HEAD"})


class BodyTooLarge(StarletteHTTPException):
    """A request body grew past the limit while it was read (raised from the receive channel)."""

    code = "request_too_large"

    def __init__(self, limit: int, variable: str = "LMSERVE_MAX_BODY") -> None:
        super().__init__(413, f"Request body is larger than the limit of {limit} bytes ({variable}).")


def is_loopback_host(host: str) -> bool:
    """localhost, *.localhost, 127.0.0.0/8 or ::1, without a port (an IPv6 address may be bracketed)."""
    name = host.strip().lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:
        return False


def split_host_header(value: str) -> str:
    """The host part of a Host header: 'localhost:11434' → 'localhost', '[::1]:80' → '[::1]'."""
    if value.startswith("["):
        end = value.find("]")
        return value if end < 0 else value[: end + 1]
    return value.rpartition(":")[0] if value.count(":") == 1 else value


def origin_pattern(origin: str) -> re.Pattern[str]:
    """An allowed-origin pattern as a regex: `*` matches anything, but only digits as a trailing `:*` port."""
    if origin == "*":
        return re.compile(r".*", re.DOTALL)
    port = origin.endswith(":*")
    body = origin[:-2] if port else origin
    regex = ".*".join(re.escape(part) for part in body.lower().split("*"))
    return re.compile(regex + (r":\d{1,5}" if port else ""))


class GuardMiddleware:
    """Host-header check (DNS rebinding), CORS, and the request-body limit, before auth and routing.

    - Bound to loopback (config.host), a Host header that is not a loopback name or address gets 403: a page on
      evil.com that rebinds its name to 127.0.0.1 must not reach the server.
    - An allowed Origin gets Access-Control-Allow-Origin and preflights are answered here with 204 (browsers send
      no Authorization on a preflight). A disallowed Origin gets no CORS headers, and 403 on anything but GET/HEAD.
    - A body beyond config.max_body_bytes gets 413: at once from Content-Length, else while it is received. Blob
      uploads are exempt; file uploads (POST /v1/files) are bounded by config.files_max_upload instead.
    """

    def __init__(self, app: ASGIApp, config: ServerConfig) -> None:
        self.app = app
        self._check_host = is_loopback_host(config.host)
        self._origins = [origin_pattern(o) for o in (*DEFAULT_ORIGINS, *config.origins)]
        self._max_body = config.max_body_bytes
        self._max_upload = config.files_max_upload + FORM_ALLOWANCE

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        method: str = scope["method"]
        if self._check_host and self._on_socket(scope):
            host = _header(scope, b"host").decode("latin-1")
            if host and not is_loopback_host(split_host_header(host)):
                await send_error(send, path, _denied(f"Host {host!r} is not allowed: the server listens on loopback."))
                return
        origin = _header(scope, b"origin").decode("latin-1")
        cors: list[tuple[bytes, bytes]] = []
        if origin:
            if not self._origin_allowed(origin):
                if method not in _SAFE_METHODS:
                    await send_error(send, path, _denied(f"Origin {origin!r} is not allowed (LMSERVE_ORIGINS)."))
                    return
            else:
                cors = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
                if method == "OPTIONS" and _header(scope, b"access-control-request-method"):
                    await self._preflight(scope, send, cors)
                    return
        limit, variable = self._body_limit(path)
        if limit:
            length = _header(scope, b"content-length")
            if length.isdigit() and int(length) > limit:
                err = _too_large(BodyTooLarge(limit, variable))
                await send_error(send, path, err, {"Connection": "close"} | _cors_dict(cors))
                return
            receive = self._limited(receive, limit, variable)
        if cors:
            send = _adding_headers(send, cors)
        try:
            await self.app(scope, receive, send)
        except BodyTooLarge as exc:  # raised where no exception handler runs; the response cannot have started
            await send_error(send, path, _too_large(exc))

    def _body_limit(self, path: str) -> tuple[int, str]:
        """The most bytes a request body on `path` may have (0: no limit) and the variable that sets it."""
        if path.startswith(BLOB_PREFIX):
            return 0, ""
        if path == FILES_PATH:
            return self._max_upload, f"{env_name('files_max_upload')} and {FORM_ALLOWANCE} for the form"
        return self._max_body, env_name("max_body_bytes")

    @staticmethod
    def _on_socket(scope: Scope) -> bool:
        """A real server reports the connection's local IP (or None on a unix socket); an in-process transport
        reports the URL's host name instead: no socket there, so nothing to rebind."""
        server = scope.get("server")
        if not server:
            return True
        try:
            ipaddress.ip_address(str(server[0]))
        except ValueError:
            return False
        return True

    def _origin_allowed(self, origin: str) -> bool:
        lowered = origin.lower()
        return any(p.fullmatch(lowered) for p in self._origins)

    async def _preflight(self, scope: Scope, send: Send, cors: list[tuple[bytes, bytes]]) -> None:
        asked = [h.strip() for h in _header(scope, b"access-control-request-headers").decode("latin-1").split(",")]
        known = {h.lower() for h in CORS_HEADERS}
        allowed = [*CORS_HEADERS, *(h for h in asked if h and h.lower() not in known)]
        headers = [
            *cors,
            (b"access-control-allow-methods", CORS_METHODS.encode()),
            (b"access-control-allow-headers", ", ".join(allowed).encode("latin-1")),
            (b"access-control-max-age", CORS_MAX_AGE.encode()),
        ]
        await send({"type": "http.response.start", "status": 204, "headers": headers})
        await send({"type": "http.response.body", "body": b""})

    @staticmethod
    def _limited(receive: Receive, limit: int, variable: str) -> Receive:
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit, variable)
            return message

        return limited_receive


def _denied(message: str) -> LmserveError:
    err = LmserveError(message, code="forbidden")
    err.status = 403
    err.type = _ERROR_TYPES[403]
    return err


def _too_large(exc: BodyTooLarge) -> LmserveError:
    err = LmserveError(str(exc.detail), code=BodyTooLarge.code)
    err.status = 413
    err.type = "invalid_request_error"
    return err


def _cors_dict(cors: list[tuple[bytes, bytes]]) -> dict[str, str]:
    return {k.decode(): v.decode("latin-1") for k, v in cors}


def _adding_headers(send: Send, extra: list[tuple[bytes, bytes]]) -> Send:
    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)

    return wrapped
