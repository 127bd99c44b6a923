"""The memory budget: what another load may take (the machine's memory, or a fixed budget), and which idle models go
for it."""

from __future__ import annotations

import pytest

from lmserve.engine.memory_estimate import MemoryEstimate
from lmserve.errors import InsufficientMemory, Overloaded
from lmserve.service.memory_budget import FixedMemory, SystemMemory, memory_gauge, room_for

GiB = 2**30
MAPPED = MemoryEstimate(weights_bytes=2 * GiB, kv_bytes=1 * GiB, compute_bytes=0, mapped_bytes=2 * GiB)
"""A llama.cpp model: its weights file mapped (counted free by the kernel), its KV cache not."""
READ = MemoryEstimate(weights_bytes=2 * GiB, kv_bytes=1 * GiB)
"""A model whose weights were read into memory (vLLM, or llama.cpp without mmap)."""


@pytest.mark.parametrize(
    ("loaded", "loading", "free", "expected"),
    [
        ([], [], 10 * GiB, 10 * GiB),
        ([MAPPED], [], 10 * GiB, 8 * GiB),  # the mapped weights are in MemAvailable, but in use
        ([READ], [], 10 * GiB, 10 * GiB),  # the kernel already counts all of it as used
        ([], [READ], 10 * GiB, 7 * GiB),  # still loading: none of it taken yet
        ([MAPPED], [MAPPED], 10 * GiB, 5 * GiB),
        ([MAPPED], [], None, None),  # the machine does not say: nothing is checked
    ],
)
def test_the_machines_memory_less_what_the_kernel_counts_free_but_models_use(
    loaded: list[MemoryEstimate], loading: list[MemoryEstimate], free: int | None, expected: int | None
) -> None:
    assert SystemMemory(lambda: free).available(loaded, loading) == expected


def test_a_fixed_budget_less_every_model() -> None:
    assert FixedMemory(10 * GiB).available([MAPPED, READ], [READ]) == 1 * GiB


@pytest.mark.parametrize(
    ("check", "budget", "expected"),
    [(True, None, SystemMemory()), (True, 5 * GiB, FixedMemory(5 * GiB)), (False, 5 * GiB, None), (False, None, None)],
)
def test_the_servers_options_pick_the_gauge(check: bool, budget: int | None, expected: object) -> None:
    assert memory_gauge(check, budget) == expected


IDLE = [("oldest", 1 * GiB), ("older", 2 * GiB), ("newest", 1 * GiB)]


@pytest.mark.parametrize(
    ("need", "available", "chosen"),
    [
        (3, 3, []),
        (3, 4, []),
        (3, 2, ["oldest"]),
        (3, 1, ["oldest", "older"]),
        (3, 0, ["oldest", "older"]),
        (4, 0, ["oldest", "older", "newest"]),
        (3, -1, ["oldest", "older", "newest"]),  # the machine is already short: more must go
    ],
)
def test_room_is_made_with_the_fewest_least_recently_used(need: int, available: int, chosen: list[str]) -> None:
    estimate = MemoryEstimate(weights_bytes=need * GiB, kv_bytes=0)
    assert room_for("m", estimate, available * GiB, IDLE, busy=0) == chosen


@pytest.mark.parametrize(
    ("busy", "error", "message"),
    [
        (1 * GiB, Overloaded, "model 'm' needs 6 GiB of memory and 5 GiB is free with every idle model unloaded; "
                              "models busy with requests hold 1 GiB more: retry when they are done"),
        (0, InsufficientMemory, "model 'm' requires more system memory (6 GiB) than is available (5 GiB): 6 GiB of "
                                "weights, 0 GiB of KV cache and 0 GiB of buffers, with every other model unloaded."),
    ],
)
def test_what_cannot_fit_is_refused_with_the_numbers(busy: int, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as refused:
        room_for("m", MemoryEstimate(weights_bytes=6 * GiB, kv_bytes=0), 1 * GiB, IDLE, busy=busy)
    assert str(refused.value).startswith(message)
