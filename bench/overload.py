#!/usr/bin/env python3
"""Overload test: more concurrent clients than slots plus queue.

Starts `lmserve serve` (default model) with ``LMSERVE_MAX_QUEUE=4 --parallel 2`` on a free loopback
port, warms it up, then fires many concurrent non-streaming chat completions at once.  Requests beyond
the slots and the queue must get 503 with a Retry-After header; every other one must complete with 200
and a finish_reason.  Prints the counts; exits non-zero when anything else happened.

    python bench/overload.py [--requests 40] [--max-queue 4] [--parallel 2] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is no package: its scripts share code
import soak


@dataclass
class OverloadResult:
    requests: int
    completed: int = 0
    rejected: int = 0
    """503 responses carrying a Retry-After header."""
    other: int = 0
    """Anything else: another status, a 200 without finish_reason, a 503 without Retry-After, a transport error."""
    other_samples: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.other == 0 and self.rejected > 0 and self.completed > 0

    def summary(self) -> str:
        lines = [
            f"overload: {self.requests} concurrent requests",
            f"  503 with Retry-After:      {self.rejected}",
            f"  200 with a finish_reason:  {self.completed}",
            f"  anything else:             {self.other} (goal 0)",
        ]
        lines += [f"  other: {s}" for s in self.other_samples]
        verdict = ("all requests not rejected completed" if self.other == 0 else "some requests neither completed "
                   "nor were rejected cleanly")
        lines.append(f"  {verdict}; result: {'PASS' if self.ok else 'FAIL'}")
        return "\n".join(lines)


async def _one(client: httpx.AsyncClient, base: str, n: int, max_tokens: int) -> tuple[str, str]:
    """('ok' | 'rejected' | 'other', detail) for one non-streaming chat completion."""
    body = {"model": soak.MODEL, "messages": [{"role": "user", "content": soak.prompt(n)}],
            "temperature": 0.7, "max_tokens": max_tokens}
    try:
        r = await client.post(base + "/v1/chat/completions", json=body)
    except httpx.HTTPError as e:
        return "other", f"{type(e).__name__}: {e}"
    if r.status_code == 503:
        return ("rejected", "") if r.headers.get("retry-after") else ("other", "503 without Retry-After")
    if r.status_code != 200:
        return "other", f"HTTP {r.status_code}: {r.text[:200]!r}"
    try:
        finish = r.json()["choices"][0]["finish_reason"]
    except (ValueError, KeyError, IndexError, TypeError):
        return "other", f"bad body {r.text[:200]!r}"
    return ("ok", "") if finish else ("other", "200 without finish_reason")


async def _overload(base: str, requests: int, max_tokens: int, result: OverloadResult) -> None:
    limits = httpx.Limits(max_connections=requests + 2, max_keepalive_connections=requests + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        kind, detail = await _one(client, base, 0, max_tokens)  # warm-up: loads the model
        if kind != "ok":
            raise RuntimeError(f"warm-up request failed: {detail}")
        for kind, detail in await asyncio.gather(*(_one(client, base, n, max_tokens) for n in range(requests))):
            if kind == "ok":
                result.completed += 1
            elif kind == "rejected":
                result.rejected += 1
            else:
                result.other += 1
                if len(result.other_samples) < 5:
                    result.other_samples.append(detail)


def run_overload(requests: int = 40, max_queue: int = 4, parallel: int = 2, max_tokens: int = 32,
                 python: str | None = None) -> OverloadResult:
    """Start a server with a small queue, fire `requests` concurrent requests; always kill the server."""
    result = OverloadResult(requests=requests)
    args = ["--parallel", str(parallel), "-c", "1024"]
    with soak.running_server(python or soak.default_python(), args, env={"LMSERVE_MAX_QUEUE": str(max_queue)}) as srv:
        asyncio.run(_overload(srv.base, requests, max_tokens, result))
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--max-queue", type=int, default=4)
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--python", default=soak.default_python(), help="interpreter that runs `lmserve serve`")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    result = run_overload(args.requests, args.max_queue, args.parallel, args.max_tokens, args.python)
    print(result.summary())
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
