#!/usr/bin/env python3
"""What logprobs cost: decode tokens/s with and without `logprobs: true, top_logprobs: 5`, at 1 and 8 streams.

One lmserve server (the default model, `--parallel 8`), chat completions of ``--max-tokens`` (128) tokens each,
``ignore_eos: true`` so every request generates exactly that many, ``temperature: 0``, short prompts. Per round and
per stream count, the plain requests then the logprob requests (``streams`` concurrent requests each); tokens/s is
all completion tokens over the wall time, median over ``--rounds`` (3) after one warm-up round. Printed: tokens/s of
each, and logprobs / plain.

    python bench/logprobs.py [--model PATH] [--threads N] [--rounds 3] [--max-tokens 128] [--streams 1,8]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is no package: its scripts share code
import throughput

TOPICS = ["rivers", "mountains", "cities", "music", "bridges", "forests", "trains", "oceans"]


async def ask(client: httpx.AsyncClient, base: str, model: str, index: int, max_tokens: int,
              logprobs: bool) -> int:
    body: dict[str, Any] = {
        "model": model, "messages": [{"role": "user", "content": f"Write a long essay about {TOPICS[index % 8]}."}],
        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
    }
    if logprobs:
        body.update(logprobs=True, top_logprobs=5)
    reply = await client.post(base + "/v1/chat/completions", json=body, timeout=600)
    reply.raise_for_status()
    data = reply.json()
    if logprobs:
        assert len(data["choices"][0]["logprobs"]["content"]) == max_tokens
    return int(data["usage"]["completion_tokens"])


async def rate(client: httpx.AsyncClient, base: str, model: str, streams: int, args: argparse.Namespace,
               logprobs: bool) -> float:
    started = time.perf_counter()
    tokens = sum(await asyncio.gather(*(ask(client, base, model, i, args.max_tokens, logprobs)
                                        for i in range(streams))))
    return tokens / (time.perf_counter() - started)


async def bench(base: str, args: argparse.Namespace) -> dict[tuple[int, bool], list[float]]:
    results: dict[tuple[int, bool], list[float]] = {}
    async with httpx.AsyncClient() as client:
        model = await throughput.model_id(client, base)
        for streams in args.streams:  # warm-up
            await rate(client, base, model, streams, args, True)
        for _ in range(args.rounds):
            for streams in args.streams:
                for logprobs in (False, True):
                    results.setdefault((streams, logprobs), []).append(
                        await rate(client, base, model, streams, args, logprobs))
    return results


def main() -> int:
    parser = throughput.bench_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--streams", type=lambda text: [int(x) for x in text.split(",")], default=[1, 8])
    args = throughput.parse_bench_args(parser)
    with throughput.lmserve(args, "--parallel", "8", "-c", "1024", name="logprobs") as started:
        results = asyncio.run(bench(started.base, args))
    print(f"model {args.model.name}, {args.threads} threads, {args.max_tokens} tokens per request, "
          f"median of {args.rounds} rounds")
    for streams in args.streams:
        plain = statistics.median(results[streams, False])
        with_logprobs = statistics.median(results[streams, True])
        print(f"  {streams} stream(s): plain {plain:7.1f} tok/s, top_logprobs=5 {with_logprobs:7.1f} tok/s, "
              f"ratio {with_logprobs / plain:5.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
