"""The llama.cpp engine: GGUF files served by the slot engine (engine/slots/batching.py) over llama.cpp
(engine/llamacpp/backend.py), in this process; CPU first, GPUs with --n-gpu-layers."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

from lmserve.engine.llamacpp.options import LlamaCppLaunch
from lmserve.engine.sampling_support import SAMPLING_OPTIONS
from lmserve.engine.spec import EngineSettings, EngineSpec
from lmserve.types import LoadOptions

if TYPE_CHECKING:
    from lmserve.engine.memory_estimate import HeaderReader, MemoryEstimate
    from lmserve.engine.protocol import Engine

PREFILL_CHUNK = 256
"""Prompt tokens prefilled per step unless --prefill-chunk says otherwise."""


def claims(path: Path) -> bool:
    """A file (a GGUF: the store checks its structure before it is opened)."""
    return path.is_file() or not path.is_dir()


def open_model(path: Path, options: LoadOptions, settings: EngineSettings) -> Engine:
    from lmserve.engine.llamacpp.backend import LlamaCppBackend
    from lmserve.engine.slots.batching import BatchingEngine

    launch = settings.of(LlamaCppLaunch)
    chunk = settings.max_prefill_tokens or PREFILL_CHUNK
    backend = LlamaCppBackend(path, options, launch, (settings.max_loras, settings.max_lora_rank))
    return BatchingEngine(backend, max_batch_tokens=options.num_batch,
                          max_prefill_tokens=backend.info.num_ctx if chunk == -1 else chunk,
                          max_queue=settings.max_queue, prompt_cache=settings.prompt_cache,
                          cache_key=prompt_cache_key(path, options, launch, backend.info.num_ctx),
                          slot_similarity=launch.slot_prompt_similarity, draft_max=launch.draft_limit)


def estimate(path: Path, options: LoadOptions, settings: EngineSettings,
             read_header: HeaderReader) -> MemoryEstimate | None:
    from lmserve.engine.llamacpp.estimate import estimate_gguf

    return estimate_gguf(path, options, settings.of(LlamaCppLaunch), read_header)


def prompt_cache_key(path: Path, options: LoadOptions, launch: LlamaCppLaunch, num_ctx: int) -> str:
    """What a llama.cpp model's saved states depend on: the weights (a store blob's digest, else the file's path,
    size and time), the adapters and projector, the KV cache's types and layout, the context, and the llama.cpp
    build. States saved under another key are never restored."""
    import llama_cpp

    from lmserve.store.lora import file_identity as identity

    parts = [identity(path), *(identity(adapter) for adapter in options.adapters),
             identity(options.projector) if options.projector else "", launch.cache_type_k, launch.cache_type_v,
             launch.flash_attn, str(launch.kv_unified), str(num_ctx), f"llama-cpp-python {llama_cpp.__version__}"]
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=16).hexdigest()


SPEC = EngineSpec(
    name="llamacpp", label="llama.cpp", serves="GGUF files", launch=LlamaCppLaunch, claims=claims, open=open_model,
    estimate=estimate, in_process=True, takes=frozenset({"adapters", "projector", "quantize"}),
    adapters_per_request=True,
    sampling=SAMPLING_OPTIONS,
)
