"""What a model holds in memory on vLLM: the KV cache sized for vLLM's CPU build, the context chosen at load
(engine/context_size.py's rule), and the rough estimate of a repository before it loads (engine/memory_estimate.py
says what is counted).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from lmserve.engine.context_size import ContextChoice, choose_context, machine_memory, memory_beside
from lmserve.engine.memory_estimate import MemoryEstimate, available_memory
from lmserve.engine.protocol import EngineStats
from lmserve.engine.vllm.args import VllmOptions
from lmserve.types import LoadOptions

CPU_KV_FLOOR_BYTES = 64 * 2**20
"""The smallest KV cache given to vLLM's CPU build (a model's KV for --parallel x --ctx-size may be smaller)."""
CPU_KV_CEILING_FRACTION = 0.5
"""The most of the machine's available memory the CPU KV cache may take when sized from --parallel x --ctx-size."""


def kv_cache_bytes(config: dict[str, Any], options: VllmOptions, available: int | None) -> int:
    """KV bytes for `num_parallel` sequences of `num_ctx` tokens of the model described by `config` (config.json),
    at least CPU_KV_FLOOR_BYTES and at most CPU_KV_CEILING_FRACTION of `available` memory."""
    needed = kv_bytes_per_token(config, options.dtype) * options.num_ctx * options.num_parallel
    ceiling = int(available * CPU_KV_CEILING_FRACTION) if available else needed
    return max(CPU_KV_FLOOR_BYTES, min(needed, ceiling))


def kv_bytes_per_token(config: dict[str, Any], dtype: str) -> int:
    """One token's KV cache in one sequence, in bytes, for the model `config` (config.json) describes: keys and
    values of every attention layer (a hybrid model's other layers keep none)."""
    text = config.get("text_config") or config
    layers = int(text.get("num_hidden_layers") or 0)
    types = text.get("layer_types")
    if isinstance(types, list) and types:
        layers = sum(1 for kind in types if "attention" in str(kind))
    heads = int(text.get("num_attention_heads") or 1)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or int(text.get("hidden_size") or 0) // heads)
    width = 4 if dtype == "float32" else 2
    return 2 * layers * kv_heads * head_dim * width


def context_choice(path: Path, options: VllmOptions, config: dict[str, Any]) -> ContextChoice:
    """The context per sequence of serving the repository at `path` (engine/context_size.py's rule). The trained
    length is the max_model_len vLLM derives from the repository (what it serves when given none); the memory is
    RAM on the CPU build, else vLLM's share of the GPUs (--gpu-memory-utilization), less the weights. Over several
    nodes auto is AUTO_CONTEXT_FLOOR: every node must size its context alike."""
    from vllm import AsyncEngineArgs

    arguments: dict[str, Any] = {"model": str(path), "dtype": options.dtype}
    trained = int(AsyncEngineArgs(**arguments).create_model_config().max_model_len)
    memory = None if options.nnodes > 1 else (machine_memory() if options.is_cpu else gpu_memory(options))
    weights = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    return choose_context(options.num_ctx, trained=trained, num_slots=options.num_parallel,
                          kv_bytes_per_token=kv_bytes_per_token(config, options.dtype),
                          memory_bytes=memory_beside(weights, memory))


def gpu_memory(options: VllmOptions) -> int | None:
    """vLLM's share of the memory of the GPUs one model spans (None when the platform does not say)."""
    from vllm.platforms import current_platform

    try:
        total = int(current_platform.get_device_total_memory(0))
    except Exception:  # a platform without the query, or NVML unavailable: the context falls back to the floor
        return None
    share = options.gpu_memory_utilization if options.gpu_memory_utilization is not None else 0.9
    return int(total * share) * options.tensor_parallel_size * options.pipeline_parallel_size


VLLM_RUNTIME_BYTES = 2**30
"""vLLM's engine process besides weights and KV cache (torch, its workers' runtime)."""


def held_bytes(path: Path, config: dict[str, Any], dtype: Any, stats: EngineStats) -> tuple[int, int]:
    """What vLLM holds for the repository at `path` loaded in `dtype` (a torch dtype): the weights (the files'
    tensors in that dtype) and the KV cache it allocated (its blocks, `stats`)."""
    width = int(getattr(dtype, "itemsize", 2))
    text = config.get("text_config") or config
    stored = _DTYPE_WIDTHS.get(str(text.get("torch_dtype") or config.get("torch_dtype")), width)
    weights = sum(p.stat().st_size for p in path.glob("*.safetensors")) * width // stored
    kv = stats.kv_num_blocks * stats.kv_block_size * kv_bytes_per_token(config, "float32" if width == 4 else "")
    return weights, kv


_DTYPE_WIDTHS = {"float32": 4, "float16": 2, "bfloat16": 2}


def estimate_repository(path: Path, options: LoadOptions) -> MemoryEstimate | None:
    """A rough estimate of what vLLM holds for the repository at `path` (None without vLLM). Blocking (imports
    vLLM to learn whether it runs on the CPU)."""
    from lmserve.engine.vllm.args import is_cpu_build

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
