"""The prompt cache keeps saved states of prompts per model, least recently used first within its RAM budget, and
finds the one serving the longest prefix of a new prompt: any common prefix for a model whose memory can be cut,
whole entries only for one that cannot."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmserve.engine.slots.prompt_cache import PromptCache
from lmserve.engine.slots.prompt_disk import DiskTier

A, B = "model-a", "model-b"


@pytest.mark.parametrize(("can_cut", "prompt", "limit", "expected"), [
    (True, [1, 2, 3, 4, 5], 4, (4, b"long")),  # the longest entry, whole
    (True, [1, 2, 3, 9, 9], 4, (3, b"long")),  # a cuttable entry serves its common prefix
    (True, [1, 2, 3, 4, 5], 2, (2, b"short")),  # never past the limit
    (False, [1, 2, 3, 9, 9], 4, (2, b"short")),  # a hybrid's entry serves only prompts holding all of it
    (False, [1, 2, 3, 4, 5], 3, (2, b"short")),
    (False, [7, 1, 2], 2, None),
])
def test_the_entry_serving_the_longest_prefix_is_found(
    can_cut: bool, prompt: list[int], limit: int, expected: tuple[int, bytes] | None
) -> None:
    cache = PromptCache(100)
    cache.put(A, [1, 2], b"short", can_cut=False)
    cache.put(A, [1, 2, 3, 4], b"long", can_cut=False)
    cache.put(B, [1, 2, 3, 4, 5, 6], b"other model", can_cut=False)
    hit = cache.lookup(A, prompt, limit, can_cut)
    assert (hit.length, hit.state) == expected if hit is not None else expected is None
    assert hit is None or hit.tier == "ram"


def test_a_cuttable_models_entry_that_another_extends_is_dropped() -> None:
    cache = PromptCache(100)
    cache.put(A, [1, 2, 3], b"turn1", can_cut=True)
    cache.put(A, [1, 2, 3, 4, 5], b"turn2", can_cut=True)
    assert cache.num_entries(A) == 1 and cache.num_bytes == 5
    assert cache.covers(A, [1, 2, 3], can_cut=True)  # saving turn 1 again would be useless
    assert not cache.covers(A, [1, 2, 3], can_cut=False)
    assert not cache.covers(B, [1, 2, 3], can_cut=True)


def test_least_recently_used_entries_leave_first_when_over_budget() -> None:
    cache = PromptCache(10)
    cache.put(A, [1], b"xxxx", can_cut=True)
    cache.put(B, [2], b"yyyy", can_cut=True)
    assert cache.lookup(A, [1, 0], 1, True) is not None  # A's entry is now the most recent
    cache.put(A, [3], b"zzzz", can_cut=True)
    assert cache.num_bytes == 8 and cache.num_entries() == 2
    assert cache.lookup(B, [2, 0], 1, True) is None
    assert cache.lookup(A, [1, 0], 1, True) is not None


def test_reclaim_frees_the_bytes_asked_for_oldest_first() -> None:
    cache = PromptCache(100)
    for token in range(5):
        cache.put(A if token % 2 else B, [token], b"x" * 10, can_cut=True)
    assert cache.reclaim(15) == 20 and cache.num_bytes == 30
    assert cache.lookup(B, [0, 0], 1, True) is None and cache.lookup(A, [1, 0], 1, True) is None
    assert cache.num_entries() == 3 and cache.model_bytes(A) == 10


def test_a_state_larger_than_the_budget_is_not_kept_and_a_zero_budget_keeps_nothing() -> None:
    cache = PromptCache(3)
    cache.put(A, [1], b"four", can_cut=True)
    assert cache.num_entries() == 0
    off = PromptCache(0)
    off.put(A, [1], b"x", can_cut=True)
    assert not off.is_enabled and off.lookup(A, [1, 2], 1, True) is None


def test_a_persisted_entry_is_found_on_disk_by_a_new_cache_and_kept_in_ram_again(tmp_path: Path) -> None:
    first = PromptCache(100, DiskTier(tmp_path, 10_000))
    first.put(A, [1, 2, 3], b"state", can_cut=True, persist=True)
    first.put(A, [4, 5, 6], b"ram only", can_cut=True)
    first.close()
    again = PromptCache(100, DiskTier(tmp_path, 10_000))
    try:
        hit = again.lookup(A, [1, 2, 3, 7], 3, True)
        assert hit is not None and (hit.length, hit.state, hit.tier) == (3, b"state", "disk")
        assert again.lookup(A, [4, 5, 6, 7], 3, True) is None
        hit = again.lookup(A, [1, 2, 3, 7], 3, True)
        assert hit is not None and hit.tier == "ram"
        assert again.lookup(B, [1, 2, 3, 7], 3, True) is None
    finally:
        again.close()


def test_on_disk_an_entry_that_another_extends_is_removed_too(tmp_path: Path) -> None:
    cache = PromptCache(100, DiskTier(tmp_path, 10_000))
    cache.put(A, [1, 2, 3], b"turn1", can_cut=True, persist=True)
    cache.put(A, [1, 2, 3, 4, 5], b"turn2", can_cut=True, persist=True)
    cache.put(A, [1, 7], b"other", can_cut=True, persist=True)
    assert cache.disk is not None
    cache.disk.flush()
    assert sorted(cache.disk.keys(A)) == [(1, 2, 3, 4, 5), (1, 7)]
    cache.close()
