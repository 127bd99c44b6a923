#!/usr/bin/env python3
"""Speculative decoding (prompt lookup, or a draft model): decode speed with and without it, beside llama-server.

Peers, each started in turn on the same model file with the same ``--threads`` and ``--parallel`` (8) slots of
``-c`` 4096 tokens: lmserve with ``--draft-max`` (16), lmserve with ``--draft-max 0`` ("plain"), and llama-server
from the same llama.cpp (``make llama-server``; left out when its binary is missing) with its defaults (no
speculation), or with ``--llama-lookup`` its own prompt lookup (``--spec-type ngram-simple``, lookup 4, drafts of the
same cap, where ``llama-server --help`` lists it).

Workloads (greedy chat completions of ``--max-tokens`` (200) tokens, streamed):
- copy: "Copy this text exactly" with a 180-word document: speculation helps most (the reply repeats the prompt);
- edit: a 24-function Python file (about 1,500 tokens) to rewrite whole with one function renamed, as an editor or
  a coding agent's whole-file edit asks: the reply copies most of the prompt;
- story: "Write a story about …": free writing, little to look up.
At 1 and 8 concurrent streams (each stream its own document, file or topic), ``--rounds`` (2) rounds, best of them:
aggregate decode tokens/s (each stream's tokens after its first, over its time after its first token). Printed:
per workload and stream count, each peer's tokens/s, the ratios to lmserve plain and to llama-server (goals of issue
43: edit >= 1.5x llama-server's defaults, story >= 0.97x), and whether lmserve's greedy text with drafts equals its
text without. ``--flash-attn MODE`` passes ``-fa MODE`` to every peer.

With ``--model-draft PATH`` both lmserve and llama-server (``-md PATH --spec-draft-n-max N``) draft with that model
instead. ``--draft-pair`` is a pair this machine has: the embedded SmolLM2-135M Q4_1 drafting for its own weights in
F32 (written once by llama.cpp's requantizer under ~/.cache/lmserve/bench), a target about 3x slower per token than
its draft that agrees with it almost always.

    python bench/speculative.py [--model PATH] [--threads N] [--draft-max N] [--max-tokens 200] [--rounds 2]
    python bench/speculative.py --workloads edit,story --streams 1 --llama-lookup --flash-attn off
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

CONTEXT = 4096
"""Tokens per slot on every peer (an edit's prompt and reply fit)."""
SUBJECTS = ["lighthouse", "glacier", "printing press", "river delta", "steam engine", "coral reef", "library",
            "volcano"]


def document(subject: str) -> str:
    sentence = (f"The {subject} was first described in a survey of 1872, which counted its parts, measured its size "
                f"and noted who looked after it. ")
    return sentence * 6 + f"Today the {subject} is studied by students who compare it with the old survey."


NAMES = ["price", "weight", "height", "speed", "volume", "length", "width", "depth", "score", "count", "total",
         "budget", "distance", "energy", "power", "rate", "margin", "balance", "amount", "limit", "size", "level",
         "value", "factor"]
BODIES = [
    "    result = []\n    for item in items:\n        if item.{name} < 0:\n            continue\n"
    "        result.append(item.{name} * factor)\n    return result\n",
    "    total = 0\n    for item in items:\n        total += item.{name}\n    return total * factor\n",
    "    if not items:\n        return None\n    best = max(items, key=lambda item: item.{name})\n"
    "    return best.{name} * factor\n",
    "    return sorted((item.{name} * factor for item in items), reverse=True)[:{i}]\n",
]


def source_file(offset: int) -> str:
    """A Python file of 24 small functions (about 1,500 tokens); `offset` varies it per stream."""
    parts = []
    for i, name in enumerate(NAMES):
        body = BODIES[(i + offset) % len(BODIES)].format(name=name, i=i + 2)
        parts.append(f"def scale_{name}(items, factor={i + offset + 2}):\n"
                     f"    \"\"\"Scale the {name} of the items by factor.\"\"\"\n{body}")
    return "\n\n".join(parts)


def prompts(workload: str, streams: int) -> list[str]:
    if workload == "copy":
        return [f"Copy this text exactly:\n{document(SUBJECTS[i % 8])}" for i in range(streams)]
    if workload == "edit":
        return [f"Here is a Python file:\n\n```python\n{source_file(i)}```\n\nRewrite the whole file with the "
                f"function scale_{NAMES[(11 + i) % 24]} renamed to scale_{NAMES[(11 + i) % 24]}_v2. Reply with the "
                "complete file only." for i in range(streams)]
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
    common = ["-np", str(args.parallel), "-c", str(CONTEXT), *(["-fa", args.flash_attn] if args.flash_attn else [])]
    if name == "lmserve":
        drafting = ["--model-draft", str(args.model_draft)] if args.model_draft else []
        cap = str(args.draft_max if args.draft_max is not None else 16)
        with throughput.lmserve(args, *common, *drafting, "--draft-max", cap, name="spec") as started:
            yield started.base
        return
    if name == "lmserve plain":
        with throughput.lmserve(args, *common, "--draft-max", "0", name="spec") as started:
            yield started.base
        return
    with throughput.llama_server(args, *common[:2], "-c", str(CONTEXT * args.parallel), *common[4:],
                                 *args.llama_spec, name="spec") as started:
        yield started.base


def main() -> int:
    parser = throughput.bench_parser(__doc__)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--draft-max", type=int, default=None, help="16, on lmserve and on llama-server's lookup")
    parser.add_argument("--model-draft", type=Path, default=None)
    parser.add_argument("--draft-pair", action="store_true")
    parser.add_argument("--llama-lookup", action="store_true", help="llama-server with its own prompt lookup")
    parser.add_argument("--flash-attn", choices=["on", "off", "auto"], default=None, help="-fa on every peer")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--streams", type=lambda text: [int(x) for x in text.split(",")], default=[1, 8])
    parser.add_argument("--workloads", type=lambda text: text.split(","), default=["copy", "edit", "story"])
    args = throughput.parse_bench_args(parser)
    if args.draft_pair:
        args.model, args.model_draft = draft_pair()
    names = ["lmserve", "lmserve plain"]
    args.llama_spec = []
    cap = args.draft_max if args.draft_max is not None else 16
    if os.access(args.llama_server_bin, os.X_OK):
        names.append("llama-server")
        if args.llama_lookup or args.model_draft:
            args.llama_spec = llama_server_spec_flags(args.llama_server_bin, cap, args.model_draft)
    else:
        print(f"llama-server left out: no {args.llama_server_bin} (make llama-server)", file=sys.stderr)
    cases = [(workload, streams) for workload in args.workloads for streams in args.streams]
    rates, texts = measure(args, names, cases)
    kind = f"draft model {args.model_draft.name}" if args.model_draft else "prompt lookup"
    spec = " ".join(args.llama_spec) or "its defaults (no speculation)"
    print(f"model {args.model.name}, {kind}, {args.threads} threads, draft cap {cap}, {args.max_tokens} tokens, "
          f"flash attention {args.flash_attn or 'auto (the defaults)'}, "
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


def measure(args: argparse.Namespace, names: list[str], cases: list[tuple[str, int]]
            ) -> tuple[dict[tuple[str, str, int], float], dict[tuple[str, str, int], list[str]]]:
    """Each peer in turn, `args.rounds` times: the best aggregate tokens/s of each (peer, workload, streams), and
    the replies of its last round."""
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
    return rates, texts


if __name__ == "__main__":
    raise SystemExit(main())
