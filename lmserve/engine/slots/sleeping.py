"""Sleep level 1 of the slot engine, on its thread: the KV cache and the slots freed while the weights stay, made
again when the engine is woken or work comes for it (service/residency/sleeping.py says what the levels are)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmserve.engine.slots.jobs import MemoryJob, settle
from lmserve.errors import Conflict

if TYPE_CHECKING:
    from lmserve.engine.slots.batching import BatchingEngine


def set_asleep(engine: BatchingEngine, job: MemoryJob | None) -> None:
    """Do what `job` asks (free or make again) and settle it; without a job, wake `engine` for work that came."""
    try:
        _set(engine, asleep=job is not None and job.asleep)
    except Exception as exc:
        if job is None:
            raise
        settle(job, None, exc)
    else:
        if job is not None:
            settle(job, [], None)


def _set(engine: BatchingEngine, *, asleep: bool) -> None:
    if asleep == engine.is_asleep:
        return
    scheduler = engine.scheduler
    if asleep:
        if scheduler.running or scheduler.waiting:
            raise Conflict("requests are running on it; it can sleep once they are done")
        engine.save_slots()  # a returning conversation restores its prompt after the wake
        for slot in range(len(scheduler.slot_tokens)):
            scheduler.forget(slot)
        engine.backend.free_memory()
    else:
        engine.backend.restore_memory()
    engine.is_asleep = asleep
