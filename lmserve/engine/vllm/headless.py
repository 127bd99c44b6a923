"""A headless node: this machine's share (vLLM's workers, no HTTP) of a model whose rank-0 node serves it."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

from lmserve.engine.lifeline import LIFELINE
from lmserve.engine.memory_estimate import meminfo_available as available_memory
from lmserve.engine.vllm.args import VllmOptions, engine_args
from lmserve.engine.vllm.memory import context_choice, kv_cache_bytes
from lmserve.engine.vllm.workers import environment, worker_environment
from lmserve.errors import InvalidRequest

log = logging.getLogger(__name__)


def serve_headless(path: Path, options: VllmOptions) -> None:
    """Run this node's vLLM workers for a model whose rank-0 node serves HTTP, until SIGTERM/SIGINT, a worker dies,
    or the rank-0 node is gone (its rendezvous port stops answering). Blocking."""
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
    with environment(worker_environment(options)):
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
