#!/usr/bin/env python3
"""lmserve on the vLLM engine vs vLLM's own OpenAI server: the same model, the same settings, side by side.

Each peer runs as a subprocess on a free loopback port, one after the other (never both at once), with the same
dtype, context, sequence count, eager execution and KV cache size; the same streaming chat requests (temperature 0,
`ignore_eos`) are sent at several concurrency levels. Reports aggregate completion tokens/s and time to first token
per level, lmserve's ratio to vLLM's server, and PASS/FAIL against the goals (tokens/s >= 0.95x, TTFT <= 1.05x).
Runs on vLLM's CPU build and, unchanged, on a GPU host. See bench/README.md.

    .venv/bin/python bench/vs_vllm.py [--model DIR] [--levels 1,8,32] [--max-tokens 128] [--rounds 2]
    .venv/bin/python bench/vs_vllm.py --quick      # levels 1,2; 16 tokens; 4 requests per level
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
# bench/ itself must not be on sys.path: this file would shadow the `vllm` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

from bench.throughput import (  # noqa: E402
    RequestResult,
    StartError,
    best_levels,
    chat,
    free_port,
    ratio,
    running,
    verdict,
)
from lmserve.engine.memory_estimate import meminfo_available as available_memory  # noqa: E402
from lmserve.engine.vllm.args import VllmOptions  # noqa: E402
from lmserve.engine.vllm.memory import kv_cache_bytes  # noqa: E402

PEERS = ("vLLM", "lmserve")
SERVED_NAME = "bench"
TPS_GOAL = 0.95
"""lmserve's aggregate tokens/s at least this times vLLM's server's."""
TTFT_GOAL = 1.05
"""lmserve's mean time to first token at most this times vLLM's server's."""
GPU_MEMORY_UTILIZATION = 0.9
TOPICS = (
    "the history of the printing press", "how a steam engine works", "the water cycle",
    "the life of a honey bee", "how volcanoes form", "the rules of chess",
    "the invention of the telephone", "how bread is baked",
)
FULL = {"levels": "1,8,32", "max_tokens": 128, "requests_per_stream": 2, "min_requests": 8, "rounds": 2,
        "max_model_len": 2048, "max_num_seqs": 32}
QUICK = {"levels": "1,2", "max_tokens": 16, "requests_per_stream": 1, "min_requests": 4, "rounds": 1,
         "max_model_len": 1024, "max_num_seqs": 4}
KV_LINE = re.compile(r"KV cache size: ([\d,]+) tokens")


@dataclass
class LevelStats:
    """One peer's measurements at one concurrency level."""

    streams: int
    tokens: int
    wall: float
    ttfts: list[float] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return len(self.ttfts)

    @property
    def tps(self) -> float:
        return self.tokens / self.wall if self.wall > 0 else 0.0

    @property
    def mean_ttft(self) -> float:
        return statistics.fmean(self.ttfts) if self.ttfts else 0.0

    @property
    def median_ttft(self) -> float:
        return statistics.median(self.ttfts) if self.ttfts else 0.0


# ---- the machine and the peers ----------------------------------------------------------------------------------


def is_gpu_host() -> bool:
    """Whether vLLM will run on a CUDA GPU here: `nvidia-smi` present, or torch sees a GPU."""
    if shutil.which("nvidia-smi"):
        return True
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def machine_info(gpu: bool) -> str:
    """One line: cores, CPU model, GPU names (on a GPU host), platform."""
    cpu = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                    if line.startswith("model name")), cpu)
    info = f"{os.cpu_count()} cores ({len(os.sched_getaffinity(0))} usable), {cpu}"
    if gpu:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, check=False) if shutil.which("nvidia-smi") else None
        names = "; ".join(smi.stdout.split("\n")).strip("; ") if smi and smi.returncode == 0 else "CUDA GPU"
        info += f", GPU: {names}"
    return f"{info}, {platform.platform()}"


def cpu_kv_bytes(args: argparse.Namespace) -> int:
    """The KV cache lmserve's vLLM engine gives this model on the CPU build (engine/vllm/memory.py `kv_cache_bytes`)."""
    config = json.loads((args.model / "config.json").read_text())
    options = VllmOptions(num_ctx=args.max_model_len, num_parallel=args.max_num_seqs, dtype=args.dtype)
    return kv_cache_bytes(config, options, available_memory())


def vllm_command(args: argparse.Namespace, port: int) -> list[str]:
    """vLLM's OpenAI server with the same engine settings as lmserve's vLLM engine."""
    memory = (["--gpu-memory-utilization", str(GPU_MEMORY_UTILIZATION)] if args.gpu
              else ["--kv-cache-memory-bytes", str(args.kv_bytes)])
    # lmserve's engine logs no stats and lmserve no access lines: vLLM's server is run as lean.
    return [args.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.model),
            "--served-model-name", SERVED_NAME, "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
            "--max-num-seqs", str(args.max_num_seqs), "--enforce-eager", *memory,
            "--disable-log-stats", "--disable-uvicorn-access-log", "--host", "127.0.0.1", "--port", str(port)]


def lmserve_command(args: argparse.Namespace, port: int) -> list[str]:
    """lmserve serving the repository on its vLLM engine."""
    memory = ["--gpu-memory-utilization", str(GPU_MEMORY_UTILIZATION)] if args.gpu else []
    return [args.python, "-m", "lmserve", "serve", str(args.model), "--engine", "vllm", "--dtype", args.dtype,
            "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
            "--alias", SERVED_NAME, *memory, "--host", "127.0.0.1", "--port", str(port)]


def peer_env(store: Path) -> dict[str, str]:
    """The environment for both peers: ours without LMSERVE_* settings, the store at `store`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMSERVE_")}
    env["LMSERVE_MODELS"] = str(store)
    return env


# ---- load -------------------------------------------------------------------------------------------------------


async def measure(base: str, streams: int, per_stream: int, max_tokens: int) -> LevelStats:
    """`streams` concurrent workers each sending `per_stream` streaming chats one after the other."""
    limits = httpx.Limits(max_connections=streams + 2, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:

        async def worker(w: int) -> list[RequestResult]:
            prompts = [f"Write a long, detailed essay about {TOPICS[(w * per_stream + i) % len(TOPICS)]}."
                       for i in range(per_stream)]
            return [await chat(client, base, SERVED_NAME, p, max_tokens) for p in prompts]

        start = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(worker(w) for w in range(streams))) for r in rs]
        wall = time.perf_counter() - start
    return LevelStats(streams, sum(r.tokens for r in results), wall, [r.ttft for r in results])


def bench_peer(name: str, args: argparse.Namespace, logdir: Path, round_no: int) -> dict[int, LevelStats]:
    """Start one peer, warm it up, measure every level, stop it. Raises StartError when it does not start."""
    port = free_port()
    argv = vllm_command(args, port) if name == "vLLM" else lmserve_command(args, port)
    log = logdir / f"{name}-{round_no}.log"
    print(f"[{name}] $ {shlex.join(argv)}", flush=True)
    results: dict[int, LevelStats] = {}
    started_at = time.monotonic()
    try:
        with running(argv, port, "/health", log, args.start_timeout, env=peer_env(args.store)) as started:
            kv = KV_LINE.search(log.read_text(errors="replace"))
            print(f"[{name}] healthy after {time.monotonic() - started_at:.0f} s; "
                  f"KV cache {kv.group(1) + ' tokens' if kv else 'size not logged'}", flush=True)
            measure_levels(name, started.base, args, results)
    except StartError as e:
        raise StartError(f"{name}: {e}") from None
    return results


def measure_levels(name: str, base: str, args: argparse.Namespace, results: dict[int, LevelStats]) -> None:
    """A warm-up request, then every level into `results`; a failed request ends this peer's round."""
    try:
        asyncio.run(measure(base, 1, 1, 16))
        for streams in args.levels:
            per_stream = max(args.requests_per_stream, -(-args.min_requests // streams))
            stats = asyncio.run(measure(base, streams, per_stream, args.max_tokens))
            print(f"[{name}] {streams:>3} streams: {stats.requests} requests, {stats.tps:7.1f} tok/s, "
                  f"TTFT mean {stats.mean_ttft * 1000:.0f} ms, median {stats.median_ttft * 1000:.0f} ms", flush=True)
            results[streams] = stats
    except (httpx.HTTPError, RuntimeError, ValueError) as e:
        print(f"[{name}] requests failed: {type(e).__name__}: {e}", flush=True)


# ---- report -----------------------------------------------------------------------------------------------------


def print_table(results: dict[str, dict[int, LevelStats]], levels: list[int]) -> None:
    """Per level: both peers' tok/s and TTFT (mean/median ms), lmserve's ratios and the goals' verdicts."""
    print(f"\nlmserve (vLLM engine) vs vLLM's OpenAI server: tok/s higher is better (goal >= {TPS_GOAL}x), "
          f"TTFT mean/median ms lower is better (goal <= {TTFT_GOAL}x, on the mean)")
    print(f"{'streams':>7} {'reqs':>4} {'vLLM tok/s':>10} {'lmserve tok/s':>13} {'ratio':>6} {'tok/s':>5} "
          f"{'vLLM TTFT':>10} {'lmserve TTFT':>12} {'ratio':>6} {'TTFT':>5}")
    for streams in levels:
        theirs, ours = results["vLLM"].get(streams), results["lmserve"].get(streams)
        if theirs is None or ours is None:
            print(f"{streams:>7} (not measured for {'vLLM' if theirs is None else 'lmserve'})")
            continue
        tps, ttft = ratio(ours.tps, theirs.tps), ratio(ours.mean_ttft, theirs.mean_ttft)
        print(f"{streams:>7} {ours.requests:>4} {theirs.tps:>10.1f} {ours.tps:>13.1f} {tps:>5.2f}x "
              f"{verdict(tps >= TPS_GOAL):>5} {ms(theirs):>10} {ms(ours):>12} {ttft:>5.2f}x "
              f"{verdict(ttft <= TTFT_GOAL):>5}")


def ms(stats: LevelStats) -> str:
    return f"{stats.mean_ttft * 1000:.0f}/{stats.median_ttft * 1000:.0f}"


# ---- command line -----------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    venv_python = ROOT / ".venv/bin/python"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None,
                   help="a Hugging Face repository directory (default: the embedded SmolLM2 converted to bf16)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float16", "bfloat16", "float32"))
    p.add_argument("--max-model-len", type=int, help=f"context per sequence (default {FULL['max_model_len']})")
    p.add_argument("--max-num-seqs", type=int, help=f"sequences decoded together (default {FULL['max_num_seqs']})")
    p.add_argument("--levels", help=f"comma-separated concurrent stream counts (default {FULL['levels']})")
    p.add_argument("--max-tokens", type=int, help=f"tokens per request (default {FULL['max_tokens']})")
    p.add_argument("--requests-per-stream", type=int, help="sequential requests per stream (default 2)")
    p.add_argument("--min-requests", type=int, help="at least this many requests per level (default 8)")
    p.add_argument("--rounds", type=int, help="peers take turns this many times, order alternating; best per level "
                                              f"(default {FULL['rounds']})")
    p.add_argument("--quick", action="store_true", help="a short check: " + ", ".join(
        f"{k.replace('_', '-')} {v}" for k, v in QUICK.items()) + " (explicit options still win)")
    p.add_argument("--python", default=str(venv_python if venv_python.exists() else sys.executable),
                   help="interpreter for both servers")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for a server's /health")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.levels = [int(x) for x in str(args.levels).split(",") if x.strip()]
    if args.model is None:
        from tests.hf_repos import smollm2_repo

        args.model = smollm2_repo()
    if not (args.model / "config.json").is_file():
        p.error(f"not a Hugging Face repository (no config.json): {args.model}")
    return args


def main() -> int:
    args = parse_args()
    # SIGTERM (e.g. from `timeout`) becomes SystemExit, so the servers' context managers still kill them.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    args.gpu = is_gpu_host()
    args.kv_bytes = None if args.gpu else cpu_kv_bytes(args)
    print(f"machine: {machine_info(args.gpu)}")
    if os.getloadavg()[0] > 0.5:
        print(f"WARNING: load average {os.getloadavg()[0]:.1f} before starting: other processes will skew the numbers")
    memory = (f"--gpu-memory-utilization {GPU_MEMORY_UTILIZATION}" if args.gpu
              else f"KV cache {args.kv_bytes / 2**20:.0f} MiB (lmserve's CPU sizing)")
    print(f"model: {args.model}; dtype {args.dtype}; max-model-len {args.max_model_len}; max-num-seqs "
          f"{args.max_num_seqs}; {memory}; levels {args.levels}; {args.max_tokens} tokens per request")
    logdir = Path(tempfile.mkdtemp(prefix="lmserve-bench-vllm-"))
    args.store = logdir / "store"
    results: dict[str, dict[int, LevelStats]] = {name: {} for name in PEERS}
    try:
        for round_no in range(1, args.rounds + 1):
            order = PEERS if round_no % 2 else PEERS[::-1]
            print(f"--- round {round_no} of {args.rounds}: {' then '.join(order)}", flush=True)
            for name in order:
                results[name] = best_levels(results[name], bench_peer(name, args, logdir, round_no))
    except StartError as e:
        print(f"a server failed to start: {e}")
        return 1
    finally:
        shutil.rmtree(args.store, ignore_errors=True)
    print_table(results, args.levels)
    print(f"\nserver logs: {logdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
