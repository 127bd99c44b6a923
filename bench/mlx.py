#!/usr/bin/env python3
"""lmserve on the MLX engine vs mlx-lm's own server (`mlx_lm.server`): the same model, the same settings.

Each peer runs as a subprocess on a free loopback port, one after the other (never both at once), on the same
Hugging Face safetensors repository with the same batch size: lmserve gets `-np P` and mlx_lm.server
`--decode-concurrency P --prompt-concurrency P` (P = `--parallel`, default the largest level). Both compute alike:
- in the same dtype (`--dtype`; auto: what lmserve's engine picks, float32 on a CPU, the repository's own on Metal).
  lmserve is given `--mlx-dtype D`; mlx_lm.server computes in the dtype the weights are stored in and has no flag
  for it, so where D differs it serves a copy of the repository converted to D (made once per run, untimed);
- with the same BLAS: on Linux lmserve's engine loads the system's OpenBLAS in place of the reference BLAS MLX's
  CPU wheel bundles (lmserve/engine/mlx/runtime.py), so mlx_lm.server gets it too, through LD_PRELOAD.

The same streaming chat requests are sent to both at several concurrency levels: temperature 0, `max_tokens`, no
`seed` (a seeded request makes mlx_lm.server serve one request at a time) and no `ignore_eos` (mlx_lm.server does
not read it), so the prompts are open-ended "write a long essay" ones and the tokens each server really returned
are counted: from `usage.completion_tokens` in the stream's final chunk (`stream_options.include_usage`; both
servers send it, mlx_lm.server counting the end-of-sequence token of a reply that stops), or, where a server sends
no usage, one per content chunk. Each level's line prints the tokens per request and which count was used.

Reports aggregate completion tokens/s and time to first token per level, lmserve's ratio to mlx_lm.server, and
PASS/FAIL against the goals (tokens/s >= 1.0x, mean TTFT <= 1.0x). Runs on MLX's CPU build (Linux) and, unchanged,
on a Mac (Metal); the header prints the platform and MLX's default device. See bench/README.md.

    .venv/bin/python bench/mlx.py [--model DIR] [--dtype auto] [--levels 1,4,8] [--max-tokens 128] [--rounds 2]
    .venv/bin/python bench/mlx.py --quick      # levels 1,2; 16 tokens; 4 requests per level; 1 round
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes.util
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
# bench/ itself must not be on sys.path: this file would shadow the `mlx` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

from bench.throughput import StartError, best_levels, free_port, ratio, running, verdict  # noqa: E402

PEERS = ("mlx_lm.server", "lmserve")
MODEL_NAMES = {"mlx_lm.server": "default_model", "lmserve": "bench"}
"""The `model` each peer is asked for: mlx_lm.server loads any other name (its /v1/models shows the resolved path)
as a second model; lmserve is started with `--alias bench`."""
TPS_GOAL = 1.0
"""lmserve's aggregate tokens/s at least this times mlx_lm.server's."""
TTFT_GOAL = 1.0
"""lmserve's mean time to first token at most this times mlx_lm.server's."""
TOPICS = (
    "the history of the printing press", "how a steam engine works", "the water cycle",
    "the life of a honey bee", "how volcanoes form", "the rules of chess",
    "the invention of the telephone", "how bread is baked",
)
FULL = {"levels": "1,4,8", "max_tokens": 128, "requests_per_stream": 2, "min_requests": 8, "rounds": 2}
QUICK = {"levels": "1,2", "max_tokens": 16, "requests_per_stream": 1, "min_requests": 4, "rounds": 1}
PROBE = """import importlib.metadata as m, json, platform, mlx.core as mx
print(json.dumps({"platform": platform.platform(), "mlx": mx.__version__, "device": str(mx.default_device()),
                  "cpu": mx.default_device() == mx.cpu, "mlx_lm": m.version("mlx-lm")}))
"""
CONVERT = """import shutil, sys
from pathlib import Path
import mlx.core as mx
src, dst, dtype = Path(sys.argv[1]), Path(sys.argv[2]), getattr(mx, sys.argv[3])
dst.mkdir(parents=True)
for f in sorted(p for p in src.iterdir() if p.is_file()):
    if f.suffix != ".safetensors":
        shutil.copy(f, dst / f.name)
        continue
    weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in mx.load(str(f)).items()}
    mx.save_safetensors(str(dst / f.name), weights, metadata={"format": "mlx"})
"""
"""Writes a copy of a repository (argv[1]) to argv[2] with its floating-point tensors in dtype argv[3], as
lmserve's engine casts them at load (`model.set_dtype`); a quantized repository's packed weights stay as they are."""
SAFETENSORS_FLOATS = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


@dataclass
class Reply:
    """One streamed chat completion as the client saw it."""

    tokens: int
    from_usage: bool
    ttft: float


@dataclass
class LevelStats:
    """One peer's measurements at one concurrency level."""

    streams: int
    tokens: int
    wall: float
    ttfts: list[float] = field(default_factory=list)
    from_usage: int = 0

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

    @property
    def counted(self) -> str:
        """How the completion tokens were counted."""
        if self.from_usage == self.requests:
            return "usage"
        return "content chunks" if self.from_usage == 0 else f"usage for {self.from_usage}, chunks for the rest"


# ---- the machine and the peers ----------------------------------------------------------------------------------


def machine_info() -> str:
    """One line: cores and the CPU model (Linux's /proc/cpuinfo, macOS's sysctl)."""
    cpu = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                    if line.startswith("model name")), cpu)
    elif platform.system() == "Darwin" and shutil.which("sysctl"):
        out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                             check=False)
        cpu = out.stdout.strip() or cpu
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{os.cpu_count()} cores ({usable} usable), {cpu}"


def mlx_info(python: str) -> dict[str, Any]:
    """The platform, MLX's version and default device, mlx-lm's version, as the servers' interpreter sees them.
    Raises StartError where that interpreter cannot import MLX or has no mlx-lm."""
    out = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or ["?"])[-1]
        raise StartError(f"{python} has no working MLX / mlx-lm ({tail}); "
                         f"install them: {python} -m pip install 'mlx[cpu]' mlx-lm  (on a Mac: mlx mlx-lm)")
    info: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return info


def stored_dtype(model: Path) -> str:
    """The floating-point dtype most of the repository's tensors are stored in (from the safetensors headers)."""
    counts: Counter[str] = Counter()
    for file in model.glob("*.safetensors"):
        with file.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        counts.update(SAFETENSORS_FLOATS[v["dtype"]] for k, v in header.items()
                      if k != "__metadata__" and v["dtype"] in SAFETENSORS_FLOATS)
    return counts.most_common(1)[0][0] if counts else "float32"


def mlx_lm_model(args: argparse.Namespace, folder: Path) -> Path:
    """The repository for mlx_lm.server: the model itself where it is stored in `args.dtype`, else a copy converted
    to it under `folder`."""
    if stored_dtype(args.model) == args.dtype:
        return Path(args.model)
    copy = folder / f"model-{args.dtype}"
    print(f"mlx_lm.server computes in the stored dtype ({stored_dtype(args.model)}): converting a copy to "
          f"{args.dtype} in {copy}", flush=True)
    out = subprocess.run([args.python, "-c", CONVERT, str(args.model), str(copy), args.dtype], capture_output=True,
                         text=True, check=False)
    if out.returncode != 0:
        raise StartError(f"converting {args.model} to {args.dtype} failed: {out.stderr.strip()[-1000:]}")
    return copy


def openblas() -> str | None:
    """The OpenBLAS lmserve's MLX engine loads on Linux (the name `ctypes.util.find_library` gives), or None: on
    macOS (Accelerate), or where it is not installed (then both peers use the wheel's reference BLAS)."""
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.util.find_library("openblas")


def mlx_lm_command(args: argparse.Namespace, port: int) -> list[str]:
    """mlx-lm's server, batching as many sequences as lmserve's slots, INFO logging off (lmserve logs nothing per
    request either). `python -m mlx_lm server` is `python -m mlx_lm.server` without its deprecation notice."""
    p = str(args.parallel)
    return [args.python, "-m", "mlx_lm", "server", "--model", str(args.mlx_lm_model), "--decode-concurrency", p,
            "--prompt-concurrency", p, "--log-level", "WARNING", "--host", "127.0.0.1", "--port", str(port)]


def lmserve_command(args: argparse.Namespace, port: int) -> list[str]:
    """lmserve serving the repository on its MLX engine."""
    return [args.python, "-m", "lmserve", "serve", str(args.model), "--engine", "mlx", "--mlx-dtype", args.dtype,
            "-np", str(args.parallel), "--alias", MODEL_NAMES["lmserve"], "--host", "127.0.0.1", "--port", str(port)]


def peer_env(name: str, args: argparse.Namespace) -> dict[str, str]:
    """The environment for a peer: ours without LMSERVE_* settings, the store at `args.store`; mlx_lm.server's
    with OpenBLAS preloaded where lmserve's engine loads it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMSERVE_")}
    env["LMSERVE_MODELS"] = str(args.store)
    if name == "mlx_lm.server" and args.openblas:
        env["LD_PRELOAD"] = " ".join(filter(None, (args.openblas, env.get("LD_PRELOAD"))))
    return env


# ---- load -------------------------------------------------------------------------------------------------------


async def chat(client: httpx.AsyncClient, base: str, model: str, prompt: str, max_tokens: int) -> Reply:
    """One streaming chat completion: its completion tokens (usage, else content chunks) and time to first token."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True, "temperature": 0,
            "max_tokens": max_tokens, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, chunks, usage_tokens, last = 0.0, 0, None, ""
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue  # blank lines, and mlx_lm.server's ": keepalive n/m" comments during a prefill
            last = line[5:].strip()
            event = json.loads(last)
            if event.get("usage"):
                usage_tokens = event["usage"].get("completion_tokens")
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    chunks += 1
                    ttft = ttft or time.perf_counter() - start
    if chunks == 0:
        raise RuntimeError(f"a stream ended without content; its last event: {last[:300]}")
    if usage_tokens is None:
        return Reply(chunks, False, ttft)
    return Reply(int(usage_tokens), True, ttft)


async def measure(base: str, model: str, streams: int, per_stream: int, max_tokens: int) -> LevelStats:
    """`streams` concurrent workers each sending `per_stream` streaming chats one after the other."""
    limits = httpx.Limits(max_connections=streams + 2, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:

        async def worker(w: int) -> list[Reply]:
            prompts = [f"Write a long, detailed essay about {TOPICS[(w * per_stream + i) % len(TOPICS)]}."
                       for i in range(per_stream)]
            return [await chat(client, base, model, p, max_tokens) for p in prompts]

        start = time.perf_counter()
        replies = [r for rs in await asyncio.gather(*(worker(w) for w in range(streams))) for r in rs]
        wall = time.perf_counter() - start
    return LevelStats(streams, sum(r.tokens for r in replies), wall, [r.ttft for r in replies],
                      sum(r.from_usage for r in replies))


def bench_peer(name: str, args: argparse.Namespace, logdir: Path, round_no: int) -> dict[int, LevelStats]:
    """Start one peer, warm it up, measure every level, stop it. Raises StartError when it does not start."""
    port = free_port()
    argv = mlx_lm_command(args, port) if name == "mlx_lm.server" else lmserve_command(args, port)
    log = logdir / f"{name}-{round_no}.log"
    env = peer_env(name, args)
    preload = f"LD_PRELOAD={env['LD_PRELOAD']} " if name == "mlx_lm.server" and "LD_PRELOAD" in env else ""
    print(f"[{name}] $ {preload}{shlex.join(argv)}", flush=True)
    results: dict[int, LevelStats] = {}
    started_at = time.monotonic()
    try:
        with running(argv, port, "/health", log, args.start_timeout, env=env) as started:
            print(f"[{name}] healthy after {time.monotonic() - started_at:.0f} s", flush=True)
            measure_levels(name, started.base, args, results)
    except StartError as e:
        raise StartError(f"{name}: {e}") from None
    return results


def measure_levels(name: str, base: str, args: argparse.Namespace, results: dict[int, LevelStats]) -> None:
    """Warm-up (one request, then one per stream of the largest level), then every level into `results`; a failed
    request ends this peer's round."""
    model = MODEL_NAMES[name]
    try:
        # mlx_lm.server answers /health before its model is loaded (it loads on its generation thread), and MLX
        # builds its kernels for each new batch shape on first use: neither is timed.
        started_at = time.monotonic()
        asyncio.run(measure(base, model, 1, 1, 16))
        asyncio.run(measure(base, model, max(args.levels), 1, 16))
        print(f"[{name}] warm-up took {time.monotonic() - started_at:.0f} s", flush=True)
        for streams in args.levels:
            per_stream = max(args.requests_per_stream, -(-args.min_requests // streams))
            stats = asyncio.run(measure(base, model, streams, per_stream, args.max_tokens))
            print(f"[{name}] {streams:>3} streams: {stats.requests} requests, {stats.tokens / stats.requests:.1f} "
                  f"tokens each ({stats.counted}), {stats.tps:7.1f} tok/s, TTFT mean {stats.mean_ttft * 1000:.0f} "
                  f"ms, median {stats.median_ttft * 1000:.0f} ms", flush=True)
            results[streams] = stats
    except (httpx.HTTPError, RuntimeError, ValueError) as e:
        print(f"[{name}] requests failed: {type(e).__name__}: {e}", flush=True)


# ---- report -----------------------------------------------------------------------------------------------------


def ms(stats: LevelStats) -> str:
    return f"{stats.mean_ttft * 1000:.0f}/{stats.median_ttft * 1000:.0f}"


def print_table(results: dict[str, dict[int, LevelStats]], levels: list[int]) -> None:
    """Per level: both peers' tok/s and TTFT (mean/median ms), lmserve's ratios and the goals' verdicts."""
    print(f"\nlmserve (MLX engine) vs mlx_lm.server: tok/s higher is better (goal >= {TPS_GOAL}x), "
          f"TTFT mean/median ms lower is better (goal <= {TTFT_GOAL}x, on the mean)")
    print(f"{'streams':>7} {'reqs':>4} {'mlx_lm tok/s':>12} {'lmserve tok/s':>13} {'ratio':>6} {'tok/s':>5} "
          f"{'mlx_lm TTFT':>11} {'lmserve TTFT':>12} {'ratio':>6} {'TTFT':>5}")
    for streams in levels:
        theirs, ours = results["mlx_lm.server"].get(streams), results["lmserve"].get(streams)
        if theirs is None or ours is None:
            print(f"{streams:>7} (not measured for {'mlx_lm.server' if theirs is None else 'lmserve'})")
            continue
        tps, ttft = ratio(ours.tps, theirs.tps), ratio(ours.mean_ttft, theirs.mean_ttft)
        print(f"{streams:>7} {ours.requests:>4} {theirs.tps:>12.1f} {ours.tps:>13.1f} {tps:>5.2f}x "
              f"{verdict(tps >= TPS_GOAL):>5} {ms(theirs):>11} {ms(ours):>12} {ttft:>5.2f}x "
              f"{verdict(ttft <= TTFT_GOAL):>5}")


# ---- command line -----------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    venv_python = ROOT / ".venv/bin/python"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None,
                   help="a Hugging Face safetensors repository directory (default: the embedded SmolLM2 converted "
                   "to bf16, tests.hf_repos.smollm2_repo())")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"),
                   help="the dtype both compute in (default auto: float32 on a CPU, the repository's own on a GPU, "
                   "as lmserve's --mlx-dtype auto)")
    p.add_argument("--parallel", type=int, default=None,
                   help="lmserve's -np and mlx_lm.server's --decode-concurrency and --prompt-concurrency "
                   "(default: the largest level)")
    p.add_argument("--levels", help=f"comma-separated concurrent stream counts (default {FULL['levels']})")
    p.add_argument("--max-tokens", type=int, help=f"max_tokens per request (default {FULL['max_tokens']})")
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
    if not args.levels or min(args.levels) < 1:
        p.error(f"--levels needs positive stream counts: {args.levels}")
    if args.parallel is None:
        args.parallel = max(args.levels)
    if args.model is None:
        from tests.hf_repos import smollm2_repo

        args.model = smollm2_repo()
    args.model = args.model.resolve()
    if not (args.model / "config.json").is_file():
        p.error(f"not a Hugging Face repository (no config.json): {args.model}")
    return args


def main() -> int:
    args = parse_args()
    # SIGTERM (e.g. from `timeout`) becomes SystemExit, so the servers' context managers still kill them.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        mlx = mlx_info(args.python)
    except StartError as e:
        print(f"cannot run: {e}")
        return 1
    if args.dtype == "auto":
        args.dtype = "float32" if mlx["cpu"] else stored_dtype(args.model)
    args.openblas = openblas() if mlx["cpu"] else None
    print(f"machine: {machine_info()}")
    print(f"platform: {mlx['platform']}; MLX {mlx['mlx']}, default device {mlx['device']}; mlx-lm {mlx['mlx_lm']}")
    if os.getloadavg()[0] > 0.5:
        print(f"WARNING: load average {os.getloadavg()[0]:.1f} before starting: other processes will skew the numbers")
    if not mlx["cpu"]:
        blas = "none (matrix products on the GPU)"
    elif sys.platform == "darwin":
        blas = "Accelerate"
    elif args.openblas:
        blas = f"{args.openblas} (lmserve's engine loads it; mlx_lm.server through LD_PRELOAD)"
    else:
        blas = "MLX's bundled reference BLAS (no OpenBLAS here: both slow; apt-get install libopenblas0-pthread)"
    print(f"model: {args.model} (stored {stored_dtype(args.model)}); computing in {args.dtype}; BLAS: {blas}")
    print(f"parallel {args.parallel} (lmserve -np, mlx_lm.server --decode-concurrency and --prompt-concurrency); "
          f"levels {args.levels}; max_tokens {args.max_tokens}", flush=True)
    logdir = Path(tempfile.mkdtemp(prefix="lmserve-bench-mlx-"))
    args.store = logdir / "store"
    results: dict[str, dict[int, LevelStats]] = {name: {} for name in PEERS}
    try:
        args.mlx_lm_model = mlx_lm_model(args, logdir)
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
        shutil.rmtree(logdir / f"model-{args.dtype}", ignore_errors=True)
    print_table(results, args.levels)
    print(f"\nserver logs: {logdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
