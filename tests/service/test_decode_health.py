"""The decode health check (lmserve/service/decode_health.py) on the engine loop over the fake backend: an idle
engine is probed with one token, a working one is observed stepping, and one whose step never returns (the fake's
`unpaused` cleared) is stuck once the deadline passes, without keeping its probe queued afterwards."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.fake import FakeBackend
from lmserve.service.decode_health import check
from lmserve.types import SamplingParams

pytestmark = pytest.mark.asyncio

NAMES = ("fake:latest", "fake-alias:latest")


@pytest.fixture
def engine() -> Iterator[BatchingEngine]:
    engine = BatchingEngine(FakeBackend(num_ctx=512, num_parallel=2, step_delay=0.002))
    yield engine
    assert isinstance(engine.backend, FakeBackend)
    engine.backend.unpaused.set()
    engine.close()


async def test_an_idle_engine_is_probed_with_one_token(engine: BatchingEngine) -> None:
    before = engine.stats.progress
    found = await check(NAMES, engine, 5.0)
    assert (found.names, found.check, found.ok, found.reason) == (NAMES, "probed", True, "")
    assert engine.stats.progress > before and 0 < found.seconds < 5.0
    assert engine.num_running == engine.num_waiting == 0


async def test_a_working_engine_is_observed_not_probed(engine: BatchingEngine) -> None:
    stream = engine.submit(engine.tokenize("long"), SamplingParams(max_tokens=400, ignore_eos=True))
    consumer = asyncio.ensure_future(asyncio.wait_for(_drain(stream), 30))
    while engine.num_running == 0:
        await asyncio.sleep(0.005)
    steps = len(engine.backend.steps) if isinstance(engine.backend, FakeBackend) else 0
    found = await check(NAMES, engine, 5.0)
    assert (found.check, found.ok) == ("observed", True)
    assert isinstance(engine.backend, FakeBackend) and len(engine.backend.steps) > steps
    assert all(len(step) == 1 for step in engine.backend.steps[steps:])  # no probe joined the batch
    stream.abort()
    await consumer


async def test_an_engine_whose_step_never_returns_is_stuck_by_the_deadline(engine: BatchingEngine) -> None:
    assert isinstance(engine.backend, FakeBackend)
    engine.backend.unpaused.clear()
    idle = await check(NAMES, engine, 0.3)  # the probe's first step hangs
    assert (idle.check, idle.ok, idle.seconds) == ("stuck", False, 0.3)
    assert idle.reason.startswith("no decode step in 0.3 s")
    busy = await check(NAMES, engine, 0.3)  # the probe's step is still in flight: observed, no progress
    assert (busy.check, busy.reason) == ("stuck", "no decode step in 0.3 s (1 running, 0 waiting)")
    engine.backend.unpaused.set()
    again = await check(NAMES, engine, 5.0)
    assert again.ok
    for _ in range(200):  # the aborted probe leaves once its step returns
        if engine.num_running == engine.num_waiting == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.num_running == engine.num_waiting == 0


async def test_a_failed_engine_is_failed(engine: BatchingEngine) -> None:
    assert isinstance(engine.backend, FakeBackend)
    engine.backend.fault = "the device is lost"
    found = await check(NAMES, engine, 5.0)
    assert (found.check, found.ok) == ("failed", False)
    assert "the device is lost" in found.reason


async def _drain(stream: object) -> None:
    async for _ in stream:  # type: ignore[attr-defined]
        pass
