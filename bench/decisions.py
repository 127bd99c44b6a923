#!/usr/bin/env python3
"""The Decisions API and reranking (issue 30) against the chat requests a client would send instead.

1. Decisions vs chat (goal: decisions' wall <= 0.1x the chat requests'). One lmserve server (the default model, `-np
   P -c CTX`). A report of numbered towns (`In town 17 the weather was cold, the market sold apples and the crowd was
   small.`, ~`--doc-tokens` tokens, generated from a seed) is asked `--questions` questions about it, in turn a choice
   (the weather: warm, cold or hot), a predicate (`The market in town 17 sold fish.`, true for every other one) and a
   score (the crowd: small, medium or large); every answer is one SmolLM2 token. Measured, order alternating over the
   rounds, each from the same cache state:
   - decisions: one `POST /v1/decisions` with all the questions;
   - chat: one `POST /v1/chat/completions` per question (the report, a blank line, then the question and its
     answers worded as lmserve's judging words them, so both sides prefill the same tokens), temperature 0, no
     max_tokens (the model answers until it stops, its context is full, or the server's default `-n`, set by
     `--n-predict`, is reached), `--parallel` requests in flight at once;
   - chat, max_tokens 8: the same, each reply cut at 8 tokens (a generous chat baseline);
   - then, to show where a decision's time goes, a decision asking the first question only (the report's prefill).
   Every measurement opens its report with a header of its own (`Report 1-D: ...`), so neither finds the other's
   report in the prompt cache (RAM or disk); only the chat template's opening is shared. A chat reply's answer is the
   first allowed answer found in it (a whole word, any case); it is compared with the decision's most probable answer
   and with the report.
2. Rerank (no goal): `--documents` short passages (~30-60 tokens) ranked for one query by `POST /v1/rerank` on (a)
   the same lmserve server (the chat model judges each passage: P(Yes)), (b) `lmserve serve` over a tiny BERT
   reranker GGUF (tests/tiny_reranker.py; written to a temporary folder) and (c) llama-server over the same GGUF
   (`--rerank`); same threads and `-np`, contexts as each server sizes them (512 tokens: the GGUF's). Milliseconds per
   passage (one request's wall / passages; for the tiny reranker the median of 3 after a warm-up) and lmserve /
   llama-server. (c) is skipped, saying so, when the llama-server binary is missing.

Timings are never asserted; the script exits 0 whatever the numbers (1 when a server cannot run). It imports
tests/tiny_reranker.py (and tests/tiny_gguf.py) for part 2, so it runs from a checkout, not from an installed wheel.

    .venv/bin/python bench/decisions.py [--doc-tokens 2000] [--questions 100] [--documents 100] [--rounds 2]
    .venv/bin/python bench/decisions.py --quick      # 500-token report, 20 questions, 20 passages, 1 round, -n 32
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
# as bench/batch.py: bench/ itself off sys.path (its names may shadow), the checkout on it (bench.*, tests.*)
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

from bench.throughput import (  # noqa: E402
    StartError,
    bench_parser,
    llama_server,
    lmserve,
    model_id,
    ratio,
    verdict,
)

GOAL = 0.1
"""One decision's wall at most this times the chat requests' asking the same questions."""
FULL: dict[str, Any] = {"doc_tokens": 2000, "questions": 100, "documents": 100, "rounds": 2, "n_predict": None}
QUICK: dict[str, Any] = {"doc_tokens": 500, "questions": 20, "documents": 20, "rounds": 1, "n_predict": 32}
SHORT_MAX_TOKENS = 8
"""max_tokens of the generous chat baseline."""
TINY_REPEATS = 3
"""Requests per tiny-reranker server after its warm-up (the median is kept)."""

WEATHERS = ("warm", "cold", "hot")
GOODS = ("apples", "fish", "bread", "salt", "rice", "corn", "milk")
CROWDS = ("small", "medium", "large")
"""Every word here and Yes/No are one SmolLM2 token each."""
PREDICATE = ("Yes", "No")
SIDES = ("decisions", "chat", f"chat, max_tokens {SHORT_MAX_TOKENS}")
PROBE = "decisions, first question only"


# ---- the report and its questions ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Town:
    number: int
    weather: str
    goods: str
    crowd: str

    def fact(self) -> str:
        return (f"In town {self.number} the weather was {self.weather}, the market sold {self.goods} and the crowd "
                f"was {self.crowd}.")


@dataclass(frozen=True)
class Ask:
    """One question: its Decisions API body, the text a chat client asks it with, its answers and the right one."""

    body: dict[str, Any]
    text: str
    answers: tuple[str, ...]
    truth: str


def make_towns(count: int, seed: int = 30) -> list[Town]:
    rng = random.Random(seed)
    return [Town(n, rng.choice(WEATHERS), rng.choice(GOODS), rng.choice(CROWDS)) for n in range(1, count + 1)]


def report(towns: list[Town], tag: str) -> str:
    """The document: a header naming the measurement (`tag`), then one fact per line."""
    return f"Report {tag}: the towns of the valley, one line each.\n" + "\n".join(t.fact() for t in towns)


def make_questions(towns: list[Town], count: int) -> list[Ask]:
    """`count` questions, in turn a choice, a predicate and a score, each about the next town (wrapping around)."""
    asks = []
    for i in range(count):
        town = towns[i % len(towns)]
        kind = i % 3
        if kind == 0:
            instructions = f"What was the weather in town {town.number}?"
            asks.append(Ask({"type": "choice", "instructions": instructions,
                             "choices": [{"value": w} for w in WEATHERS]},
                            f"Answer with one of: {', '.join(WEATHERS)}.\n{instructions}", WEATHERS, town.weather))
        elif kind == 1:
            holds = (i // 3) % 2 == 0
            goods = town.goods if holds else GOODS[(GOODS.index(town.goods) + 1 + i % 5) % len(GOODS)]
            statement = f"The market in town {town.number} sold {goods}."
            asks.append(Ask({"type": "predicate", "instructions": statement},
                            f"Say whether the statement is true. Answer Yes or No.\nStatement: {statement}", PREDICATE,
                            "Yes" if holds else "No"))
        else:
            instructions = f"How large was the crowd in town {town.number}?"
            asks.append(Ask({"type": "score", "instructions": instructions,
                             "levels": [{"label": c} for c in CROWDS]},
                            f"Answer with one of from lowest to highest: {', '.join(CROWDS)}.\n{instructions}", CROWDS,
                            town.crowd))
    return asks


def parse_reply(reply: str, answers: tuple[str, ...]) -> str | None:
    """The allowed answer that appears first in `reply` (a whole word, any case); None when none does."""
    found = [(m.start(), a) for a in answers
             for m in [re.search(rf"\b{re.escape(a)}\b", reply, flags=re.IGNORECASE)] if m]
    return min(found)[1] if found else None


def decided(answer: dict[str, Any]) -> str:
    """A Decisions API answer's most probable answer, as its question's answer text."""
    if answer["type"] == "predicate":
        return PREDICATE[0] if answer["probability"] >= 0.5 else PREDICATE[1]
    if answer["type"] == "choice":
        return str(answer["choice"])
    return str(max(answer["probabilities"], key=lambda p: p["probability"])["label"])


async def sized_towns(client: httpx.AsyncClient, base: str, doc_tokens: int) -> tuple[list[Town], int]:
    """The most towns whose report has at most `doc_tokens` tokens (counted by the server's /tokenize), and its
    size."""
    async def tokens(text: str) -> int:
        r = await client.post(base + "/tokenize", json={"content": text})
        r.raise_for_status()
        return len(r.json()["tokens"])

    probe = max(4, doc_tokens // 10)
    header = await tokens(report([], "1-D"))
    per_town = (await tokens(report(make_towns(probe), "1-D")) - header) / probe
    count = max(1, round((doc_tokens - header) / per_town))
    size = await tokens(report(make_towns(count), "1-D"))
    while size > doc_tokens and count > 1:  # the estimate's error is a few towns at most
        count -= 1
        size = await tokens(report(make_towns(count), "1-D"))
    while (grown := await tokens(report(make_towns(count + 1), "1-D"))) <= doc_tokens:
        count, size = count + 1, grown
    return make_towns(count), size


# ---- part 1: the measurements --------------------------------------------------------------------------------


@dataclass
class Side:
    """One side's measurements over the rounds: walls, answers (None: no allowed answer in the reply), tokens."""

    walls: list[float] = field(default_factory=list)
    answers: list[list[str | None]] = field(default_factory=list)
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: list[int] = field(default_factory=list)
    cut: int = 0
    """Replies that ended at a limit (finish_reason length: max_tokens, the server's -n or the context)."""

    @property
    def wall(self) -> float:
        return statistics.fmean(self.walls) if self.walls else float("nan")


async def decide(client: httpx.AsyncClient, base: str, model: str, document: str, asks: list[Ask], side: Side) -> None:
    """One decision asking every question about `document`."""
    body = {"model": model, "input": document, "questions": [a.body for a in asks]}
    started = time.perf_counter()
    r = await client.post(base + "/v1/decisions", json=body)
    wall = time.perf_counter() - started
    if r.status_code != 200:
        raise RuntimeError(f"/v1/decisions: HTTP {r.status_code}: {r.text[:300]}")
    data = r.json()
    side.walls.append(wall)
    side.answers.append([decided(a) for a in data["answers"]])
    side.requests += 1
    side.prompt_tokens += int(data["usage"]["input_tokens"])
    side.cached_tokens += int(data["usage"]["input_tokens_details"]["cached_tokens"])


async def chats(client: httpx.AsyncClient, base: str, model: str, document: str, asks: list[Ask], side: Side,
                parallel: int, max_tokens: int | None) -> None:
    """One chat completion per question, `parallel` in flight (each worker sends the next as its last returns)."""
    replies: list[str | None] = [None] * len(asks)
    pending = iter(range(len(asks)))

    async def worker() -> None:
        for i in pending:
            body: dict[str, Any] = {"model": model, "temperature": 0,
                                    "messages": [{"role": "user", "content": f"{document}\n\n{asks[i].text}"}]}
            if max_tokens is not None:
                body["max_tokens"] = max_tokens
            r = await client.post(base + "/v1/chat/completions", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"/v1/chat/completions: HTTP {r.status_code}: {r.text[:300]}")
            data = r.json()
            usage = data["usage"]
            side.prompt_tokens += int(usage["prompt_tokens"])
            side.cached_tokens += int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            side.completion_tokens.append(int(usage["completion_tokens"]))
            side.cut += data["choices"][0].get("finish_reason") == "length"
            replies[i] = parse_reply(data["choices"][0]["message"]["content"] or "", asks[i].answers)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(parallel)))
    side.walls.append(time.perf_counter() - started)
    side.answers.append(replies)
    side.requests += len(asks)


async def decisions_part(base: str, args: argparse.Namespace) -> tuple[dict[str, Side], list[Ask], int]:
    """Part 1's rounds on the server at `base`: each side per round, order alternating."""
    limits = httpx.Limits(max_connections=args.parallel + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        model = await model_id(client, base)
        towns, doc_tokens = await sized_towns(client, base, args.doc_tokens)
        asks = make_questions(towns, args.questions)
        print(f"[decisions] model {model}; report of {len(towns)} towns, {doc_tokens} tokens; {len(asks)} questions; "
              f"chat: {args.parallel} requests in flight", flush=True)
        warm = make_towns(3, seed=1)  # model load and first-request costs, on a report of its own
        await decide(client, base, model, report(warm, "warm-up"), make_questions(warm, 3), Side())
        await chats(client, base, model, report(warm, "warm-up"), make_questions(warm, 1), Side(), 1, 4)
        sides = {name: Side() for name in (*SIDES, PROBE)}
        for round_no in range(1, args.rounds + 1):
            order = list(SIDES) if round_no % 2 == 0 else list(SIDES[::-1])
            for name in order:
                side = sides[name]
                document = report(towns, f"{round_no}-{'DCS'[SIDES.index(name)]}")  # a header of its own
                if name == "decisions":
                    await decide(client, base, model, document, asks, side)
                else:
                    await chats(client, base, model, document, asks, side, args.parallel,
                                None if name == "chat" else SHORT_MAX_TOKENS)
                right = sum(a == q.truth for a, q in zip(side.answers[-1], asks, strict=True))
                print(f"[{name}] round {round_no}: {side.walls[-1]:.1f} s, {right}/{len(asks)} right per the report",
                      flush=True)
            probe = sides[PROBE]  # where a decision's time goes: the report's prefill and its first question
            await decide(client, base, model, report(towns, f"{round_no}-P"), asks[:1], probe)
            print(f"[{PROBE}] round {round_no}: {probe.walls[-1]:.1f} s", flush=True)
    return sides, asks, doc_tokens


def agreement(side: Side, reference: Side) -> tuple[int, int]:
    """(answers equal to the reference's of the same round, answers compared)."""
    pairs = [(a, b) for ours, theirs in zip(side.answers, reference.answers, strict=True)
             for a, b in zip(ours, theirs, strict=True)]
    return sum(a == b for a, b in pairs), len(pairs)


def count(values: list[str | None], predicate: Any) -> int:
    return sum(1 for v in values if predicate(v))


def decisions_report(sides: dict[str, Side], asks: list[Ask], doc_tokens: int, args: argparse.Namespace) -> list[str]:
    """Part 1's markdown tables: the measurements, then the ratios with their verdicts."""
    ordered = [sides[name] for name in SIDES]
    dec = sides["decisions"]
    truths = [q.truth for q in asks]

    def cells(values: list[str]) -> str:
        return " | ".join(values)

    def fraction(hit: int, total: int) -> str:
        return f"{hit}/{total} ({100 * hit / total:.0f}%)" if total else "-"

    default = "none" if args.n_predict in (None, -1) else f"{args.n_predict} tokens (`-n {args.n_predict}`)"
    rows = [f"\nPart 1: {len(asks)} questions about a {doc_tokens}-token report, lmserve `-np {args.parallel} "
            f"-c {args.ctx}`, {args.threads} threads, {args.rounds} round(s), each measurement on a report with a "
            "header of its own (nothing cached beyond the chat template's opening); the server's default max_tokens "
            f"(what `chat` gets): {default}\n",
            f"| measure | {cells(list(SIDES))} |", "|---|---|---|---|"]
    rows.append("| wall s, mean (each round) | " + cells([
        f"{s.wall:.1f} ({', '.join(f'{w:.1f}' for w in s.walls)})" for s in ordered]) + " |")
    rows.append("| requests | " + cells([str(s.requests) for s in ordered]) + " |")
    rows.append("| prompt tokens run (cached) | " + cells([f"{s.prompt_tokens} ({s.cached_tokens})" for s in ordered])
                + " |")
    rows.append("| tokens computed: prompt - cached + generated | " + cells([
        str(s.prompt_tokens - s.cached_tokens + sum(s.completion_tokens)) for s in ordered]) + " |")
    rows.append("| generated tokens per reply, mean / max | " + cells([
        f"{statistics.fmean(s.completion_tokens):.1f} / {max(s.completion_tokens)}" if s.completion_tokens else "-"
        for s in ordered]) + " |")
    rows.append("| replies cut at a limit (finish_reason length) | " + cells(
        ["-"] + [f"{s.cut}/{len(s.completion_tokens)}" for s in ordered[1:]]) + " |")
    rows.append("| an allowed answer in the reply | " + cells([
        fraction(sum(count(r, lambda v: v is not None) for r in s.answers), len(asks) * len(s.answers))
        for s in ordered]) + " |")
    rows.append("| same answer as the decision | " + cells(
        ["-"] + [fraction(*agreement(s, dec)) for s in ordered[1:]]) + " |")
    rows.append("| right per the report | " + cells([
        fraction(sum(a == t for r in s.answers for a, t in zip(r, truths, strict=True)), len(asks) * len(s.answers))
        for s in ordered]) + " |")
    rows += ["", "| comparison | ratio | goal | verdict |", "|---|---|---|---|"]
    for name in SIDES[1:]:
        value = ratio(dec.wall, sides[name].wall)
        rows.append(f"| decisions / {name}, wall | {value:.3f}x | <= {GOAL}x | "
                    f"{verdict(value <= GOAL, fail='MISS')} |")
    probe = sides[PROBE]
    if probe.walls and len(asks) > 1:
        rest = (dec.wall - probe.wall) / (len(asks) - 1)
        computed = (probe.prompt_tokens - probe.cached_tokens) // probe.requests
        rows.append(f"\nWhere the decision's time goes: the same report with its first question only took "
                    f"{probe.wall:.1f} s ({computed} tokens computed: the report's prefill), so each further question "
                    f"cost {1000 * rest:.0f} ms.")
    return rows


# ---- part 2: rerank --------------------------------------------------------------------------------------------

QUERY = "Where can I buy fresh bread early in the morning?"
TOPICS = (
    ("The bakery on the corner of {street} opens at six and sells fresh bread, rolls and pastries", True),
    ("Every morning the baker at {street} takes warm loaves of bread out of the oven before dawn", True),
    ("The old bridge near {street} was repaired last year after the spring floods damaged its arches", False),
    ("The library on {street} lends books, maps and records, and holds a reading club on Thursdays", False),
    ("A railway line once ran along {street}, carrying coal from the mines to the harbour", False),
    ("The museum at {street} shows paintings of the valley and tools used by its first farmers", False),
    ("Children play football in the park behind {street} until the lamps are lit in the evening", False),
    ("The garage on {street} repairs bicycles and cars and sells spare tyres at a fair price", False),
    ("Farmers bring cheese, eggs and vegetables to the square at {street} on market days", False),
    ("The school on {street} teaches music, and its choir sings at the festival every summer", False),
)
STREETS = ("Mill Street", "Harbour Road", "Church Lane", "the High Street", "Station Road", "Oak Avenue",
           "Bridge Street", "the Market Square", "Castle Hill", "River Walk")
EXTRAS = ("The street is quiet on Sundays.", "Many visitors come in summer.", "Parking is difficult nearby.",
          "It has been there for a hundred years.", "The locals recommend it.", "Prices went up last winter.")


def passages(count: int, seed: int) -> tuple[list[str], list[bool]]:
    """`count` passages of one to three sentences (~30-60 SmolLM2 tokens) and whether each is about fresh bread."""
    rng = random.Random(seed)
    texts, relevant = [], []
    for _ in range(count):
        topic, about_bread = rng.choice(TOPICS)
        extra = " ".join(rng.sample(EXTRAS, rng.randint(1, 2)))
        texts.append(f"{topic.format(street=rng.choice(STREETS))}. {extra}")
        relevant.append(about_bread)
    return texts, relevant


async def rerank(base: str, model: str, documents: list[str]) -> tuple[float, list[float]]:
    """One /v1/rerank request's wall and the scores in the documents' order."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0)) as client:
        started = time.perf_counter()
        r = await client.post(base + "/v1/rerank", json={"model": model, "query": QUERY, "documents": documents})
        wall = time.perf_counter() - started
    if r.status_code != 200:
        raise RuntimeError(f"/v1/rerank: HTTP {r.status_code}: {r.text[:300]}")
    scores = [0.0] * len(documents)
    for result in r.json()["results"]:
        scores[result["index"]] = float(result["relevance_score"])
    return wall, scores


async def served_model(base: str) -> str:
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
        return await model_id(client, base)


def timed_reranks(base: str, model: str, documents: list[str], repeats: int) -> tuple[float, list[float]]:
    """The median wall of `repeats` reranks after one warm-up, and the scores."""
    asyncio.run(rerank(base, model, documents[:2]))
    walls, scores = [], []
    for _ in range(repeats):
        wall, scores = asyncio.run(rerank(base, model, documents))
        walls.append(wall)
    return statistics.median(walls), scores


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def rerank_part(chat_base: str, args: argparse.Namespace) -> list[str]:
    """Part 2: the chat model on the running server, then the tiny reranker on lmserve and on llama-server."""
    from tests.tiny_reranker import write_tiny_reranker  # a checkout's test helper (see the module's docstring)

    documents, relevant = passages(args.documents, seed=2)
    top = max(1, sum(relevant))
    model = asyncio.run(served_model(chat_base))
    asyncio.run(rerank(chat_base, model, passages(4, seed=3)[0]))  # warm-up on other passages
    chat_wall, chat_scores = asyncio.run(rerank(chat_base, model, documents))
    hits = sum(relevant[i] for i in sorted(range(len(documents)), key=lambda i: -chat_scores[i])[:top])
    print(f"[rerank] {model} (judged): {chat_wall:.1f} s for {len(documents)} passages; {hits}/{top} of the top "
          f"{top} are about bread", flush=True)
    rows = [f"\nPart 2: one query, {len(documents)} passages; ms per passage (one request's wall / passages; the "
            f"tiny reranker: median of {TINY_REPEATS} requests after a warm-up)\n",
            "| reranker | server | ms per passage | note |", "|---|---|---|---|",
            f"| {model} (chat model judging: P(Yes)) | lmserve | {1000 * chat_wall / len(documents):.1f} | "
            f"{hits}/{top} of the top {top} about bread |"]
    with tempfile.TemporaryDirectory(prefix="lmserve-bench-decisions-") as tmp:
        gguf = write_tiny_reranker(Path(tmp) / "tiny-reranker.gguf", arch="bert")
        tiny_args = argparse.Namespace(**{**vars(args), "model": gguf})
        with lmserve(tiny_args, "-np", str(args.parallel), "-a", "tiny-reranker", name="rerank") as started:
            ours, our_scores = timed_reranks(started.base, "tiny-reranker", documents, TINY_REPEATS)
        print(f"[rerank] tiny reranker on lmserve: {ours:.3f} s", flush=True)
        rows.append(f"| tiny BERT reranker (tests/tiny_reranker.py) | lmserve | {1000 * ours / len(documents):.2f} "
                    "| |")
        if not os.access(args.llama_server_bin, os.X_OK):
            print(f"[rerank] llama-server skipped: binary {args.llama_server_bin} not found; run `make llama-server` "
                  "or set LLAMA_SERVER_BIN", flush=True)
            rows.append("| tiny BERT reranker | llama-server | - | skipped: no binary |")
            return rows
        with llama_server(tiny_args, "--rerank", "-np", str(args.parallel), name="rerank") as started:
            theirs, their_scores = timed_reranks(started.base, "tiny-reranker", documents, TINY_REPEATS)
        print(f"[rerank] tiny reranker on llama-server: {theirs:.3f} s", flush=True)
    # llama-server answers the head's logit, lmserve its sigmoid
    delta = max(abs(a - sigmoid(b)) for a, b in zip(our_scores, their_scores, strict=True))
    rows.append(f"| tiny BERT reranker | llama-server | {1000 * theirs / len(documents):.2f} | scores vs lmserve's: "
                f"max abs difference {delta:.1e} (after a sigmoid) |")
    rows.append(f"\nlmserve / llama-server, tiny reranker, ms per passage: {ratio(ours, theirs):.2f}x (no goal)")
    return rows


# ---- command line ----------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--parallel", type=int, default=4, help="-np of every server, and chat requests in flight "
                   "(default 4, lmserve's)")
    p.add_argument("--ctx", type=int, default=4096, help="-c of the chat model's server, per sequence (default 4096)")
    p.add_argument("--doc-tokens", type=int, help=f"tokens of the report (default {FULL['doc_tokens']})")
    p.add_argument("--questions", type=int, help=f"questions about it (default {FULL['questions']})")
    p.add_argument("--documents", type=int, help=f"passages to rerank (default {FULL['documents']})")
    p.add_argument("--rounds", type=int, help=f"rounds of part 1, order alternating (default {FULL['rounds']})")
    p.add_argument("--n-predict", type=int, help="the server's default max_tokens (lmserve's -n), what a chat "
                   "without max_tokens gets (default none: the reply ends when the model stops or the context is "
                   f"full; {QUICK['n_predict']} with --quick)")
    p.add_argument("--only", choices=("decisions", "rerank"), help="run one part")
    p.add_argument("--quick", action="store_true", help="a short check: " + ", ".join(
        f"{k.replace('_', '-')} {v}" for k, v in QUICK.items()) + " (explicit options still win)")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.model is None:
        p.error("no model: pass --model PATH.gguf")
    return args


def run(args: argparse.Namespace) -> Iterator[str]:
    """The parts asked for, on one chat server; the report's lines."""
    flags = ["-np", str(args.parallel), "-c", str(args.ctx)]
    if args.n_predict is not None:
        flags += ["-n", str(args.n_predict)]
    with lmserve(args, *flags, name="decisions") as started:
        print(f"[lmserve] {started.base}: {args.model.name}, {' '.join(flags)}, {args.threads} threads", flush=True)
        if args.only in (None, "decisions"):
            sides, asks, doc_tokens = asyncio.run(decisions_part(started.base, args))
            yield from decisions_report(sides, asks, doc_tokens, args)
        if args.only in (None, "rerank"):
            yield from rerank_part(started.base, args)


def main() -> int:
    args = parse_args()
    # SIGTERM (e.g. from `timeout`) becomes SystemExit, so the servers' context managers still kill them.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    print(f"machine: {os.cpu_count()} cores; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
          flush=True)
    started = time.perf_counter()
    try:
        lines = list(run(args))
    except (StartError, RuntimeError, httpx.HTTPError) as e:
        print(f"a server failed: {type(e).__name__}: {e}")
        return 1
    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"{time.perf_counter() - started:.0f} s in all")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
