"""Sleeping models: a resident name whose engine gave back memory while the server keeps its place.

Level 1 frees an engine's KV cache and slots and keeps its weights (`Engine.sleep`: the slots' prompts go to the
prompt cache first); the name stays resident and its next request, or a wake, makes them again. Level 2 frees the
weights too: the engine closes (its slots' prompts saved in the prompt cache, whose disk tier outlives it) and the
name leaves residency, remembered here with its load options, lease and memory estimate. Its estimate stays held
against the memory budget, so a model loaded meanwhile cannot take the room it wakes into; when memory is short, a
sleeping model's room is given up before any idle model is unloaded. Its next request, or a wake, loads it again as
it was. A lease (keep_alive) that runs out while it sleeps unloads it for good. `--sleep-idle-seconds` puts a
resident name to sleep at level 2 after that long unused, as llama-server does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from lmserve.engine.factory import MemoryEstimate
from lmserve.errors import InvalidRequest
from lmserve.service.residency.records import Resident
from lmserve.types import LoadOptions

log = logging.getLogger(__name__)

SLEEP_LEVELS = (1, 2)


@dataclass(frozen=True, slots=True)
class Asleep:
    """A name asleep at level 2: what it was loaded with, its lease, and the memory it will wake into."""

    options: LoadOptions
    keep_alive: float | None
    memory: MemoryEstimate | None
    last_used: float

    @property
    def expires_at(self) -> float | None:
        return None if self.keep_alive is None else self.last_used + self.keep_alive

    @property
    def ram_bytes(self) -> int:
        """The RAM held for its wake (0: on a GPU, or not estimated)."""
        return self.memory.total if self.memory is not None and not self.memory.on_gpu else 0


def asleep(resident: Resident) -> Asleep:
    """The record of `resident` put to sleep at level 2."""
    return Asleep(resident.options, resident.keep_alive, resident.memory, resident.last_used)


def forget(sleeping: dict[str, Asleep], slept: Asleep, name: str) -> None:
    """Unload the name asleep as `slept`, giving up its room to make room for `name`."""
    for other in [n for n, record in sleeping.items() if record is slept]:
        del sleeping[other]
        log.info("unloading %s, asleep, to make room for %s", other, name)


def expire_asleep(sleeping: dict[str, Asleep], now: float) -> None:
    """Unload the names asleep whose lease has run out."""
    for name, slept in list(sleeping.items()):
        if slept.expires_at is not None and slept.expires_at <= now:
            del sleeping[name]
            log.info("unloading %s (it was asleep)", name)


def check_level(level: int) -> int:
    if level not in SLEEP_LEVELS:
        raise InvalidRequest(f"sleep level must be 1 (free the KV cache, keep the weights) or 2 (free the weights "
                             f"too), not {level}", param="level")
    return level
