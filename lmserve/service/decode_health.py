"""The decode health check (GET /health/decode): each engine in memory shows, within a deadline, that it still makes
progress, where /health only says that none has failed.

An engine that is working (sequences running or waiting) is observed: its progress counter (`EngineStats.progress`,
which grows with every decode step or output) must move before the deadline. An idle engine is probed: a prompt of
one short word, one token at temperature 0 (a reranker ranks one pair instead), answered before the deadline. An
engine whose step never returns (a hung device, a paused engine process) is thus reported stuck by name, while a busy
one is never made to wait behind its own queue.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Literal

from lmserve.engine.protocol import Engine
from lmserve.types import SamplingParams

PROBE_TEXT = "Hello"
POLL_S = 0.01
DEFAULT_DEADLINE_S = 10.0
MAX_DEADLINE_S = 300.0

Check = Literal["observed", "probed", "idle", "stuck", "failed"]


@dataclass(frozen=True, slots=True)
class DecodeHealth:
    """How one engine showed progress (`check`), in how many seconds; `reason` says why it did not."""

    names: tuple[str, ...]
    check: Check
    seconds: float
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.check in ("observed", "probed", "idle")


async def check(names: tuple[str, ...], engine: Engine, deadline: float) -> DecodeHealth:
    """Observe `engine` (bound to `names`) if it works, else probe it, within `deadline` seconds."""
    start = time.monotonic()
    try:
        how = await asyncio.wait_for(_progress(engine), deadline)
    except TimeoutError:
        return DecodeHealth(names, "stuck", deadline, _stuck(engine, deadline))
    except Exception as exc:  # the probe itself failed: the engine cannot answer
        return DecodeHealth(names, "failed", time.monotonic() - start, f"its probe failed: {exc}")
    if engine.failure is not None:
        return DecodeHealth(names, "failed", time.monotonic() - start, f"its engine stopped: {engine.failure}")
    return DecodeHealth(names, how, time.monotonic() - start)


async def _progress(engine: Engine) -> Check:
    if engine.failure is not None:
        return "failed"
    if engine.num_running or engine.num_waiting:
        seen = engine.stats.progress
        while engine.stats.progress == seen and engine.failure is None:
            await asyncio.sleep(POLL_S)
        return "observed"
    if engine.info.transcriber:  # its decoder runs only with a clip in its encoder
        return "idle"
    if engine.info.can_rank:
        await engine.rank(PROBE_TEXT, [PROBE_TEXT])
        return "probed"
    stream = engine.submit(engine.tokenize(PROBE_TEXT), SamplingParams(temperature=0.0, max_tokens=1))
    try:
        async for chunk in stream:
            if chunk.error:
                raise RuntimeError(chunk.error)
    finally:
        stream.abort()
    return "probed"


def _stuck(engine: Engine, deadline: float) -> str:
    working = f"{engine.num_running} running, {engine.num_waiting} waiting"
    return f"no decode step in {deadline:g} s ({working})"
