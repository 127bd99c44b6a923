"""The MLX engine: Hugging Face and MLX-format repositories (a directory with config.json and safetensors, mlx-lm's
4- and 8-bit layouts included) served by the slot engine (engine/slots/batching.py) over mlx-lm
(engine/mlx/backend.py), in this process: on Apple silicon's GPU through Metal, and on MLX's CPU build elsewhere.

On macOS arm64 it is the first engine to claim a repository; elsewhere a repository goes to vLLM unless
`--engine mlx` asks for MLX (or vLLM is not installed).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import platform
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from lmserve.engine.mlx.options import MlxLaunch
from lmserve.engine.sampling_support import SAMPLING_OPTIONS
from lmserve.engine.spec import EngineSettings, EngineSpec
from lmserve.types import LoadOptions

if TYPE_CHECKING:
    from lmserve.engine.memory_estimate import HeaderReader, MemoryEstimate
    from lmserve.engine.protocol import Engine

PREFILL_CHUNK = 512
"""Prompt tokens prefilled per step unless --prefill-chunk says otherwise (mlx-lm's server prefills 2048 at a
time; smaller chunks let decoding slots move between them)."""
INSTALL = "pip install 'lmserve[mlx]'"


def claims(path: Path) -> bool:
    """A directory with config.json beside the weights."""
    return path.is_dir() and (path / "config.json").is_file()


def on_apple_silicon() -> bool:
    return sys.platform == "darwin" and platform.machine() == "arm64"


def missing() -> str | None:
    """What this machine lacks for MLX to be the engine `auto` picks: mlx-lm, or Apple silicon's GPU (elsewhere MLX
    runs on the CPU only, and serves a repository when asked for with --engine mlx)."""
    if importlib.util.find_spec("mlx_lm") is None or importlib.util.find_spec("mlx") is None:
        return f"MLX is not installed; install it: {INSTALL}"
    if not on_apple_silicon():
        return "MLX computes on Apple silicon's GPU, and this machine has none (its CPU build runs with --engine mlx)"
    return None


VISION_MISSING = ("the MLX engine runs language models through mlx-lm, and a vision-language model's images need "
                  "mlx-vlm, which it does not use yet: serve it with vLLM, or as a GGUF with its projector on "
                  "llama.cpp")


AUDIO_MISSING = ("the MLX engine runs language models through mlx-lm, and audio needs an audio encoder it does not "
                 "run (mlx-whisper, mlx-audio): serve an audio model with vLLM, or as a GGUF with its audio "
                 "projector on llama.cpp")


def vision_missing(config: dict[str, object]) -> str | None:
    """Why MLX cannot take a vision-language repository's images (it takes none)."""
    return VISION_MISSING if "vision_config" in config else None


def open_model(path: Path, options: LoadOptions, settings: EngineSettings) -> Engine:
    from lmserve.engine.slots.batching import BatchingEngine
    from lmserve.engine.slots.scheduler import BACKGROUND_ROWS, GPU_BACKGROUND_ROWS

    try:
        from lmserve.engine.mlx.backend import MlxBackend
    except ImportError as exc:
        from lmserve.errors import InvalidRequest

        raise InvalidRequest(f"the MLX engine needs mlx and mlx-lm ({exc}); install them: {INSTALL}",
                             param="model") from None
    launch = settings.of(MlxLaunch)
    chunk = settings.max_prefill_tokens or PREFILL_CHUNK
    backend = MlxBackend(path, options, launch, (settings.max_loras, settings.max_lora_rank))
    return BatchingEngine(backend, max_batch_tokens=max(options.num_batch, chunk),
                          max_prefill_tokens=backend.info.num_ctx if chunk == -1 else chunk,
                          max_queue=settings.max_queue, prompt_cache=settings.prompt_cache,
                          cache_key=prompt_cache_key(path, launch, backend.info.num_ctx),
                          background_rows=GPU_BACKGROUND_ROWS if backend.on_gpu else BACKGROUND_ROWS)


def estimate(path: Path, options: LoadOptions, settings: EngineSettings,
             read_header: HeaderReader) -> MemoryEstimate | None:
    return None


def prompt_cache_key(path: Path, launch: MlxLaunch, num_ctx: int) -> str:
    """What an MLX model's saved states depend on: the repository's weights (paths, sizes, times) and config.json,
    what lmserve reads from it over mlx-lm (`rope_from_parameters`), the dtype and device asked for, the context and
    the mlx-lm release. States saved under another key are never restored (a state computed by a model built
    otherwise would give other replies: seen when RoPE's base was read wrong)."""
    from importlib.metadata import version

    from lmserve.engine.mlx.loading import rope_from_parameters

    config_file = path / "config.json"
    config = config_file.read_text(errors="replace") if config_file.is_file() else "{}"
    try:
        read = rope_from_parameters(json.loads(config))
    except (ValueError, AttributeError):
        read = {}
    parts = [f"{file.resolve()}:{file.stat().st_size}:{file.stat().st_mtime_ns}"
             for file in sorted(path.glob("*.safetensors"))]
    parts += [config, json.dumps(read, sort_keys=True)]
    parts += [launch.mlx_dtype, launch.mlx_device, str(num_ctx), f"mlx-lm {version('mlx-lm')}"]
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=16).hexdigest()


SPEC = EngineSpec(
    name="mlx", label="MLX", serves="safetensors repositories (a directory with config.json; MLX's quantized ones too)",
    launch=MlxLaunch, claims=claims, open=open_model, estimate=estimate, missing=missing, in_process=True,
    vision_missing=vision_missing, sampling=SAMPLING_OPTIONS, takes=frozenset({"adapters"}), adapters_per_request=True,
)
"""MLX takes LoRA adapters as PEFT directories, per request (engine/mlx/adapters.py)."""
