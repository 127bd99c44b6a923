"""Sleep and wake benchmark: the memory a sleeping model gives back, and the time to the first token after a wake.

lmserve and llama-server (same llama.cpp revision, same model, context and slots) side by side in one run, each with
`--sleep-idle-seconds`. For each server: the resident memory (RSS, the server's whole process tree) awake and asleep,
and the median time to the first token of a short chat awake and just after each kind of sleep. lmserve is also put to
sleep on request (POST /sleep level 1: KV cache freed; level 2: weights too); llama-server sleeps only when idle.

    .venv/bin/python bench/sleep.py [--ctx 4096] [--parallel 4] [--idle 3] [--rounds 3]
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is no package: its scripts share code
from throughput import Started, bench_parser, llama_server, lmserve, parse_bench_args

from lmserve.engine.lifeline import descendants

MiB = 2**20


def tree_rss(pid: int) -> int:
    """The resident bytes of `pid` and every process below it."""
    total = 0
    for each in [pid, *descendants(pid)]:
        for line in Path(f"/proc/{each}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


def ttft(base: str) -> float:
    """Seconds to the first streamed token of a short greedy chat (to the server's first model)."""
    model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "Say hello."}], "stream": True,
            "max_tokens": 4, "temperature": 0}
    started = time.perf_counter()
    first = 0.0
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not first and line.startswith("data:") and '"content":"' in line.replace(": ", ":"):
                first = time.perf_counter() - started
    if not first:
        raise RuntimeError("no token came")
    return first


def measure(server: Started, sleep: Callable[[], None], rounds: int) -> tuple[float, float]:
    """(median TTFT after `sleep`, RSS asleep) over `rounds` sleeps."""
    times, memory = [], []
    for _ in range(rounds):
        sleep()
        memory.append(tree_rss(server.pid))
        times.append(ttft(server.base))
    return statistics.median(times), statistics.median(memory)


def run(server: Started, name: str, idle: float, rounds: int, on_request: bool) -> dict[str, tuple[float, float]]:
    base = server.base
    ttft(base)
    awake = statistics.median([ttft(base) for _ in range(rounds)]), float(tree_rss(server.pid))
    rows = {"awake": awake, "idle sleep": measure(server, lambda: time.sleep(idle + 2.5), rounds)}
    if on_request:
        for level in (1, 2):
            def asleep(level: int = level) -> None:
                httpx.post(base + "/sleep", params={"level": level}, timeout=60).raise_for_status()
            rows[f"POST /sleep level {level}"] = measure(server, asleep, rounds)
    for state, (first, rss) in rows.items():
        print(f"| {name} | {state} | {rss / MiB:.0f} | {first * 1000:.0f} |", flush=True)
    return rows


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--ctx", type=int, default=4096, help="context per slot")
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--idle", type=float, default=3.0, help="--sleep-idle-seconds of both servers")
    parser.add_argument("--rounds", type=int, default=3)
    args = parse_bench_args(parser)
    idle = str(int(args.idle))
    print("| server | state | RSS MiB | TTFT ms |\n|---|---|---|---|")
    with lmserve(args, "-c", str(args.ctx), "-np", str(args.parallel), "--sleep-idle-seconds", idle,
                 name="sleep") as server:
        ours = run(server, "lmserve", args.idle, args.rounds, on_request=True)
    with llama_server(args, "-c", str(args.ctx * args.parallel), "-np", str(args.parallel), "--sleep-idle-seconds",
                      idle, name="sleep") as server:
        theirs = run(server, "llama-server", args.idle, args.rounds, on_request=False)
    for state in ("awake", "idle sleep"):
        (our_ttft, our_rss), (their_ttft, their_rss) = ours[state], theirs[state]
        print(f"{state}: TTFT lmserve / llama-server {our_ttft / their_ttft:.2f}x, RSS {our_rss / their_rss:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
