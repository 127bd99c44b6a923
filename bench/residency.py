"""Residency benchmark: memory of derived models, and whether loading one model blocks requests to another.

Each run starts lmserve on a fresh model store with the embedded SmolLM2 and measures, through the real server:

1. RSS: the server's resident memory after one chat with `smollm2:135m`, then after chats with three models
   created FROM it that differ only in SYSTEM / PARAMETER temperature (they should share one loaded copy).
2. Load blocking: while a fourth model with another load-time option (num_ctx, so a second engine instance)
   loads, a one-token chat to the loaded `smollm2:135m` is timed; compared with the same chat when idle.

`--baseline REV` runs the same measurements on another revision of lmserve (checked out in a temporary git
worktree, run with this venv) side by side and prints the ratios, e.g. `--baseline 9df3948` for the code before the
residency rewrite.

    .venv/bin/python bench/residency.py [--baseline REV] [--big-ctx 8192]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is no package: its scripts share code
from throughput import ROOT, free_port, running

DERIVED = [("pirate", {"system": "You are a pirate."}), ("poet", {"system": "Answer in rhyme."}),
           ("cool", {"parameters": {"temperature": 0.2}})]


@dataclass
class Result:
    rss_one_mib: float
    rss_derived_mib: float
    idle_ms: float
    during_load_ms: float
    load_s: float


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def chat(client: httpx.Client, model: str) -> float:
    """Seconds for a one-token chat."""
    started = time.perf_counter()
    response = client.post("/api/chat", json={"model": model, "stream": False, "options": {"num_predict": 1},
                                              "messages": [{"role": "user", "content": "Hi"}]})
    response.raise_for_status()
    return time.perf_counter() - started


def measure(src: Path, args: argparse.Namespace) -> Result:
    port = free_port()
    with tempfile.TemporaryDirectory() as store, tempfile.TemporaryDirectory() as logs:
        env = dict(os.environ, LMSERVE_MODELS=store, PYTHONPATH=str(src))
        argv = [args.python, "-m", "lmserve", "serve", "smollm2:135m", "--host", "127.0.0.1", "--port", str(port),
                "-c", "1024", "-np", "2", "-t", str(args.threads)]
        with running(argv, port, "/health", Path(logs) / "server.log", 120, env=env, cwd=src) as server, \
                httpx.Client(base_url=server.base, timeout=300) as client:
            chat(client, "smollm2:135m")
            rss_one = rss_mib(server.pid)
            for name, fields in DERIVED:
                client.post("/api/create", json={"model": name, "from": "smollm2:135m", "stream": False,
                                                 **fields}).raise_for_status()
                chat(client, name)
            rss_derived = rss_mib(server.pid)
            client.post("/api/create", json={"model": "big", "from": "smollm2:135m", "stream": False,
                                             "parameters": {"num_ctx": args.big_ctx}}).raise_for_status()
            idle = statistics.median(chat(client, "smollm2:135m") for _ in range(5))
            during, load_s = during_load(client, args)
    return Result(rss_one, rss_derived, idle * 1e3, during * 1e3, load_s)


def during_load(client: httpx.Client, args: argparse.Namespace) -> tuple[float, float]:
    """(median one-token chat time to the loaded model while `big` loads, the load's duration)."""
    times: list[float] = []
    load: list[float] = []

    def load_big() -> None:
        started = time.perf_counter()
        client.post("/api/generate", json={"model": "big", "prompt": "", "stream": False}).raise_for_status()
        load.append(time.perf_counter() - started)

    loader = threading.Thread(target=load_big)
    loader.start()
    time.sleep(0.05)
    while loader.is_alive() and len(times) < 20:
        times.append(chat(client, "smollm2:135m"))
    loader.join()
    return statistics.median(times), load[0]


@contextlib.contextmanager
def worktree(rev: str) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="lmserve-baseline-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev], check=True,
                   capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], check=False)


def show(label: str, r: Result) -> None:
    print(f"{label:>10}  RSS one model {r.rss_one_mib:7.1f} MiB  three derived in use {r.rss_derived_mib:7.1f} MiB "
          f"({r.rss_derived_mib / r.rss_one_mib:.2f}x)  chat idle {r.idle_ms:7.1f} ms  during another load "
          f"{r.during_load_ms:7.1f} ms (that load took {r.load_s:.2f} s)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"))
    parser.add_argument("--threads", type=int, default=1,
                        help="threads per engine (default 1: two engines share 2 cores)")
    parser.add_argument("--big-ctx", type=int, default=8192, help="num_ctx of the model loaded meanwhile")
    parser.add_argument("--baseline", metavar="REV", help="also measure this git revision, side by side")
    args = parser.parse_args()
    results = {"this": measure(ROOT, args)}
    if args.baseline:
        with worktree(args.baseline) as path:
            results[args.baseline] = measure(path, args)
    for label, result in results.items():
        show(label, result)
    if args.baseline:
        now, then = results["this"], results[args.baseline]
        print(f"ratios this/{args.baseline}: derived RSS {now.rss_derived_mib / then.rss_derived_mib:.2f}x, "
              f"chat during another load {now.during_load_ms / then.during_load_ms:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
