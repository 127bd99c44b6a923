"""What a model holds in memory on MLX: its weights, one token's keys and values, and the context chosen at load
(engine/context_size.py's rule) from them and the machine's memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmserve.engine.context_size import ContextChoice, choose_context, machine_memory, memory_beside

Caches = list[Any]
"""One slot's caches: one mlx-lm cache per layer."""


def context_choice(path: Path, num_ctx: int, num_slots: int, text_config: dict[str, Any], caches: Caches,
                   dtype: Any) -> ContextChoice:
    """The context per sequence of serving the repository at `path` (`num_ctx` asked, maybe AUTO_CONTEXT) with
    `num_slots` slots: `text_config` is its text model's config.json, `caches` one slot's, `dtype` MLX's."""
    return choose_context(
        num_ctx, trained=int(text_config.get("max_position_embeddings") or 0),
        kv_bytes_per_token=kv_bytes_per_token(text_config, caches, dtype), num_slots=num_slots,
        memory_bytes=memory_beside(weights_bytes(path), machine_memory()))


def weights_bytes(path: Path) -> int:
    """The bytes of the repository's weights (its safetensors)."""
    return sum(file.stat().st_size for file in path.glob("*.safetensors"))


def kv_bytes_per_token(config: dict[str, Any], caches: Caches, dtype: Any) -> int:
    """One token's keys and values in one sequence: 2 x KV heads x head size x dtype, over the attention layers."""
    heads = int(config.get("num_key_value_heads") or config.get("num_attention_heads") or 0)
    head_dim = int(config.get("head_dim") or 0) or (
        int(config.get("hidden_size") or 0) // max(int(config.get("num_attention_heads") or 1), 1))
    layers = sum(1 for cache in caches if cache.is_trimmable())
    return 2 * heads * head_dim * layers * int(dtype.size)
