"""The phases of a sequence's life in the scheduler (engine/slots/scheduler.py), and the moves between them."""

from __future__ import annotations

from enum import Enum


class Phase(Enum):
    """Where a sequence is in its life; only a prefilling or decoding sequence puts tokens in a step."""

    WAITING = "waiting"
    """Queued for a free slot (again, after a preemption)."""
    PREFILLING = "prefilling"
    """In a slot, computing its prompt (and after a park, its output so far) chunk by chunk."""
    FOLLOWING = "following"
    """In a slot, waiting for `leader` to hold the first `share_len` tokens of its prompt, to copy them."""
    FORKING = "forking"
    """In a slot, waiting for `fork_of` (another choice of its prompt) to prefill it, to be forked from it."""
    DECODING = "decoding"
    """Its prompt is prefilled: one token (and its draft) per step."""
    PARKED = "parked"
    """Its memory was dropped to make room in a shared KV pool; it keeps its slot and waits to prefill again."""
    FINISHED = "finished"
    """Out of the scheduler (ended or aborted)."""


MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.WAITING: frozenset({Phase.PREFILLING, Phase.FOLLOWING, Phase.FORKING, Phase.FINISHED}),
    Phase.PREFILLING: frozenset({Phase.DECODING, Phase.PARKED, Phase.WAITING, Phase.FINISHED}),
    Phase.FOLLOWING: frozenset({Phase.PREFILLING, Phase.PARKED, Phase.FINISHED}),
    Phase.FORKING: frozenset({Phase.DECODING, Phase.PREFILLING, Phase.FINISHED}),
    Phase.DECODING: frozenset({Phase.PARKED, Phase.WAITING, Phase.FINISHED}),
    Phase.PARKED: frozenset({Phase.PREFILLING, Phase.FINISHED}),
    Phase.FINISHED: frozenset(),
}
"""The phases each phase may move to."""
