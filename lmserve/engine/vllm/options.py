"""The vLLM engine's launch options: its flags and LMSERVE_* variables, declared as the server's own are
(option_table.py). config.py gathers them into the server's options table."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from lmserve.option_table import ConfigError, option


@dataclass(frozen=True, slots=True)
class VllmLaunch:
    """What `lmserve serve` is started with for the models vLLM serves; each field is one option."""

    dtype: str = option("auto", "--dtype", env="DTYPE", choices=("auto", "float16", "bfloat16", "float32"),
                        help="weight and activation dtype (a hybrid model's convolution state follows it)")
    gpu_memory_utilization: float | None = option(None, "--gpu-memory-utilization", env="GPU_MEMORY_UTILIZATION",
                                                  kind="float", minimum=0.0, maximum=1.0, metavar="F",
                                                  shown="vLLM's 0.9 on a GPU",
                                                  help="fraction of GPU memory for weights and KV cache, 0-1 (GPU "
                                                  "only: vLLM's CPU build sizes its KV cache for --parallel x "
                                                  "--ctx-size)")
    tensor_parallel_size: int = option(1, "-tp", "--tensor-parallel-size", env="TENSOR_PARALLEL_SIZE", kind="int",
                                       minimum=1, metavar="N", help="GPUs (or CPU workers) each layer is split over")
    pipeline_parallel_size: int = option(1, "-pp", "--pipeline-parallel-size", env="PIPELINE_PARALLEL_SIZE",
                                         kind="int", minimum=1, metavar="N", help="stages the layers are split into")
    data_parallel_size: int = option(1, "-dp", "--data-parallel-size", env="DATA_PARALLEL_SIZE", kind="int",
                                     minimum=1, metavar="N", help="replicas of the model")
    nnodes: int = option(1, "--nnodes", env="NNODES", kind="int", minimum=1, metavar="N",
                         help="machines one model spans (vLLM's multiprocessing multi-node: start the same command "
                         "on each, with its --node-rank)")
    node_rank: int = option(0, "--node-rank", env="NODE_RANK", kind="int", minimum=0, metavar="R",
                            help="this machine's rank among --nnodes; rank 0 serves HTTP, the others run --headless")
    master_addr: str = option("127.0.0.1", "--master-addr", env="MASTER_ADDR", metavar="ADDR",
                              help="the address of node rank 0, which the other nodes join")
    master_port: int = option(29501, "--master-port", env="MASTER_PORT", kind="int", minimum=1, maximum=65535,
                              metavar="PORT", help="the port node rank 0 is joined on")
    distributed_executor_backend: str = option("auto", "--distributed-executor-backend", choices=("auto", "mp", "ray"),
                                               env="DISTRIBUTED_EXECUTOR_BACKEND",
                                               help="how vLLM runs its workers: mp (processes, and --nnodes over "
                                               "machines) or ray (a Ray cluster's GPUs; start Ray first)")
    headless: bool = option(False, "--headless", env="HEADLESS", kind="bool",
                            help="run this node's vLLM workers only (no HTTP); it ends when node rank 0 does")
    enable_torch_compile: bool = option(False, "--enable-torch-compile", env="ENABLE_TORCH_COMPILE", kind="bool",
                                        help="compile the model (and capture CUDA graphs): longer start, faster "
                                        "tokens; off runs eagerly")
    kv_offloading_size: float = option(0.0, "--kv-offloading-size", env="KV_OFFLOADING_SIZE", kind="float",
                                       minimum=0.0, metavar="GIB", shown="0, off",
                                       help="GiB of CPU RAM that KV blocks leaving the GPU's KV cache go to, so a "
                                       "returning prompt's prefix is copied back instead of prefilled (GPU only: "
                                       "vLLM's CPU build keeps its KV cache in RAM already)")
    kv_offloading_backend: str = option("native", "--kv-offloading-backend", env="KV_OFFLOADING_BACKEND",
                                        choices=("native", "lmcache"),
                                        help="who keeps the offloaded KV blocks (with --kv-offloading-size): native "
                                        "(vLLM's CPU offloading) or lmcache (an LMCache server, which sizes its own "
                                        "RAM and disk tiers)")
    kv_events_config: str | None = option(None, "--kv-events-config", env="KV_EVENTS_CONFIG", metavar="JSON",
                                          shown="none, off",
                                          help="publish vLLM's KV cache events (BlockStored, BlockRemoved, "
                                          "AllBlocksCleared) for a cache-aware router such as llm-d's: vLLM's "
                                          "KVEventsConfig as a JSON object, e.g. '{\"enable_kv_cache_events\": "
                                          "true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", "
                                          "\"topic\": \"kv@pod@model\"}' (one vLLM model per endpoint)")

    @staticmethod
    def check(values: Mapping[str, object], sources: Mapping[str, str]) -> None:
        """Refuse what no single option's reading catches (ConfigError naming the source): --kv-events-config
        must be a JSON object (its fields are vLLM's to check when a model loads)."""
        text = values.get("kv_events_config")
        if isinstance(text, str):
            kv_events_config(text, sources["kv_events_config"])


def kv_events_config(text: str, source: str = "--kv-events-config") -> dict[str, object]:
    """The JSON object --kv-events-config gives (vLLM's KVEventsConfig fields); ConfigError naming `source`."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{source} must be a JSON object (vLLM's KVEventsConfig), got {text!r}: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{source} must be a JSON object (vLLM's KVEventsConfig), got {text!r}")
    return value
