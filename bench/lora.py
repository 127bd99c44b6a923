#!/usr/bin/env python3
"""LoRA adapters mixed in one batch (issue 44): lmserve vs llama-server, side by side, alternating rounds.

Both serve the same GGUF with the same four GGUF LoRA adapters (default: the embedded SmolLM2-135M Q4_1 and four
rank-8 adapters of it, made by peft and llama.cpp's converter as the tests make them: tests/lora_adapters.py) on
``--parallel`` (8) slots of ``-c`` (1024) tokens:
- lmserve: ``--lora a0=PATH …``; a stream asks for the model ``aK`` (or the base);
- llama-server: ``--lora PATH … --lora-init-without-apply``; a stream sends ``lora: [{"id": K, "scale": 1}]``.
Two workloads per peer, ``--streams`` (8) concurrent streams of ``--requests`` (2) greedy chats each, ``--max-tokens``
(128) tokens (``ignore_eos``):
- base: every stream on the base;
- mixed: stream i on the base when i % 5 == 0, else on adapter (i % 5) - 1: the base and four adapters evenly.
Printed: aggregate tokens/s (all tokens over the wall time) per peer and workload (best of ``--rounds``, 2), the
mixed ÷ base ratio of each peer (goal of issue 44: >= 0.8) and lmserve's mixed ÷ llama-server's mixed (goal >= 1.0).

Peers ``vllm`` and ``mlx`` (``--peers lmserve,llama-server,vllm``) are lmserve on those engines, serving the same
model as a safetensors repository (tests/hf_repos.py) with the same four adapters as PEFT directories, as the tests
make them; ``--repo`` and ``--peft`` (4 of them) give others. Peer ``vllm-serve`` is vLLM's own server over the same
repository and adapters (``--enable-lora --lora-modules``): the reference for what vLLM's CPU LoRA kernels cost anyway.

    .venv/bin/python bench/lora.py [--streams 8] [--requests 2] [--max-tokens 128] [--rounds 2] [--lora PATH ...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is no package: its scripts share code
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' adapter maker
import throughput

ADAPTERS = 4
MIXED_GOAL = 0.8
PEER_GOAL = 1.0


def adapter_paths(given: list[str] | None) -> list[str]:
    if given:
        return given
    from tests.lora_adapters import smollm2_lora_gguf

    return [str(smollm2_lora_gguf(seed)) for seed in range(1, ADAPTERS + 1)]


ENGINES = ("vllm", "mlx")
"""Peers that are lmserve on another engine (over a safetensors repository and PEFT adapters)."""


def peft_paths(given: list[str] | None) -> list[str]:
    if given:
        return given
    from tests.lora_adapters import smollm2_peft

    return [str(smollm2_peft(seed)) for seed in range(1, ADAPTERS + 1)]


def pick(peer: str, stream: int, mixed: bool, base_model: str) -> tuple[str, dict[str, Any]]:
    """The model and extra body fields of a stream: the base, or adapter K, in each peer's own way."""
    k = stream % (ADAPTERS + 1) - 1 if mixed else -1
    if k < 0:
        return base_model, {}
    if peer != "llama-server":
        return f"a{k}", {}
    return base_model, {"lora": [{"id": k, "scale": 1.0}]}


async def chat(client: httpx.AsyncClient, base: str, model: str, extra: dict[str, Any], prompt: str,
               max_tokens: int) -> int:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True, "temperature": 0,
            "max_tokens": max_tokens, "ignore_eos": True, "stream_options": {"include_usage": True}, **extra}
    tokens = 0
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                usage = json.loads(line[5:]).get("usage")
                tokens = usage["completion_tokens"] if usage else tokens
    return tokens


async def workload(base: str, peer: str, mixed: bool, args: argparse.Namespace) -> float:
    """Aggregate tokens/s of `args.streams` streams, each `args.requests` chats."""
    limits = httpx.Limits(max_connections=args.streams + 2, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        base_model = await throughput.model_id(client, base)

        async def stream(i: int) -> int:
            model, extra = pick(peer, i, mixed, base_model)
            topics = [throughput.TOPICS[(i * args.requests + r) % len(throughput.TOPICS)] for r in range(args.requests)]
            return sum([await chat(client, base, model, extra, f"Write a long essay about {topic}.",
                                   args.max_tokens) for topic in topics])

        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(stream(i) for i in range(args.streams))))
        return tokens / (time.perf_counter() - start)


@contextlib.contextmanager
def vllm_serve(args: argparse.Namespace) -> Iterator[throughput.Started]:
    """vLLM's own server over the same repository and PEFT adapters (`--lora-modules aK=PATH`), on CPU as lmserve's
    vLLM engine runs it (eager, the repository's dtype, 512 MiB of KV cache)."""
    from tests.hf_repos import smollm2_repo

    port = throughput.free_port()
    modules = [f"a{k}={p}" for k, p in enumerate(peft_paths(args.peft))]
    argv = [args.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.repo or smollm2_repo()),
            "--max-model-len", str(args.ctx), "--max-num-seqs", str(args.parallel), "--enforce-eager",
            "--kv-cache-memory-bytes", str(512 * 2**20), "--enable-lora", "--max-loras", str(ADAPTERS),
            "--max-lora-rank", "64", "--lora-modules", *modules, "--disable-log-stats",
            "--disable-uvicorn-access-log", "--host", "127.0.0.1", "--port", str(port)]
    with tempfile.TemporaryDirectory(prefix="lmserve-bench-lora-vllm-serve-") as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LMSERVE_")}
        with throughput.running(argv, port, "/health", Path(tmp) / "server.log", 600, env=env) as started:
            yield started


def run_peer(peer: str, args: argparse.Namespace, paths: list[str]) -> dict[str, float]:
    slots = ["--parallel" if peer == "lmserve" or peer in ENGINES else "-np", str(args.parallel)]
    if peer in ENGINES:
        from tests.hf_repos import smollm2_repo

        repository = argparse.Namespace(**{**vars(args), "model": args.repo or smollm2_repo()})
        flags = [*slots, "-c", str(args.ctx), "--engine", peer,
                 *(f for k, p in enumerate(peft_paths(args.peft)) for f in ("--lora", f"a{k}={p}"))]
        server = throughput.lmserve(repository, *flags, name=f"lora-{peer}")
    elif peer == "vllm-serve":
        server = vllm_serve(args)
    elif peer == "lmserve":
        flags = [*slots, "-c", str(args.ctx), *(f for k, p in enumerate(paths) for f in ("--lora", f"a{k}={p}"))]
        server = throughput.lmserve(args, *flags, name="lora")
    else:
        flags = [*slots, "-c", str(args.ctx * args.parallel), "--lora-init-without-apply",
                 *(f for p in paths for f in ("--lora", p))]
        server = throughput.llama_server(args, *flags, name="lora")
    with server as started:
        asyncio.run(workload(started.base, peer, True, argparse.Namespace(**{**vars(args), "streams": 5,
                                                                               "requests": 1, "max_tokens": 8})))
        result = {kind: asyncio.run(workload(started.base, peer, kind == "mixed", args)) for kind in ("base", "mixed")}
    print(f"[{peer}] base {result['base']:.1f} tok/s, mixed {result['mixed']:.1f} tok/s", flush=True)
    return result


def main() -> int:
    parser = throughput.bench_parser(__doc__)
    parser.add_argument("--lora", action="append", help="a GGUF LoRA of the model (4 of them; default: the tests')")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--requests", type=int, default=2, help="chats per stream")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--ctx", type=int, default=1024, help="context tokens per slot")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--peers", default="lmserve,llama-server",
                        help="of lmserve, llama-server, vllm and mlx (lmserve on those engines), vllm-serve")
    parser.add_argument("--repo", help="the model as a safetensors repository, for the vllm and mlx peers")
    parser.add_argument("--peft", action="append", help="a PEFT LoRA of --repo (4 of them; default: the tests')")
    args = throughput.parse_bench_args(parser)
    paths = adapter_paths(args.lora)
    if len(paths) != ADAPTERS:
        parser.error(f"give {ADAPTERS} adapters")
    best: dict[str, dict[str, float]] = {}
    for _ in range(args.rounds):
        for peer in args.peers.split(","):
            result = run_peer(peer, args, paths)
            best[peer] = {kind: max(value, best.get(peer, {}).get(kind, 0.0)) for kind, value in result.items()}
    print(f"\n{args.streams} streams, {args.requests} chats each, {args.max_tokens} tokens; best of {args.rounds}\n")
    print("| peer | base tok/s | mixed tok/s | mixed / base (goal >= 0.8) |")
    print("|---|---|---|---|")
    for peer, result in best.items():
        share = result["mixed"] / result["base"]
        print(f"| {peer} | {result['base']:.1f} | {result['mixed']:.1f} | {share:.2f}x "
              f"({throughput.verdict(share >= MIXED_GOAL)}) |")
    if {"lmserve", "llama-server"} <= best.keys():
        ratio = best["lmserve"]["mixed"] / best["llama-server"]["mixed"]
        print(f"\nlmserve mixed / llama-server mixed: {ratio:.2f}x ({throughput.verdict(ratio >= PEER_GOAL)}; "
              f"goal >= {PEER_GOAL})")
    if {"vllm", "vllm-serve"} <= best.keys():
        ratio = best["vllm"]["mixed"] / best["vllm-serve"]["mixed"]
        print(f"lmserve (vLLM engine) mixed / vllm serve mixed: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
