"""One access-log line per request on the server console, through logging at INFO on logger `lmserve.access`:

    POST /v1/chat/completions 200 model=smollm2:135m tokens=12+34 0.52s

method, path, status, then (for requests that generated) the model and prompt+completion tokens, then the time
from the request's arrival to the end of its response body (streams included). The middleware keeps a record per
request in a context variable; the service's finish observer fills in the model and tokens from the final chunk,
which the request's own task (or one it started) yields, so the record it reaches is its own request's.
"""

from __future__ import annotations

import contextvars
import logging
import time
from dataclasses import dataclass, field

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lmserve.service.observers import Observers
from lmserve.types import Chunk

log = logging.getLogger("lmserve.access")


@dataclass(slots=True)
class AccessRecord:
    """What one request's log line says."""

    method: str
    path: str
    status: int = 0
    model: str | None = None
    finals: dict[int, Chunk] = field(default_factory=dict)
    """The final chunk of each generation the request ran (by identity: an observer told twice counts once)."""

    def line(self, seconds: float) -> str:
        parts = [self.method, self.path, str(self.status or "-")]
        if self.model is not None:
            usages = [chunk.usage for chunk in self.finals.values() if chunk.usage is not None]
            prompt = max((usage.prompt_tokens for usage in usages), default=0)
            completion = sum(usage.completion_tokens for usage in usages)
            parts += [f"model={self.model}", f"tokens={prompt}+{completion}"]
        return " ".join([*parts, f"{seconds:.2f}s"])


_current: contextvars.ContextVar[AccessRecord | None] = contextvars.ContextVar("lmserve_access", default=None)


def record_finish(model: str, chunk: Chunk) -> None:
    """A finish observer: note the model and final chunk on the current request's record."""
    record = _current.get()
    if record is not None:
        record.model = model
        record.finals[id(chunk)] = chunk


class AccessLogMiddleware:
    """Logs one line per HTTP request once its response has been sent (pure ASGI: streams pass straight on)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = AccessRecord(method=str(scope.get("method", "")), path=str(scope.get("path", "")))
        started = time.perf_counter()

        async def noting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = int(message["status"])
            await send(message)

        token = _current.set(record)
        try:
            await self.app(scope, receive, noting_send)
        finally:
            _current.reset(token)
            log.info(record.line(time.perf_counter() - started))


def install(app: FastAPI, observers: Observers) -> None:
    """Log every request of `app`, with the model and tokens the service's observers report."""
    observers.on_finish(record_finish)
    app.add_middleware(AccessLogMiddleware)
