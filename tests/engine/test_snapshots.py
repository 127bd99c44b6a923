"""The snapshot cache keeps prompt-end states least-recently-used first within its byte budget."""

from __future__ import annotations

from lmserve.engine.snapshots import SnapshotCache


def test_the_longest_stored_prefix_of_a_prompt_is_found() -> None:
    cache = SnapshotCache(100)
    cache.put([1, 2], b"a")
    cache.put([1, 2, 3, 4], b"b")
    cache.put([1, 9, 9], b"c")
    assert cache.longest_prefix([1, 2, 3, 4, 5], limit=4) == (4, b"b")
    assert cache.longest_prefix([1, 2, 3, 4, 5], limit=3) == (2, b"a")  # never past the limit
    assert cache.longest_prefix([7, 1, 2], limit=3) is None


def test_least_recently_used_snapshots_go_first_when_over_budget() -> None:
    cache = SnapshotCache(10)
    cache.put([1], b"xxxx")
    cache.put([2], b"yyyy")
    assert cache.longest_prefix([1, 0], limit=1) == (1, b"xxxx")  # [1] is now the most recent
    cache.put([3], b"zzzz")
    assert cache.num_bytes == 8 and len(cache) == 2
    assert cache.longest_prefix([2, 0], limit=1) is None
    assert cache.longest_prefix([1, 0], limit=1) is not None


def test_a_snapshot_larger_than_the_budget_is_not_kept_and_a_zero_budget_keeps_nothing() -> None:
    cache = SnapshotCache(3)
    cache.put([1], b"four")
    assert len(cache) == 0
    off = SnapshotCache(0)
    off.put([1], b"")
    off.put([2], b"x")
    assert len(off) == 0 and off.longest_prefix([2, 3], limit=1) is None
