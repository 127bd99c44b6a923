"""`/api/pull` plumbing: the blocking `ModelService.pull` runs in a worker thread; its lines reach the event loop.

The worker's progress callback hands each line over with `loop.call_soon_threadsafe` onto an `asyncio.Queue`; the
end of the worker puts a sentinel after its last line. `head()` waits until the pull is past "pulling manifest"
(the repo was found and a GGUF chosen), so a bad name or an unknown repo still fails as an ordinary 400/404 before
any line is sent. `abort()` (the client went) makes the next progress callback raise `PullCancelled`, which stops
the download; the partial file stays in the hub cache and the next pull resumes it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from lmserve.errors import LmserveError

log = logging.getLogger(__name__)

_MANIFEST = "pulling manifest"

Puller = Callable[[str, Callable[[dict[str, Any]], None]], None]
"""A blocking pull: (name, progress callback) → None (ModelService.pull)."""


class PullCancelled(LmserveError):
    """The client of a pull disconnected; raised in the worker thread to stop the download."""

    def __init__(self, name: str) -> None:
        super().__init__(f"pulling '{name}' was cancelled: the client disconnected", code="pull_cancelled")


class PullFeed:
    """One pull running in a worker thread, and its progress lines as they come. Create it on the event loop."""

    def __init__(self, pull: Puller, name: str) -> None:
        self._name = name
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self._aborted = threading.Event()
        self._ended = False
        self._worker = asyncio.ensure_future(asyncio.to_thread(pull, name, self._put))
        self._worker.add_done_callback(self._finished)

    async def head(self) -> list[dict[str, Any]]:
        """The lines up to the first one past "pulling manifest"; the pull's error if it ended before that."""
        lines: list[dict[str, Any]] = []
        while (item := await self._next()) is not None:
            lines.append(item)
            if item.get("status") != _MANIFEST:
                return lines
        self._worker.result()  # ended early: raise its error (or return: it already succeeded)
        return lines

    async def rest(self) -> AsyncIterator[dict[str, Any]]:
        """The remaining lines; raises the pull's error after its last line."""
        while (item := await self._next()) is not None:
            yield item
        self._worker.result()

    async def wait(self) -> None:
        """Until the pull ends; raises its error."""
        await asyncio.shield(self._worker)

    def abort(self) -> None:
        """Stop the pull at its next progress line (a no-op once it has ended). Safe from any thread."""
        self._aborted.set()

    async def _next(self) -> dict[str, Any] | None:
        if self._ended:
            return None
        item = await self._queue.get()
        self._ended = item is None
        return item

    def _put(self, item: dict[str, Any]) -> None:
        """The progress callback, called in the worker thread."""
        if self._aborted.is_set():
            raise PullCancelled(self._name)
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def _finished(self, worker: asyncio.Future[None]) -> None:
        """On the loop, after the worker's last `call_soon_threadsafe`: its lines are all queued before this."""
        self._queue.put_nowait(None)
        if not worker.cancelled() and isinstance(worker.exception(), PullCancelled):
            log.info("pull of %s stopped: the client disconnected", self._name)
