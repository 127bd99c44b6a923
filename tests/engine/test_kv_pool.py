"""A KV pool shared by the slots (`--kv-unified`) that fills up: idle prefix caches go first, then the newest
sequences pause and are recomputed later, and every reply comes out whole and unchanged (fake backend)."""

from __future__ import annotations

import asyncio

from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.fake import FakeBackend
from lmserve.engine.slots.phases import Phase
from lmserve.engine.slots.scheduler import Scheduler
from lmserve.engine.slots.sequence import Sequence
from lmserve.types import Chunk, SamplingParams


def seq(num_prompt: int) -> Sequence:
    return Sequence(prompt=list(range(num_prompt)), sampling=SamplingParams(), max_new_tokens=16)


def started(scheduler: Scheduler, *seqs: Sequence) -> None:
    """Admit the sequences, their prompts prefilled and a first token sampled (pending)."""
    for s in seqs:
        scheduler.add(s)
    while scheduler.can_admit():
        s = scheduler.admit()
        scheduler.reused(s, 0)
        scheduler.prefilled(s, len(s.prompt))
        s.output = [99]


def test_idle_prefix_caches_are_evicted_longest_idle_first() -> None:
    scheduler = Scheduler(num_slots=3, max_batch_tokens=64, max_prefill_tokens=64)
    a, b = seq(5), seq(7)
    started(scheduler, a, b)
    scheduler.remove(a)
    scheduler.remove(b)
    assert scheduler.evict_idle() == (a.slot, a.held)
    assert scheduler.slot_tokens[a.slot] == []
    assert scheduler.evict_idle() == (b.slot, b.held)
    assert scheduler.evict_idle() is None


def test_the_newest_sequence_is_parked_and_resumes_by_prefilling_its_prompt_and_output() -> None:
    scheduler = Scheduler(num_slots=2, max_batch_tokens=64, max_prefill_tokens=64)
    a, b, c = seq(5), seq(6), seq(3)
    started(scheduler, a, b)
    b.output = [100, 101, 102]  # 100 and 101 are in its memory, 102 is pending
    scheduler.add(c)
    assert scheduler.park() is b
    assert b.phase is Phase.PARKED and b.held == [] and b.slot >= 0
    assert [s for s, _ in scheduler.schedule()] == [a]
    scheduler.remove(a)  # a leaves: b resumes before any waiting sequence is admitted
    assert b.phase is Phase.PREFILLING
    (s, entry), = scheduler.schedule()
    assert s is b and entry.tokens == [*range(6), 100, 101, 102] and entry.pos == 0 and entry.wants_sample
    scheduler.prefilled(b, len(entry.tokens))
    b.output.append(103)  # sampled after the refilled pending token
    assert b.phase is Phase.DECODING and b.held == [*range(6), 100, 101, 102]
    (_, entry), = [p for p in scheduler.schedule() if p[0] is b]
    assert (entry.tokens, entry.pos) == ([103], 9)


def test_no_sequence_is_admitted_while_one_is_parked() -> None:
    scheduler = Scheduler(num_slots=3, max_batch_tokens=64, max_prefill_tokens=64)
    a, b, c = seq(4), seq(4), seq(4)
    started(scheduler, a, b)
    scheduler.add(c)
    assert scheduler.park() is b
    assert not scheduler.can_admit()
    scheduler.remove(a)
    assert scheduler.can_admit()


def test_the_last_sequence_that_could_run_is_never_parked() -> None:
    scheduler = Scheduler(num_slots=2, max_batch_tokens=64, max_prefill_tokens=64)
    a, b = seq(4), seq(4)
    started(scheduler, a, b)
    assert scheduler.park() is b
    assert scheduler.park() is None
    assert a.phase is Phase.DECODING


def test_followers_of_a_parked_leader_prefill_alone() -> None:
    scheduler = Scheduler(num_slots=3, max_batch_tokens=64, max_prefill_tokens=64, can_copy=True)
    a, leader, follower = seq(4), seq(40), seq(40)
    started(scheduler, a)
    for s in (leader, follower):
        scheduler.add(s)
    while scheduler.can_admit():
        scheduler.admit()
    assert follower.leader is leader
    assert scheduler.park() is follower
    assert scheduler.park() is leader
    assert follower.leader is None


async def collect(engine: BatchingEngine, prompt: str, **sampling: object) -> tuple[str, Chunk]:
    chunks = [c async for c in engine.submit(engine.tokenize(prompt), SamplingParams(**sampling))]  # type: ignore[arg-type]
    return "".join(c.text for c in chunks), chunks[-1]


def assert_bookkeeping_true(engine: BatchingEngine, backend: FakeBackend) -> None:
    """What the scheduler believes each idle slot holds is what the backend's memory holds."""
    for slot, tokens in enumerate(engine.scheduler.slot_tokens):
        assert len(tokens) == backend.held.get(slot, 0)


async def test_a_full_pool_drops_idle_prefix_caches_before_pausing_anyone() -> None:
    backend = FakeBackend(num_ctx=128, num_parallel=3, pool_size=100)
    engine = BatchingEngine(backend, max_batch_tokens=32, max_prefill_tokens=16)
    try:
        await collect(engine, "an earlier request of forty bytes long!!", max_tokens=20)
        assert sum(backend.held.values()) == 59
        prompts = ["first prompt", "second prompt!"]
        results = await asyncio.gather(*(collect(engine, p, max_tokens=25) for p in prompts))
        for prompt, (text, last) in zip(prompts, results, strict=True):
            assert text == FakeBackend.expected(len(prompt), 25) and last.finish_reason == "length"
        assert engine.num_evicted >= 1 and engine.num_parked == 0 and backend.num_full >= 1
        assert_bookkeeping_true(engine, backend)
    finally:
        engine.close()


async def test_sequences_outgrowing_the_pool_pause_and_finish_with_unchanged_output() -> None:
    backend = FakeBackend(num_ctx=256, num_parallel=6, pool_size=256)
    engine = BatchingEngine(backend, max_batch_tokens=64, max_prefill_tokens=32)
    try:
        prompts = [f"request number {i} " * (i + 1) for i in range(6)]
        results = await asyncio.gather(*(collect(engine, p, max_tokens=60, temperature=1.0, seed=i)
                                         for i, p in enumerate(prompts)))
        for seed, (prompt, (text, last)) in enumerate(zip(prompts, results, strict=True)):
            assert text == FakeBackend.expected(len(prompt), 60, seed)  # the sampler goes on where it was
            assert last.finish_reason == "length"
            assert last.usage is not None
            assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), 60)
        assert engine.num_parked >= 1
        assert engine.num_running == 0 and not engine.scheduler.waiting
        assert_bookkeeping_true(engine, backend)
    finally:
        engine.close()


async def test_a_paused_sequence_keeps_its_stop_strings_and_drafts_working() -> None:
    backend = FakeBackend(num_ctx=200, num_parallel=4, pool_size=200)
    engine = BatchingEngine(backend, max_batch_tokens=64, max_prefill_tokens=32, draft_max=4)
    try:
        prompts = [f"pool {i} " * 6 for i in range(4)]
        full = [FakeBackend.expected(len(p), 90) for p in prompts]
        stops = [text[70:74] for text in full]
        results = await asyncio.gather(*(collect(engine, p, max_tokens=90, stop=[stop])
                                         for p, stop in zip(prompts, stops, strict=True)))
        for text, stop, (got, last) in zip(full, stops, results, strict=True):
            assert got == text[: text.index(stop)] and last.finish_reason == "stop"
        assert engine.num_parked >= 1
        assert_bookkeeping_true(engine, backend)
    finally:
        engine.close()


async def test_a_sequence_that_does_not_fit_the_pool_alone_ends_with_length_and_the_engine_goes_on() -> None:
    backend = FakeBackend(num_ctx=128, num_parallel=2, pool_size=40)
    engine = BatchingEngine(backend, max_batch_tokens=32, max_prefill_tokens=16)
    try:
        text, last = await collect(engine, "twenty bytes prompt!", max_tokens=50)
        assert last.finish_reason == "length"
        assert text == FakeBackend.expected(20, len(text)) and 0 < len(text) < 50
        text, last = await collect(engine, "short", max_tokens=10)
        assert text == FakeBackend.expected(5, 10) and last.finish_reason == "length"
    finally:
        engine.close()


async def test_without_a_pool_limit_nothing_is_evicted_or_paused() -> None:
    engine = BatchingEngine(FakeBackend(num_ctx=256, num_parallel=4), max_batch_tokens=64, max_prefill_tokens=32)
    try:
        await asyncio.gather(*(collect(engine, f"prompt {i}", max_tokens=40) for i in range(6)))
        assert engine.num_evicted == engine.num_parked == 0
    finally:
        engine.close()
