"""Loaded models: load on demand, keep each for its keep-alive, evict the least recently used.

A model stays loaded while requests use it; `keep_alive` (seconds; None = forever; 0 = unload when idle)
counts from its last use. Beyond `max_loaded`, the least recently used idle model is unloaded first. A
request whose load-time options differ from the loaded instance's gets a fresh instance.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from lmserve.engine.loop import Engine
from lmserve.types import LoadOptions, Message, SamplingParams

log = logging.getLogger(__name__)



class Prompter(Protocol):
    """Renders a conversation into the model's prompt text (a GGUF Jinja template or a Modelfile Go one)."""

    def render(
        self, messages: list[Message], *, tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True
    ) -> str: ...


@dataclass(slots=True)
class LoadedModel:
    """A model ready to serve: its engine, how it renders prompts, and its Modelfile defaults."""

    name: str
    engine: Engine
    template: Prompter
    sampling: SamplingParams = field(default_factory=SamplingParams)
    system: str | None = None
    messages: list[Message] = field(default_factory=list)
    template_source: str | None = None
    """The template text the prompter renders (Modelfile TEMPLATE or the GGUF's), for tool-format detection."""
    created: int = field(default_factory=lambda: int(time.time()))
    aliases: tuple[str, ...] = ()
    owned_by: str = "lmserve"


Loader = Callable[[str, LoadOptions], LoadedModel]


@dataclass(slots=True, eq=False)
class Resident:
    """One loaded model and its lease."""

    model: LoadedModel
    options: LoadOptions
    keep_alive: float | None
    last_used: float
    users: int = 0
    loaded_at: float = field(default_factory=time.time)

    @property
    def expires_at(self) -> float | None:
        return None if self.keep_alive is None else self.last_used + self.keep_alive

    @property
    def is_idle(self) -> bool:
        return self.users == 0 and self.model.engine.num_running == 0 and self.model.engine.num_waiting == 0


class LoadedModels:
    """The set of models in memory, keyed by canonical name."""

    def __init__(
        self,
        loader: Loader,
        *,
        max_loaded: int = 3,
        clock: Callable[[], float] = time.time,
        on_unload: Callable[[LoadedModel], None] = lambda model: model.engine.close(),
        on_load: Callable[[str], None] | None = None,
    ) -> None:
        self._loader = loader
        self._on_unload = on_unload
        self.on_load = on_load
        """Told the name of each model loaded (e.g. to count loads); None (the default) observes nothing."""
        self._max_loaded = max(1, max_loaded)
        self._clock = clock
        self._residents: dict[str, Resident] = {}
        self._lock = asyncio.Lock()

    async def acquire(self, name: str, options: LoadOptions, keep_alive: float | None) -> Resident:
        """The loaded model `name` (loading it if needed), marked in use until `release`."""
        async with self._lock:
            resident = self._residents.get(name)
            if resident is not None and resident.options != options and resident.is_idle:
                self._unload(name)
                resident = None
            if resident is None:
                self._evict_for_one_more()
                model = await asyncio.to_thread(self._loader, name, options)
                resident = Resident(model, options, keep_alive, self._clock())
                self._residents[name] = resident
                if self.on_load is not None:
                    try:
                        self.on_load(name)
                    except Exception:
                        log.exception("load observer failed")
            resident.users += 1
            resident.keep_alive = keep_alive
            resident.last_used = self._clock()
            return resident

    def release(self, resident: Resident) -> None:
        resident.users = max(0, resident.users - 1)
        resident.last_used = self._clock()

    def running(self) -> list[Resident]:
        return sorted(self._residents.values(), key=lambda r: r.last_used, reverse=True)

    def get(self, name: str) -> Resident | None:
        return self._residents.get(name)

    async def unload(self, name: str) -> bool:
        async with self._lock:
            if name not in self._residents:
                return False
            self._unload(name)
            return True

    async def expire(self) -> None:
        """Unload idle models whose keep-alive has run out."""
        now = self._clock()
        async with self._lock:
            for name, resident in list(self._residents.items()):
                expires = resident.expires_at
                if expires is not None and expires <= now and resident.is_idle:
                    self._unload(name)

    async def run_expiry(self, interval: float = 1.0) -> None:
        while True:
            await asyncio.sleep(interval)
            await self.expire()

    def close(self) -> None:
        for name in list(self._residents):
            self._unload(name)

    def _evict_for_one_more(self) -> None:
        idle = [(r.last_used, n) for n, r in self._residents.items() if r.is_idle]
        for _, name in sorted(idle):
            if len(self._residents) < self._max_loaded:
                break
            self._unload(name)

    def _unload(self, name: str) -> None:
        resident = self._residents.pop(name)
        log.info("unloading %s", name)
        self._on_unload(resident.model)
