"""The vLLM engine's statistics: a stat logger that keeps `EngineStats` current from vLLM's scheduler, and the tier
/metrics names for its prefix cache.
"""

from __future__ import annotations

from typing import Any

from lmserve.engine.protocol import (
    EngineStats,
)

CACHE_TIER = "kv"
"""The tier /metrics' prompt-cache counters name for vLLM's prefix cache: blocks of its KV cache (RAM on the CPU build;
on a GPU with --kv-offloading-size, also blocks copied back from CPU RAM)."""


def stat_logger(stats: EngineStats) -> Any:
    """A vLLM stat-logger factory that keeps `stats` current from each engine step's scheduler stats."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class Recorder(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            if scheduler_stats is None:
                return
            stats.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
            stats.prefix_cache_queries += int(scheduler_stats.prefix_cache_stats.queries)
            stats.prefix_cache_hits += int(scheduler_stats.prefix_cache_stats.hits)
            stats.preemptions += int(getattr(scheduler_stats, "num_preemptions", 0))
            running = getattr(scheduler_stats, "running_lora_adapters", None) or {}
            waiting = getattr(scheduler_stats, "waiting_lora_adapters", None) or {}
            stats.running_adapters, stats.waiting_adapters = tuple(sorted(running)), tuple(sorted(waiting))

        def log_engine_initialized(self) -> None:
            pass

    return Recorder
