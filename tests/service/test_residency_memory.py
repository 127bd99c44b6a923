"""Residency's memory budget: a model loads when its estimate fits; the prompt cache gives back first, then idle models
make room, least recently used first; busy ones never do; a model that can never fit is a 400 naming the numbers;
the count limit stays on top."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator

import pytest

from lmserve.engine.memory_estimate import MemoryEstimate
from lmserve.errors import InsufficientMemory, Overloaded
from lmserve.service.memory_budget import FixedMemory
from lmserve.service.residency import LoadPlan, Residency
from lmserve.types import LoadOptions
from tests.service.test_residency import Catalog, Clock

GiB = 2**30


class SizedCatalog(Catalog):
    """The fake catalog whose plans carry an estimate: `sizes[name]` GiB of weights (on a GPU for names in `gpu`)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes = {"a": 1, "b": 2, "c": 1, "d": 2, "e": 3, "big": 6}
        self.gpu: set[str] = set()
        self.estimated: list[str] = []
        self.broken: set[str] = set()
        """Names whose estimate fails."""

    def plan(self, name: str, options: LoadOptions) -> LoadPlan:
        plan = super().plan(name, options)

        def estimate() -> MemoryEstimate:
            self.estimated.append(name)
            if name in self.broken:
                raise OSError("unreadable header")
            return MemoryEstimate(weights_bytes=self.sizes[name] * GiB, kv_bytes=0, num_ctx=512, num_slots=1,
                                  on_gpu=name in self.gpu)

        plan.estimate = estimate
        return plan


class PromptCache:
    """The reclaim hook's other end: holds `held` bytes and gives back what it is asked for, as far as it can."""

    def __init__(self, held: int) -> None:
        self.held = held
        self.asked: list[int] = []

    def reclaim(self, num_bytes: int) -> int:
        self.asked.append(num_bytes)
        freed = min(num_bytes, self.held)
        self.held -= freed
        return freed


@pytest.fixture
def catalog() -> Iterator[SizedCatalog]:
    catalog = SizedCatalog()
    yield catalog
    for gate in catalog.gates.values():
        gate.set()
    for engine in catalog.engines:
        engine.close()


def residency(catalog: Catalog, clock: Clock, *, budget: int = 4 * GiB, max_loaded: int = 10,
              cache: PromptCache | None = None) -> Residency:
    return Residency(catalog.plan, max_loaded=max_loaded, clock=clock, close_engine=catalog.close,
                     memory=FixedMemory(budget), reclaim=cache.reclaim if cache is not None else None)


async def use(models: Residency, clock: Clock, *names: str) -> None:
    """One request to each name in turn, a second apart (the last is the most recently used)."""
    for name in names:
        models.release(await models.acquire(name, LoadOptions(), 300))
        clock.now += 1


def loaded(models: Residency) -> list[str]:
    return sorted(r.model.name for r in models.running())


@pytest.mark.parametrize(
    ("used", "kept", "unloaded"),
    [
        (["a", "b", "c"], ["a", "b", "c"], []),  # 1 + 2 + 1 GiB fit in 4
        (["a", "b", "a", "c"], ["a", "b", "c"], []),  # a loaded already
        (["a", "b", "c", "d"], ["c", "d"], ["a", "b"]),  # 2 GiB more: a (1) is not enough, b too
        (["b", "a", "c", "d"], ["a", "c", "d"], ["b"]),  # b, least recently used, frees 2
        (["a", "b", "c", "e"], ["c", "e"], ["a", "b"]),
        (["c", "a", "e"], ["a", "e"], ["c"]),  # 2 GiB free, 3 needed: c (1) is enough
        (["a", "b", "c", "b", "d"], ["b", "d"], ["a", "c"]),  # b was used again: a and c are older
    ],
)
async def test_idle_models_make_room_least_recently_used_first(
    catalog: SizedCatalog, used: list[str], kept: list[str], unloaded: list[str]
) -> None:
    clock = Clock()
    models = residency(catalog, clock)
    await use(models, clock, *used)
    assert loaded(models) == kept
    assert catalog.closed == unloaded


async def test_busy_models_are_never_unloaded_for_room(catalog: SizedCatalog) -> None:
    clock = Clock()
    models = residency(catalog, clock)
    busy = await models.acquire("b", LoadOptions(), 300)  # the oldest, but in use
    clock.now += 1
    await use(models, clock, "a", "c", "d")
    assert loaded(models) == ["b", "d"]
    assert catalog.closed == ["a", "c"]
    models.release(busy)


async def test_a_model_that_fits_only_once_busy_models_are_done_is_overloaded(catalog: SizedCatalog) -> None:
    clock = Clock()
    models = residency(catalog, clock)
    busy = [await models.acquire(name, LoadOptions(), 300) for name in ("a", "b")]
    with pytest.raises(Overloaded, match=r"model 'e' needs 3 GiB of memory and 1 GiB is free .* hold 3 GiB more"):
        await models.acquire("e", LoadOptions(), 300)
    assert loaded(models) == ["a", "b"] and catalog.closed == []
    for resident in busy:
        models.release(resident)


async def test_a_model_that_can_never_fit_is_a_400_naming_the_numbers(catalog: SizedCatalog) -> None:
    clock = Clock()
    models = residency(catalog, clock)
    await use(models, clock, "a", "b")
    with pytest.raises(InsufficientMemory) as refused:
        await models.acquire("big", LoadOptions(), 300)
    error = refused.value
    assert (error.status, error.param, error.code) == (400, "model", "insufficient_memory")
    assert (error.needed_bytes, error.available_bytes) == (6 * GiB, 4 * GiB)
    assert error.message.startswith("model 'big' requires more system memory (6 GiB) than is available (4 GiB): "
                                    "6 GiB of weights, 0 GiB of KV cache for 1 slot x 512 tokens and 0 GiB of "
                                    "buffers, with every other model unloaded.")
    assert loaded(models) == ["a", "b"] and catalog.closed == []  # nothing unloaded for a model that cannot load


@pytest.mark.parametrize(
    ("held", "asked", "unloaded"),
    [
        (2 * GiB, [2 * GiB], []),  # the prompt cache gives back the whole shortfall: every model stays
        (1 * GiB, [2 * GiB], ["a"]),  # it gives back half: the least recently used model goes too
        (0, [2 * GiB], ["a", "b"]),
    ],
)
async def test_the_prompt_cache_gives_back_before_models_are_unloaded(
    catalog: SizedCatalog, held: int, asked: list[int], unloaded: list[str]
) -> None:
    clock = Clock()
    cache = PromptCache(held)
    models = residency(catalog, clock, cache=cache)
    await use(models, clock, "a", "b", "c")
    assert cache.asked == []  # nothing asked while models fit
    await use(models, clock, "d")
    assert cache.asked == asked
    assert catalog.closed == unloaded


async def test_a_model_still_loading_counts_against_the_budget(catalog: SizedCatalog) -> None:
    clock = Clock()
    models = residency(catalog, clock)
    await use(models, clock, "a", "c")
    catalog.gates["b"] = threading.Event()
    slow = asyncio.ensure_future(models.acquire("b", LoadOptions(), 300))
    await asyncio.sleep(0.05)  # b (2 GiB) is loading: 0 GiB is left
    models.release(await models.acquire("d", LoadOptions(), 300))
    assert catalog.closed == ["a", "c"]
    catalog.gates["b"].set()
    models.release(await slow)
    assert loaded(models) == ["b", "d"]


async def test_the_count_limit_stays_on_top_of_memory(catalog: SizedCatalog) -> None:
    clock = Clock()
    models = residency(catalog, clock, budget=100 * GiB, max_loaded=2)
    await use(models, clock, "a", "b", "c")
    assert loaded(models) == ["b", "c"] and catalog.closed == ["a"]


@pytest.mark.parametrize(
    ("gpu", "broken", "kept"),
    [
        ({"big"}, set(), ["a", "b", "big"]),  # on a GPU: its memory is not RAM, not budgeted here
        (set(), {"big"}, ["a", "b", "big"]),  # no estimate: loaded unchecked (the load says what is wrong)
    ],
)
async def test_models_without_a_ram_estimate_load_unchecked(
    catalog: SizedCatalog, gpu: set[str], broken: set[str], kept: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    catalog.gpu, catalog.broken = gpu, broken
    clock = Clock()
    models = residency(catalog, clock)
    await use(models, clock, "a", "b", "big")
    assert loaded(models) == kept and catalog.closed == []
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == (["big: its memory could not be estimated (OSError: unreadable header); loading it unchecked"]
                      if broken else [])


async def test_without_a_gauge_nothing_is_estimated(catalog: SizedCatalog) -> None:
    clock = Clock()
    models = Residency(catalog.plan, clock=clock, close_engine=catalog.close)
    await use(models, clock, "a", "big")
    assert catalog.estimated == [] and loaded(models) == ["a", "big"]


async def test_a_loaded_model_says_what_it_holds(catalog: SizedCatalog) -> None:
    clock = Clock()
    models = residency(catalog, clock)
    resident = await models.acquire("b", LoadOptions(), 300)
    assert resident.memory is not None and resident.memory.total == 2 * GiB
    models.release(resident)
