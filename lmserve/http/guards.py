"""The guards every request passes before its route: DNS rebinding (the Host header of a server on a loopback address),
CORS (allowed origins, preflights), and the size of request bodies."""

from __future__ import annotations

import ipaddress
import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lmserve.config import DEFAULT_ORIGINS, ServerConfig, env_name
from lmserve.endpoints.files import FILES_PATH
from lmserve.errors import LmserveError
from lmserve.http.errors import ERROR_TYPES, BodyTooLarge, send_error

BLOB_PREFIX = "/api/blobs/"
"""Blob uploads are model weights: exempt from the body limit."""


FORM_ALLOWANCE = 1 << 20
"""What a file upload's body (POST /v1/files) may carry beyond LMSERVE_FILES_MAX_UPLOAD: the form around the file
(the file store bounds the file itself)."""


CORS_METHODS = "GET, POST, PUT, DELETE, HEAD, OPTIONS"


CORS_HEADERS = ("Authorization", "Content-Type", "Accept", "User-Agent", "X-Requested-With")


CORS_MAX_AGE = "86400"


_SAFE_METHODS = frozenset({"GET", "HEAD"})


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
            host = header(scope, b"host").decode("latin-1")
            if host and not is_loopback_host(split_host_header(host)):
                await send_error(send, path, _denied(f"Host {host!r} is not allowed: the server listens on loopback."))
                return
        origin = header(scope, b"origin").decode("latin-1")
        cors: list[tuple[bytes, bytes]] = []
        if origin:
            if not self._origin_allowed(origin):
                if method not in _SAFE_METHODS:
                    await send_error(send, path, _denied(f"Origin {origin!r} is not allowed (LMSERVE_ORIGINS)."))
                    return
            else:
                cors = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
                if method == "OPTIONS" and header(scope, b"access-control-request-method"):
                    await self._preflight(scope, send, cors)
                    return
        limit, variable = self._body_limit(path)
        if limit:
            length = header(scope, b"content-length")
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
        asked = [h.strip() for h in header(scope, b"access-control-request-headers").decode("latin-1").split(",")]
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
    err.type = ERROR_TYPES[403]
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


def header(scope: Scope, name: bytes) -> bytes:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return bytes(value)
    return b""

