#!/usr/bin/env python3
"""Speed on a busy CPU: a short reply's latency while other programs load the cores, side by side.

Peers (each started in turn, same model file, same ``--threads``, one slot): lmserve with ``--thread-policy
adaptive`` (the default: llama.cpp computes with the cores the rest of the machine leaves free), lmserve with
``--thread-policy fixed``, and llama-server from the same llama.cpp (``make llama-server``; left out when its binary
is missing). For each peer: first on a quiet machine, the decode speed of one stream (``--idle-tokens`` (128)
tokens, ``ignore_eos``, greedy; median of ``--rounds``), then with ``--burners`` (default 2 x the cores) busy-loop
processes started by this script (a load of about 4 on 2 cores), the wall time of a ``--tokens`` (9) token reply
(greedy, ``ignore_eos``; median of ``--rounds`` (9) after one warm-up). Printed: per peer the idle tokens/s and the
loaded latency (median, max), then adaptive / fixed and adaptive / llama-server (goal under load: ≤ 0.5; idle: no
loss, ≈ 1.0).

    python bench/busy_cpu.py [--model PATH] [--threads N] [--burners N] [--rounds 9] [--tokens 9]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is no package: its scripts share code
import throughput

PROMPT = "Write a long story about a lighthouse keeper."


@dataclass
class Result:
    idle_tps: float
    loaded_s: list[float]


def burn() -> None:
    """A busy loop until killed (one core's worth of outside load)."""
    while True:
        pass


@contextlib.contextmanager
def burners(count: int) -> Iterator[None]:
    processes = [multiprocessing.Process(target=burn, daemon=True) for _ in range(count)]
    for process in processes:
        process.start()
    try:
        time.sleep(1.0)  # let the load settle (and lmserve's governor see it)
        yield
    finally:
        for process in processes:
            process.kill()
        for process in processes:
            process.join()


def measure(base: str, args: argparse.Namespace) -> Result:
    with httpx.Client(timeout=300) as client:
        model = client.get(base + "/v1/models").json()["data"][0]["id"]

        def timed(tokens: int) -> float:
            started = time.perf_counter()
            response = client.post(base + "/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens,
                "temperature": 0, "ignore_eos": True})
            response.raise_for_status()
            assert response.json()["usage"]["completion_tokens"] == tokens
            return time.perf_counter() - started

        timed(4)  # warm-up
        idle = [args.idle_tokens / timed(args.idle_tokens) for _ in range(3)]
        with burners(args.burners):
            timed(args.tokens)
            loaded = [timed(args.tokens) for _ in range(args.rounds)]
    return Result(statistics.median(idle), loaded)


@contextlib.contextmanager
def peer(name: str, args: argparse.Namespace) -> Iterator[str]:
    """The base URL of one peer, running."""
    if name.startswith("lmserve"):
        policy = name.split()[1]
        with throughput.lmserve(args, "-np", "1", "-c", "2048", "--thread-policy", policy, name="busy") as started:
            yield started.base
        return
    with throughput.llama_server(args, "-np", "1", "-c", "2048", name="busy") as started:
        yield started.base


def main() -> int:
    parser = throughput.bench_parser(__doc__)
    parser.add_argument("--burners", type=int, default=2 * (os.cpu_count() or 1))
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--tokens", type=int, default=9)
    parser.add_argument("--idle-tokens", type=int, default=128)
    args = throughput.parse_bench_args(parser)
    names = ["lmserve adaptive", "lmserve fixed"]
    if os.access(args.llama_server_bin, os.X_OK):
        names.append("llama-server")
    else:
        print(f"llama-server left out: no {args.llama_server_bin} (make llama-server)", file=sys.stderr)
    results: dict[str, Result] = {}
    for name in names:
        with peer(name, args) as base:
            results[name] = measure(base, args)
    print(f"model {args.model.name}, {args.threads} threads, {args.burners} burners on {os.cpu_count()} cores, "
          f"{args.tokens}-token reply, median of {args.rounds}")
    for name, result in results.items():
        print(f"  {name:17s} idle {result.idle_tps:6.1f} tok/s   loaded {statistics.median(result.loaded_s):6.3f} s "
              f"(max {max(result.loaded_s):6.3f} s)")
    adaptive = results["lmserve adaptive"]
    for other in names[1:]:
        ratio = statistics.median(adaptive.loaded_s) / statistics.median(results[other].loaded_s)
        print(f"  adaptive / {other}: loaded latency {ratio:.2f} (goal <= 0.5), idle tok/s "
              f"{adaptive.idle_tps / results[other].idle_tps:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
