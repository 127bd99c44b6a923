#!/usr/bin/env python3
"""Many open conversations on 4 slots: lmserve vs llama-server, alternating rounds (issue 25).

Per count N (--counts), a fresh server each (one at a time; lmserve with a temporary LMSERVE_MODELS): N
conversations with their own ~--system-tokens system prompt get turn 1 one after another, then turn 2, ... up to
--turns; each prompt is the whole conversation so far. Reports TTFT of cold and returning turns, the hit rate of
cached prompt tokens, RSS growth per conversation, and, after restarting each server at the largest N, the next
turn's TTFT against a cold prefill of the same length (measured). See bench/README.md ("Many conversations").

    .venv/bin/python bench/conversations.py [--counts 2,4,10,30] [--turns 3] [--max-tokens 16] [--threads N]
        [--system-tokens 900] [--servers lmserve,llama-server] [--model PATH] [--llama-server-bin PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is no package: its scripts share code
import prefix
import throughput

SERVERS = ("lmserve", "llama-server")
RETURNING_GOAL = 1.0
RESTART_GOAL = 0.2
COLD_SAMPLES = 8
METRIC_PREFIX = "lmserve_prompt_cache_"
WORDS = tuple(sorted({w.lower() for s in (*prefix.SENTENCES, *prefix.QUESTIONS) for w in re.findall(r"[A-Za-z]+", s)
                      if len(w) > 2}))
OPENERS = random.Random(0).sample(WORDS, len(WORDS))
"""First words, one per conversation (cold references take them from the other end)."""


@dataclass
class Reply:
    conv: int
    turn: int
    ttft: float
    text: str
    prompt_tokens: int
    cached_tokens: int
    """usage.prompt_tokens_details.cached_tokens, else timings.cache_n, else 0."""
    cache_n: int | None
    """llama-server's timings.cache_n, when sent."""


@dataclass
class Conversation:
    index: int
    messages: list[dict[str, str]]


@dataclass
class Run:
    """One server at one conversation count."""
    server: str
    n: int
    replies: list[Reply] = field(default_factory=list)
    restarted: list[Reply] = field(default_factory=list)
    cold: list[Reply] = field(default_factory=list)
    rss_before: int = 0
    rss_after: int = 0
    error: str = ""


# ------------------------------------------------------------------------------------------------------ prompts


def system_prompt(opener: str, seed: str, tokens: int, count: Callable[[str], int]) -> str:
    """Seeded random words after `opener`, a full stop every few words, until the text is about `tokens` tokens."""
    rng = random.Random(seed)
    words = [opener.capitalize()]
    while count(" ".join(words)) < tokens:
        words.extend(rng.choice(WORDS) for _ in range(rng.randint(6, 12)))
        words[-1] += "."
    return " ".join(words)


def question(conv: int, turn: int) -> str:
    return prefix.QUESTIONS[(conv * 7 + turn * 3) % len(prefix.QUESTIONS)]


# ------------------------------------------------------------------------------------------------------ servers


class Server:
    """One server process in its own process group, which can be stopped and started again with the same argv
    (but a new free port), environment and folders."""

    def __init__(self, name: str, argv_for: Callable[[int], list[str]], env: dict[str, str] | None, logdir: Path,
                 timeout: float) -> None:
        self.name, self.argv_for, self.env, self.logdir, self.timeout = name, argv_for, env, logdir, timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.base, self.starts = "", 0

    def start(self) -> None:
        """Start and wait until /health answers 200; raises throughput.StartError."""
        port = throughput.free_port()
        argv = self.argv_for(port)
        self.starts += 1
        log = self.logdir / f"{self.name}.{self.starts}.log"
        print(f"  $ {shlex.join(argv)}", flush=True)
        with log.open("wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=throughput.ROOT, env=self.env, start_new_session=True)
        self.base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self.timeout
        while True:
            if self.proc.poll() is not None:
                raise throughput.StartError(f"exited with status {self.proc.returncode}:\n{throughput.log_tail(log)}")
            if time.monotonic() > deadline:
                raise throughput.StartError(f"not healthy after {self.timeout:.0f}s:\n{throughput.log_tail(log)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base + "/health", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.25)

    def stop(self, grace: float = 60.0) -> float:
        """SIGTERM to the process group, wait up to `grace` seconds (then SIGKILL); the seconds it took."""
        start = time.perf_counter()
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return 0.0
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=wait)
                break
            print(f"  [{self.name}] still running {grace:.0f}s after SIGTERM: killed", flush=True)
        return time.perf_counter() - start

    def rss(self) -> int:
        """The server process's resident memory in bytes (0 when unknown)."""
        if self.proc is None:
            return 0
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0


def make_server(name: str, args: argparse.Namespace, store: Path, logdir: Path) -> Server:
    """lmserve (store as its LMSERVE_MODELS, no other LMSERVE_* variable) or llama-server, args.parallel slots."""
    model, t = str(args.model), str(args.threads)
    if name == "lmserve":
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("LMSERVE_")}, "LMSERVE_MODELS": str(store)}
        return Server(name, lambda port: [
            args.python, "-m", "lmserve", "serve", "-m", model, "--host", "127.0.0.1", "--port", str(port),
            "--threads", t, "--parallel", str(args.parallel), "-c", str(args.ctx), *args.lmserve_args.split()],
            env, logdir, args.start_timeout)
    if not os.access(args.llama_server_bin, os.X_OK):
        raise throughput.StartError(f"binary {args.llama_server_bin} not found; run `make llama-server`")
    return Server(name, lambda port: [
        args.llama_server_bin, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", t, "-tb", t,
        "-np", str(args.parallel), "-c", str(args.ctx * args.parallel)], None, logdir, args.start_timeout)


def prompt_cache_metrics(base: str) -> list[str]:
    """lmserve's /metrics lines whose series name starts with lmserve_prompt_cache_."""
    with contextlib.suppress(httpx.HTTPError):
        text = httpx.get(base + "/metrics", timeout=10.0).text
        return [line for line in text.splitlines() if line.startswith(METRIC_PREFIX)]
    return []


# ------------------------------------------------------------------------------------------------------ requests


def ask(client: httpx.Client, base: str, model: str, messages: list[dict[str, str]], max_tokens: int,
        conv: int, turn: int) -> Reply:
    """One streaming chat completion."""
    stream = prefix.ChatStream()
    with client.stream("POST", base + "/v1/chat/completions", json=prefix.chat_body(model, messages, max_tokens)) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            stream.feed(line)
    cache_n = stream.timings.get("cache_n")
    return Reply(conv, turn, stream.ttft or time.perf_counter() - stream.start, stream.text,
                 int(stream.usage.get("prompt_tokens", 0)), stream.cached or 0,
                 None if cache_n is None else int(cache_n))


def new_client() -> httpx.Client:
    # A fresh connection per request, as in throughput.run_level (cpp-httplib closes keep-alive connections).
    return httpx.Client(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_keepalive_connections=0))


def warm_up(client: httpx.Client, base: str) -> str:
    """One short unrelated request (first-graph costs); returns the model id to ask for."""
    model = "default"
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError):
        model = str(client.get(base + "/v1/models").json()["data"][0]["id"])
    ask(client, base, model, [{"role": "user", "content": "Say hi."}], 4, -1, 0)
    return model


def play_round(client: httpx.Client, base: str, model: str, convs: list[Conversation], turn: int,
               max_tokens: int, label: str) -> list[Reply]:
    """Turn `turn` of every conversation, one after another; each reply joins its conversation."""
    replies = []
    for conv in convs:
        conv.messages.append({"role": "user", "content": question(conv.index, turn)})
        reply = ask(client, base, model, conv.messages, max_tokens, conv.index, turn)
        conv.messages.append({"role": "assistant", "content": reply.text})
        replies.append(reply)
    print(f"  [{label}] turn {turn}: {describe(replies)}", flush=True)
    return replies


def describe(replies: list[Reply]) -> str:
    cache_n = [r.cache_n for r in replies if r.cache_n is not None]
    return (f"median TTFT {ms(median_ttft(replies))} ms, cached {sum(r.cached_tokens for r in replies)}"
            f"/{sum(r.prompt_tokens for r in replies)} prompt tokens"
            + (f" (timings.cache_n {sum(cache_n)})" if cache_n else ""))


# ------------------------------------------------------------------------------------------------------ one run


def run_count(name: str, n: int, args: argparse.Namespace, systems: list[str], cold_systems: list[str],
              logdir: Path, restart: bool) -> Run:
    """N conversations on a fresh `name`; with `restart`, the restart case after the last round."""
    run, label = Run(name, n), f"{name} N={n}"
    print(f"\n[{label}]", flush=True)
    with tempfile.TemporaryDirectory(prefix=f"conversations-{name}-{n}-", dir=logdir) as tmp:
        try:
            server = make_server(name, args, Path(tmp) / "models", logdir / f"{name}-{n}")
            server.logdir.mkdir()
            try:
                server.start()
                play(server, run, args, systems, cold_systems, restart)
            finally:
                server.stop()
        except throughput.StartError as e:
            run.error = f"failed to start: {e}"
        except (httpx.HTTPError, RuntimeError, ValueError) as e:
            run.error = f"{type(e).__name__}: {e}"
    if run.error:
        print(f"  [{label}] {run.error}", flush=True)
    return run


def play(server: Server, run: Run, args: argparse.Namespace, systems: list[str], cold_systems: list[str],
         restart: bool) -> None:
    label = f"{run.server} N={run.n}"
    convs = [Conversation(i, [{"role": "system", "content": systems[i]}]) for i in range(run.n)]
    with new_client() as client:
        model = warm_up(client, server.base)
        run.rss_before = server.rss()
        for turn in range(1, args.turns + 1):
            run.replies += play_round(client, server.base, model, convs, turn, args.max_tokens, label)
        run.rss_after = server.rss()
        print_metrics(server.base, run)
        if not restart:
            return
        print(f"  [{label}] stopped in {server.stop():.1f} s (SIGTERM); starting again", flush=True)
        server.start()
        model = warm_up(client, server.base)
        run.restarted = play_round(client, server.base, model, convs, args.turns + 1, args.max_tokens,
                                   f"{label} after restart")
        for conv in convs[:COLD_SAMPLES]:
            fresh = [{"role": "system", "content": cold_systems[conv.index]}, *conv.messages[1:-1]]
            run.cold.append(ask(client, server.base, model, fresh, args.max_tokens, conv.index, args.turns + 1))
        print(f"  [{label}] cold, same length: {describe(run.cold)}", flush=True)
        print_metrics(server.base, run)


def print_metrics(base: str, run: Run) -> None:
    if run.server != "lmserve":
        return
    lines = prompt_cache_metrics(base)
    print(f"  [lmserve N={run.n}] /metrics {METRIC_PREFIX}*: " + ("none" if not lines else ""), flush=True)
    for line in lines:
        print(f"    {line}")


# ------------------------------------------------------------------------------------------------------ report


def ms(seconds: float) -> str:
    return "—" if math.isnan(seconds) else f"{seconds * 1000:.0f}"


def median_ttft(replies: list[Reply]) -> float:
    return statistics.median(r.ttft for r in replies) if replies else float("nan")


def p90_ttft(replies: list[Reply]) -> float:
    """Nearest-rank 90th percentile."""
    ttfts = sorted(r.ttft for r in replies)
    return ttfts[math.ceil(0.9 * len(ttfts)) - 1] if ttfts else float("nan")


def hit_rate(replies: list[Reply]) -> float:
    prompt = sum(r.prompt_tokens for r in replies)
    return sum(r.cached_tokens for r in replies) / prompt if prompt else float("nan")


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def verdict(value: float, goal: float) -> str:
    return "" if math.isnan(value) else f"{value:.2f}x ({'PASS' if value <= goal else 'FAIL'})"


def print_returning(runs: list[Run]) -> None:
    """The table of rounds: cold and returning turns, hit rate, RAM, lmserve / llama-server."""
    reference = {r.n: median_ttft([x for x in r.replies if x.turn >= 2]) for r in runs if r.server == "llama-server"}
    print("\n| N | server | turn 1 TTFT median (cold) | returning TTFT median | returning p90 | hit rate "
          f"| RAM / conversation | lmserve / llama-server (goal ≤ {RETURNING_GOAL:.1f}x) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        back = [x for x in r.replies if x.turn >= 2]
        ram = (r.rss_after - r.rss_before) / r.n / 2**20
        cmp = verdict(ratio(median_ttft(back), reference.get(r.n, float("nan"))), RETURNING_GOAL)
        print(f"| {r.n} | {r.server} | {ms(median_ttft([x for x in r.replies if x.turn == 1]))} ms "
              f"| {ms(median_ttft(back))} ms | {ms(p90_ttft(back))} ms | {hit_rate(back):.0%} | {ram:+.2f} MiB "
              f"| {cmp if r.server == 'lmserve' else ''} |")


def print_restarted(runs: list[Run]) -> None:
    """The table of the restart case: returning turn after a restart vs a cold prefill of the same length."""
    print(f"\n| N | server | turn {runs[0].restarted[0].turn} after restart: TTFT median | hit rate "
          "| cold prefill of the same length (measured: n fresh conversations): TTFT median "
          f"| prompt tokens (restart / cold) | after restart / cold (goal ≤ {RESTART_GOAL}x) |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        value = ratio(median_ttft(r.restarted), median_ttft(r.cold))
        tokens = (f"{statistics.median(x.prompt_tokens for x in r.restarted):.0f} / "
                  f"{statistics.median(x.prompt_tokens for x in r.cold):.0f}")
        print(f"| {r.n} | {r.server} | {ms(median_ttft(r.restarted))} ms | {hit_rate(r.restarted):.0%} "
              f"| {ms(median_ttft(r.cold))} ms (n={len(r.cold)}) | {tokens} | {verdict(value, RESTART_GOAL)} |")


def print_tables(runs: list[Run]) -> None:
    """Both tables (markdown) over the runs that completed, then the runs that failed."""
    ok = [r for r in runs if not r.error]
    if ok:
        print_returning(ok)
    if any(r.restarted for r in ok):
        print_restarted([r for r in ok if r.restarted])
    for r in runs:
        if r.error:
            print(f"\n{r.server} N={r.n}: {r.error.splitlines()[0]}")


def parse_args() -> argparse.Namespace:
    p = throughput.bench_parser(__doc__)
    p.add_argument("--counts", default="2,4,10,30", help="comma-separated numbers of open conversations")
    p.add_argument("--turns", type=int, default=3, help="rounds: turns per conversation")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--system-tokens", type=int, default=900, help="tokens of each conversation's system prompt")
    p.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated subset of {','.join(SERVERS)}")
    p.add_argument("--parallel", type=int, default=4, help="slots on each server")
    p.add_argument("--ctx", type=int, default=2048, help="context tokens per slot")
    p.add_argument("--no-restart", action="store_true", help="skip the restart case")
    p.add_argument("--lmserve-args", default="", help="more lmserve flags, e.g. \"--cache-disk 0\"")
    p.add_argument("--start-timeout", type=float, default=180.0, help="seconds to wait for /health")
    args = throughput.parse_bench_args(p)
    args.counts = sorted({int(c) for c in args.counts.split(",") if c.strip()})
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if set(args.servers) - set(SERVERS) or not args.counts or min(args.counts) < 1 or args.turns < 1:
        p.error(f"--servers is a subset of {','.join(SERVERS)}; --counts and --turns are positive")
    if max(args.counts) > len(OPENERS) // 2:
        p.error(f"at most {len(OPENERS) // 2} conversations (distinct first words)")
    return args


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # servers still get stopped
    load = os.getloadavg()[0]
    busy = " (other work will skew the numbers)" if load > 0.5 else ""
    print(f"machine: {os.cpu_count()} cores; load average {load:.1f}{busy}")
    print(f"model: {args.model}; threads {args.threads}; {args.parallel} slots x {args.ctx} tokens; counts "
          f"{args.counts}; {args.turns} turns; {args.max_tokens} tokens per answer; ~{args.system_tokens}-token "
          f"system prompts; servers {','.join(args.servers)}", flush=True)
    count = prefix.token_counter(args.model)
    most = max(args.counts)
    systems = [system_prompt(OPENERS[i], f"conv-{i}", args.system_tokens, count) for i in range(most)]
    cold = [system_prompt(OPENERS[-1 - i], f"cold-{i}", count(systems[i]), count) for i in range(most)]
    logdir = Path(tempfile.mkdtemp(prefix="lmserve-conversations-"))
    started, runs = time.perf_counter(), list[Run]()
    for n in args.counts:
        for name in args.servers:
            runs.append(run_count(name, n, args, systems, cold, logdir, restart=n == most and not args.no_restart))
    print_tables(runs)
    print(f"\ntotal {time.perf_counter() - started:.0f} s; server logs: {logdir}")
    return 0 if any(not r.error for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
