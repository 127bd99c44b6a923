#!/usr/bin/env python3
"""Speculative decoding (prompt lookup or a draft model): decode speed with and without it, beside llama-server.

Peers, each started in turn on the same model file with the same ``--threads`` and ``--parallel`` (8) slots of
``-c`` 2048 tokens: lmserve with ``--draft-max`` (8), lmserve without it, and llama-server from the same llama.cpp
(``make llama-server``; left out when its binary is missing) with its own prompt-lookup drafting on when it has one
(``--spec-type ngram-simple``, lookup 4, drafts of ``--draft-max``, where ``llama-server --help`` lists it; else
plain, and said so).

Workloads (greedy chat completions of ``--max-tokens`` (200) tokens, streamed):
- copy: "Copy this text exactly" with a 180-word document: speculation helps (the reply repeats the prompt);
- story: "Write a story about …": it does not (little to look up).
At 1 and 8 concurrent streams (each stream its own document or topic), ``--rounds`` (2) rounds, best of them:
aggregate decode tokens/s (each stream's tokens after its first, over its time after its first token). Printed:
per workload and stream count, each peer's tokens/s, the ratios to lmserve without drafts and to llama-server
(goal: at least 1.3 x llama-server's single stream on copy, 1.0 x on story), and whether lmserve's greedy text
with drafts equals its text without.

With ``--model-draft PATH`` both lmserve and llama-server (``-md PATH --spec-draft-n-max N``) draft with that model
instead (drafts of up to ``--draft-max``, 16 by default then). ``--draft-pair`` is a pair this machine has: the
embedded SmolLM2-135M Q4_1 drafting for its own weights in F32 (written once by llama.cpp's requantizer under
~/.cache/lmserve/bench), a target about 3x slower per token than its draft that agrees with it almost always.

    python bench/speculative.py [--model PATH] [--threads N] [--draft-max 8] [--max-tokens 200] [--rounds 2]
    python bench/speculative.py --draft-pair --streams 1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is no package: its scripts share code
import throughput

SUBJECTS = ["lighthouse", "glacier", "printing press", "river delta", "steam engine", "coral reef", "library",
            "volcano"]


def document(subject: str) -> str:
    sentence = (f"The {subject} was first described in a survey of 1872, which counted its parts, measured its size "
                f"and noted who looked after it. ")
    return sentence * 6 + f"Today the {subject} is studied by students who compare it with the old survey."


def prompts(workload: str, streams: int) -> list[str]:
    if workload == "copy":
        return [f"Copy this text exactly:\n{document(SUBJECTS[i % 8])}" for i in range(streams)]
    return [f"Write a story about a {SUBJECTS[i % 8]}." for i in range(streams)]


async def stream_one(client: httpx.AsyncClient, base: str, model: str, prompt: str,
                     max_tokens: int) -> tuple[str, int, float]:
    """(text, tokens, decode seconds after the first token) of one streamed greedy reply."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    parts: list[str] = []
    first = 0.0
    tokens = 0
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    parts.append(piece)
    return "".join(parts), tokens, time.perf_counter() - first


async def level(base: str, workload: str, streams: int, max_tokens: int) -> tuple[float, list[str]]:
    """Aggregate decode tokens/s of `streams` concurrent replies, and their texts."""
    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(base + "/v1/models")).json()["data"][0]["id"]
        results = await asyncio.gather(*(stream_one(client, base, model, prompt, max_tokens)
                                         for prompt in prompts(workload, streams)))
    rate = sum((tokens - 1) / seconds for _, tokens, seconds in results if tokens > 1 and seconds > 0)
    return rate, [text for text, _, _ in results]


def llama_server_spec_flags(binary: str, draft_max: int, model_draft: Path | None) -> list[str]:
    """llama-server's speculative flags where this build has them: its draft model with drafts of up to `draft_max`,
    or prompt lookup of 4 tokens (lmserve's longest) with drafts of `draft_max` (lmserve's cap)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        help_text = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30).stdout
        if model_draft is not None:
            length = "--spec-draft-n-max" if "--spec-draft-n-max" in help_text else "--draft-max"
            return ["-md", str(model_draft), length, str(draft_max)]
        if "ngram-simple" in help_text:
            return ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "4",
                    "--spec-ngram-simple-size-m", str(draft_max)]
    return []


def draft_pair() -> tuple[Path, Path]:
    """(target, draft): the embedded SmolLM2 Q4_1 as the draft of its own weights in F32 (written once)."""
    import llama_cpp as lc

    from lmserve.store.embedded import embedded_model_path

    draft = embedded_model_path()
    target = Path.home() / ".cache" / "lmserve" / "bench" / f"{draft.stem}.F32.gguf"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        lc.llama_backend_init()
        params = lc.llama_model_quantize_default_params()
        params.ftype = lc.LLAMA_FTYPE_ALL_F32
        params.allow_requantize = True
        partial = target.with_suffix(".partial")
        if lc.llama_model_quantize(str(draft).encode(), str(partial).encode(), params) != 0:
            raise SystemExit(f"llama.cpp could not write {target}")
        partial.rename(target)
    return target, draft


@contextlib.contextmanager
def peer(name: str, args: argparse.Namespace) -> Iterator[str]:
    common = ["-np", str(args.parallel), "-c", "2048"]
    if name == "lmserve":
        drafting = ["--model-draft", str(args.model_draft)] if args.model_draft else []
        with throughput.lmserve(args, *common, *drafting, "--draft-max", str(args.draft_max), name="spec") as started:
            yield started.base
        return
    if name == "lmserve plain":
        with throughput.lmserve(args, *common, name="spec") as started:
            yield started.base
        return
    with throughput.llama_server(args, "-np", str(args.parallel), "-c", str(2048 * args.parallel), *args.llama_spec,
                                 name="spec") as started:
        yield started.base


def main() -> int:
    parser = throughput.bench_parser(__doc__)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--draft-max", type=int, default=None, help="8, or 16 with a draft model")
    parser.add_argument("--model-draft", type=Path, default=None)
    parser.add_argument("--draft-pair", action="store_true")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--streams", type=lambda text: [int(x) for x in text.split(",")], default=[1, 8])
    args = throughput.parse_bench_args(parser)
    if args.draft_pair:
        args.model, args.model_draft = draft_pair()
    if args.draft_max is None:
        args.draft_max = 16 if args.model_draft else 8
    names = ["lmserve", "lmserve plain"]
    args.llama_spec = []
    if os.access(args.llama_server_bin, os.X_OK):
        names.append("llama-server")
        args.llama_spec = llama_server_spec_flags(args.llama_server_bin, args.draft_max, args.model_draft)
    else:
        print(f"llama-server left out: no {args.llama_server_bin} (make llama-server)", file=sys.stderr)
    cases = [(workload, streams) for workload in ("copy", "story") for streams in args.streams]
    rates: dict[tuple[str, str, int], float] = {}
    texts: dict[tuple[str, str, int], list[str]] = {}
    for _ in range(args.rounds):
        for name in names:
            with peer(name, args) as base:
                asyncio.run(level(base, "story", 1, 8))  # warm-up
                for workload, streams in cases:
                    rate, replies = asyncio.run(level(base, workload, streams, args.max_tokens))
                    key = (name, workload, streams)
                    rates[key] = max(rates.get(key, 0.0), rate)
                    texts[key] = replies
    kind = f"draft model {args.model_draft.name}" if args.model_draft else "prompt lookup"
    spec = f"its {kind} on" if args.llama_spec else f"plain (this build has no {kind})"
    print(f"model {args.model.name}, {kind}, {args.threads} threads, draft-max {args.draft_max}, "
          f"{args.max_tokens} tokens, "
          f"best of {args.rounds}; llama-server {spec if 'llama-server' in names else 'not run'}")
    for workload, streams in cases:
        row = "  ".join(f"{name} {rates[name, workload, streams]:6.1f}" for name in names)
        ours = rates["lmserve", workload, streams]
        ratios = f"vs plain {ours / rates['lmserve plain', workload, streams]:.2f}x"
        if "llama-server" in names:
            ratios += f", vs llama-server {ours / rates['llama-server', workload, streams]:.2f}x"
        same = texts["lmserve", workload, streams] == texts["lmserve plain", workload, streams]
        print(f"  {workload:5s} {streams} stream(s): {row} tok/s; {ratios}; same greedy text: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
