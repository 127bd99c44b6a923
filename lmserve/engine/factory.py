"""Which engine serves a model, and how one is opened: the one place a model's format maps to an engine.

A GGUF file goes to llama.cpp (the batching engine over the llama.cpp backend). A hub repository or a directory
of safetensors (config.json beside the weights) is the second engine's (vLLM) — `engine_kind` already tells it
apart, and `open_engine` is where that engine will be opened.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from lmserve.engine.protocol import Engine
from lmserve.errors import InvalidRequest
from lmserve.types import LoadOptions

EngineKind = Literal["llamacpp", "vllm"]


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """Server-wide engine settings that are not per-model load options."""

    max_prefill_tokens: int = 256
    """Most prompt tokens prefilled in one step (chunked prefill)."""
    max_queue: int = 512
    """Requests that may wait for a slot; beyond it Overloaded (503)."""
    snapshot_bytes: int = 256 * 2**20
    """Memory for prompt-end state snapshots of hybrid models; 0 turns them off."""


def engine_kind(path: Path) -> EngineKind:
    """The engine for the model at `path`: llama.cpp for a GGUF file, vLLM for a safetensors directory."""
    if path.is_dir() and (path / "config.json").is_file():
        return "vllm"
    return "llamacpp"


def open_engine(path: Path, options: LoadOptions, settings: EngineSettings) -> Engine:
    """Load the model at `path` with `options` into the engine its format needs. Blocking (seconds)."""
    kind = engine_kind(path)
    if kind == "vllm":
        raise InvalidRequest(f"{path} is a safetensors repository, which the vLLM engine serves; this build has "
                             "only the llama.cpp engine (serve a .gguf file)", param="model")
    from lmserve.engine.batching import BatchingEngine
    from lmserve.engine.llamacpp import LlamaCppBackend

    backend = LlamaCppBackend(path, options)
    return BatchingEngine(backend, max_batch_tokens=options.num_batch, max_prefill_tokens=settings.max_prefill_tokens,
                          max_queue=settings.max_queue, snapshot_bytes=settings.snapshot_bytes)


def quantize_weights(source: Path, destination: Path, level: str, *, label: str | None = None) -> None:
    """Write the GGUF `source` quantized to `level` (e.g. "q4_K_M") at `destination` with llama.cpp. Blocking.

    InvalidRequest (param `quantize`) for an unknown level or weights that cannot be quantized; `label` names the
    source in errors.
    """
    from lmserve.engine.quantize import quantize

    quantize(source, destination, level, label=label)


def check_quantization(level: str) -> None:
    """InvalidRequest (param `quantize`) unless llama.cpp can quantize to `level`."""
    from lmserve.engine.quantize import parse_quant

    parse_quant(level)
