"""The web chat page: `GET /` answers a browser with the page and any other client with plain text, and the page's
files (lmserve/web/, shipped inside the package) are served under WEB_PREFIX.

The files are indexed once, when the router is made: a request names one of them exactly or gets 404, so no path
can reach outside the folder.
"""

from __future__ import annotations

from importlib import resources
from importlib.resources.abc import Traversable

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from lmserve.errors import LmserveError

WEB_PREFIX = "/web/"
"""Where the page's own files are served (no API key needed: the page must load to ask for one)."""
INDEX = "index.html"
PLAIN_ROOT = "lmserve is running"

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
    ".md": "text/plain; charset=utf-8",
}
"""By file suffix; anything else (the vendored LICENSE files) is plain text."""
PLAIN_TEXT = "text/plain; charset=utf-8"

PAGE_POLICY = ("default-src 'self'; img-src 'self' data: blob:; connect-src 'self'; style-src 'self'; "
               "object-src 'none'; base-uri 'none'; frame-ancestors 'none'")
"""The page's Content-Security-Policy: its own scripts and styles only, so sanitised Markdown cannot run code."""


def web_files(root: Traversable | None = None) -> dict[str, Traversable]:
    """{"app.js": file, "vendor/marked.esm.js": file, …}: every file under lmserve/web/, by its relative path."""
    folder = root if root is not None else resources.files("lmserve") / "web"
    found: dict[str, Traversable] = {}

    def walk(node: Traversable, prefix: str) -> None:
        for child in node.iterdir():
            if child.is_dir():
                walk(child, f"{prefix}{child.name}/")
            elif child.is_file():
                found[prefix + child.name] = child

    if folder.is_dir():
        walk(folder, "")
    return found


def content_type(name: str) -> str:
    """The Content-Type of a page file from its suffix."""
    suffix = name[name.rfind("."):] if "." in name.rpartition("/")[2] else ""
    return CONTENT_TYPES.get(suffix.lower(), PLAIN_TEXT)


def wants_html(accept: str) -> bool:
    """Whether an Accept header asks for HTML by name (a browser does; `*/*` alone, as curl sends, does not)."""
    for item in accept.split(","):
        media, *params = (part.strip() for part in item.split(";"))
        if media.lower() not in ("text/html", "application/xhtml+xml"):
            continue
        quality = 1.0
        for param in params:
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    quality = float(value)
                except ValueError:
                    quality = 0.0
        if quality > 0:
            return True
    return False


def web_router(root: Traversable | None = None) -> APIRouter:
    """`GET /` (the page or plain text, by Accept) and `GET /web/{file}` (the page's files)."""
    router = APIRouter()
    files = web_files(root)

    def page_file(name: str) -> Response:
        file = files.get(name)
        if file is None:
            err = LmserveError(f"Unknown route: GET {WEB_PREFIX}{name}", code="unknown_route")
            err.status = 404
            err.type = "not_found_error"
            raise err
        headers = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
        if name == INDEX:
            headers["Content-Security-Policy"] = PAGE_POLICY
        return Response(file.read_bytes(), media_type=content_type(name), headers=headers)

    @router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def root_page(request: Request) -> Response:
        if wants_html(request.headers.get("accept", "")):
            response = page_file(INDEX)
            response.headers["Vary"] = "Accept"
            return response
        return PlainTextResponse(PLAIN_ROOT, headers={"Vary": "Accept"})

    @router.api_route(WEB_PREFIX + "{name:path}", methods=["GET", "HEAD"], include_in_schema=False)
    async def asset(name: str) -> Response:
        return page_file(name)

    return router
