"""Snapshots of a slot's memory at the end of a prompt, for models whose memory cannot be cut (hybrid LFM2).

Such a model's convolution state exists only for the last position, so a slot cannot be rolled back to a shorter
prefix. Instead the engine saves the slot's state when a prompt is fully prefilled, and a later prompt that starts
with that whole prompt (the next turn of the chat) restores it and prefills only what follows. Snapshots are kept
least-recently-used first within a byte budget.
"""

from __future__ import annotations

from collections import OrderedDict


class SnapshotCache:
    """Token prefix → saved state, LRU within `budget_bytes` (0 disables it)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[tuple[int, ...], bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, tokens: list[int], state: bytes) -> None:
        """Keep `state` as the memory after `tokens`, evicting the least recently used beyond the budget."""
        if not tokens or not self.budget_bytes or len(state) > self.budget_bytes:
            return
        key = tuple(tokens)
        old = self._entries.pop(key, None)
        if old is not None:
            self.num_bytes -= len(old)
        self._entries[key] = state
        self.num_bytes += len(state)
        while self.num_bytes > self.budget_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.num_bytes -= len(evicted)

    def longest_prefix(self, prompt: list[int], limit: int) -> tuple[int, bytes] | None:
        """The snapshot of the longest prefix of `prompt` no longer than `limit` tokens, as (length, state)."""
        best: tuple[int, ...] | None = None
        for key in self._entries:
            n = len(key)
            if n <= limit and (best is None or n > len(best)) and tuple(prompt[:n]) == key:
                best = key
        if best is None:
            return None
        self._entries.move_to_end(best)
        return len(best), self._entries[best]
