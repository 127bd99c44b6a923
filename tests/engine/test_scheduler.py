"""The scheduler admits in order, decodes every running sequence each step, and prefills in chunks."""

from __future__ import annotations

from lmserve.engine.scheduler import Scheduler, Sequence
from lmserve.types import SamplingParams


def seq(num_prompt: int) -> Sequence:
    return Sequence(prompt=list(range(num_prompt)), sampling=SamplingParams(), max_new_tokens=16)


def admit_all(scheduler: Scheduler) -> None:
    while scheduler.can_admit():
        scheduler.admit()


def test_admits_fifo_up_to_the_number_of_slots() -> None:
    scheduler = Scheduler(num_slots=2, max_batch_tokens=64, max_prefill_tokens=64)
    a, b, c = seq(3), seq(3), seq(3)
    for s in (a, b, c):
        scheduler.add(s)
    admit_all(scheduler)
    assert scheduler.running == [a, b]
    assert list(scheduler.waiting) == [c]
    assert {a.slot, b.slot} == {0, 1}


def test_a_removed_sequence_frees_its_slot_for_the_next() -> None:
    scheduler = Scheduler(num_slots=1, max_batch_tokens=64, max_prefill_tokens=64)
    a, b = seq(3), seq(3)
    scheduler.add(a)
    scheduler.add(b)
    admit_all(scheduler)
    assert scheduler.remove(a) is True
    admit_all(scheduler)
    assert scheduler.running == [b]
    assert b.slot == a.slot


def test_removing_a_waiting_sequence_releases_nothing() -> None:
    scheduler = Scheduler(num_slots=1, max_batch_tokens=64, max_prefill_tokens=64)
    a = seq(3)
    scheduler.add(a)
    assert scheduler.remove(a) is False
    assert not scheduler.has_work


def test_long_prompt_is_prefilled_in_chunks_while_others_decode() -> None:
    scheduler = Scheduler(num_slots=2, max_batch_tokens=64, max_prefill_tokens=10)
    decoding, long = seq(4), seq(25)
    decoding.num_prefilled = 4
    decoding.output = [7]
    scheduler.add(decoding)
    scheduler.add(long)
    admit_all(scheduler)

    chunks = []
    for _ in range(3):
        plan = scheduler.schedule()
        entries = {s is long: e for s, e in plan}
        assert entries[False].tokens == [7]  # the running stream decodes in every step
        assert entries[False].pos == 4
        chunk = entries[True]
        chunks.append((chunk.pos, len(chunk.tokens), chunk.wants_sample))
        long.num_prefilled += len(chunk.tokens)
    assert chunks == [(0, 10, False), (10, 10, False), (20, 5, True)]


def test_decode_position_follows_generated_tokens() -> None:
    scheduler = Scheduler(num_slots=1, max_batch_tokens=8, max_prefill_tokens=8)
    s = seq(5)
    scheduler.add(s)
    admit_all(scheduler)
    s.num_prefilled = 5
    s.output = [1, 2, 3]
    [(_, entry)] = scheduler.schedule()
    assert (entry.tokens, entry.pos, entry.wants_sample) == ([3], 7, True)


def test_batch_budget_is_never_exceeded() -> None:
    scheduler = Scheduler(num_slots=4, max_batch_tokens=12, max_prefill_tokens=100)
    for _ in range(4):
        scheduler.add(seq(9))
    admit_all(scheduler)
    plan = scheduler.schedule()
    assert sum(len(e.tokens) for _, e in plan) == 12


def test_a_new_sequence_gets_the_free_slot_holding_the_longest_prefix_of_its_prompt() -> None:
    scheduler = Scheduler(num_slots=3, max_batch_tokens=64, max_prefill_tokens=64)
    scheduler.slot_tokens = [[1, 2, 9], [1, 2, 3, 4, 5], [7]]
    s = Sequence(prompt=[1, 2, 3, 4, 6], sampling=SamplingParams(), max_new_tokens=4)
    scheduler.add(s)
    scheduler.admit()
    assert (s.slot, s.num_cached) == (1, 4)


def test_at_least_the_last_prompt_token_is_always_decoded() -> None:
    scheduler = Scheduler(num_slots=1, max_batch_tokens=64, max_prefill_tokens=64)
    scheduler.slot_tokens = [[1, 2, 3, 4]]
    s = Sequence(prompt=[1, 2, 3], sampling=SamplingParams(), max_new_tokens=4)
    scheduler.add(s)
    scheduler.admit()
    assert s.num_cached == 2


def test_a_finished_slot_remembers_the_tokens_it_decoded() -> None:
    scheduler = Scheduler(num_slots=1, max_batch_tokens=64, max_prefill_tokens=64)
    s = seq(3)
    scheduler.add(s)
    scheduler.admit()
    s.num_prefilled = 3
    s.output = [10, 11, 12]
    scheduler.remove(s)
    assert scheduler.slot_tokens[0] == [0, 1, 2, 10, 11]
