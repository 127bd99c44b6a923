#!/usr/bin/env python3
"""Soak test: concurrent streaming chat clients against one `lmserve serve` for a fixed time.

Starts the server (default model, ``--parallel 8 -c 1024``, a temporary LMSERVE_MODELS) on a free
loopback port, warms it up, records the server's RSS, then keeps N clients sending streaming
/v1/chat/completions requests (varied prompts, temperature 0.7) until the time is up.  Prints the
requests done, errors (non-200, a broken stream, no ``[DONE]``; goal 0), tokens/s and the RSS at
start and end (goal: < 5% growth after warm-up).  Exits non-zero when a goal is missed.

    python bench/soak.py [--minutes 10] [--clients 8] [--max-tokens 64] [--seconds S]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2:135m"
WARMUP_REQUESTS = 20
MAX_RSS_GROWTH = 0.05
TOPICS = (
    "the history of the printing press", "how a steam engine works", "the water cycle",
    "the life of a honey bee", "how volcanoes form", "the rules of chess",
    "the invention of the telephone", "how bread is baked", "why the sky is blue",
    "the migration of birds", "how a compass works", "the first moon landing",
)
STYLES = ("Write a short essay about {}.", "Explain {} to a child.", "Give three facts about {}.",
          "Write a poem about {}.", "Summarise {} in a few sentences.")


@dataclass
class SoakResult:
    seconds: float
    clients: int
    requests: int = 0
    errors: int = 0
    tokens: int = 0
    wall: float = 0.0
    rss_start_kib: int = 0
    rss_end_kib: int = 0
    error_samples: list[str] = field(default_factory=list)

    @property
    def tps(self) -> float:
        return self.tokens / self.wall if self.wall > 0 else 0.0

    @property
    def rss_growth(self) -> float:
        """Fractional RSS growth between the end of warm-up and the end of the run."""
        return (self.rss_end_kib - self.rss_start_kib) / self.rss_start_kib if self.rss_start_kib else 0.0

    @property
    def ok(self) -> bool:
        return self.errors == 0 and self.requests > 0 and self.rss_growth < MAX_RSS_GROWTH

    def summary(self) -> str:
        lines = [
            f"soak: {self.clients} clients for {self.wall:.1f}s (asked {self.seconds:.0f}s)",
            f"  requests done: {self.requests}",
            f"  errors:        {self.errors} (goal 0)",
            f"  tokens:        {self.tokens} ({self.tps:.1f} tok/s)",
            f"  RSS start:     {self.rss_start_kib / 1024:.1f} MiB (after warm-up)",
            f"  RSS end:       {self.rss_end_kib / 1024:.1f} MiB",
            f"  RSS growth:    {self.rss_growth * 100:+.2f}% (goal < {MAX_RSS_GROWTH * 100:.0f}%)",
        ]
        lines += [f"  error: {e}" for e in self.error_samples]
        lines.append(f"  result: {'PASS' if self.ok else 'FAIL'}")
        return "\n".join(lines)


def default_python() -> str:
    venv_python = ROOT / ".venv/bin/python"
    return str(venv_python if venv_python.exists() else sys.executable)


def rss_kib(pid: int) -> int:
    """Resident set size of process `pid` in KiB, from /proc/<pid>/status (0 when unavailable)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is no package: its scripts share code
import throughput  # noqa: E402


@contextlib.contextmanager
def running_server(python: str, args: list[str], env: dict[str, str] | None = None,
                   timeout: float = 180.0) -> Iterator[Any]:
    """`lmserve serve` with `args` on a free port and a temporary model store (throughput.running: waits for
    /health, yields base URL and pid, always kills the process group)."""
    port = throughput.free_port()
    tmp = Path(tempfile.mkdtemp(prefix="lmserve-soak-"))
    environ = {k: v for k, v in os.environ.items() if not k.startswith("LMSERVE_")}
    environ["LMSERVE_MODELS"] = str(tmp / "models")
    environ.update(env or {})
    argv = [python, "-m", "lmserve", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    with throughput.running(argv, port, "/health", tmp / "server.log", timeout, env=environ) as started:
        yield started


def prompt(n: int) -> str:
    return STYLES[n % len(STYLES)].format(TOPICS[(n * 7) % len(TOPICS)])


async def stream_chat(client: httpx.AsyncClient, base: str, text: str, max_tokens: int) -> int:
    """One streaming chat completion; returns completion tokens, raises RuntimeError on any fault."""
    body = {
        "model": MODEL, "messages": [{"role": "user", "content": text}], "stream": True,
        "temperature": 0.7, "max_tokens": max_tokens, "stream_options": {"include_usage": True},
    }
    done, finished, chunks, usage = False, False, 0, None
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                continue
            if done:
                raise RuntimeError("data after [DONE]")
            try:
                event = json.loads(data)
            except ValueError as e:
                raise RuntimeError(f"bad stream event {data[:200]!r}") from e
            if "error" in event:
                raise RuntimeError(f"error event: {event['error']}")
            if event.get("usage"):
                usage = event["usage"].get("completion_tokens")
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    chunks += 1
                if choice.get("finish_reason"):
                    finished = True
    if not done:
        raise RuntimeError("stream ended without [DONE]")
    if not finished:
        raise RuntimeError("stream had no finish_reason")
    return int(usage) if usage is not None else chunks


async def _soak(
    base: str, pid: int, seconds: float, clients: int, max_tokens: int, warmup: int, result: SoakResult
) -> None:
    limits = httpx.Limits(max_connections=clients + 2, max_keepalive_connections=clients + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        # Warm-up: loads the model and fills allocator pools before the RSS baseline is taken.
        sem = asyncio.Semaphore(clients)

        async def warm(i: int) -> None:
            async with sem:
                await stream_chat(client, base, prompt(i), max_tokens)

        await asyncio.gather(*(warm(i) for i in range(warmup)))
        result.rss_start_kib = rss_kib(pid)
        counter = warmup
        start = time.monotonic()
        end = start + seconds

        async def worker() -> None:
            nonlocal counter
            while time.monotonic() < end:
                counter += 1
                try:
                    # Not `result.tokens += await …`: that reads result.tokens before awaiting, losing updates.
                    tokens = await stream_chat(client, base, prompt(counter), max_tokens)
                    result.tokens += tokens
                except (httpx.HTTPError, RuntimeError) as e:
                    result.errors += 1
                    if len(result.error_samples) < 5:
                        result.error_samples.append(f"{type(e).__name__}: {e}")
                result.requests += 1

        await asyncio.gather(*(worker() for _ in range(clients)))
        result.wall = time.monotonic() - start
        result.rss_end_kib = rss_kib(pid)


def run_soak(
    seconds: float = 600.0,
    clients: int = 8,
    max_tokens: int = 64,
    python: str | None = None,
    warmup: int = WARMUP_REQUESTS,
) -> SoakResult:
    """Start a server, warm it up, soak it with `clients` streaming clients for `seconds`; always kill it."""
    result = SoakResult(seconds=seconds, clients=clients)
    with running_server(python or default_python(), ["--parallel", "8", "-c", "1024"]) as srv:
        asyncio.run(_soak(srv.base, srv.pid, seconds, clients, max_tokens, warmup, result))
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--seconds", type=float, default=None, help="run time in seconds (overrides --minutes)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--python", default=default_python(), help="interpreter that runs `lmserve serve`")
    args = p.parse_args()
    # SIGTERM (e.g. from `timeout`) becomes SystemExit so the server still gets killed.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    seconds = args.seconds if args.seconds is not None else args.minutes * 60
    result = run_soak(seconds, args.clients, args.max_tokens, args.python)
    print(result.summary())
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
