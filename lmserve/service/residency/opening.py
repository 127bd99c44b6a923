"""Opening an engine for residency: in a thread, within the load timeout, and the load's log line."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable

from lmserve.engine.protocol import Engine, ModelInfo
from lmserve.errors import EngineFailure, LmserveError
from lmserve.parsing import format_duration
from lmserve.service.residency.records import LoadPlan
from lmserve.types import AUTO_CONTEXT, LoadOptions

log = logging.getLogger(__name__)


def log_load(name: str, options: LoadOptions, info: ModelInfo) -> None:
    """The load's log line: the context in force (as the engine reports it) and why; before it, a warning when more
    was asked for than the model was trained for (the engine capped it)."""
    asked, trained = options.num_ctx, info.num_ctx_train
    if asked != AUTO_CONTEXT and 0 < trained < asked:
        log.warning("%s: a context of %d tokens per sequence was asked for (-c/--ctx-size, LMSERVE_CTX_SIZE or "
                    "num_ctx), but the model was trained for %d: its context is %d tokens per sequence",
                    name, asked, trained, info.num_ctx)
    slots = f"{info.num_parallel} slot" + ("s" if info.num_parallel != 1 else "")
    why = ("auto" if asked == AUTO_CONTEXT else "asked") + (f", trained for {trained}" if trained > 0 else "")
    log.info("loaded %s: context %d tokens per sequence x %s (%s)", name, info.num_ctx, slots, why)


async def open_engine(plan: LoadPlan, name: str, load_timeout: float | None,
                      close_engine: Callable[[Engine], None]) -> Engine:
    """`plan.open()` run in a thread, within the load timeout; an error that is not lmserve's is EngineFailure.

    An engine that opens after its load timed out is closed then (with `close_engine`)."""
    opening = asyncio.ensure_future(asyncio.to_thread(plan.open))
    try:
        return await asyncio.wait_for(asyncio.shield(opening), load_timeout)
    except TimeoutError:
        opening.add_done_callback(functools.partial(_close_late, close_engine))
        log.error("%s did not load within %s (LMSERVE_LOAD_TIMEOUT)", name, format_duration(load_timeout))
        raise EngineFailure(f"model '{name}' did not load within {format_duration(load_timeout)} "
                            "(LMSERVE_LOAD_TIMEOUT): its engine hangs or is too slow to start; see the server "
                            "log") from None
    except LmserveError:
        raise
    except Exception as exc:
        log.exception("loading %s failed", name)
        raise EngineFailure(f"loading model '{name}' failed: {type(exc).__name__}: {exc}") from exc


def _close_late(close_engine: Callable[[Engine], None], opening: asyncio.Future[Engine]) -> None:
    """Close an engine whose load finished after it timed out."""
    if opening.cancelled() or opening.exception() is not None:
        return
    log.info("a load that timed out has finished: closing its engine")
    close_engine(opening.result())
