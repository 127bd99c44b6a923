"""What vLLM will hold in memory for a repository, roughly (engine/memory_estimate.py says what is counted)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from lmserve.engine.context_size import choose_context, machine_memory, memory_beside
from lmserve.engine.memory_estimate import MemoryEstimate, available_memory
from lmserve.types import LoadOptions

VLLM_RUNTIME_BYTES = 2**30
"""vLLM's engine process besides weights and KV cache (torch, its workers' runtime)."""


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
