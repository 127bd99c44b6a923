"""Streaming responses: wire encoders, and the guarantee that a generation ends when its client goes.

Every streamed route hands `GenerationResponse` a `Generation` and an async iterator of already-encoded
frames. Whatever ends the response — the last frame, a client disconnect, a cancelled task, a failed
send — the generation is aborted (abort is idempotent), so its slot in the engine is freed at once.

Encoders: `sse_event`/`SSE_DONE` (OpenAI dialect). The native dialect's NDJSON encoder belongs here too.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

log = logging.getLogger(__name__)

T = TypeVar("T")

SSE_MEDIA_TYPE = "text/event-stream"
SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Abortable(Protocol):
    """What streaming needs of a generation: a way to stop it."""

    def abort(self) -> None: ...


def dumps(obj: Any) -> str:
    """Compact JSON, UTF-8 kept as is."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def sse_event(payload: str) -> bytes:
    """One Server-Sent Event carrying an already-encoded JSON payload."""
    return f"data: {payload}\n\n".encode()


def sse_json(obj: Any) -> bytes:
    return sse_event(dumps(obj))


HOLE = "\x00hole\x00"
"""Placeholder for the one string that changes between the frames of a `TextFrame`."""
_HOLE_JSON = dumps(HOLE)
_json_string: Callable[[str], str] = json.encoder.encode_basestring
"""A string as JSON, UTF-8 kept as is: what `dumps` gives for a string, without making an encoder per call."""


class TextFrame:
    """An SSE frame pre-encoded around one string field, so a token costs one small json.dumps.

    Build it from the chunk object with `HOLE` where the text goes; call it with each new text.
    """

    __slots__ = ("_prefix", "_suffix")

    def __init__(self, template: Any) -> None:
        encoded = f"data: {dumps(template)}\n\n"
        self._prefix, self._suffix = encoded.split(_HOLE_JSON)

    def __call__(self, text: str) -> bytes:
        return (self._prefix + _json_string(text) + self._suffix).encode()


class GenerationResponse(StreamingResponse):
    """A streaming response that aborts its generation however the response ends."""

    def __init__(
        self,
        generation: Abortable,
        frames: AsyncIterator[bytes],
        *,
        media_type: str = SSE_MEDIA_TYPE,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(frames, media_type=media_type, headers=headers or dict(SSE_HEADERS))
        self.generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.abort()


class ClientGone(Exception):
    """The client disconnected before a non-streaming answer was ready."""


async def until_disconnect(work: Awaitable[T], receive: Receive) -> T:
    """Run `work` (collecting a whole answer) unless the client disconnects first.

    The body must already have been read, so the next `receive()` only returns on disconnect. On a
    disconnect `work` is cancelled (its own try/finally aborts the generation) and ClientGone is raised.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task not in done:
        raise ClientGone
    return task.result()


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def guarded_errors(frames: AsyncIterator[bytes], on_error: Callable[[Exception], bytes]) -> AsyncIterator[bytes]:
    """Pass frames through; an unexpected exception after the headers went out becomes one error frame."""
    try:
        async for frame in frames:
            yield frame
    except Exception as exc:
        log.exception("stream failed")
        yield on_error(exc)
