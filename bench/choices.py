#!/usr/bin/env python3
"""What `n` costs: 4 choices of one prompt with n=4, vs 4 separate concurrent requests, vs 1 request.

One lmserve server (the default model, `--parallel 4`), streaming-free chat completions of ``--max-tokens`` (64)
tokens each, ``ignore_eos: true`` so every choice generates exactly that many, ``temperature: 1`` with a seed. The
prompt is a ~``--prompt-tokens`` (500) token text, new for every measurement (a number at its start), so no slot's
prefix cache holds it. Per round, in this order: one request with n=4; four concurrent requests (n=1, seeds
seed..seed+3, same prompt: lmserve's prefix sharing lets three of them copy the first's prefill too); one request.
Wall time from sending to the last choice done; medians over ``--rounds`` (5) after one warm-up round. Printed:
the medians, n=4 / 4 requests and n=4 / 1 request.

    python bench/choices.py [--model PATH] [--threads N] [--rounds 5] [--max-tokens 64] [--prompt-tokens 500]
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

TEXT = ("The printing press spread across Europe within fifty years of its invention, and books became cheap "
        "enough for merchants to own. ")
"""About 24 tokens; repeated to size the prompt."""


def prompt(round_id: int, num_tokens: int) -> list[dict[str, str]]:
    body = f"Document {round_id}. " + TEXT * max(1, num_tokens // 24)
    return [{"role": "user", "content": body + "\nSummarize the document in one sentence."}]


async def ask(client: httpx.AsyncClient, base: str, model: str, messages: Any, max_tokens: int, n: int,
              seed: int) -> int:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "n": n, "seed": seed,
            "temperature": 1.0, "ignore_eos": True}
    reply = await client.post(base + "/v1/chat/completions", json=body, timeout=600)
    reply.raise_for_status()
    data = reply.json()
    assert len(data["choices"]) == n
    return int(data["usage"]["completion_tokens"])


async def one_round(client: httpx.AsyncClient, base: str, model: str, round_id: int,
                    args: argparse.Namespace) -> tuple[float, float, float]:
    timings = []
    for index, shape in enumerate(("n4", "separate", "single")):
        messages = prompt(round_id * 3 + index, args.prompt_tokens)
        started = time.perf_counter()
        if shape == "n4":
            tokens = await ask(client, base, model, messages, args.max_tokens, 4, 1)
        elif shape == "separate":
            tokens = sum(await asyncio.gather(*(ask(client, base, model, messages, args.max_tokens, 1, 1 + i)
                                                for i in range(4))))
        else:
            tokens = await ask(client, base, model, messages, args.max_tokens, 1, 1)
        timings.append(time.perf_counter() - started)
        assert tokens == args.max_tokens * (1 if shape == "single" else 4), (shape, tokens)
    return timings[0], timings[1], timings[2]


async def bench(base: str, args: argparse.Namespace) -> list[tuple[float, float, float]]:
    async with httpx.AsyncClient() as client:
        model = await throughput.model_id(client, base)
        await one_round(client, base, model, 1000, args)  # warm-up
        return [await one_round(client, base, model, r, args) for r in range(args.rounds)]


def main() -> int:
    parser = throughput.bench_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=500)
    args = throughput.parse_bench_args(parser)
    with throughput.lmserve(args, "--parallel", "4", "-c", "2048", name="choices") as started:
        rounds = asyncio.run(bench(started.base, args))
    n4, separate, single = (statistics.median(column) for column in zip(*rounds, strict=True))
    print(f"model {args.model.name}, {args.threads} threads, prompt ~{args.prompt_tokens} tokens, "
          f"{args.max_tokens} tokens per choice, median of {args.rounds} rounds")
    print(f"  n=4, one request        {n4:7.3f} s")
    print(f"  4 concurrent requests   {separate:7.3f} s")
    print(f"  1 request (1 choice)    {single:7.3f} s")
    print(f"  n=4 / 4 requests        {n4 / separate:7.2f}")
    print(f"  n=4 / 1 request         {n4 / single:7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
