"""LoRA adapter sets in the slot engine (issue 44), over the fake backend, whose adapters shift a sequence's text and
which refuses a step that mixes sets: one set per step, turns between sets, and no prefix (a slot's, a copy, a saved
state) computed under one set serving another."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.fake import FakeBackend
from lmserve.engine.slots.phases import Phase
from lmserve.engine.slots.scheduler import ADAPTER_TURN, Scheduler
from lmserve.engine.slots.sequence import Sequence
from lmserve.errors import InvalidRequest
from lmserve.types import Adapter, SamplingParams

PROMPT = "The system prompt all the users share, long enough to be worth a copy. Question?"


@pytest.fixture
def adapters(tmp_path: Path) -> list[tuple[Adapter, ...]]:
    """The base and three adapter sets (files the fake accepts: each shifts the text by twice its first byte times its
    scale, here 10, 22 and 5 of the sentence's 45 characters)."""
    sets: list[tuple[Adapter, ...]] = [()]
    for name, effect in (("a", 5), ("b", 11)):
        (tmp_path / f"{name}.gguf").write_bytes(bytes([effect]))
        sets.append((Adapter(str(tmp_path / f"{name}.gguf")),))
    sets.append((Adapter(str(tmp_path / "a.gguf"), 0.5),))
    return sets


async def answer(engine: BatchingEngine, adapters: tuple[Adapter, ...], prompt: str = PROMPT) -> str:
    sampling = SamplingParams(temperature=0, max_tokens=12, adapters=adapters)
    return "".join([chunk.text async for chunk in engine.submit(engine.tokenize(prompt), sampling)])


async def test_each_set_answers_as_alone_when_mixed_and_no_step_mixes_sets(
        adapters: list[tuple[Adapter, ...]]) -> None:
    backend = FakeBackend(num_ctx=256, num_parallel=4)
    engine = BatchingEngine(backend, max_batch_tokens=64, max_prefill_tokens=32)
    try:
        alone = [await answer(engine, adapter_set) for adapter_set in adapters]
        assert len(set(alone)) == len(adapters)  # each set gives its own answer
        mixed = await asyncio.gather(*(answer(engine, adapters[i % len(adapters)]) for i in range(8)))
        assert mixed == [alone[i % len(adapters)] for i in range(8)]
        assert len(set(backend.step_adapters)) == len(adapters)  # (the fake refuses a mixed step)
    finally:
        engine.close()


def step(scheduler: Scheduler) -> set[tuple[Adapter, ...]]:
    """Plan a step and take it as the engine would (prefill done, one token sampled); the sets it ran."""
    plan = scheduler.schedule()
    for seq, entry in plan:
        if seq.phase is Phase.PREFILLING:
            scheduler.prefilled(seq, entry.num_positions)
        if entry.wants_sample:
            seq.output.append(7)
    return {seq.adapters for seq, _ in plan}


def admitted(scheduler: Scheduler, *sequences: Sequence) -> None:
    for seq in sequences:
        scheduler.add(seq)
    while scheduler.can_admit():
        scheduler.reused(scheduler.admit(), 0)


def test_sets_take_turns_of_a_few_steps() -> None:
    scheduler = Scheduler(4, 64, 32)
    one, two = (Adapter("one.gguf"),), (Adapter("two.gguf"),)
    admitted(scheduler, *(Sequence(prompt=[1, 2, 3], sampling=SamplingParams(adapters=adapter_set), max_new_tokens=99)
                          for adapter_set in (one, two, one)))
    turns = [step(scheduler) for _ in range(3 * ADAPTER_TURN)]
    assert turns == [{one}] * ADAPTER_TURN + [{two}] * ADAPTER_TURN + [{one}] * ADAPTER_TURN
    assert max(len(seq.output) for seq in scheduler.running) == 2 * ADAPTER_TURN


def test_a_slot_computed_under_another_set_lends_no_prefix() -> None:
    scheduler = Scheduler(1, 64, 32)
    first = Sequence(prompt=list(range(1, 40)), sampling=SamplingParams(), max_new_tokens=1)
    scheduler.add(first)
    scheduler.reused(scheduler.admit(), 0)
    scheduler.remove(first)
    again = Sequence(prompt=list(range(1, 40)), sampling=SamplingParams(), max_new_tokens=1)
    other = Sequence(prompt=list(range(1, 40)), sampling=SamplingParams(adapters=(Adapter("x.gguf"),)),
                     max_new_tokens=1)
    scheduler.add(other)
    assert scheduler.admit().num_cached == 0
    scheduler.reused(other, 0)
    scheduler.remove(other)
    scheduler.add(again)
    assert scheduler.admit().num_cached == 0  # the slot now holds the prompt under the adapter, not the base


async def test_a_saved_state_serves_only_its_own_set(adapters: list[tuple[Adapter, ...]]) -> None:
    backend = FakeBackend(num_ctx=256, num_parallel=1)
    engine = BatchingEngine(backend, max_batch_tokens=64, max_prefill_tokens=64)
    try:
        base, adapted = adapters[0], adapters[1]
        await answer(engine, base)
        await answer(engine, adapted)  # takes the only slot: the base's state is saved
        assert engine.cache_stats.hits["ram"] == 0
        await answer(engine, base)  # restored from the base's saved state
        assert engine.cache_stats.hits["ram"] == 1
        await answer(engine, adapters[3])  # the same file at another scale: nothing of the others serves it
        assert engine.cache_stats.hits["ram"] == 1
        await answer(engine, adapted)
        assert engine.cache_stats.hits["ram"] == 2
    finally:
        engine.close()


async def test_an_adapter_the_backend_refuses_is_a_400_before_anything_is_queued(tmp_path: Path) -> None:
    engine = BatchingEngine(FakeBackend(num_ctx=256, num_parallel=1))
    try:
        with pytest.raises(InvalidRequest, match="not found"):
            engine.submit(engine.tokenize("hi"), SamplingParams(adapters=(Adapter(str(tmp_path / "none.gguf")),)))
        assert engine.num_waiting == 0
    finally:
        engine.close()


async def test_stats_name_the_adapters_running_and_waiting(tmp_path: Path) -> None:
    (tmp_path / "a.gguf").write_bytes(b"\x01")
    backend = FakeBackend(num_ctx=256, num_parallel=1, step_delay=0.01)
    engine = BatchingEngine(backend)
    try:
        running = SamplingParams(max_tokens=200, adapters=(Adapter(str(tmp_path / "a.gguf"), name="sea"),))
        waiting = SamplingParams(max_tokens=200, adapters=(Adapter(str(tmp_path / "a.gguf"), 0.5, name="half"),))
        first = engine.submit(engine.tokenize("one"), running)
        second = engine.submit(engine.tokenize("two"), waiting)
        async for _ in first:
            break
        for _ in range(200):  # the engine thread may take the second request a step after the first one's token
            stats = engine.stats
            if len(stats.running_adapters) + len(stats.waiting_adapters) == 2:
                break
            await asyncio.sleep(0.01)
        # One slot: one set runs and the other waits (which one, after the fair turns between sets that a loaded
        # machine lets pass before this reads, does not matter).
        assert stats.max_adapters == 4 and len(stats.running_adapters) == 1
        assert sorted(stats.running_adapters + stats.waiting_adapters) == ["half", "sea"]
        first.abort()
        second.abort()
    finally:
        engine.close()


def test_a_batch_line_of_another_set_waits_for_a_users_request() -> None:
    scheduler = Scheduler(4, 64, 32)
    user, line = (Adapter("user.gguf"),), (Adapter("line.gguf"),)
    admitted(scheduler, Sequence(prompt=[1, 2, 3], sampling=SamplingParams(adapters=line, priority=1000),
                                 max_new_tokens=99),
             Sequence(prompt=[4, 5, 6], sampling=SamplingParams(adapters=user), max_new_tokens=99),
             Sequence(prompt=[7, 8, 9], sampling=SamplingParams(adapters=user, priority=1000), max_new_tokens=99))
    assert all(step(scheduler) == {user} for _ in range(3 * ADAPTER_TURN))  # the line of the user's set rides along
    [first] = [seq for seq in scheduler.running if seq.priority == 0]
    scheduler.remove(first)
    assert {line} in [step(scheduler) for _ in range(ADAPTER_TURN + 1)]  # both batch lines now: turns again
