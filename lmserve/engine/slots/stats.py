"""The slot engine's counters as the engine seam's `EngineStats` (engine/protocol.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmserve.engine.protocol import EngineStats
from lmserve.engine.slots.sequence import adapter_names

if TYPE_CHECKING:
    from lmserve.engine.slots.batching import BatchingEngine


def slot_engine_stats(engine: BatchingEngine) -> EngineStats:
    """What `engine` has done since it loaded and holds now (KV use in cells: one position of one sequence each)."""
    cache, info, scheduler, backend = engine.cache_stats, engine.info, engine.scheduler, engine.backend
    cells = info.num_kv_cells or info.num_ctx * info.num_parallel
    usage = min(1.0, scheduler.num_held_tokens() / cells) if cells else None
    weights_bytes, kv_bytes = backend.held_bytes  # MLX sums its caches' arrays for it: once
    return EngineStats(step_ns=engine.step_ns, decode_ns=engine.decode_ns, progress=engine.num_steps,
                       preemptions=engine.num_parked + engine.num_preempted,
                       kv_cache_usage=usage, kv_block_size=1, kv_num_blocks=cells,
                       prefix_cache_queries=engine.num_prompt_tokens, prefix_cache_hits=sum(cache.tokens.values()),
                       cache_hits={str(k): v for k, v in cache.hits.items()},
                       cache_tokens={str(k): v for k, v in cache.tokens.items()}, cache_misses=cache.misses,
                       cache_bytes=engine.cache.model_bytes(engine.cache_key),
                       adapter_bytes=backend.adapter_bytes, max_adapters=backend.max_adapters,
                       weights_bytes=weights_bytes, kv_bytes=kv_bytes,
                       running_adapters=adapter_names(list(scheduler.running)),
                       waiting_adapters=adapter_names(list(scheduler.waiting)))
