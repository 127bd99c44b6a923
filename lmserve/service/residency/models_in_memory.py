"""`Residency`: the models in memory, resident names bound to engine instances, loaded without a lock, leased,
expired, evicted for room and restarted when their engine fails (the package docstring says how)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace

from lmserve.engine.factory import MemoryEstimate
from lmserve.engine.protocol import Engine
from lmserve.errors import Conflict, EngineFailure, InvalidRequest, LmserveError, gib
from lmserve.service.healing import Healing
from lmserve.service.memory_budget import MemoryGauge, estimate_of, room_for
from lmserve.service.observers import Observers
from lmserve.service.residency.opening import log_load, open_engine
from lmserve.service.residency.records import (
    Instance,
    LoadPlan,
    ModelHealth,
    Planner,
    Resident,
    WeightsKey,
    keep_alive_seconds,
)
from lmserve.service.residency.sleeping import Asleep, asleep, expire_asleep, forget
from lmserve.types import AUTO_CONTEXT, LoadOptions

log = logging.getLogger(__name__)


def _retrieve(future: asyncio.Future[Instance]) -> None:
    if not future.cancelled():
        future.exception()


class Residency:
    """The models in memory: resident names by canonical name, engine instances by WeightsKey."""

    def __init__(
        self,
        planner: Planner,
        *,
        max_loaded: int = 3,
        keep_alive: float | None = 300.0,
        clock: Callable[[], float] = time.time,
        close_engine: Callable[[Engine], None] = lambda engine: engine.close(),
        observers: Observers | None = None,
        memory: MemoryGauge | None = None,
        reclaim: Callable[[int], int] | None = None,
        load_timeout: float | None = None,
        sleep_idle: float | None = None,
    ) -> None:
        """`memory`: the budget loads are held against (None: no memory check); `reclaim(num_bytes)`: frees up to
        that much elsewhere (the prompt cache's RAM tier) before models are unloaded for room, and says how much
        it freed; `load_timeout`: seconds a load may take before its requests fail (None: no limit); `sleep_idle`:
        seconds unused after which a name sleeps at level 2 (None: never; service/residency/sleeping.py)."""
        self._planner = planner
        self._memory = memory
        self._reclaim = reclaim
        self._max_loaded = max(1, max_loaded)
        self.default_keep_alive = keep_alive
        """Lease of a newly loaded name when the request names none (None: forever)."""
        self._clock = clock
        self._close_engine = close_engine
        self.observers = observers or Observers()
        self._residents: dict[str, Resident] = {}
        self._instances: dict[WeightsKey, Instance] = {}
        self._loading: dict[WeightsKey, asyncio.Future[Instance]] = {}
        self._loading_memory: dict[WeightsKey, MemoryEstimate] = {}
        """The estimates of instances loading now (their memory not taken yet)."""
        self._retired: list[Instance] = []
        """Instances no name binds any more, closed when their last request releases them."""
        self._num_waiting: dict[WeightsKey, int] = {}
        """Requests waiting for an instance to load (it must not be closed before they bind it)."""
        self._num_acquiring: dict[str, int] = {}
        """Requests of each name between asking for it and holding it (they may be waiting for a load)."""
        self._unloaded_while_acquiring: set[str] = set()
        """Names unloaded while a request for them was loading: that request runs, then the name goes."""
        self._load_timeout = load_timeout
        self.sleep_idle = sleep_idle
        self._asleep: dict[str, Asleep] = {}
        self._healing = Healing(clock)
        self._restarts: set[asyncio.Task[None]] = set()
        self._is_closed = False

    async def acquire(self, name: str, options: LoadOptions, keep_alive: float | None = None, *,
                      plan: LoadPlan | None = None) -> Resident:
        """The resident model `name` (loading its instance if needed), leased until `release`; `plan` is the caller's
        plan of it with `options` (else the planner's).

        `keep_alive` None keeps a resident name's lease as it is (a model preloaded by `serve` stays loaded) and gives
        a new one the default; negative means forever; otherwise seconds after last use.
        """
        lease = None if keep_alive is None else keep_alive_seconds(keep_alive)
        plan = plan or self._planner(name, options)
        self._num_acquiring[name] = self._num_acquiring.get(name, 0) + 1
        slept = self._asleep.pop(name, None)  # it wakes: loaded again by `_bound`, its room no longer held aside
        try:
            resident = await self._bound(name, plan)
        finally:
            self._num_acquiring[name] -= 1
            if not self._num_acquiring[name]:
                del self._num_acquiring[name]
        resident.instance.is_asleep = False  # the engine itself wakes for the request's work
        if keep_alive is not None:
            resident.keep_alive = lease
        elif slept is not None:
            resident.keep_alive = slept.keep_alive
        if name in self._unloaded_while_acquiring:  # unloaded (or deleted) meanwhile: answer, then go
            self._unloaded_while_acquiring.discard(name)
            resident.keep_alive = 0.0
        return self._lease(resident)

    async def _bound(self, name: str, plan: LoadPlan) -> Resident:
        """The resident bound as `plan` says: as it is, bound again on its instance, or on a newly loaded one."""
        while True:
            resident = self._residents.get(name)
            if resident is not None and resident.instance.key == plan.key and resident.binding == plan.binding:
                if not self._has_failed(resident.instance):
                    return resident
                refusal = self._healing.refusal(name, plan.key)
                if refusal is not None:
                    raise refusal
            instance = await self._instance(plan, name)
            current = self._residents.get(name)
            if current is not None and current is not resident:
                continue  # another request bound it while this one waited for the load: look again
            try:
                model = plan.bind(instance.engine)
            except BaseException:
                self._close_if_unbound(instance)
                raise
            lease = resident.keep_alive if resident is not None else self.default_keep_alive
            bound = Resident(model, instance, plan.binding, lease, self._clock())
            self._residents[name] = bound
            if resident is not None:
                self._close_if_unbound(resident.instance)
            return bound

    def serving(self, name: str, options: LoadOptions) -> LoadOptions:
        """The load options that serve `name` for a request that asked for `options`: those, or the resident
        instance's when they differ only in a context it already holds. A `num_ctx` that resolves (capped at the
        trained length, as engines cap it) to at most the loaded context reloads nothing: the request runs within its
        own limit (`SamplingParams.context_limit`) and the prompt cache stays. Only a larger one loads another.
        Options the instance cannot act on (`ModelInfo.inert_load_options`: `num_gpu` on a CPU-only build, which
        Open WebUI users set) reload nothing either."""
        resident = self._residents.get(name)
        if resident is None or options.num_ctx == AUTO_CONTEXT or resident.instance.failure is not None:
            return options
        loaded, info = resident.options, resident.instance.engine.info
        inert = {name: getattr(loaded, name) for name in info.inert_load_options}
        if replace(options, num_ctx=loaded.num_ctx, **inert) != loaded:
            return options
        wanted = min(options.num_ctx, info.num_ctx_train) if info.num_ctx_train > 0 else options.num_ctx
        return loaded if wanted <= info.num_ctx else options

    def release(self, resident: Resident) -> None:
        """End one lease; an instance no name binds any more is closed once its last request is done."""
        now = self._clock()
        resident.users = max(0, resident.users - 1)
        resident.last_used = now
        instance = resident.instance
        instance.users = max(0, instance.users - 1)
        instance.last_used = now
        if instance in self._retired and instance.users == 0:
            self._retired.remove(instance)
            self._close(instance)

    def running(self) -> list[Resident]:
        """The resident names, most recently used first."""
        return sorted(self._residents.values(), key=lambda r: r.last_used, reverse=True)

    def engines(self) -> list[Engine]:
        """Every engine in memory, retired ones still finishing requests included."""
        return [instance.engine for instance in [*self._instances.values(), *self._retired]]

    @property
    def num_instances(self) -> int:
        """Engine instances in memory (weights loaded), retired ones still finishing requests included."""
        return len(self._instances) + len(self._retired)

    async def unload(self, name: str) -> bool:
        """Forget `name`; its instance is closed when no other name binds it and its requests are done. A request
        for it that is loading it now still gets its answer; the name goes when that request is done."""
        if self._asleep.pop(name, None) is not None:
            return True
        pending = name in self._num_acquiring
        if pending:
            self._unloaded_while_acquiring.add(name)
        if name not in self._residents:
            return pending
        self._unbind(name)
        return True

    async def expire(self) -> None:
        """Unload idle names whose keep-alive has run out."""
        now = self._clock()
        for name, resident in list(self._residents.items()):
            expires = resident.expires_at
            if expires is not None and expires <= now and resident.is_idle:
                self._unbind(name)
            elif self.sleep_idle is not None and now - resident.last_used >= self.sleep_idle and \
                    resident.instance.is_idle:
                self._sleep_deeply(name)
        expire_asleep(self._asleep, now)
        for instance in list(self._instances.values()):
            self._close_if_unbound(instance)  # loaded for a request that went away before binding it

    async def run_expiry(self, interval: float = 1.0) -> None:
        """Every `interval` seconds: unload expired names, and restart failed engines (`heal`)."""
        while True:
            await asyncio.sleep(interval)
            await self.expire()
            self.heal()

    def heal(self) -> list[asyncio.Task[None]]:
        """Find engines that failed and start restarting, in the background, each failed name whose restart is
        due (service/healing.py); requests for them meanwhile wait for the restart's load. Returns the restarts
        started (each ends when its model is back, or its load failed)."""
        for instance in list(self._instances.values()):
            self._has_failed(instance)
        now = self._clock()
        started: list[asyncio.Task[None]] = []
        for name, resident in self._residents.items():
            key = resident.instance.key
            if (resident.instance.failure is not None and key not in self._loading
                    and self._healing.restart_at(key) <= now):
                task = asyncio.ensure_future(self._restart(name, resident))
                self._restarts.add(task)
                task.add_done_callback(self._restarts.discard)
                started.append(task)
        return started

    def decoders(self) -> list[tuple[tuple[str, ...], Engine]]:
        """Each working engine bound to resident names, with those names (the decode health check's subjects)."""
        bound: dict[int, tuple[list[str], Engine]] = {}
        for name, resident in sorted(self._residents.items()):
            if not self._has_failed(resident.instance) and not resident.instance.is_asleep:
                bound.setdefault(id(resident.instance), ([], resident.instance.engine))[0].append(name)
        return [(tuple(names), engine) for names, engine in bound.values()]

    async def sleep(self, names: list[str] | None, level: int) -> list[str]:
        """Put the resident `names` (None: every one) to sleep at `level` (service/residency/sleeping.py: 1 or 2); the
        names asleep now. InvalidRequest for a name not loaded; Conflict while one serves requests."""
        chosen = sorted(self._residents) if names is None else names
        for name in chosen:
            resident = self._residents.get(name)
            if resident is None and name not in self._asleep:
                raise InvalidRequest(f"model '{name}' is not loaded", param="model")
            if resident is not None and not resident.instance.is_idle:
                raise Conflict(f"model '{name}' is serving requests; it can sleep once they are done")
        for name in chosen:
            resident = self._residents.get(name)
            if resident is not None and level == 2:
                self._sleep_deeply(name)
            elif resident is not None:
                await resident.instance.engine.sleep()
                resident.instance.is_asleep = resident.instance.users == 0
                log.info("%s sleeps (level 1: its KV cache freed)", name)
        return chosen

    async def wake_up(self, names: list[str] | None) -> list[str]:
        """Wake the sleeping `names` (None: every one), loading or making the KV cache again: the names woken."""
        woken = []
        for name in sorted(self.sleeping()) if names is None else names:
            slept, resident = self._asleep.get(name), self._residents.get(name)
            if slept is not None:
                self.release(await self.acquire(name, slept.options))
            elif resident is not None and resident.instance.is_asleep:
                await resident.instance.engine.wake_up()
                resident.instance.is_asleep = False
            else:
                continue
            woken.append(name)
        return woken

    def sleeping(self) -> dict[str, int]:
        """Each sleeping name's level."""
        levels = {name: 2 for name in self._asleep} | {n: 1 for n, r in self._residents.items() if r.instance.is_asleep}
        return dict(sorted(levels.items()))

    def health(self) -> list[ModelHealth]:
        """Each resident name's state (a failed engine's names: restarting, or failed while restarts pause), and
        each name loading for a request."""
        states: list[ModelHealth] = []
        for name, resident in sorted(self._residents.items()):
            instance = resident.instance
            if not self._has_failed(instance):
                states.append(ModelHealth(name, "ok"))
                continue
            refusal = self._healing.refusal(name, instance.key)
            if refusal is not None:
                states.append(ModelHealth(name, "failed", refusal.message))
            else:
                states.append(ModelHealth(name, "restarting", f"its engine stopped ({instance.failure}); restarting"))
        states += [ModelHealth(name, "loading", "its engine is loading") for name in sorted(self._num_acquiring)
                   if name not in self._residents]
        return states

    def close(self) -> None:
        """Close every instance (requests still running end with an error); loads still running are closed when
        they finish."""
        self._is_closed = True
        for task in self._restarts:
            task.cancel()
        self._residents.clear()
        self._asleep.clear()
        for instance in [*self._instances.values(), *self._retired]:
            self._close(instance)
        self._instances.clear()
        self._retired.clear()

    # ---- internals ------------------------------------------------------------------------------

    def _lease(self, resident: Resident) -> Resident:
        resident.users += 1
        resident.instance.users += 1
        resident.last_used = resident.instance.last_used = self._clock()
        return resident

    async def _instance(self, plan: LoadPlan, name: str) -> Instance:
        """The instance for `plan.key`: in memory, being loaded (waited for), or loaded now (without a lock)."""
        instance = self._instances.get(plan.key)
        if instance is not None:
            return instance
        for retired in self._retired:  # still finishing requests: take it back instead of loading a second copy
            if retired.key == plan.key and retired.failure is None:
                self._retired.remove(retired)
                self._instances[plan.key] = retired
                return retired
        pending = self._loading.get(plan.key)
        if pending is None:
            refusal = self._healing.refusal(name, plan.key)
            if refusal is not None:
                raise refusal
            self._evict_for_one_more()
            pending = asyncio.ensure_future(self._open(plan, name))
            pending.add_done_callback(_retrieve)  # a load nobody waits for any more may fail unheard
            self._loading[plan.key] = pending
        self._num_waiting[plan.key] = self._num_waiting.get(plan.key, 0) + 1
        try:
            return await asyncio.shield(pending)
        finally:
            self._num_waiting[plan.key] -= 1
            if not self._num_waiting[plan.key]:
                del self._num_waiting[plan.key]

    async def _open(self, plan: LoadPlan, name: str) -> Instance:
        try:
            estimate = await estimate_of(plan.estimate, name) if self._memory is not None else None
            self._make_room(name, estimate)
            if estimate is not None:
                self._loading_memory[plan.key] = estimate
            engine = await open_engine(plan, name, self._load_timeout, self._close_engine)
        except Exception as exc:
            if self._healing.is_recovering(plan.key):  # a restart: its failure counts
                cause = exc.message if isinstance(exc, LmserveError) else f"{type(exc).__name__}: {exc}"
                self._failed(name, plan.key, f"restarting it failed: {cause}")
            raise
        finally:
            del self._loading[plan.key]
            self._loading_memory.pop(plan.key, None)
        instance = Instance(plan.key, engine, self._clock(), memory=estimate)
        if self._is_closed or plan.key not in self._num_waiting:  # shut down, or every request for it went away
            self._close(instance)
            raise EngineFailure(f"model '{name}' was loaded for requests that are gone")
        self._instances[plan.key] = instance
        log_load(name, plan.key.options, engine.info)
        self.observers.loaded(name)
        return instance

    def _has_failed(self, instance: Instance) -> bool:
        """Whether `instance`'s engine has failed; the first time it is seen, the instance is taken out of service
        (closed once its requests are gone) and the failure counted."""
        if instance.failure is not None:
            return True
        failure = instance.engine.failure
        if failure is None:
            return False
        instance.failure = failure
        names = sorted(name for name, r in self._residents.items() if r.instance is instance)
        log.error("the engine serving %s stopped: %s", ", ".join(names) or "a model", failure)
        self._failed(names[0] if names else instance.key.weights, instance.key, failure)
        if self._instances.get(instance.key) is instance:
            del self._instances[instance.key]
        self._retire(instance)
        return True

    def _failed(self, name: str, key: WeightsKey, cause: str) -> None:
        """Count a failure of `key` (serving `name`); say so once when it pauses the restarts."""
        self._healing.failed(key, cause)
        if self._healing.is_pausing(key):
            refusal = self._healing.refusal(name, key)
            log.error("%s", refusal.message if refusal is not None else cause)

    async def _restart(self, name: str, failed: Resident) -> None:
        """Load `name` again on a new instance, bound as before, unless it was bound anew or let go meanwhile."""
        if self._residents.get(name) is not failed or self._is_closed:
            return
        try:
            plan = self._planner(name, failed.options)
        except LmserveError as exc:  # deleted or changed meanwhile: a request would load it as it is now
            log.info("not restarting %s: %s", name, exc.message)
            self._unbind(name)
            return
        log.info("restarting %s", name)
        try:
            instance = await self._instance(plan, name)
        except Exception as exc:  # counted by the load (_open); the next due restart tries again
            log.warning("restarting %s failed: %s", name, exc.message if isinstance(exc, LmserveError) else exc)
            return
        if self._residents.get(name) is not failed:  # bound anew, or let go, meanwhile
            self._close_if_unbound(instance)
            return
        try:
            model = plan.bind(instance.engine)
        except Exception:  # a request would meet the same error, and report it
            log.exception("restarting %s failed", name)
            self._close_if_unbound(instance)
            return
        self._residents[name] = Resident(model, instance, plan.binding, failed.keep_alive, failed.last_used)
        self._close_if_unbound(failed.instance)
        log.info("restarted %s", name)

    def _sleep_deeply(self, name: str) -> None:
        """Sleep level 2: remember `name` as loaded and unbind it (its instance closes unless another name binds it)."""
        resident = self._residents.pop(name)
        self._asleep[name] = asleep(resident)
        log.info("%s sleeps (level 2: its engine closed, its memory held for its wake)", name)
        self._close_if_unbound(resident.instance)

    def _unbind(self, name: str) -> None:
        resident = self._residents.pop(name)
        log.info("unloading %s", name)
        self._close_if_unbound(resident.instance)

    def _close_if_unbound(self, instance: Instance) -> None:
        """Close (or retire, while requests use it) an instance no resident name binds."""
        if instance.key in self._num_waiting or any(r.instance is instance for r in self._residents.values()):
            return
        if self._instances.get(instance.key) is instance:
            del self._instances[instance.key]
        elif instance not in self._retired:
            return  # already closed
        self._retire(instance)

    def _retire(self, instance: Instance) -> None:
        """Close an instance taken out of service, or keep it retired until the requests still using it are done."""
        if instance.users == 0:
            if instance in self._retired:
                self._retired.remove(instance)
            self._close(instance)
        elif instance not in self._retired:
            self._retired.append(instance)

    def _evict_for_one_more(self) -> None:
        for instance in self._idle_instances():
            if len(self._instances) + len(self._working_retired()) + len(self._loading) < self._max_loaded:
                break
            self._unload_instance(instance)

    def _working_retired(self) -> list[Instance]:
        """Retired instances whose engines work (a failed one is not counted: it ends as soon as its requests do, and
        restarting it must not unload other models)."""
        return [instance for instance in self._retired if instance.failure is None]

    def _idle_instances(self) -> list[Instance]:
        """Instances no request uses or waits for, least recently used first."""
        return sorted((i for i in self._instances.values() if i.is_idle and i.key not in self._num_waiting),
                      key=lambda i: i.last_used)

    def _unload_instance(self, instance: Instance) -> None:
        """Unload an idle instance and every name bound to it."""
        for name in [n for n, r in self._residents.items() if r.instance is instance]:
            self._residents.pop(name)
            log.info("unloading %s", name)
        self._close_if_unbound(instance)

    def _make_room(self, name: str, need: MemoryEstimate | None) -> None:
        """Make `need` fit in memory (memory_budget.room_for): unload what it says, least recently used first."""
        if self._memory is None or need is None or need.on_gpu:
            return
        held = [*self._instances.values(), *self._working_retired()]
        loading = [e for e in self._loading_memory.values() if not e.on_gpu]
        reserved = [(slept, slept.ram_bytes) for slept in self._asleep.values() if slept.ram_bytes]
        available = self._memory.available([i.memory for i in held if i.memory is not None and i.ram_bytes],
                                           [*loading, *(slept.memory for slept, _ in reserved if slept.memory)])
        if available is None:
            return
        idle = self._idle_instances()
        busy = sum(i.ram_bytes for i in held if i not in idle) + sum(e.total for e in loading)
        candidates: list[tuple[Instance | Asleep, int]] = [*reserved, *((i, i.ram_bytes) for i in idle)]
        for chosen in room_for(name, need, available, candidates, busy, self._reclaim):
            if isinstance(chosen, Asleep):  # a sleeping model's room is given up first
                forget(self._asleep, chosen, name)
                continue
            log.info("unloading an idle model (%s) to make room for %s", gib(chosen.ram_bytes), name)
            self._unload_instance(chosen)

    def _close(self, instance: Instance) -> None:
        if instance.is_closed:
            return
        instance.is_closed = True
        try:
            self._close_engine(instance.engine)
        except Exception:
            log.exception("closing an engine failed")
