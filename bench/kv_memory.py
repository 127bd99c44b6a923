#!/usr/bin/env python3
"""What the KV cache costs in memory: resident memory per slot of `lmserve serve` with f16, q8_0 and q4_0 KV, with
a pool per slot and with one pool shared by all slots (`--kv-unified`).

For each cache type (keys and values alike; flash attention `auto`) and each layout (``--layouts``: `separate`, a
pool of ``-c`` tokens per slot; `unified`, one pool of ``-c`` tokens for all slots), the server (the default model,
``-c`` ``--ctx`` (4096)) is started twice, with 1 and with 1 + ``--slots`` (8) slots; after one short chat its
resident memory (VmRSS: llama.cpp clears its KV buffers when it makes them, so they are resident) is read.
Memory per slot = (RSS with 1 + slots - RSS with 1) / slots. Printed: per type and layout, the MiB per slot, the
RSS with 1 + slots, and the ratio to f16's (goal for q8_0: ≤ 0.55).

    python bench/kv_memory.py [--model PATH] [--threads N] [--ctx 4096] [--slots 8] [--types f16,q8_0,q4_0]
                              [--layouts separate,unified]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is no package: its scripts share code
import throughput
from residency import rss_mib


def resident_mib(args: argparse.Namespace, cache_type: str, slots: int, layout: str = "separate") -> float:
    """VmRSS of a server with `slots` slots and a `cache_type` KV cache (`layout` unified: one shared pool), after
    one short chat."""
    flags = ("-np", str(slots), "-c", str(args.ctx), "-ctk", cache_type, "-ctv", cache_type)
    flags += ("--kv-unified",) if layout == "unified" else ()
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
    parser.add_argument("--layouts", type=lambda text: text.split(","), default=["separate"])
    args = throughput.parse_bench_args(parser)
    rows: list[tuple[str, str, float, float]] = []
    for layout in args.layouts:
        for cache_type in args.types:
            one = resident_mib(args, cache_type, 1, layout)
            many = resident_mib(args, cache_type, 1 + args.slots, layout)
            rows.append((layout, cache_type, (many - one) / args.slots, many))
    print(f"model {args.model.name}, -c {args.ctx}, {args.slots} extra slots")
    for layout, cache_type, mib, total in rows:
        base = next((m for lay, t, m, _ in rows if lay == layout and t == "f16"), None)
        ratio = f", {mib / base:.3f} of f16" if base and layout == "separate" else ""
        print(f"  {layout:8s} {cache_type:6s} {mib:7.1f} MiB per slot, {total:7.1f} MiB with {1 + args.slots} "
              f"slots{ratio}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
