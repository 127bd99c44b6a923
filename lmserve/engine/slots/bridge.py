"""The bridge between the event loops and the engine thread: submitted work in, chunks out.

The event loop hands the engine thread requests, aborts, embedding and rerank jobs, a failure or the close under one
condition (`Bridge`); the engine thread takes them all between two steps (`Bridge.wait`). Each request's output
comes back on its own queue (`RequestStream`), filled in one callback per event loop per step (`deliver`). This is
the only place where threads and queues meet asyncio in the slot engine (engine/slots/batching.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from lmserve.engine.detokenize import IncrementalDecoder
from lmserve.engine.logprobs import LogprobAligner
from lmserve.engine.slots.drafting import DraftLength
from lmserve.engine.slots.jobs import Job
from lmserve.engine.slots.sequence import Sequence
from lmserve.engine.stops import StopMatcher
from lmserve.errors import EngineStopped, InvalidRequest, Overloaded
from lmserve.types import Chunk


class RequestStream:
    """Output of one submitted request: an async iterator of chunks, the last one with a finish reason."""

    def __init__(self, bridge: Bridge, seq: Sequence, loop: asyncio.AbstractEventLoop) -> None:
        self._bridge = bridge
        self.seq = seq
        self.loop = loop
        self.queue: asyncio.Queue[Chunk] = asyncio.Queue()
        self.is_done = False

    @property
    def prompt_tokens(self) -> list[int]:
        return self.seq.prompt

    @property
    def output_tokens(self) -> list[int]:
        return self.seq.output

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        while not self.is_done:
            chunk = await self.queue.get()
            if chunk.finish_reason is not None:
                self.is_done = True
            yield chunk

    def abort(self) -> None:
        """Stop generating; the slot and its memory are freed before the next step."""
        if not self.is_done:
            self.is_done = True
            self._bridge.abort(self.seq)


@dataclass(slots=True, eq=False)
class Tracker:
    """Per-request state the engine thread keeps beside the scheduler's sequence."""

    stream: RequestStream
    decoder: IncrementalDecoder = field(default_factory=IncrementalDecoder)
    stops: StopMatcher = field(default_factory=lambda: StopMatcher([]))
    submitted_ns: int = 0
    admitted_ns: int = 0
    first_token_ns: int = 0
    is_stop_hit: bool = False
    logprobs: LogprobAligner | None = None
    """With `SamplingParams.logprobs`: the tokens whose text is not out yet (made at the first token)."""
    drafter: DraftLength | None = None
    """With speculative decoding: the adaptive draft length, and with prompt lookup (an NgramDrafter) the n-gram
    index of the prompt and output (made at the first draft)."""
    num_drafted: int = 0
    num_accepted: int = 0
    scores: list[float] = field(default_factory=list)
    """With `SamplingParams.score_tokens`: their log-probabilities at the first token (for the final chunk)."""


Outbox = list[tuple[RequestStream, Chunk]]
"""Chunks for their streams, delivered together at the end of a step."""


class Work(NamedTuple):
    """What the engine thread takes from the bridge before a step."""

    failure: str | None
    inbox: Iterable[Sequence]
    aborts: Iterable[Sequence]
    job: Job | None


QUIET_S = 0.25
"""How long nothing must come before the engine thread does work that can wait (saving free slots' states), so the
next request of a client that answers at once (an agent's tool loop) does not wait for that work."""

_NOTHING: tuple[Sequence, ...] = ()
"""Nothing submitted, or nothing aborted (a step then makes no new lists)."""


class Bridge:
    """The engine thread's inbox, under one condition, and the trackers of the requests in flight.

    `trackers` is filled here under the lock; the engine thread reads it and drops finished requests without it.
    """

    def __init__(self, has_work: Callable[[], bool]) -> None:
        self._has_work = has_work
        self.trackers: dict[Sequence, Tracker] = {}
        self._cond = threading.Condition()
        self._inbox: list[Sequence] = []
        self._aborts: list[Sequence] = []
        self._jobs: deque[Job] = deque()
        self._failure: str | None = None
        self.death: str | None = None
        """Why the engine thread ended before the engine was closed."""
        self.is_closing = False

    @property
    def num_submitted(self) -> int:
        """Requests submitted and not yet taken by the engine thread."""
        return len(self._inbox)

    @property
    def is_idle(self) -> bool:
        """Nothing is waiting for the engine thread (submitted requests, aborts, jobs, a failure or the close)."""
        return not (self._inbox or self._aborts or self._jobs or self.is_closing or self._failure)

    def stays_quiet(self) -> bool:
        """True when nothing comes for the engine thread for QUIET_S seconds (it waits that long to know)."""
        with self._cond:
            return not self._cond.wait_for(lambda: not self.is_idle or self._has_work(), QUIET_S)

    def _check_open(self) -> None:
        if self.is_closing:
            raise InvalidRequest("the server is shutting down")
        if self.death is not None:
            raise EngineStopped(f"the engine stopped: {self.death}")

    def submit(self, seqs: list[Sequence], trackers: list[Tracker], num_free: int, num_waiting: int,
               max_queue: int) -> None:
        """Queue sequences for the engine thread, unless the queue cannot take them (Overloaded).

        Submitted sequences not yet admitted take the `num_free` slots first: only the rest wait, beside the
        scheduler's `num_waiting` (a burst of as many requests as free slots is admitted whole, whatever the queue's
        size)."""
        with self._cond:
            self._check_open()
            num_queued = len(self._inbox) + num_waiting
            if num_queued + len(seqs) - num_free > max_queue:
                raise Overloaded(f"{max(num_queued - num_free, 0)} sequences are already waiting for this model (at "
                                 f"most {max_queue}); retry shortly")
            for seq, tracker in zip(seqs, trackers, strict=True):
                self.trackers[seq] = tracker
            self._inbox += seqs
            self._cond.notify()

    def add_jobs(self, jobs: Iterable[Job]) -> None:
        with self._cond:
            self._check_open()
            self._jobs.extend(jobs)
            self._cond.notify()

    def abort(self, seq: Sequence) -> None:
        with self._cond:
            self._aborts.append(seq)
            self._cond.notify()

    def fail(self, message: str) -> list[Tracker]:
        """Ask the engine thread to end every request with `message`; the trackers of the requests in flight now."""
        with self._cond:
            self._failure = message
            trackers = list(self.trackers.values())  # one call: the engine thread drops trackers without the lock
            self._cond.notify()
        return trackers

    def close(self) -> None:
        with self._cond:
            self.is_closing = True
            self._cond.notify()

    def wait(self) -> Work | None:
        """Wait until there is something to do (or the engine's `has_work` says its scheduler has) and take it; None
        once the engine closes."""
        with self._cond:
            while not (self._inbox or self._aborts or self._jobs or self._has_work() or self.is_closing
                       or self._failure):
                self._cond.wait()
            if self.is_closing:
                return None
            inbox: Iterable[Sequence] = _NOTHING
            aborts: Iterable[Sequence] = _NOTHING
            if self._inbox:
                inbox, self._inbox = self._inbox, []
            if self._aborts:
                aborts, self._aborts = self._aborts, []
            work = Work(self._failure, inbox, aborts, self._jobs.popleft() if self._jobs else None)
            self._failure = None
        return work

    def take_all(self) -> list[tuple[Sequence, Tracker]]:
        """Drop what was submitted and not taken; every request in flight, with its tracker."""
        with self._cond:
            self._inbox.clear()
            return list(self.trackers.items())

    def take_jobs(self) -> list[Job]:
        """The jobs not taken yet, no longer queued."""
        with self._cond:
            jobs, self._jobs = list(self._jobs), deque()
        return jobs

    def die(self, reason: str) -> tuple[list[Tracker], list[Job]]:
        """Mark the engine failed: nothing more is taken. The trackers and jobs in flight, forgotten here."""
        with self._cond:
            self.death = reason
            self._inbox.clear()
            trackers = list(self.trackers.values())
            self.trackers.clear()
            jobs, self._jobs = list(self._jobs), deque()
        return trackers, jobs


def deliver(outbox: Outbox) -> None:
    """Hand each stream its chunks on its event loop: one callback per loop."""
    by_loop: dict[asyncio.AbstractEventLoop, Outbox] = {}
    for stream, chunk in outbox:
        by_loop.setdefault(stream.loop, []).append((stream, chunk))
    for loop, items in by_loop.items():
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: Outbox) -> None:
    for stream, chunk in items:
        stream.queue.put_nowait(chunk)
