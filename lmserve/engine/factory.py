"""What the service asks of the engines, over the table of them (engine/registry.py): which engine serves a model,
opening it, what loading it will hold in memory, and GGUF quantization. The service imports engines through this
module and the protocol only, and never names one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmserve.engine.memory_estimate import HeaderReader
from lmserve.engine.memory_estimate import MemoryEstimate as MemoryEstimate  # re-exported: the service's view
from lmserve.engine.memory_estimate import available_memory as available_memory
from lmserve.engine.protocol import Engine
from lmserve.engine.registry import AUTO, engine_for, engine_named
from lmserve.engine.sampling_support import refuse_unhonoured
from lmserve.engine.slots.prompt_cache import PromptCache as PromptCache  # re-exported: the service closes it
from lmserve.engine.spec import EngineSettings as EngineSettings
from lmserve.engine.spec import EngineSpec as EngineSpec
from lmserve.types import LoadOptions, SamplingParams


def engine_of(path: Path, settings: EngineSettings | None = None) -> EngineSpec:
    """The engine that serves the model at `path` (`--engine`, or the first that claims it). InvalidRequest
    (param "model") when the engine asked for cannot serve it."""
    return engine_for(path, settings.engine if settings is not None else AUTO)


def open_engine(path: Path, options: LoadOptions, settings: EngineSettings) -> Engine:
    """Load the model at `path` with `options` into the engine that serves it. Blocking (seconds)."""
    return engine_of(path, settings).open(path, options, settings)


def estimate_memory(path: Path, options: LoadOptions, read_header: HeaderReader,
                    settings: EngineSettings | None = None) -> MemoryEstimate | None:
    """What loading the model at `path` with `options` will hold in memory, or None when it cannot be told.
    Blocking (reads headers, never the weights); `read_header` reads a GGUF's header."""
    settings = settings or EngineSettings()
    return engine_of(path, settings).estimate(path, options, settings, read_header)


def vision_missing(path: Path, config: dict[str, Any]) -> str | None:
    """What this machine lacks for the engine of the repository at `path` to serve its images (`config` is its
    config.json), or None."""
    spec = engine_of(path)
    return spec.vision_missing(config) if spec.vision_missing is not None else None


def check_sampling(engine: str, sampling: SamplingParams) -> None:
    """InvalidRequest (param: the option) when `sampling` asks for an option the engine named `engine`
    (`ModelInfo.engine`) does not honour (engine/sampling_support.py)."""
    refuse_unhonoured(sampling, engine_named(engine))


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
