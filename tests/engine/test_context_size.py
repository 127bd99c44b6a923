"""The context rule both engines follow: what was asked for, capped at the trained length; or auto, sized from the
memory the weights leave and the KV cache each token costs, between the floor and the ceiling."""

from __future__ import annotations

import pytest

from lmserve.engine.context_size import ContextChoice, auto_context, choose_context, machine_memory
from lmserve.types import AUTO_CONTEXT, AUTO_CONTEXT_CEILING, AUTO_CONTEXT_FLOOR

GiB = 2**30
SMOLLM2_KV = 23040
"""SmolLM2-135M's KV cache per token at f16: 30 layers x 3 KV heads x (64 + 64) values x 2 bytes."""
LLAMA_8B_KV = 131072
"""A Llama-3-8B's: 32 layers x 8 KV heads x (128 + 128) values x 2 bytes."""
TINY_KV = 256


@pytest.mark.parametrize(
    ("memory", "trained", "kv_per_token", "slots", "expected"),
    [
        # a small model on this 24 GiB test machine: what it was trained for
        (24 * GiB, 8192, SMOLLM2_KV, 4, 8192),
        # a tiny model trained for 64k: all of it (a Claude Code prompt of ~30k tokens fits)
        (24 * GiB, 65536, TINY_KV, 4, 65536),
        # an 8B model: a quarter of 24 GiB holds 4 slots of 8k (2^12.6 x 4 x 128 KiB), not 16k
        (24 * GiB, 131072, LLAMA_8B_KV, 4, 8192),
        # ... one slot of 32k
        (24 * GiB, 131072, LLAMA_8B_KV, 1, 32768),
        # ... and on an 8 GiB machine the floor
        (8 * GiB, 131072, LLAMA_8B_KV, 4, AUTO_CONTEXT_FLOOR),
        # an 80 GiB GPU: 32k per slot for 4 slots
        (80 * GiB, 131072, LLAMA_8B_KV, 4, 32768),
        # no memory to speak of: the floor, never less
        (0, 131072, LLAMA_8B_KV, 4, AUTO_CONTEXT_FLOOR),
        # ... but never more than trained
        (0, 1024, LLAMA_8B_KV, 4, 1024),
        # a huge machine and a 1M-token model: the ceiling
        (2048 * GiB, 1048576, TINY_KV, 1, AUTO_CONTEXT_CEILING),
        # memory unknown: the floor
        (None, 131072, LLAMA_8B_KV, 4, AUTO_CONTEXT_FLOOR),
        # no KV per token (a recurrent model): what it was trained for, up to the ceiling
        (8 * GiB, 1048576, 0, 4, AUTO_CONTEXT_CEILING),
        # trained length unknown: the memory's answer
        (24 * GiB, 0, SMOLLM2_KV, 4, 65536),
    ],
)
def test_auto_context_follows_memory_kv_cost_and_trained_length(
    memory: int | None, trained: int, kv_per_token: int, slots: int, expected: int
) -> None:
    assert auto_context(trained=trained, kv_bytes_per_token=kv_per_token, num_slots=slots,
                        memory_bytes=memory) == expected


@pytest.mark.parametrize(
    ("asked", "trained", "expected", "capped"),
    [
        (AUTO_CONTEXT, 8192, ContextChoice(8192, AUTO_CONTEXT, 8192), False),
        (2048, 8192, ContextChoice(2048, 2048, 8192), False),
        (8192, 8192, ContextChoice(8192, 8192, 8192), False),
        (32768, 8192, ContextChoice(8192, 32768, 8192), True),
        (32768, 0, ContextChoice(32768, 32768, 0), False),  # trained length unknown: as asked
    ],
)
def test_an_asked_context_is_capped_at_the_trained_length(asked: int, trained: int, expected: ContextChoice,
                                                          capped: bool) -> None:
    choice = choose_context(asked, trained=trained, kv_bytes_per_token=SMOLLM2_KV, num_slots=4,
                            memory_bytes=24 * GiB)
    assert choice == expected
    assert choice.is_capped == capped


def test_machine_memory_is_the_ram_this_process_may_use() -> None:
    memory = machine_memory()
    assert memory is not None and memory > 0
