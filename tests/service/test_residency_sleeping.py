"""Sleeping models (service/residency/sleeping.py): level 1 frees the engine's KV cache and keeps it loaded; level 2
closes it and keeps its place; a request or a wake brings either back; --sleep-idle-seconds sleeps idle ones; a
sleeping model's room stays held until memory is short."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.fake import FakeBackend
from lmserve.errors import Conflict, InvalidRequest
from lmserve.service.memory_budget import FixedMemory
from lmserve.service.residency import Residency
from lmserve.types import LoadOptions, SamplingParams
from tests.service.test_residency import OPTIONS, Catalog, Clock, engine_of
from tests.service.test_residency_memory import GiB, SizedCatalog


@pytest.fixture
def catalog() -> Iterator[SizedCatalog]:
    catalog = SizedCatalog()
    yield catalog
    for engine in catalog.engines:
        engine.close()


def residency(catalog: Catalog, clock: Clock, **kwargs: object) -> Residency:
    return Residency(catalog.plan, max_loaded=5, clock=clock, close_engine=catalog.close, **kwargs)  # type: ignore[arg-type]


async def ask(models: Residency, name: str, text: str = "hello") -> str:
    """One short request to `name` naming no keep_alive; the text generated."""
    resident = await models.acquire(name, OPTIONS)
    try:
        engine = resident.model.engine
        stream = engine.submit(engine.tokenize(text), SamplingParams(max_tokens=4, temperature=0))
        return "".join([chunk.text async for chunk in stream])
    finally:
        models.release(resident)


def backend_of(models: Residency, name: str) -> FakeBackend:
    engine = engine_of(models, name)
    assert isinstance(engine, BatchingEngine) and isinstance(engine.backend, FakeBackend)
    return engine.backend


async def test_level_1_frees_the_kv_cache_keeps_the_engine_and_a_request_wakes_it(catalog: SizedCatalog) -> None:
    models = residency(catalog, Clock())
    before = await ask(models, "a")
    engine = engine_of(models, "a")
    assert await models.sleep(["a"], 1) == ["a"]
    assert models.sleeping() == {"a": 1}
    assert backend_of(models, "a").is_freed and catalog.closed == []  # the weights stay
    assert models.decoders() == []  # the decode check does not wake it
    assert await ask(models, "a") == before  # the engine wakes for the request (a step on freed memory would fail)
    assert engine_of(models, "a") is engine and not backend_of(models, "a").is_freed
    assert models.sleeping() == {}


async def test_level_2_closes_the_engine_and_a_request_loads_it_again_with_its_lease(catalog: SizedCatalog) -> None:
    clock = Clock()
    models = residency(catalog, clock)
    models.release(await models.acquire("a", OPTIONS, -1))  # kept forever
    await models.sleep(None, 2)
    assert models.sleeping() == {"a": 2} and models.running() == [] and catalog.closed == ["a"]
    assert models.health() == []  # nothing loaded is down
    await ask(models, "a")
    assert [r.model.name for r in models.running()] == ["a"] and models.sleeping() == {}
    assert models.running()[0].keep_alive is None  # its lease came back with it
    assert len(catalog.opened) == 2


async def test_wake_up_wakes_both_levels_and_leaves_the_rest(catalog: SizedCatalog) -> None:
    models = residency(catalog, Clock())
    for name in ("a", "b", "c"):
        await ask(models, name)
    await models.sleep(["a"], 1)
    await models.sleep(["b"], 2)
    assert await models.wake_up(None) == ["a", "b"]
    assert models.sleeping() == {} and not backend_of(models, "a").is_freed
    assert sorted(r.model.name for r in models.running()) == ["a", "b", "c"]
    assert await models.wake_up(["c"]) == []


async def test_a_busy_model_or_one_not_loaded_is_refused(catalog: SizedCatalog) -> None:
    models = residency(catalog, Clock())
    resident = await models.acquire("a", OPTIONS, 300)
    with pytest.raises(Conflict, match="'a' is serving requests"):
        await models.sleep(["a"], 1)
    models.release(resident)
    with pytest.raises(InvalidRequest, match="'b' is not loaded"):
        await models.sleep(["b"], 2)
    assert models.sleeping() == {}


async def test_sleep_idle_seconds_puts_an_unused_model_to_sleep_at_level_2(catalog: SizedCatalog) -> None:
    clock = Clock()
    models = residency(catalog, clock, sleep_idle=60.0)
    models.release(await models.acquire("a", OPTIONS, -1))
    models.release(await models.acquire("b", OPTIONS, -1))
    clock.now += 30
    models.release(await models.acquire("b", OPTIONS, None))
    clock.now += 31
    await models.expire()
    assert models.sleeping() == {"a": 2}
    assert [r.model.name for r in models.running()] == ["b"]


async def test_a_lease_that_runs_out_while_asleep_unloads_it(catalog: SizedCatalog) -> None:
    clock = Clock()
    models = residency(catalog, clock)
    models.release(await models.acquire("a", OPTIONS, 100))
    await models.sleep(["a"], 2)
    clock.now += 101
    await models.expire()
    assert models.sleeping() == {}


async def test_a_sleeping_model_keeps_its_room_until_memory_is_short(catalog: SizedCatalog) -> None:
    clock = Clock()
    models = residency(catalog, clock, memory=FixedMemory(4 * GiB))
    models.release(await models.acquire("b", LoadOptions(), 300))  # 2 GiB
    await models.sleep(["b"], 2)
    models.release(await models.acquire("d", LoadOptions(), 300))  # 2 more: fits beside b's room
    assert models.sleeping() == {"b": 2}
    clock.now += 1
    models.release(await models.acquire("a", LoadOptions(), 300))  # 1 more: b's room is given up, d stays
    assert models.sleeping() == {} and sorted(r.model.name for r in models.running()) == ["a", "d"]
