#!/usr/bin/env python3
"""Replicas on Ray Serve (issue 27): cache-aware routing against round robin and one plain server, and Ray's own
overhead. Every server runs alone, on this machine, with the embedded model (`--model`, default smollm2:135m), a
fresh temporary LMSERVE_MODELS (shared by a deployment's replicas, as `lmserve serve --replicas` shares it) and
LMSERVE_SUPERVISOR=0. Requests are streamed chat completions, ``temperature: 0``, ``ignore_eos: true``, a fixed
``max_tokens``; TTFT is the time from sending a request to its first content chunk. Parts (``--only``):

routing   --conversations conversations (more than all slots together), each with its own ~--system-tokens
          system prompt (distinct from its first word), --turns turns each; a turn appends the last answer and a
          short question. Round 1 sends turn 1 of every conversation, round 2 turn 2, ..., each round in a seeded
          shuffled order (the same on every setup: in a fixed order round robin would send a conversation to the
          same replica every round), --users requests in flight at once. Setups, the same total slots and threads:
            ray-prefix        --replicas R --replica-routing prefix,      -np P -t T per replica
            ray-round-robin   --replicas R --replica-routing round-robin, -np P -t T per replica
            plain             one `lmserve serve` (no Ray), -np R*P -t R*T
          Per setup, over returning turns (turn >= 2): TTFT mean, median and p90; hits / returning turns, a hit being a
          turn with at least half its prompt cached (usage.prompt_tokens_details.cached_tokens; not merely > 0:
          every prompt shares a few chat-template tokens that any replica reports as cached); cached / prompt
          tokens; how often a turn was answered by the replica that answered the conversation's previous turn (the
          `lmserve-replica` header). Each setup's turns are written to routing-<setup>.jsonl in the log folder.
          Goals: ray-prefix hits >= 0.9 and its mean returning TTFT <= 0.5x ray-round-robin's. The mean, because
          round robin over 2 replicas misses at most half the turns of round 2, and fewer later (a conversation's
          history is soon on both replicas), so its median returning turn is a hit and the misses show only in the
          mean and the p90 (both ratios printed, with the median's).
overhead  Ray's own cost: one replica behind Ray (--replicas 1) against plain `lmserve serve`, both -np R*P -t R*T:
          aggregate streamed tokens/s at each of --concurrency streams (as bench/throughput.py: each stream sends
          requests one after another, --max-tokens-overhead tokens each). Setups take turns for --rounds rounds,
          each keeping its best round per level. Goal: ray / plain >= 0.95x at every level.

    python bench/replicas.py [--only routing,overhead] [--replicas 2] [--parallel 4] [--threads N]
        [--conversations 16] [--turns 4] [--users 4] [--system-tokens 500] [--max-tokens 16]
        [--concurrency 1,8] [--max-tokens-overhead 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is no package: its scripts share code
import conversations
import prefix
import throughput

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("routing", "overhead")
SETUPS = ("ray-prefix", "ray-round-robin", "plain")
MODEL = "smollm2:135m"
REPLICA_HEADER = "lmserve-replica"
HIT_GOAL = 0.9
HIT_SHARE = 0.5
"""A returning turn is a hit when at least this share of its prompt was cached: every prompt starts with the same
few chat-template tokens (`<|im_start|>system\\n`), which a replica that never saw the conversation reports as
cached too, so `cached_tokens > 0` alone counts misses as hits."""
TTFT_GOAL = 0.5
OVERHEAD_GOAL = 0.95
STOP_GRACE_S = 60.0
"""Seconds a server is given to stop after SIGTERM (Ray shuts its processes down) before its group is killed."""


# ------------------------------------------------------------------------------------------------------ servers


@dataclass
class Setup:
    """One way of serving: a label, and the flags of `lmserve serve` beyond the shared ones."""
    label: str
    replicas: int
    """0: a plain `lmserve serve`, no Ray."""
    routing: str = ""
    slots: int = 0
    threads: int = 0

    def flags(self, args: argparse.Namespace) -> list[str]:
        common = ["-np", str(self.slots), "-t", str(self.threads), "-c", str(args.ctx), *args.lmserve_args.split()]
        if not self.replicas:
            return common
        cpus = self.threads if args.replica_cpus is None else args.replica_cpus
        return [*common, "--replicas", str(self.replicas), "--replica-cpus", f"{cpus:g}",
                *(["--replica-routing", self.routing] if self.routing else [])]


def stop(proc: subprocess.Popen[bytes], grace: float = STOP_GRACE_S) -> None:
    """SIGTERM to the server (a Ray server then shuts Ray down itself); its process group killed if it is still
    running after `grace` seconds, and whatever it left in the group."""
    if proc.poll() is None:
        start = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
            print(f"  stopped in {time.perf_counter() - start:.1f} s (SIGTERM, status {proc.returncode})", flush=True)
        except subprocess.TimeoutExpired:
            print(f"  server {proc.pid} still running {grace:.0f} s after SIGTERM: its process group killed",
                  flush=True)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10.0)


@contextlib.contextmanager
def serving(setup: Setup, args: argparse.Namespace, logdir: Path, tag: str) -> Iterator[str]:
    """`setup` serving args.model on a free loopback port, in its own process group with a fresh model store;
    yields its base URL once /health answers 200 (a Ray server: once every replica runs); always stopped."""
    port = throughput.free_port()
    argv = [args.python, "-m", "lmserve", "serve", args.model, "--host", "127.0.0.1", "--port", str(port),
            *setup.flags(args)]
    store = Path(tempfile.mkdtemp(prefix=f"models-{tag}-", dir=logdir))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("LMSERVE_")},
           "LMSERVE_MODELS": str(store), "LMSERVE_SUPERVISOR": "0"}
    log = logdir / f"{tag}.log"
    print(f"[{tag}] $ {shlex.join(argv)}", flush=True)
    started = time.perf_counter()
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                                env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + args.start_timeout
        while True:
            if proc.poll() is not None:
                raise throughput.StartError(f"exited with status {proc.returncode}:\n{throughput.log_tail(log)}")
            if time.monotonic() > deadline:
                raise throughput.StartError(f"not healthy after {args.start_timeout:.0f}s:\n"
                                            f"{throughput.log_tail(log)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/health", timeout=5.0).status_code == 200:
                    break
            time.sleep(0.25)
        print(f"[{tag}] healthy after {time.perf_counter() - started:.1f} s", flush=True)
        yield base
    finally:
        stop(proc)


# ------------------------------------------------------------------------------------------------------ routing


@dataclass
class Turn:
    conv: int
    turn: int
    ttft: float
    prompt_tokens: int
    cached_tokens: int
    replica: str
    """The `lmserve-replica` header ("" from a plain server)."""


@dataclass
class Routing:
    """One setup's conversations."""
    setup: Setup
    turns: list[Turn] = field(default_factory=list)
    error: str = ""

    @property
    def returning(self) -> list[Turn]:
        return [t for t in self.turns if t.turn >= 2]

    def hits(self) -> int:
        """Returning turns with at least HIT_SHARE of their prompt cached."""
        return sum(t.cached_tokens >= HIT_SHARE * t.prompt_tokens for t in self.returning)

    def stayed(self) -> float:
        """Of the returning turns, the share answered by the replica that answered the conversation's previous
        turn (nan without replicas)."""
        answered = {(t.conv, t.turn): t.replica for t in self.turns}
        back = [t for t in self.returning if t.replica]
        if not back:
            return float("nan")
        return sum(answered.get((t.conv, t.turn - 1)) == t.replica for t in back) / len(back)


async def ask(client: httpx.AsyncClient, base: str, model: str, messages: list[dict[str, str]], max_tokens: int,
              conv: int, turn: int) -> tuple[Turn, str]:
    """One streamed chat completion: its Turn and its text."""
    stream = prefix.ChatStream()
    body = prefix.chat_body(model, messages, max_tokens)
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        replica = r.headers.get(REPLICA_HEADER, "")
        async for line in r.aiter_lines():
            stream.feed(line)
    ttft = stream.ttft or time.perf_counter() - stream.start
    return Turn(conv, turn, ttft, int(stream.usage.get("prompt_tokens", 0)), stream.cached or 0, replica), \
        stream.text


async def warm_up(base: str, replicas: int) -> str:
    """Short unrelated requests until every replica answered one (first-graph costs; at most 4 per replica);
    returns the model id to ask for."""
    seen: set[str] = set()
    async with prefix.new_client(1) as client:
        model = await throughput.model_id(client, base)
        for i in range(4 * max(replicas, 1)):
            turn, _ = await ask(client, base, model, [{"role": "user", "content": f"Warm-up {i}: say hi."}], 4, -1, 0)
            seen.add(turn.replica)
            if len(seen) >= max(replicas, 1):
                break
    return model


async def play_round(client: httpx.AsyncClient, base: str, model: str, messages: list[list[dict[str, str]]],
                     order: list[int], turn: int, args: argparse.Namespace) -> list[Turn]:
    """Turn `turn` of the conversations in `order`, args.users at once; each answer joins its conversation."""
    queue = list(reversed(order))

    async def user() -> list[Turn]:
        done = []
        while queue:
            conv = queue.pop()
            messages[conv].append({"role": "user", "content": conversations.question(conv, turn)})
            reply, text = await ask(client, base, model, messages[conv], args.max_tokens, conv, turn)
            messages[conv].append({"role": "assistant", "content": text})
            done.append(reply)
        return done

    return [t for done in await asyncio.gather(*(user() for _ in range(args.users))) for t in done]


async def converse(base: str, model: str, systems: list[str], args: argparse.Namespace, tag: str) -> list[Turn]:
    """Every conversation's turns, round by round, each round in its seeded shuffled order."""
    messages = [[{"role": "system", "content": system}] for system in systems]
    rng = random.Random(args.seed)
    turns: list[Turn] = []
    async with prefix.new_client(args.users) as client:
        for turn in range(1, args.turns + 1):
            order = list(range(len(systems)))
            rng.shuffle(order)
            now = await play_round(client, base, model, messages, order, turn, args)
            print(f"  [{tag}] turn {turn}: median TTFT {ms(median([t.ttft for t in now]))} ms, cached "
                  f"{sum(t.cached_tokens for t in now)}/{sum(t.prompt_tokens for t in now)} prompt tokens",
                  flush=True)
            turns += now
    return turns


def part_routing(args: argparse.Namespace, logdir: Path) -> list[Routing]:
    count = token_counter()
    systems = [conversations.system_prompt(conversations.OPENERS[i], f"conv-{i}", args.system_tokens, count)
               for i in range(args.conversations)]
    r, p, t = args.replicas, args.parallel, args.threads
    setups = [Setup("ray-prefix", r, "prefix", p, t), Setup("ray-round-robin", r, "round-robin", p, t),
              Setup("plain", 0, "", r * p, r * t)]
    results = []
    for setup in (s for s in setups if s.label in args.setups):
        result = Routing(setup)
        with recorded(result, setup.label):
            with serving(setup, args, logdir, f"routing-{setup.label}") as base:
                model = asyncio.run(warm_up(base, setup.replicas))
                result.turns = asyncio.run(converse(base, model, systems, args, setup.label))
            with (logdir / f"routing-{setup.label}.jsonl").open("w") as out:
                out.writelines(json.dumps(asdict(turn)) + "\n" for turn in result.turns)
        results.append(result)
    return results


@contextlib.contextmanager
def recorded(result: Routing | Overhead, tag: str) -> Iterator[None]:
    """Run one setup's measurement; a server that does not start or a failed request is its result's error,
    printed, and the other setups still run."""
    try:
        yield
    except throughput.StartError as e:
        result.error = f"failed to start: {e}"
    except (httpx.HTTPError, RuntimeError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
    if result.error:
        print(f"  [{tag}] {result.error}", flush=True)


# ------------------------------------------------------------------------------------------------------ overhead


@dataclass
class Overhead:
    setup: Setup
    levels: list[throughput.LevelResult] | None = None
    error: str = ""


def part_overhead(args: argparse.Namespace, logdir: Path) -> list[Overhead]:
    slots, threads = args.replicas * args.parallel, args.replicas * args.threads
    results = [Overhead(Setup("plain", 0, "", slots, threads)), Overhead(Setup("ray-1-replica", 1, "", slots, threads))]
    for round_no in range(1, args.rounds + 1):
        for result in results:
            tag = f"overhead-{result.setup.label}-{round_no}"
            with recorded(result, tag):
                with serving(result.setup, args, logdir, tag) as base:
                    asyncio.run(throughput.run_level(base, 1, 1, min(16, args.max_tokens_overhead)))  # warm-up
                    levels = []
                    for streams in args.concurrency:
                        per_stream = max(args.requests_per_stream, -(-args.min_requests // streams))
                        level = asyncio.run(throughput.run_level(base, streams, per_stream, args.max_tokens_overhead))
                        print(f"  [{tag}] {streams} streams: {level.tps:.1f} tok/s, TTFT {ms(level.mean_ttft)} ms",
                              flush=True)
                        levels.append(level)
                result.levels = throughput.best_of(result.levels, levels)
    return results


# ------------------------------------------------------------------------------------------------------ report


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def p90(values: list[float]) -> float:
    """Nearest-rank 90th percentile."""
    ordered = sorted(values)
    return ordered[math.ceil(0.9 * len(ordered)) - 1] if ordered else float("nan")


def ms(seconds: float) -> str:
    return "—" if math.isnan(seconds) else f"{seconds * 1000:.0f}"


def share(value: float) -> str:
    return "—" if math.isnan(value) else f"{value:.0%}"


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 and not math.isnan(a) else float("nan")


def verdict(value: float, ok: Callable[[float], bool]) -> str:
    return "—" if math.isnan(value) else f"{value:.2f}x ({'PASS' if ok(value) else 'FAIL'})"


def print_routing(results: list[Routing]) -> None:
    print("\n| setup | slots x threads | returning turns | turn 1 TTFT median | returning TTFT mean | median | p90 "
          f"| hits (cached ≥ {HIT_SHARE:.0%} of the prompt) | cached / prompt tokens "
          "| same replica as the turn before |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        s = r.setup
        shape = f"{s.replicas} x ({s.slots} x {s.threads})" if s.replicas else f"{s.slots} x {s.threads}"
        if r.error:
            print(f"| {s.label} | {shape} | {r.error.splitlines()[0]} | | | | | | | |")
            continue
        back = r.returning
        ttfts = [t.ttft for t in back]
        hits = r.hits()
        cached, prompt = sum(t.cached_tokens for t in back), sum(t.prompt_tokens for t in back)
        print(f"| {s.label} | {shape} | {len(back)} | {ms(median([t.ttft for t in r.turns if t.turn == 1]))} ms "
              f"| {ms(mean(ttfts))} ms | {ms(median(ttfts))} ms | {ms(p90(ttfts))} ms "
              f"| {hits}/{len(back)} ({share(ratio(hits, len(back)))}) "
              f"| {cached}/{prompt} ({share(ratio(cached, prompt))}) | {share(r.stayed())} |")
    by = {r.setup.label: r for r in results if not r.error}
    prefix_run, rr, plain = by.get("ray-prefix"), by.get("ray-round-robin"), by.get("plain")
    if prefix_run is None:
        return
    back = prefix_run.returning
    hit = ratio(prefix_run.hits(), len(back))
    print(f"\nray-prefix hits: {share(hit)} of returning turns (goal ≥ {HIT_GOAL:.0%}: "
          f"{'—' if math.isnan(hit) else 'PASS' if hit >= HIT_GOAL else 'FAIL'})")
    mine = [t.ttft for t in back]
    for other in (rr, plain):
        if other is None:
            continue
        theirs = [t.ttft for t in other.returning]
        mean_ratio = ratio(mean(mine), mean(theirs))
        goal = f" (goal ≤ {TTFT_GOAL}x: {'PASS' if mean_ratio <= TTFT_GOAL else 'FAIL'})" \
            if other is rr and not math.isnan(mean_ratio) else ""
        print(f"ray-prefix / {other.setup.label} returning TTFT: mean {mean_ratio:.2f}x{goal}, median "
              f"{ratio(median(mine), median(theirs)):.2f}x, p90 {ratio(p90(mine), p90(theirs)):.2f}x")


def print_overhead(results: list[Overhead]) -> None:
    plain, ray = results
    print("\n| streams | plain tok/s (TTFT) | Ray, 1 replica tok/s (TTFT) | ray / plain "
          f"(goal ≥ {OVERHEAD_GOAL}x) |")
    print("|---|---|---|---|")
    if plain.levels is None or ray.levels is None:
        for r in results:
            print(f"| | {r.setup.label}: {(r.error or 'no result').splitlines()[0]} | | |")
        return
    for a, b in zip(plain.levels, ray.levels, strict=True):
        print(f"| {a.streams} | {a.tps:.1f} ({ms(a.mean_ttft)} ms) | {b.tps:.1f} ({ms(b.mean_ttft)} ms) "
              f"| {verdict(ratio(b.tps, a.tps), lambda v: v >= OVERHEAD_GOAL)} |")


# ------------------------------------------------------------------------------------------------------ main


def token_counter() -> Callable[[str], int]:
    """Tokens of a text by the embedded model's vocab (sizing prompts only); ~4 characters a token without it."""
    try:
        from lmserve.store.embedded import embedded_model_path
    except ImportError:
        return lambda text: max(1, len(text) // 4)
    return prefix.token_counter(embedded_model_path())


def parse_args() -> argparse.Namespace:
    venv_python = ROOT / ".venv/bin/python"
    cores = os.cpu_count() or 1
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--model", default=MODEL, help="the model every server serves (a name or a GGUF path)")
    p.add_argument("--replicas", type=int, default=2, help="routing: replicas behind Ray")
    p.add_argument("--parallel", type=int, default=4, help="slots per replica (the plain server: replicas x this)")
    p.add_argument("--threads", type=int, default=None,
                   help="threads per replica (the plain server: replicas x this); default all cores / replicas")
    p.add_argument("--replica-cpus", type=float, default=None,
                   help="CPUs Ray reserves per replica (default: its threads)")
    p.add_argument("--setups", default=",".join(SETUPS), help=f"routing: comma-separated subset of {','.join(SETUPS)}")
    p.add_argument("--ctx", type=int, default=2048, help="context tokens per slot")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4, help="turns per conversation (turn 1 cold, the rest returning)")
    p.add_argument("--users", type=int, default=4, help="routing: requests in flight at once")
    p.add_argument("--system-tokens", type=int, default=500, help="tokens of each conversation's system prompt")
    p.add_argument("--max-tokens", type=int, default=16, help="routing: tokens per answer")
    p.add_argument("--seed", type=int, default=0, help="routing: seed of the rounds' orders")
    p.add_argument("--concurrency", default="1,8", help="overhead: comma-separated concurrent stream counts")
    p.add_argument("--max-tokens-overhead", type=int, default=64, help="overhead: tokens per request")
    p.add_argument("--requests-per-stream", type=int, default=2, help="overhead: sequential requests per stream")
    p.add_argument("--min-requests", type=int, default=8, help="overhead: at least this many requests per level")
    p.add_argument("--rounds", type=int, default=2, help="overhead: setups take turns; best round per level")
    p.add_argument("--lmserve-args", default="", help="more lmserve flags for every server, e.g. \"--cache-disk 0\"")
    p.add_argument("--python", default=str(venv_python if venv_python.exists() else sys.executable),
                   help="interpreter for lmserve")
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds to wait for /health")
    args = p.parse_args()
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    args.setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    if set(args.setups) - set(SETUPS):
        p.error(f"unknown setups: {', '.join(sorted(set(args.setups) - set(SETUPS)))}")
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if set(args.only) - set(PARTS):
        p.error(f"unknown parts: {', '.join(sorted(set(args.only) - set(PARTS)))}")
    args.threads = args.threads or max(1, cores // args.replicas)
    if min(args.replicas, args.parallel, args.conversations, args.turns, args.users, args.rounds) < 1:
        p.error("--replicas, --parallel, --conversations, --turns, --users and --rounds are positive")
    if args.conversations > len(conversations.OPENERS):
        p.error(f"at most {len(conversations.OPENERS)} conversations (distinct first words)")
    return args


def main() -> int:
    args = parse_args()
    # SIGTERM (e.g. from `timeout`) becomes SystemExit so the servers still get stopped.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    load = os.getloadavg()[0]
    busy = " (other work will skew the numbers)" if load > 0.5 else ""
    print(f"machine: {os.cpu_count()} cores; load average {load:.1f}{busy}")
    r, p, t = args.replicas, args.parallel, args.threads
    cpus = "its threads" if args.replica_cpus is None else f"{args.replica_cpus:g}"
    print(f"model: {args.model}; per replica -np {p} -t {t} (CPUs Ray reserves per replica: {cpus}), "
          f"{args.ctx} tokens per slot; plain and the 1-replica overhead runs: -np {r * p} -t {r * t}; "
          f"parts {','.join(args.only)}", flush=True)
    if "routing" in args.only:
        print(f"routing: {args.conversations} conversations x {args.turns} turns, ~{args.system_tokens}-token system "
              f"prompts, {args.max_tokens} tokens per answer, {args.users} users at once", flush=True)
    if "overhead" in args.only:
        print(f"overhead: streams {args.concurrency}, {args.max_tokens_overhead} tokens per request, "
              f"{args.rounds} rounds", flush=True)
    logdir = Path(tempfile.mkdtemp(prefix="lmserve-replicas-"))
    started = time.perf_counter()
    routing = part_routing(args, logdir) if "routing" in args.only else []
    overhead = part_overhead(args, logdir) if "overhead" in args.only else []
    if routing:
        print_routing(routing)
    if overhead:
        print_overhead(overhead)
    print(f"\ntotal {time.perf_counter() - started:.0f} s; server logs: {logdir}")
    failed = any(r.error for r in routing) or any(o.levels is None for o in overhead)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
