#!/usr/bin/env python3
"""Audio (issue 45): transcribing the same 30 s clips on lmserve and its peers, side by side, alternating rounds.

Pairs, each serving the same model the same way:
- ``llama``: lmserve vs llama-server (same llama.cpp revision), both ``-m MODEL --mmproj PROJECTOR``, ``--parallel``
  (4) slots of ``-c`` (2048) tokens; requests go to each one's ``POST /v1/audio/transcriptions`` (multipart, as the
  openai client sends it) with ``max_tokens`` (llama-server's form field, lmserve takes it too).
- ``vllm``: lmserve on its vLLM engine vs ``vllm serve`` (vLLM's own OpenAI server), the same repository and engine
  settings; requests are chats with the clip as an ``input_audio`` part and ``max_tokens`` (vLLM transcribes only
  with Whisper-style models; an audio chat model answers in chat).
- ``whisper``: lmserve on its vLLM engine vs ``vllm serve``, both serving a Whisper-style speech-to-text model (default
  the tests' tiny random Whisper, tests/tiny_whisper.py; ``--whisper`` names another) through their own
  ``POST /v1/audio/transcriptions``, ``language`` en (no detection pass on either), the token limit in each one's
  field (lmserve ``max_tokens``, vLLM ``max_completion_tokens``); ``--max-model-len`` 448 (Whisper's decoder).
The default model is the tests' tiny random Qwen2-Audio (tests/tiny_audio.py: the GGUF and projector for ``llama``,
the repository for ``vllm``); ``--gguf``/``--mmproj``/``--repo`` name others. The clips are synthesized (tones
changing every second), a fresh one for every request (nothing is found in a cache): a random model's transcript
means nothing, so every request decodes ``--max-tokens`` (32).

Printed per peer and concurrency (``--concurrency`` 1,4; ``--requests`` 8 per level): requests/s, the mean latency
and the real-time factor (seconds of processing per second of audio, one request at a time: lower is faster);
best of ``--rounds`` (2); then lmserve ÷ peer requests/s (goal of issue 45: >= 1.0). ``--seconds`` sets the clips'
length (30: the issue's; llama.cpp pads a clip of whole 30 s windows with one window of silence more, which lmserve
leaves out, so the figure at 29 s is the one without that).

    .venv/bin/python bench/audio.py [--pairs llama,vllm,whisper] [--concurrency 1,4] [--requests 8] [--rounds 2]
        [--seconds 30]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is no package: its scripts share code
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' model makers
import throughput

GOAL = 1.0
CLIP_SECONDS = 30.0
RATE = 16_000


def clip(seconds: float = CLIP_SECONDS, seed: int = 0) -> bytes:
    """A WAV of tones that change every second (a different tune per `seed`)."""
    import soundfile

    rng = np.random.default_rng(seed)
    times = np.arange(RATE) / RATE
    wave = np.concatenate([0.3 * np.sin(2 * np.pi * rng.uniform(200, 1200) * times) for _ in range(int(seconds))])
    buffer = io.BytesIO()
    soundfile.write(buffer, wave.astype(np.float32), RATE, format="WAV")
    return buffer.getvalue()


async def transcribe(client: httpx.AsyncClient, base: str, model: str, data: bytes, max_tokens: int) -> None:
    form = {"model": model, "response_format": "json", "max_tokens": str(max_tokens), "temperature": "0"}
    response = await client.post(base + "/v1/audio/transcriptions", data=form, files={"file": ("clip.wav", data)})
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")


async def transcribe_english(client: httpx.AsyncClient, base: str, model: str, data: bytes, max_tokens: int) -> None:
    """A transcription of English speech, the limit also in vLLM's field (`max_completion_tokens`)."""
    form = {"model": model, "response_format": "json", "max_tokens": str(max_tokens), "temperature": "0",
            "language": "en", "max_completion_tokens": str(max_tokens)}
    response = await client.post(base + "/v1/audio/transcriptions", data=form, files={"file": ("clip.wav", data)})
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")


async def chat(client: httpx.AsyncClient, base: str, model: str, data: bytes, max_tokens: int) -> None:
    audio = {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Transcribe this clip."}, audio]}]}
    response = await client.post(base + "/v1/chat/completions", json=body)
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")


async def level(base: str, pair: str, concurrency: int, args: argparse.Namespace) -> tuple[float, float]:
    """Requests/s and mean latency of `args.requests` requests, `concurrency` at a time."""
    send = {"llama": transcribe, "vllm": chat, "whisper": transcribe_english}[pair]
    level.calls += 1  # fresh clips for every level and round: nothing is found in a peer's cache
    clips = [clip(args.seconds, seed=level.calls * 1000 + i) for i in range(args.requests)]
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        model = await throughput.model_id(client, base)
        queue = list(enumerate(clips))
        latencies: list[float] = []

        async def worker() -> None:
            while queue:
                _, data = queue.pop(0)
                start = time.perf_counter()
                await send(client, base, model, data, args.max_tokens)
                latencies.append(time.perf_counter() - start)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return len(clips) / wall, sum(latencies) / len(latencies)


level.calls = 0  # type: ignore[attr-defined]


@contextlib.contextmanager
def server(peer: str, pair: str, args: argparse.Namespace) -> Iterator[throughput.Started]:
    if pair == "llama":
        gguf = argparse.Namespace(**{**vars(args), "model": args.gguf})
        if peer == "lmserve":
            with throughput.lmserve(gguf, "--mmproj", str(args.mmproj), "--parallel", str(args.parallel), "-c",
                                    str(args.ctx), name="audio") as started:
                yield started
        else:
            with throughput.llama_server(gguf, "--mmproj", str(args.mmproj), "-np", str(args.parallel), "-c",
                                         str(args.ctx * args.parallel), name="audio") as started:
                yield started
        return
    port = throughput.free_port()
    repo, ctx = (args.whisper, 448) if pair == "whisper" else (args.repo, args.ctx)
    common = ["--dtype", "float32", "--max-model-len", str(ctx), "--max-num-seqs", str(args.parallel)]
    if peer == "lmserve":
        argv = [args.python, "-m", "lmserve", "serve", str(repo), "--engine", "vllm", *common,
                "--host", "127.0.0.1", "--port", str(port)]
    else:
        argv = [args.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(repo), *common,
                "--enforce-eager", "--kv-cache-memory-bytes", str(512 * 2**20), "--disable-log-stats",
                "--disable-uvicorn-access-log", "--host", "127.0.0.1", "--port", str(port)]
    with tempfile.TemporaryDirectory(prefix=f"lmserve-bench-audio-{peer}-") as tmp:
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("LMSERVE_")}, "LMSERVE_MODELS": tmp}
        with throughput.running(argv, port, "/health", Path(tmp) / "server.log", 600, env=env) as started:
            yield started


def run(peer: str, pair: str, args: argparse.Namespace) -> dict[int, tuple[float, float]]:
    with server(peer, pair, args) as started:
        asyncio.run(level(started.base, pair, 1, argparse.Namespace(**{**vars(args), "requests": 1})))  # warm up
        results = {n: asyncio.run(level(started.base, pair, n, args)) for n in args.concurrency}
    for n, (rps, latency) in results.items():
        print(f"[{pair}/{peer}] {n} at once: {rps:.2f} req/s, {latency:.2f} s each", flush=True)
    return results


def defaults(args: argparse.Namespace) -> None:
    """The tests' tiny Qwen2-Audio where no model was named."""
    if args.whisper is None:
        from tests.tiny_whisper import tiny_whisper_repo

        args.whisper = tiny_whisper_repo()
    if args.gguf is None or args.mmproj is None or args.repo is None:
        from tests.tiny_audio import tiny_qwen2_audio_gguf, tiny_qwen2_audio_repo

        gguf, mmproj = tiny_qwen2_audio_gguf()
        args.gguf, args.mmproj = args.gguf or gguf, args.mmproj or mmproj
        args.repo = args.repo or tiny_qwen2_audio_repo()


def report(best: dict[tuple[str, str], dict[int, tuple[float, float]]], args: argparse.Namespace) -> None:
    print(f"\n{args.requests} clips of {args.seconds:g} s per level, {args.max_tokens} tokens each; "
          f"best of {args.rounds}\n")
    print("| pair | peer | at once | req/s | latency s | real-time factor |")
    print("|---|---|---|---|---|---|")
    for (pair, peer), levels in best.items():
        for n, (rps, latency) in levels.items():
            print(f"| {pair} | {peer} | {n} | {rps:.2f} | {latency:.2f} | {latency / args.seconds:.3f} |")
    print()
    for pair in args.pairs:
        ours, theirs = best.get((pair, "lmserve")), best.get((pair, PEERS[pair]))
        if ours is None or theirs is None:
            continue
        for n in args.concurrency:
            ratio = ours[n][0] / theirs[n][0]
            print(f"{pair}: lmserve / {PEERS[pair]} at {n}: {ratio:.2f}x ({throughput.verdict(ratio >= GOAL)}; "
                  f"goal >= {GOAL})")


PEERS = {"llama": "llama-server", "vllm": "vllm-serve", "whisper": "vllm-serve"}


def main() -> int:
    parser = throughput.bench_parser(__doc__)
    parser.add_argument("--gguf", type=Path, help="an audio chat model's GGUF (default: the tests' tiny one)")
    parser.add_argument("--mmproj", type=Path, help="its audio projector")
    parser.add_argument("--repo", type=Path, help="the same model as a repository, for the vllm pair")
    parser.add_argument("--whisper", type=Path, help="a Whisper repository, for the whisper pair")
    parser.add_argument("--pairs", type=lambda text: text.split(","), default=["llama"],
                        help="llama, vllm, whisper")
    parser.add_argument("--concurrency", type=lambda text: [int(n) for n in text.split(",")], default=[1, 4])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=CLIP_SECONDS, help="each clip's length")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--ctx", type=int, default=2048, help="context tokens per slot")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    defaults(args)
    best: dict[tuple[str, str], dict[int, tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for pair in args.pairs:
            for peer in ("lmserve", PEERS[pair]):
                got = run(peer, pair, args)
                old = best.get((pair, peer), {})
                best[(pair, peer)] = {n: max(got[n], old.get(n, (0.0, 0.0))) for n in got}
    report(best, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
