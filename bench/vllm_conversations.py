#!/usr/bin/env python3
"""Many conversations on the vLLM engine: does vLLM's own prefix cache serve returning turns (issue 25's workload)?

One `lmserve serve` on the vLLM engine (a subprocess on a free loopback port, as in bench/vs_vllm.py) serves N
conversations, each with its own ~900-token system prompt: turn 1 for all of them one after another, then turn 2
(turn 1's prompt + its reply + a new question) for all. Requests are streaming chat completions (temperature 0,
`ignore_eos`, `stream_options.include_usage`); TTFT is the time from sending to the first content chunk. Per
conversation count: the median TTFT of turn 1 (a cold prefill) and of turn 2, median and p90, their ratio, the
median `usage.prompt_tokens_details.cached_tokens` of turn 2 against its prompt, the returning turns that reused
at least their first prompt's full blocks, and the hit rate `/metrics` counts (lmserve_prefix_cache_hits /
lmserve_prefix_cache_queries over the count's requests). Each count gets conversations of its own. vLLM's prefix
cache lives in its KV cache, which lmserve sizes to --parallel x --ctx-size on the CPU build (VLLM_CPU_KVCACHE_SPACE
overrides it): conversations beyond that capacity evict the oldest blocks. Nothing here asserts a timing.

    .venv/bin/python bench/vllm_conversations.py [--counts 4,10] [--parallel 4] [--ctx-size 0] [--dtype float32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
# Imports from the repository root (`bench.`, `lmserve`, `tests.`), as bench/vs_vllm.py does.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

from bench.throughput import StartError, free_port, running  # noqa: E402
from bench.vs_vllm import KV_LINE, peer_env  # noqa: E402

SERVED_NAME = "bench"
CPU_BLOCK = 128
"""vLLM's KV block on its CPU build (16 on a GPU): the prefix cache reuses whole blocks only."""
WORDS = (
    "river", "mountain", "library", "garden", "engine", "harbor", "lantern", "meadow", "orchard", "compass",
    "violin", "glacier", "market", "bridge", "canyon", "festival", "island", "journal", "kitchen", "ladder",
    "museum", "notebook", "ocean", "pepper", "quarry", "rocket", "saddle", "theater", "umbrella", "valley",
    "window", "yarn", "anchor", "basket", "candle", "desert", "feather", "granite", "helmet", "ivory",
)


@dataclass
class Turn:
    """One request's measurements."""

    ttft: float
    prompt_tokens: int
    cached_tokens: int
    reply: str


@dataclass
class CountResult:
    """Both turns of every conversation at one conversation count, and the prefix-cache counters' deltas."""

    count: int
    first: list[Turn]
    second: list[Turn]
    queries: float
    hits: float


def system_prompt(name: str, tokens: int) -> str:
    """A system prompt of about `tokens` SmolLM2 tokens, its own from the first word (seeded by `name`)."""
    pick = random.Random(name)
    sentences = [f"You are the assistant of conversation {name}."]
    while len(" ".join(sentences)) < tokens * 5:  # about 5 characters per token for this text
        sentences.append(f"Rule {len(sentences)}: " + " ".join(pick.choice(WORDS) for _ in range(10)) + ".")
    return " ".join(sentences)


async def chat(client: httpx.AsyncClient, base: str, messages: list[dict[str, str]], max_tokens: int) -> Turn:
    """One streaming chat completion: its TTFT, prompt and cached tokens, and its reply."""
    body = {"model": SERVED_NAME, "messages": messages, "stream": True, "temperature": 0, "max_tokens": max_tokens,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, parts = 0.0, []
    usage: dict[str, Any] = {}
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            event = json.loads(line[5:])
            usage = event.get("usage") or usage
            for choice in event.get("choices") or []:
                text = (choice.get("delta") or {}).get("content")
                if text:
                    ttft = ttft or time.perf_counter() - start
                    parts.append(text)
    details = usage.get("prompt_tokens_details") or {}
    return Turn(ttft, int(usage.get("prompt_tokens", 0)), int(details.get("cached_tokens") or 0), "".join(parts))


async def prefix_counters(client: httpx.AsyncClient, base: str) -> tuple[float, float]:
    """lmserve_prefix_cache_queries and _hits summed over models, from /metrics."""
    text = (await client.get(base + "/metrics")).text
    totals = {"lmserve_prefix_cache_queries": 0.0, "lmserve_prefix_cache_hits": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name in totals:
                totals[name] += sample.value
    return totals["lmserve_prefix_cache_queries"], totals["lmserve_prefix_cache_hits"]


async def conversations(base: str, count: int, args: argparse.Namespace) -> CountResult:
    """`count` conversations of their own: turn 1 for all, one after another, then turn 2 for all."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0)) as client:
        before = await prefix_counters(client, base)
        histories = [[{"role": "system", "content": system_prompt(f"{count}-{i}", args.system_tokens)},
                      {"role": "user", "content": f"Conversation {i}: which rule mentions a river first?"}]
                     for i in range(count)]
        first = []
        for history in histories:
            first.append(await chat(client, base, history, args.max_tokens))
            history.append({"role": "assistant", "content": first[-1].reply})
            history.append({"role": "user", "content": "And which one mentions a violin last?"})
        second = [await chat(client, base, history, args.max_tokens) for history in histories]
        after = await prefix_counters(client, base)
    return CountResult(count, first, second, after[0] - before[0], after[1] - before[1])


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def print_table(results: list[CountResult]) -> None:
    """One row per conversation count: TTFTs (ms), turn 2's cached tokens, full-block reuse and the hit rate."""
    print(f"\n{'convs':>5} {'turn1 TTFT':>10} {'turn2 TTFT':>10} {'turn2 p90':>9} {'ratio':>6} {'turn1 prompt':>12} "
          f"{'turn2 cached/prompt':>19} {'reused':>6} {'hit rate':>8}")
    for r in results:
        one = statistics.median(t.ttft for t in r.first)
        two = statistics.median(t.ttft for t in r.second)
        prompt = statistics.median(t.prompt_tokens for t in r.first)
        cached = statistics.median(t.cached_tokens for t in r.second)
        prompt2 = statistics.median(t.prompt_tokens for t in r.second)
        reused = sum(t2.cached_tokens >= t1.prompt_tokens // CPU_BLOCK * CPU_BLOCK
                     for t1, t2 in zip(r.first, r.second, strict=True))
        rate = r.hits / r.queries if r.queries else float("nan")
        tail = p90([t.ttft for t in r.second])
        print(f"{r.count:>5} {one * 1000:>8.0f}ms {two * 1000:>8.0f}ms {tail * 1000:>7.0f}ms "
              f"{two / one:>5.2f}x {prompt:>12.0f} {f'{cached:.0f}/{prompt2:.0f}':>19} "
              f"{f'{reused}/{r.count}':>6} {rate:>8.1%}")


def lmserve_command(args: argparse.Namespace, port: int) -> list[str]:
    """lmserve serving the repository on its vLLM engine."""
    context = ["--ctx-size", str(args.ctx_size)] if args.ctx_size else []
    return [args.python, "-m", "lmserve", "serve", str(args.model), "--engine", "vllm", "--dtype", args.dtype,
            "--parallel", str(args.parallel), *context, "--alias", SERVED_NAME, "--host", "127.0.0.1",
            "--port", str(port)]


def run(args: argparse.Namespace, logdir: Path) -> list[CountResult]:
    """Start the server, warm it up, run every conversation count, stop it."""
    port = free_port()
    argv = lmserve_command(args, port)
    log = logdir / "lmserve.log"
    print(f"$ {shlex.join(argv)}", flush=True)
    results = []
    with running(argv, port, "/health", log, args.start_timeout, env=peer_env(logdir / "store")) as started:
        kv = KV_LINE.search(log.read_text(errors="replace"))
        print(f"healthy; vLLM's KV cache (and so its prefix cache): {kv.group(1) + ' tokens' if kv else 'not logged'}",
              flush=True)
        asyncio.run(warm_up(started.base))
        for count in args.counts:
            results.append(asyncio.run(conversations(started.base, count, args)))
            print(f"{count} conversations done", flush=True)
    return results


async def warm_up(base: str) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0)) as client:
        await chat(client, base, [{"role": "user", "content": "Hello"}], 4)


def parse_args() -> argparse.Namespace:
    venv_python = ROOT / ".venv/bin/python"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None,
                   help="a Hugging Face repository directory (default: the embedded SmolLM2 as safetensors, the "
                   "tests' `smollm2_repo()`)")
    p.add_argument("--counts", default="4,10", help="comma-separated conversation counts (default 4,10)")
    p.add_argument("--parallel", type=int, default=4, help="sequences decoded together (default 4)")
    p.add_argument("--ctx-size", type=int, default=0, help="context per sequence (default 0: lmserve's auto)")
    p.add_argument("--dtype", default="float32", choices=("auto", "float16", "bfloat16", "float32"))
    p.add_argument("--system-tokens", type=int, default=900, help="about this many tokens of system prompt each")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per reply (default 16)")
    p.add_argument("--python", default=str(venv_python if venv_python.exists() else sys.executable))
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for /health")
    args = p.parse_args()
    args.counts = [int(x) for x in args.counts.split(",") if x.strip()]
    if args.model is None:
        from tests.hf_repos import smollm2_repo

        args.model = smollm2_repo()
    return args


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # the server is still stopped
    if os.getloadavg()[0] > 0.5:
        print(f"WARNING: load average {os.getloadavg()[0]:.1f} before starting: other processes will skew TTFTs")
    print(f"model: {args.model}; dtype {args.dtype}; --parallel {args.parallel}; ~{args.system_tokens}-token system "
          f"prompts; {args.max_tokens} tokens per reply; counts {args.counts}")
    logdir = Path(tempfile.mkdtemp(prefix="lmserve-bench-vllm-conversations-"))
    try:
        results = run(args, logdir)
    except StartError as e:
        print(f"the server failed to start: {e}")
        return 1
    print_table(results)
    print(f"\nserver log: {logdir / 'lmserve.log'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
