"""The environment vLLM's worker processes start in: their CPU cores on the CPU build (`cpu_binding`), and over
several nodes the address this one is reached at.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from lmserve.engine.vllm.args import VllmOptions
from lmserve.errors import InvalidRequest


def cpu_binding(cpus: list[int], workers: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `workers` CPU workers (tensor x pipeline parallel): the cores split evenly,
    `0,1|2,3`. vLLM's own default binds workers to NUMA nodes, and a one-node machine has too few of them."""
    if workers > len(cpus):
        raise InvalidRequest(f"{workers} CPU workers (tensor x pipeline parallel) need as many cores; this process may "
                             f"use {len(cpus)}")
    share = len(cpus) // workers
    return "|".join(",".join(str(c) for c in cpus[i * share:(i + 1) * share]) for i in range(workers))


@contextlib.contextmanager
def environment(values: dict[str, str | None]) -> Iterator[None]:
    """Set the variables that are not None and not set already (the user's own settings win) for the block: the
    engine's processes are spawned inside it and inherit them."""
    added = {key: value for key, value in values.items() if value is not None and key not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


LORA_FIX = "LMSERVE_VLLM_CPU_LORA_FIX"
"""Set for vLLM's processes of a CPU model with LoRA: lmserve's vLLM plugin mends the CPU LoRA kernels there
(engine/vllm/plugin.py), and leaves every other vLLM run alone."""


def worker_environment(options: VllmOptions) -> dict[str, str | None]:
    """Variables vLLM's processes need here: on the CPU build with several workers, their cores; over several
    nodes, the address this node is reached at (vLLM otherwise asks for the route to a public address, which a
    cluster's private network may not have); with LoRA on the CPU build, the plugin's cue (LORA_FIX)."""
    workers = options.local_workers
    binding = cpu_binding(sorted(os.sched_getaffinity(0)), workers) if options.is_cpu and workers > 1 else None
    address = address_towards(options.master_addr) if options.nnodes > 1 else None
    lora_fix = "1" if options.enable_lora and options.is_cpu else None
    return {"VLLM_CPU_OMP_THREADS_BIND": binding, "VLLM_HOST_IP": address, LORA_FIX: lora_fix}


def address_towards(host: str) -> str | None:
    """This machine's address on the route to `host` (no packet is sent), or None."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return str(probe.getsockname()[0])
    except OSError:
        return None
