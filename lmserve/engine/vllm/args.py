"""What lmserve asks of vLLM for one model (`VllmOptions`) and vLLM's engine arguments for it (`engine_args`: pure,
no vLLM import, where every launch option maps to vLLM's names), with the checks of what this machine's vLLM can
do: KV offloading, its CPU build, the models whose RoPE its CPU kernel computes wrongly.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmserve.engine.vllm.lora import lora_args
from lmserve.engine.vllm.rerank import is_reranker
from lmserve.errors import InvalidRequest
from lmserve.types import AUTO_CONTEXT


@dataclass(frozen=True, slots=True)
class VllmOptions:
    """What lmserve's options ask of vLLM for one model (built by `engine/factory.py` from the server's flags)."""

    num_ctx: int = AUTO_CONTEXT
    """max_model_len: the context per sequence (AUTO_CONTEXT: sized at load, engine/context_size.py)."""
    num_parallel: int = 4
    """max_num_seqs: sequences decoded together."""
    dtype: str = "auto"
    gpu_memory_utilization: float | None = None
    """The fraction of GPU memory vLLM may use; None: vLLM's default on a GPU, a KV size from num_parallel x
    num_ctx on the CPU build."""
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    torch_compile: bool = False
    """False runs eagerly (no compile step at start); True uses vLLM's compilation and CUDA graphs."""
    prefill_chunk: int | None = None
    """Most prompt tokens per step (vLLM's max_num_batched_tokens); -1 turns chunked prefill off; None: vLLM's."""
    max_queue: int = 512
    is_cpu: bool = True
    nnodes: int = 1
    """Machines the model spans (vLLM's multiprocessing multi-node); this one is `node_rank`."""
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29501
    executor: str = "auto"
    """vLLM's distributed executor: `mp`, `ray`, or `auto` (vLLM's choice: processes on one machine or --nnodes)."""
    kv_offloading_size: float = 0.0
    """GiB of CPU memory vLLM offloads KV blocks to, beyond its (GPU) KV cache; 0: none (vLLM's --kv-offloading-size,
    GPU only: check_kv_offloading)."""
    kv_offloading_backend: str = "native"
    """Who keeps the offloaded blocks: `native` (vLLM's OffloadingConnector) or `lmcache` (an LMCache server)."""
    kv_events_config: dict[str, Any] | None = None
    """vLLM's KVEventsConfig fields (--kv-events-config): where and how its KV cache events are published; None:
    not published."""
    enable_lora: bool = False
    """Ready vLLM for LoRA adapters per request (engine/vllm/lora.py), up to `max_loras` in one batch."""
    max_loras: int = 8
    max_lora_rank: int = 64

    @property
    def local_workers(self) -> int:
        """Worker processes on this machine: tensor x pipeline parallel ranks over the nodes."""
        return max(1, self.tensor_parallel_size * self.pipeline_parallel_size // self.nnodes)


def engine_args(path: Path, options: VllmOptions, *, kv_bytes: int | None = None,
                config: dict[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's `AsyncEngineArgs` keywords for serving the repository at `path` with `options`.

    On the CPU build the KV cache is sized explicitly (`kv_bytes`), since vLLM's default memory fraction asks for
    nearly all of the machine's RAM. A hybrid model's convolution state follows an explicit dtype (vLLM keeps it
    in the weights' dtype otherwise, and a float16 model with a bfloat16 state fails). `config` is config.json.
    """
    config = config or {}
    args: dict[str, Any] = {
        "model": str(path),
        "dtype": options.dtype,
        "max_model_len": options.num_ctx,
        "max_num_seqs": options.num_parallel,
        "tensor_parallel_size": options.tensor_parallel_size,
        "pipeline_parallel_size": options.pipeline_parallel_size,
        "data_parallel_size": options.data_parallel_size,
        "enforce_eager": not options.torch_compile,
        "enable_prefix_caching": True,
        "disable_log_stats": True,
        "logprobs_mode": "processed_logprobs",  # the sampling distribution's, as on llama.cpp (engine/logprobs.py)
        "scheduling_policy": "priority",  # requests' `priority` (batch lines run last); FCFS within one priority
    }
    if is_reranker(config):  # a cross-encoder: vLLM's pooling runner, the classify task (engine/vllm/rerank.py)
        args["runner"] = "pooling"
        del args["logprobs_mode"]
        del args["enable_prefix_caching"]  # vLLM's choice: an encoder-only model has no KV cache to keep
    if config.get("is_encoder_decoder"):  # Whisper: vLLM caches no cross-attention prefix (it would fail the step)
        args["enable_prefix_caching"] = False
    args.update(_compilation_args(options, config))
    args.update(_distributed_args(options))
    if options.dtype != "auto":
        args["mamba_cache_dtype"] = options.dtype
    if options.kv_offloading_size > 0:
        args.update(kv_offloading_size=options.kv_offloading_size, kv_offloading_backend=options.kv_offloading_backend)
    if options.kv_events_config is not None:
        args["kv_events_config"] = dict(options.kv_events_config)  # vLLM's config validates it into KVEventsConfig
    if options.gpu_memory_utilization is not None:
        args["gpu_memory_utilization"] = options.gpu_memory_utilization
    elif kv_bytes is not None:
        args["kv_cache_memory_bytes"] = kv_bytes
    args.update(_prefill_args(options, config))
    args.update(lora_args(options.enable_lora, options.max_loras, options.max_lora_rank))
    return args


def _compilation_args(options: VllmOptions, config: dict[str, Any]) -> dict[str, Any]:
    """The engine arguments of vLLM's compilation the CPU build needs for this model, if any."""
    args: dict[str, Any] = {}
    compilation: dict[str, Any] = {}
    if options.is_cpu and cpu_rope_kernel_wrong(config):
        compilation["custom_ops"] = ["-rotary_embedding"]  # vLLM's PyTorch RoPE instead (CPU_ROPE_KERNEL_WRONG)
    if options.is_cpu and options.pipeline_parallel_size > 1 and not options.torch_compile:
        # vLLM's CPU build sets up the buffers a later pipeline stage reads only in its warm-up, which eager mode
        # skips: trace the graph once (no inductor) instead.
        args["enforce_eager"] = False
        compilation.update(mode=2, backend="eager")
    if compilation:
        args["compilation_config"] = compilation
    return args


def _distributed_args(options: VllmOptions) -> dict[str, Any]:
    """The engine arguments of the executor and the nodes a model spans, when not vLLM's defaults."""
    args: dict[str, Any] = {}
    if options.executor != "auto":
        args["distributed_executor_backend"] = options.executor
    if options.nnodes > 1:
        args.update(nnodes=options.nnodes, node_rank=options.node_rank, master_addr=options.master_addr,
                    master_port=options.master_port)
    return args


def _prefill_args(options: VllmOptions, config: dict[str, Any]) -> dict[str, Any]:
    """The engine arguments of chunked prefill (`prefill_chunk`; none for vLLM's default). An encoder-decoder model
    (Whisper) is never chunked, and its encoder's whole input (1,500 positions for Whisper) must fit one step."""
    if config.get("is_encoder_decoder"):
        return {"max_num_batched_tokens": max(options.num_ctx, int(config.get("max_source_positions") or 0), 2048)}
    if options.prefill_chunk == -1:
        args: dict[str, Any] = {"enable_chunked_prefill": False}
        if is_hybrid(config):  # vLLM keeps a hybrid model's prefix states only while it chunks prefills
            args["enable_prefix_caching"] = False
        args["max_num_batched_tokens"] = max(options.num_ctx, 2048)
        return args
    if options.prefill_chunk is not None:
        return {"enable_chunked_prefill": True,
                "max_num_batched_tokens": max(options.prefill_chunk, options.num_parallel)}
    return {}


def check_kv_offloading(options: VllmOptions, *, lmcache_installed: bool | None = None) -> None:
    """InvalidRequest unless vLLM here can offload the KV cache as `options` ask (none asked: nothing to check).

    vLLM's offloading copies KV blocks between GPU memory and CPU RAM: its CPU build's workers refuse it at start
    ("CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"), and there the KV cache, so the prefix
    cache, is in RAM already. The `lmcache` backend needs the LMCache package (`lmcache_installed`; None: look).
    """
    if options.kv_offloading_size <= 0:
        return
    if options.is_cpu:
        raise InvalidRequest("--kv-offloading-size moves vLLM's KV cache from GPU memory to CPU RAM, and this machine "
                             "runs vLLM's CPU build, whose KV cache (and prefix cache) is in RAM already and which "
                             "cannot offload: drop it (a larger CPU KV cache keeps more prefixes: --parallel x "
                             "--ctx-size, or VLLM_CPU_KVCACHE_SPACE in GiB), or serve on a GPU host with the `vllm` "
                             "package")
    if lmcache_installed is None:
        lmcache_installed = importlib.util.find_spec("lmcache") is not None
    if options.kv_offloading_backend == "lmcache" and not lmcache_installed:
        raise InvalidRequest("--kv-offloading-backend lmcache needs the LMCache package (pip install lmcache) and an "
                             "LMCache server, which vLLM reaches at tcp://localhost:5555; or use "
                             "--kv-offloading-backend native")


CPU_ROPE_KERNEL_WRONG: dict[str, str] = {
    "lfm2": "its attention norms each head of q and k, then hands RoPE a (tokens, heads, head_dim) query and key",
}
"""Model families (a prefix of config.json's model_type, its text_config's, or, case aside, an architecture's) that
vLLM's CPU `rotary_embedding` kernel computes wrongly, and why: lmserve turns the kernel off for them on CPU.

The kernel (csrc/cpu/pos_encoding.cpp) takes a 3-D query for a 2-D one: it reads one head per row (the last
dimension over head_size) and rotates only the first len(positions) rows, row r with positions[r]. Flattened,
row t*heads+h gets token r's position or none: keys and queries are right only with one head each, and a prompt
is exact only at position 0 (the identity). A tiny LFM2 is off by 0.1-4 nats from its second token on,
LFM2-MoE and the all-attention LFM2 alike; with the PyTorch form it matches transformers to 2e-5."""


def cpu_rope_kernel_wrong(config: dict[str, Any]) -> bool:
    """Whether the model config.json describes is in CPU_ROPE_KERNEL_WRONG."""
    text = config.get("text_config") or {}
    names = [str(config.get("model_type") or ""), str(text.get("model_type") or "")]
    names += [str(name).lower() for name in config.get("architectures") or []]
    return any(name.startswith(family) for name in names if name for family in CPU_ROPE_KERNEL_WRONG)


def is_hybrid(config: dict[str, Any]) -> bool:
    """Whether config.json describes a hybrid model: some layers are not attention (LFM2's convolutions)."""
    text = config.get("text_config") or config
    kinds = text.get("layer_types")
    return isinstance(kinds, list) and any("attention" not in str(kind) for kind in kinds)


def is_cpu_build() -> bool:
    """Whether vLLM runs on the CPU here (its CPU build, or no GPU it can use)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())
