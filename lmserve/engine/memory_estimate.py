"""What loading a model will take from memory, estimated before anything is loaded, and what the machine has for it.

Residency (service/residency.py) holds every load against one memory budget with these numbers.

- llama.cpp (a GGUF file), read from the file's header only: the weights (the file's size; llama.cpp maps the file,
  so the kernel counts those pages as reclaimable cache: `mapped_bytes`), the KV cache as the load will allocate it
  (one token of every attention layer in the cache types x the context per sequence x the slots, or one pool of
  num_ctx tokens with --kv-unified), the context resolved as engine/llamacpp/memory.py `context_choice` resolves it
  (auto: engine/context_size.py), a recurrent or hybrid model's state per slot, compute buffers (a base and a share
  per batch token), and a draft model, a projector and adapters. Sliding-window layers count whole, as the context
  choice counts them (an upper bound).
- vLLM (a repository), roughly: its safetensors, the KV cache the CPU build is given (engine/vllm/engine.py
  `kv_cache_bytes`, or VLLM_CPU_KVCACHE_SPACE) and its engine process's runtime. On a GPU the load takes GPU memory,
  which vLLM budgets itself (--gpu-memory-utilization): such an estimate is `on_gpu` and not held against RAM; so is
  a llama.cpp load with layers on a GPU.

`available_memory` is what the machine has for another load now: MemAvailable, capped by the room the control
group leaves (a container's /proc/meminfo shows the host's).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

from lmserve.engine.context_size import choose_context, machine_memory, memory_beside
from lmserve.errors import gib
from lmserve.types import LoadOptions

HeaderReader = Callable[[Path], Mapping[str, Any]]
"""Reads a GGUF file's header key/values, checked (the store's `gguf_metadata`): the engine never parses an
untrusted header itself."""
COMPUTE_BASE_BYTES = 64 * 2**20
"""llama.cpp's buffers besides weights and KV (graph, outputs, threads), measured at about 50 MiB on a small model."""
COMPUTE_VALUES_PER_BATCH_TOKEN = 8
"""Activations kept per batch token, in units of the embedding width (float32), for the compute buffer."""
VLLM_RUNTIME_BYTES = 2**30
"""vLLM's engine process besides weights and KV cache (torch, its workers' runtime)."""
_STATE_BYTES = 4
"""A recurrent layer's state is float32."""
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


def estimate_gguf(path: Path, options: LoadOptions, read_header: HeaderReader) -> MemoryEstimate:
    """What llama.cpp will hold for the GGUF at `path` loaded with `options`. Blocking (reads headers)."""
    header = read_header(path)
    weights = path.stat().st_size
    on_gpu = options.num_gpu_layers != 0
    kv_per_token = header_kv_bytes_per_token(header, options)
    slots = 1 if options.kv_unified else options.num_parallel
    memory = _gpu_memory() if on_gpu else None
    if memory is None:
        memory = memory_beside(weights, machine_memory())
    num_ctx = choose_context(options.num_ctx, trained=_number(header, "context_length"),
                             kv_bytes_per_token=kv_per_token, num_slots=slots, memory_bytes=memory).num_ctx
    cells = num_ctx if options.kv_unified else num_ctx * options.num_parallel
    kv = kv_per_token * cells + state_bytes_per_sequence(header) * options.num_parallel
    mapped = weights if options.use_mmap is not False and not options.use_mlock else 0
    if options.draft_model:
        draft_path = Path(options.draft_model)
        draft = read_header(draft_path)
        draft_ctx = min(num_ctx, _number(draft, "context_length") or num_ctx)
        weights += draft_path.stat().st_size
        mapped += draft_path.stat().st_size if mapped else 0
        kv += header_kv_bytes_per_token(draft, options) * draft_ctx * options.num_parallel
    weights += sum(Path(extra).stat().st_size for extra in (*options.adapters, options.projector or "") if extra)
    vocab = _number(header, "vocab_size")
    compute = (COMPUTE_BASE_BYTES + options.num_batch * _number(header, "embedding_length") * 4
               * COMPUTE_VALUES_PER_BATCH_TOKEN + options.num_parallel * vocab * 4)
    return MemoryEstimate(weights, kv, compute, mapped, num_ctx=num_ctx, num_slots=options.num_parallel,
                          kv_unified=options.kv_unified, on_gpu=on_gpu)


def header_kv_bytes_per_token(header: Mapping[str, Any], options: LoadOptions) -> int:
    """One token's KV cache in one sequence, from a GGUF header: as engine/llamacpp/memory.py
    `kv_bytes_per_token` counts it from a loaded model (0 when the model keeps none per token)."""
    heads = _first(header, "attention.head_count")
    head_dim = _number(header, "embedding_length") // heads if heads > 0 else 0
    key_dim = _number(header, "attention.key_length") or head_dim
    value_dim = _number(header, "attention.value_length") or head_dim
    per_value = sum(_kv_heads(header)) * (key_dim * bytes_per_value(options.cache_type_k)
                                          + value_dim * bytes_per_value(options.cache_type_v))
    return int(per_value)


def bytes_per_value(cache_type: str) -> float:
    """Bytes per cached value of a KV cache type ("q8_0": a block of 32 values in 34 bytes), from ggml's table as
    the gguf package has it (llama_cpp stays unimported)."""
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[cache_type.upper()]]
    return size / block


def state_bytes_per_sequence(header: Mapping[str, Any]) -> int:
    """A recurrent model's state of one sequence (its layers without KV heads): a short convolution's window
    (LFM2), or a Mamba layer's convolution and SSM state; 0 for an attention-only model."""
    recurrent = sum(1 for heads in _kv_heads(header) if heads == 0)
    embd = _number(header, "embedding_length")
    l_cache = _number(header, "shortconv.l_cache")
    d_conv, d_inner, d_state = (_number(header, f"ssm.{key}") for key in ("conv_kernel", "inner_size", "state_size"))
    if l_cache:
        per_layer = (l_cache - 1) * embd
    elif d_conv and d_inner:
        groups = _number(header, "ssm.group_count") or 1
        per_layer = (d_conv - 1) * (d_inner + 2 * groups * d_state) + d_state * d_inner
    else:
        per_layer = 0
    return recurrent * per_layer * _STATE_BYTES


def estimate_repository(path: Path, options: LoadOptions) -> MemoryEstimate | None:
    """A rough estimate of what vLLM holds for the repository at `path` (None without vLLM). Blocking (imports
    vLLM to learn whether it runs on the CPU)."""
    from lmserve.engine.vllm.engine import VllmOptions, is_cpu_build, kv_bytes_per_token, kv_cache_bytes

    weights = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    try:
        is_cpu = is_cpu_build()
    except ImportError:
        return None
    if not is_cpu:
        return MemoryEstimate(weights, 0, on_gpu=True)
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config") or config
    trained = int(text.get("max_position_embeddings") or 0)
    num_ctx = choose_context(options.num_ctx, trained=trained, kv_bytes_per_token=kv_bytes_per_token(config, "auto"),
                             num_slots=options.num_parallel,
                             memory_bytes=memory_beside(weights, machine_memory())).num_ctx
    space = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")
    vllm_options = VllmOptions(num_ctx=num_ctx, num_parallel=options.num_parallel)
    kv = int(float(space) * 2**30) if space else kv_cache_bytes(config, vllm_options, available_memory())
    return MemoryEstimate(weights, kv, VLLM_RUNTIME_BYTES, num_ctx=num_ctx, num_slots=options.num_parallel)


def available_memory() -> int | None:
    """The memory another load may take now, in bytes: MemAvailable, capped by the room left in this process's
    control group (its limit less its usage, reclaimable page cache counted as room); None where unknown."""
    from lmserve.engine.vllm.engine import available_memory as mem_available

    found = mem_available()
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


def _gpu_memory() -> int | None:
    from lmserve.engine.llamacpp.memory import gpu_free_memory

    return gpu_free_memory()


def _kv_heads(header: Mapping[str, Any]) -> list[int]:
    """The KV heads of each layer: `<arch>.attention.head_count_kv` (a number for every layer, or one per layer;
    llama.cpp's default is the attention heads)."""
    layers = _number(header, "block_count")
    value = _value(header, "attention.head_count_kv")
    if value is None:
        value = _value(header, "attention.head_count")
    if isinstance(value, Sequence) and not isinstance(value, str):
        return [int(v) for v in value]
    return [int(value or 0)] * layers


def _first(header: Mapping[str, Any], key: str) -> int:
    """A number that may be given per layer (then the first layer's, as llama.cpp reports it)."""
    value = _value(header, key)
    if isinstance(value, Sequence) and not isinstance(value, str):
        return int(value[0]) if value else 0
    return int(value or 0)


def _number(header: Mapping[str, Any], key: str) -> int:
    value = _value(header, key)
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


def _value(header: Mapping[str, Any], key: str) -> Any:
    """`<architecture>.<key>` of the header (None when absent)."""
    return header.get(f"{header.get('general.architecture', '')}.{key}")
