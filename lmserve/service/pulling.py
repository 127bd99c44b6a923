"""A pull's progress as an async iterator: the blocking download runs in a worker thread, its records reach the
event loop as they come.

Each record the download reports is handed over with `loop.call_soon_threadsafe` onto an `asyncio.Queue`; the end
of the worker puts a sentinel after its last record. `abort()` (the caller went) makes the next progress report
raise `PullCancelled`, which stops the download; the partial file stays in the hub cache and the next pull resumes
it. Each user encodes the records in its own format (native /api/pull lines, `serve`'s lines on stderr).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from lmserve.errors import LmserveError

if TYPE_CHECKING:  # the hub client loads with the first pull, not with the service
    from lmserve.store.pull import PullProgress

log = logging.getLogger(__name__)

Report = Callable[["PullProgress"], None]
"""Where a blocking pull reports its progress; raising stops it."""


class PullCancelled(LmserveError):
    """The caller of a pull went; raised in the worker thread to stop the download."""

    def __init__(self, name: str) -> None:
        super().__init__(f"pulling '{name}' was cancelled: the client disconnected", code="pull_cancelled")


class Pull:
    """One pull running in a worker thread (started on the event loop): its progress records as an async iterator,
    which raises the pull's error after its last record."""

    def __init__(self, run: Callable[[Report], None], name: str) -> None:
        """Start `run(report)` (a blocking pull of `name`) in a worker thread."""
        self.name = name
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[PullProgress | None] = asyncio.Queue()
        self._aborted = threading.Event()
        self._ended = False
        self._worker = asyncio.ensure_future(asyncio.to_thread(run, self._report))
        self._worker.add_done_callback(self._finished)

    async def __aiter__(self) -> AsyncIterator[PullProgress]:
        while not self._ended:
            record = await self._queue.get()
            if record is None:
                self._ended = True
                break
            yield record
        await self._worker  # raises the pull's error

    def abort(self) -> None:
        """Stop the pull at its next progress record (a no-op once it has ended). Safe from any thread."""
        self._aborted.set()

    def _report(self, record: PullProgress) -> None:
        """The progress callback, called in the worker thread."""
        if self._aborted.is_set():
            raise PullCancelled(self.name)
        self._loop.call_soon_threadsafe(self._queue.put_nowait, record)

    def _finished(self, worker: asyncio.Future[None]) -> None:
        """On the loop, after the worker's last `call_soon_threadsafe`: its records are all queued before this."""
        self._queue.put_nowait(None)
        if not worker.cancelled() and isinstance(worker.exception(), PullCancelled):
            log.info("pull of %s stopped: the client disconnected", self.name)
