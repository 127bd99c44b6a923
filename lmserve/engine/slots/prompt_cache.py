"""The prompt cache beyond the slots: saved sequence states of prompts, in RAM and on disk, shared by every engine.

A slot's memory is the fastest cache, but a server has fewer slots than open conversations. When a slot is about
to lose a prefix (another prompt takes it), the engine saves the slot's state here first (llama.cpp's sequence
state: the KV cells of that sequence, in the cache's own type, and a hybrid model's recurrent state); a later prompt
that starts with a saved prefix restores it into its slot and prefills only the rest (engine/slots/batching.py).

Entries are keyed by the model (`model_key`: the weights and the load options that change the state's layout) and
the tokens the state holds. A model whose memory can be cut reuses any common prefix of an entry: the state is
restored whole and cut to the shared length, so one entry per conversation serves every point of it, and an entry
that another extends is dropped. A hybrid model's state exists only for its last position: an entry serves a
prompt that starts with all of its tokens (snapshots at the end of prompts and checkpoints fill the gaps).

The RAM tier keeps the least recently used entries within `ram_bytes` (all models together, so it is one budget
the server can reclaim from when it loads a model). The disk tier (engine/slots/prompt_disk.py) keeps what is worth
keeping across an unload or a restart; it is written on a thread of its own and read on a miss in RAM.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

from lmserve.engine.slots.prompt_disk import DiskTier, SavedState

Tier = Literal["slot", "ram", "disk"]
TIERS: tuple[Tier, ...] = ("slot", "ram", "disk")


@dataclass(frozen=True, slots=True)
class Hit:
    """A saved state usable for a prompt: restore `state`, then keep `length` positions of it."""

    length: int
    state: SavedState
    tier: Tier


@dataclass(slots=True)
class CacheStats:
    """One model's prompt-cache counters since load (for /metrics)."""

    hits: dict[Tier, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    """Prompts that skipped a prefix, by where it came from."""
    tokens: dict[Tier, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    """Prompt tokens not computed again, by where they came from."""
    misses: int = 0
    """Prompts that found nothing to reuse."""


class PromptCache:
    """Saved prompt states: a RAM tier within `ram_bytes`, and a disk tier when one is given. Thread-safe."""

    def __init__(self, ram_bytes: int, disk: DiskTier | None = None) -> None:
        self.ram_budget = max(ram_bytes, 0)
        self.disk = disk if disk is not None and disk.budget_bytes > 0 else None
        self.num_bytes = 0
        """Bytes the RAM tier holds."""
        self._entries: OrderedDict[tuple[str, tuple[int, ...]], SavedState] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def is_enabled(self) -> bool:
        return self.ram_budget > 0 or self.disk is not None

    @property
    def disk_bytes(self) -> int:
        return self.disk.num_bytes if self.disk is not None else 0

    def num_entries(self, model_key: str | None = None) -> int:
        with self._lock:
            return sum(1 for key, _ in self._entries if model_key is None or key == model_key)

    def model_bytes(self, model_key: str) -> int:
        """RAM held by one model's entries."""
        with self._lock:
            return sum(len(state) for (key, _), state in self._entries.items() if key == model_key)

    def covers(self, model_key: str, tokens: list[int], can_cut: bool) -> bool:
        """Whether an entry already serves every prefix of `tokens` (so saving them again is useless)."""
        wanted = tuple(tokens)
        with self._lock:
            if (model_key, wanted) in self._entries:
                self._entries.move_to_end((model_key, wanted))
                return True
            return can_cut and any(key == model_key and held[: len(wanted)] == wanted for key, held in self._entries)

    def put(
        self, model_key: str, tokens: list[int], state: SavedState, *, can_cut: bool, persist: bool = False
    ) -> None:
        """Keep `state` as the memory after `tokens`; with `persist`, also on disk. The least recently used entries
        leave RAM beyond the budget; a cuttable model's entries that this one extends leave at once."""
        if not tokens:
            return
        held = tuple(tokens)
        if persist and self.disk is not None:
            self.disk.put(model_key, held, state)
            for covered in self.disk.keys(model_key) if can_cut else ():
                if len(covered) < len(held) and held[: len(covered)] == covered:
                    self.disk.remove(model_key, covered)
        if len(state) > self.ram_budget:
            return
        with self._lock:
            old = self._entries.pop((model_key, held), None)
            if old is not None:
                self.num_bytes -= len(old)
            if can_cut:
                for key in [k for k in self._entries if k[0] == model_key and held[: len(k[1])] == k[1]]:
                    self.num_bytes -= len(self._entries.pop(key))
            self._entries[(model_key, held)] = state
            self.num_bytes += len(state)
            self._shrink_to(self.ram_budget)

    def lookup(self, model_key: str, prompt: list[int], limit: int, can_cut: bool) -> Hit | None:
        """The saved state serving the longest prefix of `prompt` (at most `limit` positions): from RAM, or from
        disk when it holds a longer one (that entry is then kept in RAM too)."""
        best: Hit | None = None
        best_key: tuple[str, tuple[int, ...]] | None = None
        with self._lock:
            for key, state in self._entries.items():
                if key[0] == model_key:
                    length = _usable(key[1], prompt, limit, can_cut)
                    if length > 0 and (best is None or length > best.length):
                        best, best_key = Hit(length, state, "ram"), key
            if best_key is not None:
                self._entries.move_to_end(best_key)
        if self.disk is None:
            return best
        from_disk = max(((_usable(held, prompt, limit, can_cut), held) for held in self.disk.keys(model_key)),
                        default=(0, ()))
        if from_disk[0] > (best.length if best is not None else 0):
            loaded = self.disk.load(model_key, from_disk[1])
            if loaded is not None:
                self.put(model_key, list(from_disk[1]), loaded, can_cut=can_cut)
                return Hit(from_disk[0], loaded, "disk")
        return best

    def reclaim(self, num_bytes: int) -> int:
        """Drop least recently used RAM entries until `num_bytes` are freed (or none is left); the bytes freed."""
        with self._lock:
            before = self.num_bytes
            self._shrink_to(max(self.num_bytes - num_bytes, 0))
            return before - self.num_bytes

    def close(self) -> None:
        """Write what the disk tier still has queued, and stop its writer."""
        if self.disk is not None:
            self.disk.close()

    def _shrink_to(self, budget: int) -> None:
        while self.num_bytes > budget and self._entries:
            _, state = self._entries.popitem(last=False)
            self.num_bytes -= len(state)


def _usable(held: tuple[int, ...], prompt: list[int], limit: int, can_cut: bool) -> int:
    """How many positions of an entry holding `held` a prompt can keep (at most `limit`); 0: none."""
    if can_cut:
        n = min(len(held), limit)
        for i in range(n):
            if held[i] != prompt[i]:
                return i
        return n
    n = len(held)
    return n if n <= limit and tuple(prompt[:n]) == held else 0
