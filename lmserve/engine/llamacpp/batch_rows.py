"""Writing rows into a llama.cpp batch: the one place that knows a `llama_batch`'s fields."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Row = tuple[int, int, int, bool]
"""(sequence id, position, token, whether llama.cpp keeps the logits after it)."""


def fill(batch: Any, rows: Sequence[Row]) -> None:
    """Write `rows` into `batch` (a llama_batch with room for them) and set its size."""
    for i, (seq, pos, token, logits) in enumerate(rows):
        batch.token[i] = token
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = logits
    batch.n_tokens = len(rows)
