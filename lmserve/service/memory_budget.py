"""The memory budget that residency holds every load against: how much another model may take now, and which idle
models to unload for it.

Loaded models (weights, their slots' KV cache, buffers), the prompt cache's RAM tier and the model being loaded
share one machine. A gauge says what is left for another load:

- `SystemMemory` (the default): what the machine has now (engine/memory_estimate.py `available_memory`:
  MemAvailable, capped by the control group's room). The kernel counts a loaded model's mapped weights file as
  reclaimable cache, so those bytes are taken off; a model still loading has not taken its memory yet, so its whole
  estimate is.
- `FixedMemory` (LMSERVE_MEMORY_BYTES): a fixed number of bytes for models, less every model's estimate; for
  machines whose /proc/meminfo does not tell this process's share, and for tests.

`memory_gauge` picks one from the server's options; LMSERVE_MEMORY_CHECK=0 turns the check off (None).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from lmserve.engine.factory import MemoryEstimate, available_memory
from lmserve.errors import InsufficientMemory, Overloaded, gib

T = TypeVar("T")
log = logging.getLogger(__name__)


class MemoryGauge(Protocol):
    """What another load may take from memory now."""

    def available(self, loaded: Sequence[MemoryEstimate], loading: Sequence[MemoryEstimate]) -> int | None:
        """Bytes another model may take, given the models in memory (`loaded`) and those being loaded (their memory
        not taken yet); None when it cannot be told (then nothing is checked)."""
        ...


@dataclass(frozen=True, slots=True)
class SystemMemory:
    """The machine's available memory, less what the kernel counts as free but the models use or will use."""

    read: Callable[[], int | None] = available_memory

    def available(self, loaded: Sequence[MemoryEstimate], loading: Sequence[MemoryEstimate]) -> int | None:
        free = self.read()
        if free is None:
            return None
        return free - sum(e.mapped_bytes for e in loaded) - sum(e.total for e in loading)


@dataclass(frozen=True, slots=True)
class FixedMemory:
    """A fixed number of bytes for models, less every model's estimate."""

    total_bytes: int

    def available(self, loaded: Sequence[MemoryEstimate], loading: Sequence[MemoryEstimate]) -> int | None:
        return self.total_bytes - sum(e.total for e in (*loaded, *loading))


def memory_gauge(check: bool, budget_bytes: int | None) -> MemoryGauge | None:
    """The gauge of the server's options: none (`check` off), a fixed budget, or the machine's memory."""
    if not check:
        return None
    return FixedMemory(budget_bytes) if budget_bytes is not None else SystemMemory()


async def estimate_of(estimate: Callable[[], MemoryEstimate | None] | None, name: str) -> MemoryEstimate | None:
    """A load plan's memory estimate, made off the event loop; None when there is none or it fails (the load itself
    then says what is wrong with the model)."""
    if estimate is None:
        return None
    try:
        return await asyncio.to_thread(estimate)
    except Exception as exc:
        log.warning("%s: its memory could not be estimated (%s: %s); loading it unchecked", name, type(exc).__name__,
                    exc)
        return None


def room_for(name: str, need: MemoryEstimate, available: int, idle: Sequence[tuple[T, int]], busy: int,
             reclaim: Callable[[int], int] | None = None) -> list[T]:
    """What to unload for model `name`, which needs `need`, to fit beside `available` bytes: nothing when it fits;
    else, once `reclaim` (the prompt cache) gave back what it could of the shortfall, the fewest of the `idle`
    models (least recently used first, each with the bytes unloading it frees) in their order.

    InsufficientMemory when it cannot fit even with every model unloaded (`busy`: the bytes of models busy with
    requests or loading); Overloaded when it would once those are done."""
    if need.total <= available:
        return []
    if reclaim is not None:
        available += reclaim(need.total - available)
    chosen: list[T] = []
    for item, freed in idle:
        if need.total <= available:
            break
        chosen.append(item)
        available += freed
    if need.total <= available:
        return chosen
    if need.total <= available + busy:
        raise Overloaded(f"model '{name}' needs {gib(need.total)} of memory and {gib(available)} is free with every "
                         f"idle model unloaded; models busy with requests hold {gib(busy)} more: retry when they are "
                         "done")
    raise InsufficientMemory(name, need.total, available + busy, detail=(
        f"{need.describe()}, with every other model unloaded. Ask for less: a smaller context (num_ctx, -c), fewer "
        "slots (-np), a quantized KV cache (-ctk/-ctv q8_0) or a smaller model; LMSERVE_MEMORY_CHECK=0 turns this "
        "check off"))
