"""The scheduler admits in order, decodes every running sequence each step, and prefills in chunks."""

from __future__ import annotations

import pytest

from lmserve.engine.protocol import PromptImage
from lmserve.engine.slots.phases import Phase
from lmserve.engine.slots.scheduler import BACKGROUND_ROWS, RECENT_S, SPREAD_REUSE, Scheduler
from lmserve.engine.slots.sequence import Sequence
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
    scheduler.add(decoding)
    scheduler.add(long)
    admit_all(scheduler)
    scheduler.prefilled(decoding, 4)
    decoding.output = [7]

    chunks = []
    for _ in range(3):
        plan = scheduler.schedule()
        entries = {s is long: e for s, e in plan}
        assert entries[False].tokens == [7]  # the running stream decodes in every step
        assert entries[False].pos == 4
        chunk = entries[True]
        chunks.append((chunk.pos, len(chunk.tokens), chunk.wants_sample))
        scheduler.prefilled(long, len(chunk.tokens))
    assert chunks == [(0, 10, False), (10, 10, False), (20, 5, True)]


def test_decode_position_follows_generated_tokens() -> None:
    scheduler = Scheduler(num_slots=1, max_batch_tokens=8, max_prefill_tokens=8)
    s = seq(5)
    scheduler.add(s)
    admit_all(scheduler)
    scheduler.prefilled(s, 5)
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


@pytest.mark.parametrize(("held", "prompt", "expected"), [
    # a prompt keeping most of a slot's tokens takes it (the next turn of that conversation)
    ([[1, 2, 3, 4], [], [1, 2, 7, 7]], [1, 2, 3, 4, 5], (0, 4)),
    # a short match (the template's first tokens) never takes a slot holding a long prefix: an empty slot does
    ([[1, 2, 3, 4, 5, 6], [], [1, 9, 9, 9, 9, 9]], [1, 8, 8], (1, 0)),
    # a prompt the slot holds whole (a repeated request) takes it, however much more the slot holds
    ([[1, 2, 3, 4, 5, 6], [], [1, 9, 9, 9, 9, 9]], [1, 2, 3], (0, 2)),
    # no empty slot: the least recently freed one (the first in the free list)
    ([[1, 2, 3, 4, 5, 6], [1, 9, 9, 9, 9, 9], [1, 7, 7, 7, 7, 7]], [1, 8, 8], (2, 1)),
])
def test_a_slot_is_reused_only_when_the_prompt_keeps_enough_of_it(
    held: list[list[int]], prompt: list[int], expected: tuple[int, int]
) -> None:
    scheduler = Scheduler(num_slots=3, max_batch_tokens=64, max_prefill_tokens=64, slot_similarity=0.5)
    scheduler.slot_tokens = held
    s = Sequence(prompt=prompt, sampling=SamplingParams(), max_new_tokens=4)
    scheduler.add(s)
    scheduler.admit()
    assert (s.slot, s.num_cached) == expected
    assert s.evicts == held[s.slot]


def test_two_users_taking_turns_on_two_slots_keep_their_own_slot() -> None:
    scheduler = Scheduler(num_slots=2, max_batch_tokens=64, max_prefill_tokens=64)
    chats = {"a": [1, 10, 11, 12, 13], "b": [1, 20, 21, 22, 23]}
    slots: dict[str, list[int]] = {}
    for _ in range(3):
        for name, prompt in chats.items():
            s = Sequence(prompt=list(prompt), sampling=SamplingParams(), max_new_tokens=4)
            scheduler.add(s)
            scheduler.admit()
            slots.setdefault(name, []).append(s.slot)
            scheduler.reused(s, s.num_cached)
            scheduler.prefilled(s, len(s.prompt) - s.num_prefilled)
            s.output = [99, 98]
            scheduler.remove(s)
            prompt += [99, 5]
    assert slots == {"a": [0, 0, 0], "b": [1, 1, 1]}


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
    scheduler.prefilled(s, 3)
    s.output = [10, 11, 12]
    scheduler.remove(s)
    assert scheduler.slot_tokens[0] == [0, 1, 2, 10, 11]


def image_seq(layout: list[int | str]) -> Sequence:
    """A prompt from a layout: an int is that many text tokens, "imgN" an image of N positions."""
    prompt: list[int] = []
    images: list[PromptImage] = []
    for part in layout:
        if isinstance(part, int):
            prompt += range(100, 100 + part)
        else:
            length = int(part.removeprefix("img"))
            images.append(PromptImage(len(prompt), length, handle=part))
            prompt += [-5] * length
    return Sequence(prompt=prompt, sampling=SamplingParams(), max_new_tokens=4, images=images)


def prefill_plan(scheduler: Scheduler, s: Sequence) -> list[tuple[int, int, bool, bool]]:
    """Run the prefill to the end: (pos, positions, is image, wants sample) per step."""
    steps = []
    while s.phase is Phase.PREFILLING:
        (entry,) = [e for q, e in scheduler.schedule() if q is s]
        steps.append((entry.pos, entry.num_positions, entry.image is not None, entry.wants_sample))
        scheduler.prefilled(s, entry.num_positions)
    return steps


def test_an_image_is_prefilled_whole_in_a_step_of_its_own() -> None:
    scheduler = Scheduler(num_slots=1, max_batch_tokens=64, max_prefill_tokens=8)
    s = image_seq([5, "img12", 10])
    scheduler.add(s)
    admit_all(scheduler)
    # Text stops at the image; the image goes whole even over the budget (it is the step's first prefill).
    assert prefill_plan(scheduler, s) == [(0, 5, False, False), (5, 12, True, False), (17, 8, False, False),
                                          (25, 2, False, True)]


def test_an_image_over_the_remaining_budget_waits_for_the_next_step() -> None:
    scheduler = Scheduler(num_slots=2, max_batch_tokens=64, max_prefill_tokens=16)
    text, image = seq(10), image_seq(["img12", 3])
    for s in (text, image):
        scheduler.add(s)
    admit_all(scheduler)
    plan = scheduler.schedule()
    assert [(q is text, e.num_positions) for q, e in plan] == [(True, 10)]  # 10 + 12 > 16: the image waits
    scheduler.prefilled(text, 10)
    text.output = [1]
    plan = scheduler.schedule()
    assert [(q is image, e.image is not None) for q, e in plan] == [(False, False), (True, True)]


def test_a_reused_prefix_never_ends_inside_an_image() -> None:
    scheduler = Scheduler(num_slots=1, max_batch_tokens=64, max_prefill_tokens=64)
    first = image_seq([4, "img8", 2])
    scheduler.add(first)
    admit_all(scheduler)
    scheduler.prefilled(first, len(first.prompt))
    scheduler.remove(first)
    # Same text and image, then different text: the whole image is reusable.
    again = image_seq([4, "img8", 1])
    again.prompt[-1] = 7
    scheduler.add(again)
    admit_all(scheduler)
    assert again.num_cached == 12
    # A slot holding only part of an image (cut memory) reuses up to the image's start.
    scheduler.remove(again)
    scheduler.slot_tokens[again.slot] = again.prompt[:9]
    third = image_seq([4, "img8", 3])
    scheduler.add(third)
    admit_all(scheduler)
    assert third.num_cached == 4


def sharing(num_slots: int = 4) -> Scheduler:
    return Scheduler(num_slots=num_slots, max_batch_tokens=512, max_prefill_tokens=512, can_copy=True, min_share=4)


def test_a_longer_prefix_held_by_another_slot_is_copied() -> None:
    scheduler = sharing()
    busy = seq(40)  # still running, its slot holds 40 prompt tokens and 2 decoded ones
    scheduler.add(busy)
    admit_all(scheduler)
    scheduler.prefilled(busy, 40)
    busy.output = [7, 8, 9]
    follow_up = Sequence(prompt=[*busy.prompt, 7, 8, 5], sampling=SamplingParams(), max_new_tokens=4)
    scheduler.add(follow_up)
    admit_all(scheduler)
    assert follow_up.slot != busy.slot
    assert (follow_up.copy_from, follow_up.copy_len) == (busy.slot, 42)
    short = Sequence(prompt=[*busy.prompt[:3], 1], sampling=SamplingParams(), max_new_tokens=4)
    scheduler.add(short)
    admit_all(scheduler)
    assert short.copy_from == -1  # 3 shared tokens are not worth a copy (min_share 4)


def test_followers_wait_for_a_leader_prefilling_their_shared_prefix_then_copy_it() -> None:
    scheduler = sharing()
    system = list(range(100))
    users = [Sequence(prompt=[*system, 1000 + i, 2000 + i], sampling=SamplingParams(), max_new_tokens=4)
             for i in range(3)]
    for s in users:
        scheduler.add(s)
    admit_all(scheduler)
    leader, *followers = users
    assert all(f.leader is leader and f.share_len == 100 for f in followers)
    plan = scheduler.schedule()
    assert [s for s, _ in plan] == [leader]  # followers compute nothing meanwhile
    assert scheduler.ready_shares() == []
    scheduler.prefilled(leader, 100)
    assert scheduler.ready_shares() == [(f, leader.slot, 100) for f in followers]
    for f in followers:
        scheduler.reused(f, 100)
    plan = scheduler.schedule()
    assert sorted(len(e.tokens) for _, e in plan) == [2, 2, 2]  # only each user's own tail is left


def test_a_follower_whose_leader_left_early_prefills_alone() -> None:
    scheduler = sharing()
    system = list(range(100))
    leader = Sequence(prompt=[*system, 1], sampling=SamplingParams(), max_new_tokens=4)
    follower = Sequence(prompt=[*system, 2], sampling=SamplingParams(), max_new_tokens=4)
    scheduler.add(leader)
    scheduler.add(follower)
    admit_all(scheduler)
    scheduler.prefilled(leader, 30)
    scheduler.remove(leader)  # aborted after 30 tokens: its slot holds too little to copy
    assert scheduler.ready_shares() == []
    assert follower.leader is None
    assert [s for s, _ in scheduler.schedule()] == [follower]


def test_without_copies_nothing_is_shared() -> None:
    scheduler = Scheduler(num_slots=4, max_batch_tokens=512, max_prefill_tokens=512)
    a, b = seq(100), seq(100)
    scheduler.add(a)
    scheduler.add(b)
    admit_all(scheduler)
    assert b.leader is None and b.copy_from == -1


def test_prefill_pauses_at_a_checkpoint() -> None:
    scheduler = Scheduler(num_slots=1, max_batch_tokens=64, max_prefill_tokens=64, can_snapshot=True)
    s = seq(50)
    s.checkpoints = [20]
    scheduler.add(s)
    admit_all(scheduler)
    assert prefill_plan(scheduler, s) == [(0, 20, False, False), (20, 30, False, True)]


def test_without_copies_followers_wait_for_a_leaders_checkpoint() -> None:
    scheduler = Scheduler(num_slots=4, max_batch_tokens=512, max_prefill_tokens=512, can_snapshot=True, min_share=4)
    system = list(range(100))
    leader = Sequence(prompt=[*system, 1, 2], sampling=SamplingParams(), max_new_tokens=4, checkpoints=[100])
    follower = Sequence(prompt=[*system, 3, 4], sampling=SamplingParams(), max_new_tokens=4, checkpoints=[100])
    stranger = Sequence(prompt=[7, *system], sampling=SamplingParams(), max_new_tokens=4)
    for s in (leader, follower, stranger):
        scheduler.add(s)
    admit_all(scheduler)
    assert (follower.leader, follower.share_len) == (leader, 100)
    assert stranger.leader is None
    assert {s for s, _ in scheduler.schedule()} == {leader, stranger}
    scheduler.prefilled(leader, 100)
    assert scheduler.ready_shares() == [(follower, leader.slot, 100)]


def test_a_sequence_waits_prefills_decodes_and_finishes() -> None:
    scheduler = Scheduler(num_slots=1, max_batch_tokens=64, max_prefill_tokens=4)
    s = seq(6)
    scheduler.add(s)
    assert s.phase is Phase.WAITING
    admit_all(scheduler)
    assert s.phase is Phase.PREFILLING
    scheduler.prefilled(s, 4)
    assert s.phase is Phase.PREFILLING
    scheduler.prefilled(s, 2)
    assert s.phase is Phase.DECODING
    scheduler.remove(s)
    assert s.phase is Phase.FINISHED


def test_a_follower_prefills_once_its_leader_holds_the_shared_prefix() -> None:
    scheduler = sharing()
    system = list(range(100))
    leader, follower = (Sequence(prompt=[*system, i], sampling=SamplingParams(), max_new_tokens=4) for i in (1, 2))
    for s in (leader, follower):
        scheduler.add(s)
    admit_all(scheduler)
    assert (leader.phase, follower.phase) == (Phase.PREFILLING, Phase.FOLLOWING)
    scheduler.prefilled(leader, 100)
    scheduler.ready_shares()
    assert follower.phase is Phase.PREFILLING and follower.leader is None


def test_choices_fork_from_the_first_or_prefill_alone_when_it_leaves() -> None:
    scheduler = Scheduler(num_slots=3, max_batch_tokens=64, max_prefill_tokens=64)
    first, forked, orphan = seq(8), seq(8), seq(8)
    for s in (first, forked, orphan):
        s.fork_of = first if s is not first else None
        scheduler.add(s)
    admit_all(scheduler)
    assert [s.phase for s in (first, forked, orphan)] == [Phase.PREFILLING, Phase.FORKING, Phase.FORKING]
    assert scheduler.forks(first) == [forked, orphan]
    scheduler.forked(forked)
    assert forked.phase is Phase.DECODING and forked.num_prefilled == 8
    scheduler.remove(first)
    assert orphan.phase is Phase.PREFILLING and orphan.fork_of is None


def test_a_parked_sequence_prefills_again_when_it_resumes() -> None:
    scheduler = Scheduler(num_slots=2, max_batch_tokens=64, max_prefill_tokens=64)
    a, b = seq(4), seq(4)
    for s in (a, b):
        scheduler.add(s)
    admit_all(scheduler)
    for s in (a, b):
        scheduler.prefilled(s, 4)
        s.output = [9]
    assert scheduler.park() is b
    assert b.phase is Phase.PARKED
    scheduler.remove(a)
    assert b.phase is Phase.PREFILLING


def test_an_illegal_move_raises_naming_both_phases() -> None:
    s = seq(4)
    with pytest.raises(AssertionError, match="from WAITING to DECODING"):
        s.move(Phase.DECODING)
    scheduler = Scheduler(num_slots=1, max_batch_tokens=64, max_prefill_tokens=64)
    scheduler.add(s)
    scheduler.remove(s)
    with pytest.raises(AssertionError, match="from FINISHED to PREFILLING"):
        s.move(Phase.PREFILLING)


# ---- priority ----------------------------------------------------------------------------------------------------


def ranked(num_prompt: int, priority: int) -> Sequence:
    return Sequence(prompt=list(range(num_prompt)), sampling=SamplingParams(priority=priority), max_new_tokens=16)


def test_the_waiting_queue_is_in_priority_order_and_first_come_first_served_within_one() -> None:
    scheduler = Scheduler(num_slots=1, max_batch_tokens=64, max_prefill_tokens=64)
    low1, high, low2, normal = ranked(3, 1000), ranked(3, -5), ranked(3, 1000), ranked(3, 0)
    for s in (low1, high, low2, normal):
        scheduler.add(s)
    assert list(scheduler.waiting) == [high, normal, low1, low2]


@pytest.mark.parametrize(
    ("running", "waiting", "preempted"),
    [
        ((1000, 1000), 0, 1),  # the newest of the lowest
        ((5, 1000), 0, 1),  # the lowest, not the newest
        ((1000, 5), 0, 0),
        ((0, 0), 0, None),  # the same priority waits its turn
        ((0, 5), 10, None),  # a lower priority never preempts
    ],
)
def test_a_waiting_sequence_preempts_the_lowest_running_below_it_when_no_slot_is_free(
    running: tuple[int, int], waiting: int, preempted: int | None,
) -> None:
    scheduler = Scheduler(num_slots=2, max_batch_tokens=64, max_prefill_tokens=64)
    seqs = [ranked(3, priority) for priority in running]
    for s in seqs:
        scheduler.add(s)
    admit_all(scheduler)
    scheduler.add(ranked(3, waiting))
    victim = scheduler.preemptible()
    assert victim is (seqs[preempted] if preempted is not None else None)


def test_no_preemption_while_a_slot_is_free() -> None:
    scheduler = Scheduler(num_slots=2, max_batch_tokens=64, max_prefill_tokens=64)
    low = ranked(3, 1000)
    scheduler.add(low)
    admit_all(scheduler)
    scheduler.add(ranked(3, 0))
    assert scheduler.preemptible() is None


def test_a_preempted_sequence_waits_first_among_its_priority_and_prefills_its_output_when_it_returns() -> None:
    scheduler = Scheduler(num_slots=1, max_batch_tokens=64, max_prefill_tokens=64)
    low, later_low = ranked(6, 1000), ranked(4, 1000)
    scheduler.add(low)
    admit_all(scheduler)
    scheduler.prefilled(low, 6)
    low.output = [40, 41, 42]  # 40 and 41 are in the slot, 42 is pending
    scheduler.add(later_low)
    high = ranked(5, 0)
    scheduler.add(high)
    slot = low.slot
    assert scheduler.preemptible() is low
    scheduler.preempt(low)
    assert low.phase is Phase.WAITING and low.slot == -1
    assert list(scheduler.waiting) == [high, low, later_low]
    assert scheduler.slot_tokens[slot] == [*range(6), 40, 41]  # a prefix cache like any freed slot's
    assert low.prefill_tokens == [*range(6), 40, 41, 42]
    admit_all(scheduler)
    assert scheduler.running == [high]
    scheduler.remove(high)
    admit_all(scheduler)
    assert scheduler.running == [low]
    plan = scheduler.schedule()
    [(planned, entry)] = plan
    assert planned is low and entry.tokens == low.prefill_tokens[low.num_prefilled:] and entry.wants_sample
    assert scheduler.prefilled(low, len(entry.tokens)) is True
    assert low.phase is Phase.DECODING and low.output == [40, 41, 42]


def test_lower_priority_work_waits_while_a_higher_priority_prompt_prefills() -> None:
    scheduler = Scheduler(num_slots=3, max_batch_tokens=64, max_prefill_tokens=8)
    batch_decoding, batch_prefilling = ranked(4, 1000), ranked(30, 1000)
    for s in (batch_decoding, batch_prefilling):
        scheduler.add(s)
    admit_all(scheduler)
    scheduler.prefilled(batch_decoding, 4)
    batch_decoding.output = [9]
    interactive = ranked(20, 0)
    scheduler.add(interactive)
    admit_all(scheduler)
    plan = scheduler.schedule()
    assert [s for s, _ in plan] == [interactive]
    assert len(plan[0][1].tokens) == 8
    scheduler.prefilled(interactive, 20)  # done: the batch runs again, a little beside the user's stream
    interactive.output = [1]
    plan = scheduler.schedule()
    assert interactive in [s for s, _ in plan]
    assert sum(len(e.tokens) for s, e in plan if s is not interactive) == BACKGROUND_ROWS


def test_a_reuse_limit_caps_the_prefix_taken_from_a_slot_and_from_copies() -> None:
    scheduler = Scheduler(num_slots=2, max_batch_tokens=64, max_prefill_tokens=64, can_copy=True)
    scheduler.slot_tokens = [[1, 2, 3, 4, 5, 9], [1, 2, 3, 4, 5, 6, 7]]
    s = Sequence(prompt=[1, 2, 3, 4, 5, 6, 8], sampling=SamplingParams(reuse_limit=3), max_new_tokens=1)
    scheduler.add(s)
    scheduler.admit()
    assert s.num_cached == 3 and s.copy_len <= 3  # slot 1 holds 6 of its tokens: it may take 3


def test_with_a_reuse_limit_a_prefix_past_a_checkpoint_is_cut_back_to_the_last_checkpoint_it_reaches() -> None:
    prompt = list(range(1, 31))
    judged = Sequence(prompt=prompt, sampling=SamplingParams(reuse_limit=20), max_new_tokens=1, checkpoints=[10, 20])
    assert [judged.reusable(n) for n in (5, 10, 15, 19, 20, 25)] == [5, 10, 10, 10, 20, 20]
    chat = Sequence(prompt=prompt, sampling=SamplingParams(), max_new_tokens=1, checkpoints=[10, 20])
    assert [chat.reusable(n) for n in (15, 25, 40)] == [15, 25, 29]  # a chat's checkpoints only pause prefill


def test_a_judged_sequence_copies_a_prefix_only_up_to_a_checkpoint_and_prefills_each_stretch_alone() -> None:
    scheduler = Scheduler(num_slots=2, max_batch_tokens=64, max_prefill_tokens=64, can_copy=True, min_share=2)
    scheduler.slot_tokens = [[], [*range(1, 16), 99]]  # the input and part of the opening: 15 tokens in common
    s = Sequence(prompt=list(range(1, 31)), sampling=SamplingParams(reuse_limit=20), max_new_tokens=1,
                 checkpoints=[10, 20])
    scheduler.add(s)
    scheduler.admit()
    assert (s.slot, s.num_cached) == (1, 10)  # cut back to the input's end, never into the opening
    scheduler.reused(s, 10)
    starts = []
    while s.phase is Phase.PREFILLING:
        [(seq, entry)] = scheduler.schedule()
        starts.append((entry.pos, len(entry.tokens)))
        scheduler.prefilled(seq, len(entry.tokens))
    assert starts == [(10, 10), (20, 10)]  # the opening in one piece, then the question's own tokens


@pytest.mark.parametrize(("recently", "priorities", "chunks"), [
    (False, (10, 10), [256]),  # a batch alone, no user for a while: prefills at full speed
    (True, (10, 10), [BACKGROUND_ROWS]),  # a user was just served: the batch's share of a step is small
    (True, (0, 10), [256]),  # the user's own prompt prefills first, the batch's waits for it
    (True, (0,), [256]),
])
def test_a_batch_prefills_little_per_step_soon_after_an_interactive_request_so_the_next_one_waits_little(
        recently: bool, priorities: tuple[int, ...], chunks: list[int]) -> None:
    scheduler = Scheduler(num_slots=2, max_batch_tokens=512, max_prefill_tokens=256)
    if recently:
        scheduler.add(ranked(3, 0))
        admit_all(scheduler)
        scheduler.schedule()
        scheduler.remove(scheduler.running[0])
    for priority in priorities:
        scheduler.add(ranked(1000, priority))
    admit_all(scheduler)
    assert [len(entry.tokens) for _, entry in scheduler.schedule()] == chunks


def decoding_batch(scheduler: Scheduler, priorities: list[int]) -> list[Sequence]:
    """Sequences of `priorities`, admitted in that order, their prompts in, each with a token to decode next."""
    seqs = [ranked(3, priority) for priority in priorities]
    for s in seqs:
        scheduler.add(s)
    admit_all(scheduler)
    for s in seqs:
        scheduler.prefilled(s, 3)
        s.output = [7]
    return seqs


def test_while_a_user_decodes_the_batch_gets_a_few_tokens_a_step_for_its_oldest_lines() -> None:
    scheduler = Scheduler(num_slots=8, max_batch_tokens=64, max_prefill_tokens=64)
    user, *batch = decoding_batch(scheduler, [0, 10, 10, 10, 10, 10])
    for s in batch:
        s.draft = [5, 5, 5]  # a drafted line's tokens count among the few too
    plan = dict(scheduler.schedule())
    assert len(plan[user].tokens) == 1  # the user decodes every step
    assert sum(len(plan[s].tokens) for s in batch if s in plan) == BACKGROUND_ROWS
    assert all(s in plan for s in batch[:BACKGROUND_ROWS])  # the oldest lines first: they finish one by one
    scheduler.remove(batch[0])
    late = ranked(30, 10)
    scheduler.add(late)
    admit_all(scheduler)
    plan = dict(scheduler.schedule())
    assert late not in plan and batch[1] in plan  # a new line's prompt waits for the older lines


def test_a_batch_alone_decodes_every_line_every_step() -> None:
    scheduler = Scheduler(num_slots=8, max_batch_tokens=64, max_prefill_tokens=64)
    batch = decoding_batch(scheduler, [10] * 6)
    assert {s for s, _ in scheduler.schedule()} == set(batch)


def test_the_batch_takes_whole_steps_again_once_no_user_was_served_for_recent_seconds() -> None:
    clock = [100.0]
    scheduler = Scheduler(num_slots=2, max_batch_tokens=64, max_prefill_tokens=64, clock=lambda: clock[0])
    scheduler.add(ranked(3, 0))
    admit_all(scheduler)
    scheduler.schedule()
    scheduler.remove(scheduler.running[0])
    scheduler.add(ranked(100_000, 10))
    admit_all(scheduler)
    sizes = []
    for clock[0] in (100.0, 100.0 + RECENT_S / 2, 100.0 + RECENT_S):
        sizes.append(len(scheduler.schedule()[0][1].tokens))
    assert sizes == [BACKGROUND_ROWS, BACKGROUND_ROWS, 64]


@pytest.mark.parametrize("others_run", [False, True])
@pytest.mark.parametrize("length", [SPREAD_REUSE - 8, SPREAD_REUSE + 8])
def test_a_short_prefix_does_not_spread_the_running_slots(others_run: bool, length: int) -> None:
    """Alone, a prompt takes the slot holding its prefix wherever it is; while another sequence runs on slot 0, a slot
    further away than a free neighbour is taken only for SPREAD_REUSE tokens or more (llama.cpp's step costs the range
    of slots it touches), else the nearest slot."""
    scheduler = Scheduler(4, 512, 256)
    prompt = list(range(1, length + 1))
    if others_run:
        scheduler.add(seq(4))
        scheduler.admit()
    scheduler.slot_tokens[3] = prompt + list(range(500, 700))  # slot 3: the prompt, then its reply
    s = Sequence(prompt=prompt, sampling=SamplingParams(), max_new_tokens=4)
    scheduler.add(s)
    scheduler.admit()
    spread = others_run and length < SPREAD_REUSE
    assert (s.slot, s.num_cached) == ((1, 0) if spread else (3, length - 1))
