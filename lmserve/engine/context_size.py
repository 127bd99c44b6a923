"""A sequence's context length: decided once per load, the same way on both engines.

- Asked for (`-c N`, LMSERVE_CTX_SIZE, a Modelfile's or a request's num_ctx): N, but never more than the model was
  trained for. Above it the context is the trained length, and the load logs a warning naming both numbers.
- Auto (nothing asked: AUTO_CONTEXT): the largest power of two whose KV cache for every slot fits in
  AUTO_KV_FRACTION of the memory the weights leave (RAM on CPU; GPU memory where the model sits on a GPU), kept
  between AUTO_CONTEXT_FLOOR and AUTO_CONTEXT_CEILING, and never more than the trained length. Small machines and
  models with a large KV cache get small contexts; a model with a small KV cache gets what it was trained for.

The engine reports the context it uses (`ModelInfo.num_ctx`) and the trained length (`ModelInfo.num_ctx_train`):
the load's log line (service/residency.py), `ps`, `show` and the 400 for a prompt that does not fit read those,
never the number asked for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from lmserve.types import AUTO_CONTEXT, AUTO_CONTEXT_CEILING, AUTO_CONTEXT_FLOOR, AUTO_KV_FRACTION

_CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


@dataclass(frozen=True, slots=True)
class ContextChoice:
    """The context per sequence a load uses, and what it was decided from."""

    num_ctx: int
    asked: int
    """What was asked for: a number of tokens, or AUTO_CONTEXT."""
    trained: int
    """The model's trained context length (0: not known)."""

    @property
    def is_capped(self) -> bool:
        """More was asked for than the model was trained for."""
        return self.asked != AUTO_CONTEXT and 0 < self.trained < self.asked


def auto_context(*, trained: int, kv_bytes_per_token: int, num_slots: int, memory_bytes: int | None) -> int:
    """The auto context per sequence (see the module docstring). `kv_bytes_per_token` is one token's KV cache in
    one sequence (0: the model keeps none per token, as a recurrent one), `num_slots` how many sequences the cache
    holds, `memory_bytes` the memory the weights leave (None: not known, then the floor); `trained` 0 when not
    known."""
    if kv_bytes_per_token <= 0:
        size = AUTO_CONTEXT_CEILING
    elif memory_bytes is None:
        size = AUTO_CONTEXT_FLOOR
    else:
        fits = int(max(memory_bytes, 0) * AUTO_KV_FRACTION) // (kv_bytes_per_token * max(num_slots, 1))
        size = min(max(_power_of_two_below(fits), AUTO_CONTEXT_FLOOR), AUTO_CONTEXT_CEILING)
    return min(size, trained) if trained > 0 else size


def choose_context(asked: int, *, trained: int, kv_bytes_per_token: int, num_slots: int,
                   memory_bytes: int | None) -> ContextChoice:
    """The context per sequence for a load that asked for `asked` tokens (AUTO_CONTEXT: auto_context)."""
    if asked == AUTO_CONTEXT:
        num_ctx = auto_context(trained=trained, kv_bytes_per_token=kv_bytes_per_token, num_slots=num_slots,
                               memory_bytes=memory_bytes)
    else:
        num_ctx = min(asked, trained) if trained > 0 else asked
    return ContextChoice(num_ctx=num_ctx, asked=asked, trained=trained)


def machine_memory() -> int | None:
    """The RAM this process may use in bytes: the machine's, or its control group's limit when lower (None where
    it cannot be read)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        return None
    for path in _CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total if total > 0 else None


def memory_beside(weights_bytes: int, memory_bytes: int | None) -> int | None:
    """What `memory_bytes` leaves once the weights are in it (None stays None)."""
    return None if memory_bytes is None else max(memory_bytes - weights_bytes, 0)


def _power_of_two_below(n: int) -> int:
    """The largest power of two at most `n` (0 for n < 1)."""
    return 1 << (n.bit_length() - 1) if n >= 1 else 0
