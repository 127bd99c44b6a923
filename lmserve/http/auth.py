"""Authentication: with --api-key set, every route but the open ones (health, liveness, the web page and its files)
needs the key, as a bearer token or an x-api-key header."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from lmserve.errors import AuthenticationFailed
from lmserve.http.errors import send_error
from lmserve.http.guards import header as read_header
from lmserve.http.health import HEALTH_PATH, LIVENESS_PATH
from lmserve.http.web import WEB_PREFIX

OPEN_PATHS = frozenset({HEALTH_PATH, LIVENESS_PATH, "/"})
"""Routes that need no API key (not /metrics: with a key set, a scraper sends it too)."""


OPEN_PREFIXES = (WEB_PREFIX,)
"""Path prefixes that need no API key: the web page's files (the page asks for the key)."""


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
        api_key = read_header(scope, b"x-api-key").strip()
        if api_key and hmac.compare_digest(api_key, self._key):
            return True
        header = read_header(scope, b"authorization")
        scheme, _, key = header.strip().partition(b" ")
        if scheme.lower() not in (b"bearer", b"key"):
            return False
        return hmac.compare_digest(key.strip(), self._key)
