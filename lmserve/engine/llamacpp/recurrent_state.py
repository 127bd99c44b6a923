"""Rewinding a hybrid or recurrent model's sequence after a rejected draft (speculative decoding).

Such a memory cannot be cut back to a position: its recurrent part (LFM2's short-convolution state) holds the effect
of every token decoded. What can be done instead: save the recurrent part alone before a drafted step (llama.cpp's
partial sequence state, a few tens of KiB, unlike a whole snapshot that grows with the context), and after a
rejection put it back and cut the attention part to the same position; the tokens the step did accept are then
decoded again. Measured (bench/hybrid_drafting.py) to keep about 97% of a cuttable model's gain on a reply that
copies its context, and to cost 5-7% on free writing.
"""

from __future__ import annotations

import ctypes
from typing import Any

import llama_cpp as lc

from lmserve.engine.llamacpp import batch_rows
from lmserve.engine.slots.backend import PoolFull
from lmserve.errors import EngineFailure

PARTIAL = lc.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY


def save(ctx: lc.llama_context_p, seq: int) -> bytes:
    """The recurrent part of sequence `seq`'s memory state."""
    size = lc.llama_state_seq_get_size_ext(ctx, seq, PARTIAL)
    buf = (ctypes.c_uint8 * size)()
    written = lc.llama_state_seq_get_data_ext(ctx, buf, size, seq, PARTIAL)
    return ctypes.string_at(buf, written)


def rewind(ctx: lc.llama_context_p, seq: int, state: bytes, pos: int) -> bool:
    """Put back the recurrent part `state` (saved when the sequence held `pos` positions) and cut the attention part
    to `pos` positions; False when llama.cpp refuses either."""
    buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
    if lc.llama_state_seq_set_data_ext(ctx, buf, len(state), seq, PARTIAL) == 0:
        return False
    return bool(lc.llama_memory_seq_rm(lc.llama_get_memory(ctx), seq, pos, -1))


def redecode(ctx: lc.llama_context_p, batch: Any, capacity: int, redo: dict[int, tuple[int, list[int]]]) -> None:
    """Decode again what rewinds took back: for each slot of `redo`, (its position, the accepted tokens to decode
    there), every such slot in one batch (of at most `capacity` rows). Its logits are not needed: the next tokens
    were sampled in the drafted step. PoolFull when none of it finds room in a shared KV pool."""
    rows = [(slot, pos + i, token, False) for slot, (pos, tokens) in sorted(redo.items())
            for i, token in enumerate(tokens)]
    for start in range(0, len(rows), capacity):
        batch_rows.fill(batch, rows[start:start + capacity])
        rc = lc.llama_decode(ctx, batch)
        if rc == 1 and start == 0:  # nothing of it placed: the engine makes room and steps again
            raise PoolFull(f"no room to decode {len(rows)} rewound tokens again in the KV pool")
        if rc != 0:
            raise EngineFailure(f"llama_decode failed with code {rc} decoding rewound tokens again")
