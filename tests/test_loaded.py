"""Loaded models: on-demand loading, keep-alive expiry, LRU eviction, reload on load-time option changes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lmserve.chat.template import ChatTemplate
from lmserve.engine.fake import FakeBackend
from lmserve.engine.loop import Engine
from lmserve.loaded import LoadedModel, LoadedModels
from lmserve.types import LoadOptions


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Loader:
    """Builds fake-engine models and records every load and close."""

    def __init__(self) -> None:
        self.loads: list[tuple[str, LoadOptions]] = []
        self.closed: list[str] = []
        self.engines: list[Engine] = []

    def __call__(self, name: str, options: LoadOptions) -> LoadedModel:
        self.loads.append((name, options))
        engine = Engine(FakeBackend(num_ctx=options.num_ctx, num_parallel=1))
        self.engines.append(engine)
        return LoadedModel(name=name, engine=engine, template=ChatTemplate(None))

    def unload(self, model: LoadedModel) -> None:
        self.closed.append(model.name)
        model.engine.close()


@pytest.fixture
def loader() -> Iterator[Loader]:
    loader = Loader()
    yield loader
    for engine in loader.engines:
        engine.close()


def models(loader: Loader, clock: Clock, max_loaded: int = 2) -> LoadedModels:
    return LoadedModels(loader, max_loaded=max_loaded, clock=clock, on_unload=loader.unload)


async def test_a_model_is_loaded_once_and_reused(loader: Loader) -> None:
    loaded = models(loader, Clock())
    first = await loaded.acquire("a", LoadOptions(), 300)
    loaded.release(first)
    second = await loaded.acquire("a", LoadOptions(), 300)
    assert second.model is first.model
    assert [name for name, _ in loader.loads] == ["a"]


async def test_keep_alive_expires_idle_models_only(loader: Loader) -> None:
    clock = Clock()
    loaded = models(loader, clock)
    busy = await loaded.acquire("busy", LoadOptions(), 10)
    idle = await loaded.acquire("idle", LoadOptions(), 10)
    loaded.release(idle)
    clock.now += 11
    await loaded.expire()
    assert [r.model.name for r in loaded.running()] == ["busy"]
    assert loader.closed == ["idle"]
    loaded.release(busy)
    clock.now += 11
    await loaded.expire()
    assert loaded.running() == []


async def test_none_keep_alive_means_forever_and_zero_unloads_when_idle(loader: Loader) -> None:
    clock = Clock()
    loaded = models(loader, clock)
    forever = await loaded.acquire("forever", LoadOptions(), None)
    loaded.release(forever)
    now = await loaded.acquire("now", LoadOptions(), 0)
    loaded.release(now)
    clock.now += 10**6
    await loaded.expire()
    assert [r.model.name for r in loaded.running()] == ["forever"]
    assert forever.expires_at is None


async def test_the_least_recently_used_idle_model_is_evicted_beyond_the_limit(loader: Loader) -> None:
    clock = Clock()
    loaded = models(loader, clock, max_loaded=2)
    for name in ("a", "b"):
        loaded.release(await loaded.acquire(name, LoadOptions(), 300))
        clock.now += 1
    loaded.release(await loaded.acquire("a", LoadOptions(), 300))  # a is now the most recent
    clock.now += 1
    loaded.release(await loaded.acquire("c", LoadOptions(), 300))
    assert sorted(r.model.name for r in loaded.running()) == ["a", "c"]
    assert loader.closed == ["b"]


async def test_a_changed_load_time_option_reloads_the_model(loader: Loader) -> None:
    loaded = models(loader, Clock())
    loaded.release(await loaded.acquire("a", LoadOptions(num_ctx=512), 300))
    loaded.release(await loaded.acquire("a", LoadOptions(num_ctx=512), 300))
    resident = await loaded.acquire("a", LoadOptions(num_ctx=1024), 300)
    assert resident.model.engine.info.num_ctx == 1024
    assert [options.num_ctx for _, options in loader.loads] == [512, 1024]
    assert loader.closed == ["a"]
