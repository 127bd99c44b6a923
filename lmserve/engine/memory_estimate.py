"""What loading a model will take from memory, estimated before anything is loaded, and what the machine has for it.

Residency (service/residency.py) holds every load against one memory budget with these numbers.

- llama.cpp (a GGUF file), read from the file's header only: the weights (the file's size; llama.cpp maps the file,
  so the kernel counts those pages as reclaimable cache: `mapped_bytes`), the KV cache as the load will allocate it
  (one token of every attention layer in the cache types x the context per sequence x the slots, or one pool of
  num_ctx tokens with --kv-unified), the context resolved as engine/llamacpp/memory.py `context_choice` resolves it
  (auto: engine/context_size.py), a recurrent or hybrid model's state per slot, compute buffers (a base and a share
  per batch token), and a draft model, a projector and adapters. Sliding-window layers count whole, as the context
  choice counts them (an upper bound).
- vLLM (a repository), roughly: its safetensors, the KV cache the CPU build is given (engine/vllm/memory.py
  `kv_cache_bytes`, or VLLM_CPU_KVCACHE_SPACE) and its engine process's runtime. On a GPU the load takes GPU memory,
  which vLLM budgets itself (--gpu-memory-utilization): such an estimate is `on_gpu` and not held against RAM; so is
  a llama.cpp load with layers on a GPU.

`available_memory` is what the machine has for another load now: MemAvailable, capped by the room the control
group leaves (a container's /proc/meminfo shows the host's).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmserve.errors import gib

HeaderReader = Callable[[Path], Mapping[str, Any]]
"""Reads a GGUF file's header key/values, checked (the store's `gguf_metadata`): the engine never parses an
untrusted header itself."""
COMPUTE_BASE_BYTES = 64 * 2**20
"""llama.cpp's buffers besides weights and KV (graph, outputs, threads), measured at about 50 MiB on a small model."""
COMPUTE_VALUES_PER_BATCH_TOKEN = 8
"""Activations kept per batch token, in units of the embedding width (float32), for the compute buffer."""
_CGROUP_ROOMS = (
    (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current"), "inactive_file"),
    (Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"), Path("/sys/fs/cgroup/memory/memory.usage_in_bytes"),
     "total_inactive_file"),
)
"""cgroup v2 and v1: (limit, usage, the reclaimable page cache's line in memory.stat)."""


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """What one loaded model holds in memory, in bytes."""

    weights_bytes: int
    kv_bytes: int
    """The KV cache of every slot, and a recurrent model's state per slot."""
    compute_bytes: int = 0
    """Buffers besides weights and KV (compute graph, outputs; vLLM's runtime)."""
    mapped_bytes: int = 0
    """The part of the weights mapped from their file: the kernel counts those pages in MemAvailable even while
    the model uses them."""
    num_ctx: int = 0
    """The context per sequence the estimate is for."""
    num_slots: int = 0
    kv_unified: bool = False
    """The slots share one KV pool of `num_ctx` tokens."""
    on_gpu: bool = False
    """The model sits on a GPU (its memory is not RAM, and not budgeted here)."""

    @property
    def total(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.compute_bytes

    def describe(self) -> str:
        """"0.0916 GiB of weights, 0.352 GiB of KV cache for 2 slots x 8192 tokens and 0.0723 GiB of buffers"."""
        slots = f"{self.num_slots} slot" + ("s" if self.num_slots != 1 else "")
        kv = f" for {slots} x {self.num_ctx} tokens" if self.num_ctx else ""
        if self.num_ctx and self.kv_unified:
            kv = f" for one pool of {self.num_ctx} tokens shared by {slots}"
        return (f"{gib(self.weights_bytes)} of weights, {gib(self.kv_bytes)} of KV cache{kv} and "
                f"{gib(self.compute_bytes)} of buffers")

def available_memory() -> int | None:
    """The memory another load may take now, in bytes: MemAvailable, capped by the room left in this process's
    control group (its limit less its usage, reclaimable page cache counted as room); None where unknown."""
    found = meminfo_available()
    for limit_file, usage_file, inactive_key in _CGROUP_ROOMS:
        room = _cgroup_room(limit_file, usage_file, inactive_key)
        if room is not None:
            found = room if found is None else min(found, room)
    return found


def _cgroup_room(limit_file: Path, usage_file: Path, inactive_key: str) -> int | None:
    """A control group's limit less its usage, plus its inactive page cache; None when it has no limit."""
    try:
        limit, usage = limit_file.read_text().strip(), usage_file.read_text().strip()
        stat = (limit_file.parent / "memory.stat").read_text().splitlines()
    except OSError:
        return None
    if not (limit.isdigit() and usage.isdigit()) or int(limit) >= 2**60:  # "max", or v1's "unlimited"
        return None
    inactive = next((int(line.split()[1]) for line in stat if line.startswith(inactive_key + " ")), 0)
    return max(int(limit) - int(usage), 0) + inactive


def meminfo_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
