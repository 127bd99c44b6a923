"""One HTTP request as a Ray handle call: what the ingress sends a replica, and how a replica answers it.

`HttpCall` carries the request whole (method, path, query, headers, body) and, as `prompt`, the text Ray's
prefix-aware router matches replicas on. `answer` runs lmserve's app for one call as an ASGI server would: it
yields the response's `Head` first, then its body in the pieces the app sends them (a stream stays a stream); when
the caller goes away the app sees the client disconnect, so the generation is aborted as on a plain server.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message

from lmserve.dialects.table import dialect_of

_SKIPPED = frozenset({"type", "role", "id", "tool_call_id", "call_id", "url", "image_url", "images", "data",
                      "source", "file_id", "cache_control", "signature"})
"""Keys whose strings are not prompt text (tags, ids, image bytes)."""


AT_ONCE = 8
"""Body pieces sent as they come before the interval applies: every dialect's opening events (Anthropic's are
four) and the first tokens, so the time to the first token is not held."""


@dataclass(frozen=True, slots=True)
class HttpCall:
    """An HTTP request for a replica to answer."""

    method: str
    path: str
    query: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    prompt: str
    """The request's prompt text, read by Ray's prefix-aware router ("" for a request without one)."""
    client: tuple[str, int] | None = None


@dataclass(frozen=True, slots=True)
class Head:
    """The status and headers of a response, sent before its body."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]


@dataclass(frozen=True, slots=True)
class Whole:
    """A whole response and the replica that gave it (for the routes merged across replicas)."""

    replica: str
    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def prompt_text(path: str, body: bytes) -> str:
    """The text of a request body's prompt: the fields its dialect's `prompt_keys` name (lmserve/dialects/table.py),
    in template order; "" when the body is not a JSON object or has none (GET routes, uploads)."""
    try:
        data = json.loads(body) if body[:1] == b"{" else None
    except ValueError:
        return ""
    if not isinstance(data, dict):
        return ""
    pieces: list[str] = []
    for key in dialect_of(path).prompt_keys:
        if key in data:
            _strings(data[key], pieces)
    return "".join(pieces)


def _strings(value: object, out: list[str]) -> None:
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, list):
        for item in value:
            _strings(item, out)
    elif isinstance(value, dict):
        for key, item in value.items():
            if key not in _SKIPPED:
                _strings(item, out)


async def answer(app: ASGIApp, call: HttpCall, interval: float = 0.0) -> AsyncIterator[Head | bytes]:
    """Run `app` for `call`: the response's Head, then its body pieces: the first AT_ONCE as they come (a stream's
    opening events and its first tokens), then at most one per `interval` seconds (a piece is sent at once when
    none was for `interval`; those that come sooner are held and sent together when it has passed). Closing the
    iterator early (the caller went away) tells the app the client disconnected."""
    sent: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await sent.put(message)

    scope: dict[str, Any] = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": call.method,
        "scheme": "http", "path": call.path, "raw_path": call.path.encode(), "query_string": call.query,
        "root_path": "", "headers": list(call.headers), "client": call.client, "server": None,
    }
    task: asyncio.Task[None] = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: sent.put_nowait(None))
    loop = asyncio.get_running_loop()
    held, flush_at, pieces = bytearray(), 0.0, 0
    try:
        while True:
            wait = max(0.0, flush_at - loop.time()) if held else None
            try:
                message = await asyncio.wait_for(sent.get(), wait)
            except TimeoutError:
                yield bytes(held)
                held.clear()
                flush_at = loop.time() + interval
                continue
            if message is None:  # the app ended without a whole response: its error, raised here
                task.result()
                return
            if message["type"] == "http.response.start":
                yield Head(message["status"], tuple((bytes(k), bytes(v)) for k, v in message.get("headers", ())))
            elif message["type"] == "http.response.body":
                held += message.get("body", b"")
                if not message.get("more_body", False):
                    if held:
                        yield bytes(held)
                    return
                pieces += 1
                if held and (pieces <= AT_ONCE or loop.time() >= flush_at):
                    yield bytes(held)
                    held.clear()
                    flush_at = loop.time() + interval if pieces >= AT_ONCE else 0.0
    finally:
        gone.set()
