"""A pull as an async iterator of progress records: the blocking download in a worker thread, stopped by `abort`."""

from __future__ import annotations

import asyncio
import threading

import pytest

from lmserve.errors import ModelNotFound
from lmserve.service.pulling import Pull, PullCancelled, Report
from lmserve.store.pull import PullProgress


class SlowPull:
    """A blocking pull that reports progress until its report raises."""

    def __init__(self) -> None:
        self.stopped = threading.Event()

    def __call__(self, report: Report) -> None:
        report(PullProgress("pulling manifest"))
        try:
            for completed in range(10_000):
                report(PullProgress("pulling x.gguf", "sha256:00", 10_000, completed))
                threading.Event().wait(0.001)
        finally:
            self.stopped.set()


async def test_abort_stops_the_worker_at_its_next_progress_record() -> None:
    run = SlowPull()
    pull = Pull(run, "hf.co/org/repo")
    records = aiter(pull)
    assert await anext(records) == PullProgress("pulling manifest")
    assert (await anext(records)).status == "pulling x.gguf"
    pull.abort()
    with pytest.raises(PullCancelled):
        async for _ in records:
            pass
    assert await asyncio.to_thread(run.stopped.wait, 5)


def steps(*statuses: str) -> list[PullProgress]:
    return [PullProgress(status) for status in statuses]


async def test_records_come_in_order_then_the_end() -> None:
    def run(report: Report) -> None:
        for record in steps("pulling manifest", "pulling a", "writing manifest", "success"):
            report(record)

    assert [record async for record in Pull(run, "org/repo")] == steps(
        "pulling manifest", "pulling a", "writing manifest", "success")


async def test_the_pulls_error_comes_after_its_last_record() -> None:
    def run(report: Report) -> None:
        report(PullProgress("pulling manifest"))
        raise ModelNotFound("org/nope")

    seen: list[PullProgress] = []
    with pytest.raises(ModelNotFound):
        async for record in Pull(run, "org/nope"):
            seen.append(record)
    assert seen == steps("pulling manifest")
