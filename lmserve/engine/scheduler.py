"""Continuous-batching scheduler: pure and synchronous, no threads, no llama.cpp.

Sequences wait in FIFO order for a free slot. Each step, every sequence that has finished its prompt
decodes one token, and the rest of the token budget goes to prompt prefill in chunks, oldest first, so
running streams keep producing tokens while a long prompt is processed.

A slot's memory outlives its sequence: the scheduler remembers which tokens each slot holds and gives a
new sequence the free slot sharing the longest prefix with its prompt, so that prefix is not computed
again (a multi-turn chat, or many requests with one system prompt).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from lmserve.engine.base import BatchEntry
from lmserve.types import SamplingParams


@dataclass(slots=True, eq=False)
class Sequence:
    """Engine-side state of one request."""

    prompt: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    special: bool = False
    slot: int = -1
    num_prefilled: int = 0
    num_cached: int = 0
    output: list[int] = field(default_factory=list)
    is_aborted: bool = False

    @property
    def is_prefilling(self) -> bool:
        return self.num_prefilled < len(self.prompt)

    @property
    def num_tokens(self) -> int:
        """Tokens in the slot's memory after this step's input (prompt + generated, minus the pending one)."""
        return len(self.prompt) + max(len(self.output) - 1, 0)


class Scheduler:
    """Decides which tokens of which sequences go into the next batch."""

    def __init__(self, num_slots: int, max_batch_tokens: int, max_prefill_tokens: int) -> None:
        if num_slots < 1 or max_batch_tokens < 1 or max_prefill_tokens < 1:
            raise ValueError("scheduler sizes must be positive")
        self.num_slots = num_slots
        self.max_batch_tokens = max_batch_tokens
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free_slots: list[int] = list(range(num_slots - 1, -1, -1))
        self.slot_tokens: list[list[int]] = [[] for _ in range(num_slots)]
        """Tokens whose state each slot's memory holds, position by position."""

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def can_admit(self) -> bool:
        return bool(self.waiting and self._free_slots)

    def admit(self) -> Sequence:
        """Move the oldest waiting sequence into the free slot holding the longest prefix of its prompt.

        `num_cached` is set to that prefix's length (at most all but the last prompt token, which must be
        decoded to get the next token's logits); the backend may still refuse to reuse it.
        """
        seq = self.waiting.popleft()
        best, best_len = len(self._free_slots) - 1, -1
        for i, slot in enumerate(self._free_slots):
            length = common_prefix_length(self.slot_tokens[slot], seq.prompt)
            if length > best_len:
                best, best_len = i, length
        seq.slot = self._free_slots.pop(best)
        seq.num_cached = min(best_len, len(seq.prompt) - 1)
        self.running.append(seq)
        return seq

    def reused(self, seq: Sequence, num_reused: int) -> None:
        """Record how much of the slot's memory the backend kept for `seq`."""
        seq.num_cached = seq.num_prefilled = num_reused
        self.slot_tokens[seq.slot] = seq.prompt[:num_reused]

    def forget(self, slot: int) -> None:
        """The slot's memory is no longer trusted (a failed decode): reuse nothing from it."""
        self.slot_tokens[slot] = []

    def remove(self, seq: Sequence) -> bool:
        """Take a sequence out (finished or aborted); return True when it held a slot to release."""
        if seq in self.waiting:
            self.waiting.remove(seq)
            return False
        if seq in self.running:
            self.running.remove(seq)
            self._free_slots.append(seq.slot)
            # Decoded so far: the prefilled prompt, then every output token but the last (sampled, not decoded).
            decoded = seq.output[:-1] if not seq.is_prefilling else []
            self.slot_tokens[seq.slot] = seq.prompt[: seq.num_prefilled] + decoded
            return True
        return False

    def schedule(self) -> list[tuple[Sequence, BatchEntry]]:
        """Plan one step: one token per decoding sequence, then prefill chunks within the budget."""
        plan: list[tuple[Sequence, BatchEntry]] = []
        budget = self.max_batch_tokens
        for seq in self.running:
            if not seq.is_prefilling and budget > 0:
                plan.append((seq, BatchEntry(seq.slot, [seq.output[-1]], seq.num_tokens, True)))
                budget -= 1
        budget = min(budget, self.max_prefill_tokens)
        for seq in self.running:
            if budget <= 0:
                break
            if seq.is_prefilling:
                start = seq.num_prefilled
                chunk = seq.prompt[start : start + budget]
                is_last = start + len(chunk) == len(seq.prompt)
                plan.append((seq, BatchEntry(seq.slot, chunk, start, is_last)))
                budget -= len(chunk)
        return plan


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
