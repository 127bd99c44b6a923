"""Residency: on-demand loading, keep-alive expiry, LRU eviction, shared weights, loads that block nobody else,
and fresh instances for changed load-time options."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator

import pytest

from lmserve.chat.template import ChatTemplate
from lmserve.engine.protocol import Engine, ModelInfo
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.fake import FakeBackend
from lmserve.errors import EngineFailure, EngineStopped, InvalidRequest
from lmserve.service.healing import FAILURE_WINDOW, MAX_FAILURES, RESTART_BACKOFF
from lmserve.service.residency import (
    LoadedModel,
    LoadPlan,
    ModelHealth,
    Residency,
    Resident,
    WeightsKey,
    log_load,
)
from lmserve.types import AUTO_CONTEXT, LoadOptions, SamplingParams


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Catalog:
    """Names mapped to weights (several names may share them); records every open and close of an engine."""

    def __init__(self, weights: dict[str, str] | None = None) -> None:
        self.weights = weights or {}
        self.bindings: dict[str, str] = {}
        """The stored settings' version of each name (changing it is like creating the name again)."""
        self.opened: list[tuple[str, LoadOptions]] = []
        self.closed: list[str] = []
        self.engines: list[BatchingEngine] = []
        self.gates: dict[str, threading.Event] = {}
        """Weights whose open waits for the event (a slow load)."""
        self.unreadable: set[str] = set()
        """Weights whose open fails."""

    def plan(self, name: str, options: LoadOptions) -> LoadPlan:
        weights = self.weights.get(name, name)

        def open_engine() -> Engine:
            if weights in self.gates:
                assert self.gates[weights].wait(10)
            if weights in self.unreadable:
                raise RuntimeError("the weights are unreadable")
            self.opened.append((weights, options))
            engine = BatchingEngine(FakeBackend(num_ctx=options.num_ctx, num_parallel=1))
            engine.info.path = weights
            self.engines.append(engine)
            return engine

        def bind(engine: Engine) -> LoadedModel:
            return LoadedModel(name=name, engine=engine, template=ChatTemplate(None),
                               sampling=SamplingParams(temperature=len(name) / 10))

        return LoadPlan(WeightsKey(weights, options), open_engine, bind, binding=self.bindings.get(name, ""))

    def close(self, engine: Engine) -> None:
        self.closed.append(engine.info.path)
        engine.close()


@pytest.fixture
def catalog() -> Iterator[Catalog]:
    catalog = Catalog()
    yield catalog
    for gate in catalog.gates.values():
        gate.set()
    for engine in catalog.engines:
        engine.close()


async def loading(models: Residency, catalog: Catalog, name: str) -> asyncio.Future[Resident]:
    """A request for `name` whose load is under way (held until `catalog.gates[name]` is set)."""
    catalog.gates[name] = threading.Event()
    pending = asyncio.ensure_future(models.acquire(name, LoadOptions(), 300))
    await asyncio.sleep(0.05)
    return pending


def residency(catalog: Catalog, clock: Clock, max_loaded: int = 2, load_timeout: float | None = None) -> Residency:
    return Residency(catalog.plan, max_loaded=max_loaded, clock=clock, close_engine=catalog.close,
                     load_timeout=load_timeout)


OPTIONS = LoadOptions(num_ctx=64)
"""Load options the fake engine can answer with (the default's automatic context is 0 on the fake)."""


async def kill(engine: Engine, fault: str = "the slot's memory is gone") -> None:
    """Break `engine`'s thread (the fake backend's fault, met by a short request) and see it failed."""
    assert isinstance(engine, BatchingEngine)
    assert isinstance(engine.backend, FakeBackend)
    engine.backend.fault = fault
    chunks = [chunk async for chunk in engine.submit(engine.tokenize("x"), SamplingParams(max_tokens=1))]
    assert chunks[-1].finish_reason == "error"
    assert engine.failure is not None


async def until(done: Callable[[], bool]) -> None:
    """Let the event loop run until `done()` (a background restart on the fake engine takes milliseconds)."""
    for _ in range(500):
        if done():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("it did not happen")


def engine_of(models: Residency, name: str) -> Engine:
    return next(r.model.engine for r in models.running() if r.model.name == name)


async def test_a_model_is_loaded_once_and_reused(catalog: Catalog) -> None:
    models = residency(catalog, Clock())
    first = await models.acquire("a", LoadOptions(), 300)
    models.release(first)
    second = await models.acquire("a", LoadOptions(), 300)
    assert second.model is first.model
    assert [weights for weights, _ in catalog.opened] == ["a"]


async def test_keep_alive_expires_idle_models_only(catalog: Catalog) -> None:
    clock = Clock()
    models = residency(catalog, clock)
    busy = await models.acquire("busy", LoadOptions(), 10)
    idle = await models.acquire("idle", LoadOptions(), 10)
    models.release(idle)
    clock.now += 11
    await models.expire()
    assert [r.model.name for r in models.running()] == ["busy"]
    assert catalog.closed == ["idle"]
    models.release(busy)
    clock.now += 11
    await models.expire()
    assert models.running() == []


async def test_none_keep_alive_means_forever_and_zero_unloads_when_idle(catalog: Catalog) -> None:
    clock = Clock()
    models = residency(catalog, clock)
    forever = await models.acquire("forever", LoadOptions(), -1)
    models.release(forever)
    now = await models.acquire("now", LoadOptions(), 0)
    models.release(now)
    clock.now += 10**6
    await models.expire()
    assert [r.model.name for r in models.running()] == ["forever"]
    assert forever.expires_at is None


@pytest.mark.parametrize(("keep_alive", "lease"), [(None, 300.0), (-1, None), (float("inf"), None), (1e308, None),
                                                   (0, 0.0), (42, 42.0)])
async def test_keep_alive_none_gives_the_default_and_extremes_mean_forever(
    catalog: Catalog, keep_alive: float | None, lease: float | None
) -> None:
    models = Residency(catalog.plan, keep_alive=300.0, close_engine=catalog.close)
    assert (await models.acquire("a", LoadOptions(), keep_alive)).keep_alive == lease


async def test_the_least_recently_used_idle_model_is_evicted_beyond_the_limit(catalog: Catalog) -> None:
    clock = Clock()
    models = residency(catalog, clock, max_loaded=2)
    for name in ("a", "b"):
        models.release(await models.acquire(name, LoadOptions(), 300))
        clock.now += 1
    models.release(await models.acquire("a", LoadOptions(), 300))  # a is now the most recent
    clock.now += 1
    models.release(await models.acquire("c", LoadOptions(), 300))
    assert sorted(r.model.name for r in models.running()) == ["a", "c"]
    assert catalog.closed == ["b"]


async def test_a_changed_load_time_option_reloads_an_idle_model(catalog: Catalog) -> None:
    models = residency(catalog, Clock())
    models.release(await models.acquire("a", LoadOptions(num_ctx=512), 300))
    models.release(await models.acquire("a", LoadOptions(num_ctx=512), 300))
    resident = await models.acquire("a", LoadOptions(num_ctx=1024), 300)
    assert resident.model.engine.info.num_ctx == 1024
    assert [options.num_ctx for _, options in catalog.opened] == [512, 1024]
    assert catalog.closed == ["a"]


async def test_a_context_no_larger_than_the_loaded_one_is_served_by_it(catalog: Catalog) -> None:
    models = residency(catalog, Clock())
    models.release(await models.acquire("a", LoadOptions(num_ctx=1024), 300))
    for asked in (1024, 512, 1000, 8):  # what aider sends changes with every prompt
        options = models.serving("a", LoadOptions(num_ctx=asked))
        assert options == LoadOptions(num_ctx=1024)
        models.release(await models.acquire("a", options, 300))
    assert [options.num_ctx for _, options in catalog.opened] == [1024] and catalog.closed == []
    assert models.serving("a", LoadOptions(num_ctx=2048)) == LoadOptions(num_ctx=2048)  # more: another instance
    assert models.serving("a", LoadOptions(num_ctx=512, num_batch=64)).num_ctx == 512  # another option changed
    assert models.serving("b", LoadOptions(num_ctx=512)).num_ctx == 512  # not loaded


async def test_a_context_above_the_trained_one_resolves_to_it_before_it_is_compared(catalog: Catalog) -> None:
    models = residency(catalog, Clock())
    models.release(await models.acquire("a", LoadOptions(), 300))  # the automatic context
    [engine] = catalog.engines
    engine.info.num_ctx = engine.info.num_ctx_train = 8192
    for asked in (9000, 9001, 8192):  # the reproduction: each was a reload
        assert models.serving("a", LoadOptions(num_ctx=asked)) == LoadOptions()
    engine.info.num_ctx_train = 0  # trained length unknown: the number asked is the context
    assert models.serving("a", LoadOptions(num_ctx=9000)).num_ctx == 9000


async def test_options_the_instance_cannot_act_on_reload_nothing(catalog: Catalog) -> None:
    """Open WebUI users set num_gpu; on a llama.cpp built without GPU offload it places nothing anywhere."""
    models = residency(catalog, Clock())
    models.release(await models.acquire("a", LoadOptions(num_ctx=1024), 300))
    [engine] = catalog.engines
    assert models.serving("a", LoadOptions(num_ctx=1024, num_gpu_layers=99)).num_gpu_layers == 99  # a GPU build
    engine.info.inert_load_options = frozenset({"num_gpu_layers", "main_gpu"})
    for asked in (LoadOptions(num_ctx=1024, num_gpu_layers=99), LoadOptions(num_ctx=512, main_gpu=1)):
        assert models.serving("a", asked) == LoadOptions(num_ctx=1024)
    assert models.serving("a", LoadOptions(num_ctx=1024, num_batch=64)).num_batch == 64  # still a reload


async def test_a_busy_model_asked_for_other_options_gets_a_fresh_instance_and_the_old_one_drains(
    catalog: Catalog,
) -> None:
    models = residency(catalog, Clock())
    busy = await models.acquire("a", LoadOptions(num_ctx=512), 300)
    fresh = await models.acquire("a", LoadOptions(num_ctx=1024), 300)
    assert (busy.model.engine.info.num_ctx, fresh.model.engine.info.num_ctx) == (512, 1024)
    assert [r.model.engine.info.num_ctx for r in models.running()] == [1024]
    assert catalog.closed == [] and models.num_instances == 2  # the old instance still serves its request
    models.release(busy)
    assert catalog.closed == ["a"] and models.num_instances == 1
    models.release(fresh)


async def test_names_on_the_same_weights_share_one_engine_instance(catalog: Catalog) -> None:
    catalog.weights = {"base": "w", "pirate": "w", "poet": "w", "other": "x"}
    models = residency(catalog, Clock(), max_loaded=3)
    residents = [await models.acquire(name, LoadOptions(), 300) for name in ("base", "pirate", "poet", "other")]
    assert [w for w, _ in catalog.opened] == ["w", "x"]
    base, pirate, poet, other = (r.model for r in residents)
    assert base.engine is pirate.engine is poet.engine is not other.engine
    assert (base.sampling.temperature, pirate.sampling.temperature) == (0.4, 0.6)  # each keeps its own defaults
    assert models.num_instances == 2
    for resident in residents:
        models.release(resident)
    await models.unload("pirate")
    await models.unload("base")
    assert catalog.closed == []  # poet still binds the shared instance
    await models.unload("poet")
    assert catalog.closed == ["w"]


async def test_the_same_weights_with_other_load_options_are_a_second_instance(catalog: Catalog) -> None:
    catalog.weights = {"small": "w", "large": "w"}
    models = residency(catalog, Clock())
    small = await models.acquire("small", LoadOptions(num_ctx=512), 300)
    large = await models.acquire("large", LoadOptions(num_ctx=1024), 300)
    assert small.model.engine is not large.model.engine
    assert len(catalog.opened) == 2


async def test_concurrent_requests_for_shared_weights_wait_for_one_load(catalog: Catalog) -> None:
    catalog.weights = {"a": "w", "b": "w"}
    catalog.gates["w"] = threading.Event()
    models = residency(catalog, Clock())
    first = asyncio.ensure_future(models.acquire("a", LoadOptions(), 300))
    second = asyncio.ensure_future(models.acquire("b", LoadOptions(), 300))
    await asyncio.sleep(0.05)
    catalog.gates["w"].set()
    a, b = await asyncio.gather(first, second)
    assert a.model.engine is b.model.engine
    assert len(catalog.opened) == 1


async def test_a_model_that_is_loading_blocks_no_request_to_a_loaded_model(catalog: Catalog) -> None:
    models = residency(catalog, Clock())
    models.release(await models.acquire("loaded", LoadOptions(), 300))
    catalog.gates["slow"] = threading.Event()
    slow = asyncio.ensure_future(models.acquire("slow", LoadOptions(), 300))
    await asyncio.sleep(0.05)
    resident = await asyncio.wait_for(models.acquire("loaded", LoadOptions(), 300), timeout=1)
    assert not slow.done()
    models.release(resident)
    catalog.gates["slow"].set()
    models.release(await slow)


async def test_a_failed_load_fails_its_requests_and_leaves_nothing_behind(catalog: Catalog) -> None:
    def broken(name: str, options: LoadOptions) -> LoadPlan:
        def fail() -> Engine:
            raise RuntimeError("bad weights")

        return LoadPlan(WeightsKey(name, options), fail, lambda engine: LoadedModel(name, engine, ChatTemplate(None)))

    models = Residency(broken, close_engine=catalog.close)
    with pytest.raises(EngineFailure, match="loading model 'a' failed: RuntimeError: bad weights"):
        await models.acquire("a", LoadOptions())
    assert models.running() == [] and models.num_instances == 0


async def test_an_unloaded_instance_still_in_use_is_taken_back_instead_of_loaded_twice(catalog: Catalog) -> None:
    models = residency(catalog, Clock())
    busy = await models.acquire("a", LoadOptions(), 300)
    await models.unload("a")
    again = await models.acquire("a", LoadOptions(), 300)
    assert again.model.engine is busy.model.engine and len(catalog.opened) == 1
    models.release(busy)
    models.release(again)
    assert catalog.closed == []


async def test_a_model_created_again_is_bound_again_on_the_same_instance(catalog: Catalog) -> None:
    models = residency(catalog, Clock())
    before = await models.acquire("a", LoadOptions(), -1)
    models.release(before)
    catalog.bindings["a"] = "v2"
    after = await models.acquire("a", LoadOptions())
    assert after.model is not before.model and after.model.engine is before.model.engine
    assert after.binding == "v2" and after.keep_alive is None  # the forever lease stays
    assert len(catalog.opened) == 1 and catalog.closed == []


async def test_a_preloaded_model_keeps_its_lease_when_other_options_reload_it(catalog: Catalog) -> None:
    models = residency(catalog, Clock())
    models.release(await models.acquire("a", LoadOptions(num_ctx=512), -1))
    resident = await models.acquire("a", LoadOptions(num_ctx=1024))
    assert resident.keep_alive is None and resident.model.engine.info.num_ctx == 1024


async def test_a_name_unloaded_while_it_loads_answers_its_request_then_goes(catalog: Catalog) -> None:
    clock = Clock()
    models = residency(catalog, clock)
    pending = await loading(models, catalog, "a")
    assert await models.unload("a")  # e.g. deleted meanwhile
    catalog.gates["a"].set()
    resident = await pending
    assert resident.keep_alive == 0
    models.release(resident)
    await models.expire()
    assert models.running() == [] and catalog.closed == ["a"]


async def test_a_load_whose_only_request_went_away_is_closed(catalog: Catalog) -> None:
    models = residency(catalog, Clock())
    pending = await loading(models, catalog, "a")
    pending.cancel()
    await asyncio.sleep(0)
    catalog.gates["a"].set()
    for _ in range(100):
        if catalog.closed:
            break
        await asyncio.sleep(0.01)
    assert catalog.closed == ["a"] and models.num_instances == 0


async def test_closing_while_a_model_loads_closes_it_when_it_is_loaded(catalog: Catalog) -> None:
    models = residency(catalog, Clock())
    pending = await loading(models, catalog, "a")
    models.close()
    catalog.gates["a"].set()
    with pytest.raises(EngineFailure):
        await pending
    assert catalog.closed == ["a"] and models.num_instances == 0


async def test_a_nan_keep_alive_is_refused_before_anything_is_leased(catalog: Catalog) -> None:
    models = residency(catalog, Clock())
    with pytest.raises(InvalidRequest, match="NaN"):
        await models.acquire("a", LoadOptions(), float("nan"))
    assert catalog.opened == [] and models.running() == []


# ---- the load's log line ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("asked", "in_force", "trained", "slots", "lines"),
    [
        (AUTO_CONTEXT, 8192, 8192, 4,
         ["loaded m: context 8192 tokens per sequence x 4 slots (auto, trained for 8192)"]),
        (2048, 2048, 8192, 1, ["loaded m: context 2048 tokens per sequence x 1 slot (asked, trained for 8192)"]),
        (32768, 8192, 8192, 4, [
            "m: a context of 32768 tokens per sequence was asked for (-c/--ctx-size, LMSERVE_CTX_SIZE or num_ctx), but "
            "the model was trained for 8192: its context is 8192 tokens per sequence",
            "loaded m: context 8192 tokens per sequence x 4 slots (asked, trained for 8192)"]),
        (4096, 4096, 0, 2, ["loaded m: context 4096 tokens per sequence x 2 slots (asked)"]),  # trained length unknown
    ],
)
def test_a_load_logs_the_context_in_force_and_warns_when_capped(
    asked: int, in_force: int, trained: int, slots: int, lines: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="lmserve.service.residency")
    info = ModelInfo(path="m.gguf", architecture="llama", num_ctx=in_force, num_parallel=slots, num_vocab=10,
                     num_ctx_train=trained)
    log_load("m", LoadOptions(num_ctx=asked), info)
    assert [r.getMessage() for r in caplog.records] == lines
    assert [r.levelno for r in caplog.records] == [logging.WARNING] * (len(lines) - 1) + [logging.INFO]


async def test_a_failed_engine_is_closed_and_its_model_restarted_at_once_leaving_the_others_alone(
    catalog: Catalog,
) -> None:
    models = residency(catalog, Clock())
    for name in ("a", "b"):
        models.release(await models.acquire(name, OPTIONS, -1))
    a, b = engine_of(models, "a"), engine_of(models, "b")
    await kill(a)
    restarts = models.heal()
    assert catalog.closed == ["a"]
    assert models.health() == [
        ModelHealth("a", "restarting", "its engine stopped (its engine thread failed: RuntimeError: the slot's memory "
                    "is gone); restarting"),
        ModelHealth("b", "ok"),
    ]
    await asyncio.gather(*restarts)
    assert engine_of(models, "a") is not a
    assert models.health() == [ModelHealth("a", "ok"), ModelHealth("b", "ok")]
    assert engine_of(models, "b") is b and [w for w, _ in catalog.opened] == ["a", "b", "a"]
    resident = await models.acquire("a", OPTIONS)
    assert resident.keep_alive is None  # the lease it had: forever
    models.release(resident)


async def test_a_request_for_a_failed_model_loads_it_again_before_the_background_does(catalog: Catalog) -> None:
    models = residency(catalog, Clock())
    first = await models.acquire("a", OPTIONS, 300)
    await kill(first.model.engine)
    second = await models.acquire("a", OPTIONS, 300)
    assert second.model.engine is not first.model.engine and second.model.engine.failure is None
    assert catalog.closed == []  # the failed engine still has a request: closed when it is done
    models.release(first)
    assert catalog.closed == ["a"]
    models.release(second)


async def test_restarts_back_off_and_pause_after_repeated_failures_saying_why_once(
    catalog: Catalog, caplog: pytest.LogCaptureFixture
) -> None:
    """A death, then restarts whose loads fail: the first restart at once, the next after RESTART_BACKOFF; at
    MAX_FAILURES within the window restarts pause, requests get the 503 with the count and the last cause (the log
    says it once); after the window a request loads the model again."""
    assert MAX_FAILURES == 3
    clock = Clock()
    models = residency(catalog, clock)
    models.release(await models.acquire("a", OPTIONS, -1))
    catalog.unreadable.add("a")
    await kill(engine_of(models, "a"))
    assert len(await asyncio.gather(*models.heal())) == 1  # failure 1: restarted at once; that load fails (2)
    assert models.health()[0].state == "restarting"
    assert models.heal() == []  # the next restart is RESTART_BACKOFF away
    clock.now += RESTART_BACKOFF
    caplog.set_level(logging.ERROR, logger="lmserve.service.residency")
    assert len(await asyncio.gather(*models.heal())) == 1  # restarted again; that load fails too (3): paused
    for _ in range(2):
        with pytest.raises(EngineStopped) as refused:
            await models.acquire("a", OPTIONS)
        models.heal()
    assert refused.value.status == 503
    assert refused.value.message.startswith(
        "the engine serving 'a' failed 3 times within 5m (last: restarting it failed: loading model 'a' failed: "
        "RuntimeError: the weights are unreadable); lmserve stopped restarting it for now and tries again in ")
    [health] = models.health()
    assert (health.state, health.reason) == ("failed", refused.value.message)
    assert sum("stopped restarting" in r.getMessage() for r in caplog.records) == 1
    assert [w for w, _ in catalog.opened] == ["a"]
    catalog.unreadable.clear()
    clock.now += FAILURE_WINDOW
    models.release(await models.acquire("a", OPTIONS))
    assert models.health() == [ModelHealth("a", "ok")]


async def test_a_load_that_hangs_fails_its_request_after_the_load_timeout_and_is_closed_when_it_ends(
    catalog: Catalog,
) -> None:
    models = residency(catalog, Clock(), load_timeout=1)  # (it also bounds the load of "other" below: not less)
    catalog.gates["slow"] = threading.Event()
    with pytest.raises(EngineFailure, match=r"model 'slow' did not load within 1s \(LMSERVE_LOAD_TIMEOUT\)"):
        await models.acquire("slow", OPTIONS)
    resident = await models.acquire("other", OPTIONS)  # the server goes on serving
    models.release(resident)
    catalog.gates["slow"].set()
    await until(lambda: "slow" in catalog.closed)
    assert [r.model.name for r in models.running()] == ["other"] and models.health() == [ModelHealth("other", "ok")]


async def test_health_says_which_models_are_loading(catalog: Catalog) -> None:
    models = residency(catalog, Clock())
    pending = await loading(models, catalog, "slow")
    assert models.health() == [ModelHealth("slow", "loading", "its engine is loading")]
    catalog.gates["slow"].set()
    models.release(await pending)
    assert models.health() == [ModelHealth("slow", "ok")]


async def test_restarting_a_failed_model_unloads_no_other_model_for_room(catalog: Catalog) -> None:
    """At the limit of loaded models, a failed engine that still has a request does not count: its restart takes
    its place, not an idle neighbour's."""
    models = residency(catalog, Clock(), max_loaded=3)
    held = await models.acquire("a", OPTIONS, -1)
    for name in ("b", "c"):
        models.release(await models.acquire(name, OPTIONS, -1))
    await kill(held.model.engine)
    models.release(await models.acquire("a", OPTIONS))
    assert sorted(r.model.name for r in models.running()) == ["a", "b", "c"] and catalog.closed == []
    models.release(held)
    assert catalog.closed == ["a"]
