"""What llama.cpp will hold in memory for a GGUF, estimated from the file's header before anything is loaded
(engine/memory_estimate.py says what is counted)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import gguf

from lmserve.engine.context_size import choose_context, machine_memory, memory_beside
from lmserve.engine.llamacpp.options import LlamaCppLaunch
from lmserve.engine.memory_estimate import (
    COMPUTE_BASE_BYTES,
    COMPUTE_VALUES_PER_BATCH_TOKEN,
    HeaderReader,
    MemoryEstimate,
)
from lmserve.types import LoadOptions

_STATE_BYTES = 4
"""A recurrent layer's state is float32."""


def estimate_gguf(path: Path, options: LoadOptions, launch: LlamaCppLaunch,
                  read_header: HeaderReader) -> MemoryEstimate:
    """What llama.cpp will hold for the GGUF at `path` loaded with `options`. Blocking (reads headers)."""
    header = read_header(path)
    weights = path.stat().st_size
    on_gpu = options.num_gpu_layers != 0
    kv_per_token = header_kv_bytes_per_token(header, launch)
    slots = 1 if launch.kv_unified else options.num_parallel
    memory = _gpu_memory() if on_gpu else None
    if memory is None:
        memory = memory_beside(weights, machine_memory())
    num_ctx = choose_context(options.num_ctx, trained=_number(header, "context_length"),
                             kv_bytes_per_token=kv_per_token, num_slots=slots, memory_bytes=memory).num_ctx
    cells = num_ctx if launch.kv_unified else num_ctx * options.num_parallel
    kv = kv_per_token * cells + state_bytes_per_sequence(header) * options.num_parallel
    mapped = weights if options.use_mmap is not False and not options.use_mlock else 0
    if launch.model_draft:
        draft_path = Path(launch.model_draft)
        draft = read_header(draft_path)
        draft_ctx = min(num_ctx, _number(draft, "context_length") or num_ctx)
        weights += draft_path.stat().st_size
        mapped += draft_path.stat().st_size if mapped else 0
        kv += header_kv_bytes_per_token(draft, launch) * draft_ctx * options.num_parallel
    weights += sum(Path(extra).stat().st_size for extra in (*options.adapters, options.projector or "") if extra)
    vocab = _number(header, "vocab_size")
    compute = (COMPUTE_BASE_BYTES + options.num_batch * _number(header, "embedding_length") * 4
               * COMPUTE_VALUES_PER_BATCH_TOKEN + options.num_parallel * vocab * 4)
    return MemoryEstimate(weights, kv, compute, mapped, num_ctx=num_ctx, num_slots=options.num_parallel,
                          kv_unified=launch.kv_unified, on_gpu=on_gpu)


def header_kv_bytes_per_token(header: Mapping[str, Any], launch: LlamaCppLaunch) -> int:
    """One token's KV cache in one sequence, from a GGUF header: as engine/llamacpp/memory.py
    `kv_bytes_per_token` counts it from a loaded model (0 when the model keeps none per token)."""
    heads = _first(header, "attention.head_count")
    head_dim = _number(header, "embedding_length") // heads if heads > 0 else 0
    key_dim = _number(header, "attention.key_length") or head_dim
    value_dim = _number(header, "attention.value_length") or head_dim
    per_value = sum(_kv_heads(header)) * (key_dim * bytes_per_value(launch.cache_type_k)
                                          + value_dim * bytes_per_value(launch.cache_type_v))
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


def _gpu_memory() -> int | None:
    from lmserve.engine.llamacpp.memory import gpu_free_memory  # loads llama.cpp's library

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
