"""Prompt-lookup drafting: what followed the latest earlier occurrence of the sequence's last n tokens, no longer
than the match it comes from."""

from __future__ import annotations

from lmserve.engine.slots.drafting import FIRST_DRAFT, NgramDrafter


def test_the_draft_is_what_followed_the_last_tokens_before() -> None:
    drafter = NgramDrafter([7, 8, 9, 1, 2, 3, 4, 5, 6, 9, 9, 7, 8, 9, 1, 2, 3], most=8)
    assert drafter.draft(10) == [4, 5, 6]  # "9 1 2 3" occurred at 2..5, matched for 6 tokens: 3 of 4 5 6 9


def test_the_longest_match_and_the_latest_occurrence_win() -> None:
    drafter = NgramDrafter([7, 1, 2, 3, 8, 0, 1, 2, 3, 6, 5, 0, 1, 2, 3], most=8)
    assert drafter.draft(10) == [6]  # "0 1 2 3" (n=4) beats the later "1 2 3"; matched for 4 tokens only: 1 drafted
    drafter = NgramDrafter([1, 2, 3, 8, 1, 2, 3, 9, 1, 2, 3], most=8)
    assert drafter.draft(10) == [9]  # the latest "1 2 3" before the end is at 4..6 (then 9), not 0..2


def test_a_draft_is_as_long_as_the_match_behind_it() -> None:
    text = list(range(100, 130))
    assert NgramDrafter([*text, 5, *text[:4]], most=16).draft(16) == [104]  # a chance match: one token
    assert NgramDrafter([*text, 5, *text[:6]], most=16).draft(16) == [106, 107, 108]  # 6 matched: 3 drafted
    drafter = NgramDrafter([*text, 5, *text[:20]], most=16)
    drafter.length = 16
    assert drafter.draft(16) == [*text[20:30], 5, *text[:5]]  # copying: the whole cap


def test_no_earlier_occurrence_of_three_tokens_no_draft() -> None:
    assert NgramDrafter([1, 2, 3, 4, 5], most=8).draft(10) == []
    assert NgramDrafter([1, 2, 9, 1, 2], most=8).draft(10) == []  # two tokens are too weak a match
    assert NgramDrafter([5], most=8).draft(10) == []


def test_the_draft_follows_the_tokens_added_later() -> None:
    drafter = NgramDrafter([10, 11, 12, 13, 14], most=8)
    assert drafter.draft(10) == []
    drafter.extend([20, 10, 11, 12, 13, 14, 20])
    assert drafter.draft(10) == [10, 11, 12]
    assert drafter.size == 12


def test_the_limit_and_the_cap_bound_the_draft() -> None:
    drafter = NgramDrafter([*range(20), *range(5)], most=2)
    assert drafter.draft(10) == [5, 6]
    assert drafter.draft(1) == [5]
    assert drafter.draft(0) == []


def test_the_length_doubles_on_full_acceptance_and_shrinks_after_a_miss() -> None:
    drafter = NgramDrafter([], most=16)
    assert drafter.length == FIRST_DRAFT
    drafter.accepted(4, 4)
    assert drafter.length == 8
    drafter.accepted(8, 8)
    drafter.accepted(16, 16)
    assert drafter.length == 16  # capped
    drafter.accepted(16, 2)
    assert drafter.length == 3
    drafter.accepted(3, 0)
    assert drafter.length == 1
    drafter.accepted(0, 0)
    assert drafter.length == 1  # nothing drafted: nothing learned


def test_drafts_rejected_from_their_first_token_pause_drafting_longer_each_time() -> None:
    drafter = NgramDrafter([0, 1, 2, 3, 4, 5, 0, 1, 2, 3], most=8)
    pauses = []
    for _ in range(4):
        drafter.accepted(drafter.length, 0)
        skipped = 0
        while not drafter.draft(10):
            skipped += 1
        pauses.append(skipped)
    assert pauses == [1, 2, 4, 8]
    drafter.accepted(drafter.length, 1)  # an accepted token ends the backing off
    drafter.accepted(drafter.length, 0)
    assert drafter.draft(10) == [] and drafter.draft(10) == [4]
