#!/usr/bin/env python3
"""What the KV cache types cost in memory: resident memory per slot of `lmserve serve` with f16, q8_0 and q4_0 KV.

For each cache type (keys and values alike; flash attention `auto`), the server (the default model, ``-c``
``--ctx`` (4096) tokens per slot) is started twice, with 1 and with 1 + ``--slots`` (8) slots; after one short chat
its resident memory (VmRSS: llama.cpp clears its KV buffers when it makes them, so they are resident) is read.
Memory per slot = (RSS with 1 + slots - RSS with 1) / slots. Printed: per type, the MiB per slot and the ratio to
f16's (goal for q8_0: ≤ 0.55).

    python bench/kv_memory.py [--model PATH] [--threads N] [--ctx 4096] [--slots 8] [--types f16,q8_0,q4_0]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is no package: its scripts share code
import throughput
from residency import rss_mib


def resident_mib(args: argparse.Namespace, cache_type: str, slots: int) -> float:
    """VmRSS of a server with `slots` slots and a `cache_type` KV cache, after one short chat."""
    flags = ("-np", str(slots), "-c", str(args.ctx), "-ctk", cache_type, "-ctv", cache_type)
    with throughput.lmserve(args, *flags, name="kv") as started:
        reply = httpx.post(started.base + "/api/chat", timeout=120, json={
            "model": "smollm2:135m", "stream": False, "messages": [{"role": "user", "content": "Hi"}],
            "options": {"num_predict": 4, "temperature": 0}})
        reply.raise_for_status()
        return rss_mib(started.pid)


def main() -> int:
    parser = throughput.bench_parser(__doc__)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--types", type=lambda text: text.split(","), default=["f16", "q8_0", "q4_0"])
    args = throughput.parse_bench_args(parser)
    per_slot: dict[str, float] = {}
    for cache_type in args.types:
        one = resident_mib(args, cache_type, 1)
        many = resident_mib(args, cache_type, 1 + args.slots)
        per_slot[cache_type] = (many - one) / args.slots
    base = per_slot.get("f16")
    print(f"model {args.model.name}, {args.ctx} tokens per slot, {args.slots} extra slots")
    for cache_type, mib in per_slot.items():
        ratio = f", {mib / base:.3f} of f16" if base else ""
        print(f"  {cache_type:6s} {mib:7.1f} MiB per slot{ratio}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
