"""Per-token cost of lmserve's serving layer: CPU time per streamed token between the engine and the socket.

A small model shows what a large one hides: every microsecond lmserve spends per token outside llama.cpp's decode
is time the decode threads do not get on a busy CPU. This benchmark keeps that cost in view, so a feature cannot
quietly add to it.

It drives the real app in-process (lmserve.http.app.create_app over the real service and BatchingEngine) with the
fake backend, whose steps cost nothing, and streams `--tokens` tokens per request through each dialect's streaming
route at the ASGI level (no socket, no client: only the server's work is timed). The cost of a token is the CPU
time of the whole process (event loop and engine thread) divided by the tokens streamed.

Side by side in the same run, the *floor*: a bare Starlette StreamingResponse yielding pre-encoded SSE frames, one
per token, through the same ASGI driver; what no server on this stack can go under. The budget is a ratio to the
floor (machine-independent): BUDGET below, PASS/FAIL printed.

    .venv/bin/python bench/token_cost.py [--tokens 512] [--rounds 5] [--streams 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message

from lmserve.chat.template import ChatTemplate
from lmserve.config import ServerConfig
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.fake import FakeBackend
from lmserve.http.app import create_app
from lmserve.service import static_service
from lmserve.service.residency import LoadedModel

BUDGET = {"/v1/chat/completions": 14.0, "/api/chat": 14.0, "/v1/messages": 14.0, "/v1/responses": 18.0}
"""The most a streamed token may cost on each route, as a multiple of the floor's cost per frame: what it cost on
2026-11-29 (11-15x) and a fifth more for noise. Lower it when the serving layer gets cheaper; never raise it
without saying in bench/README.md what the new cost buys."""

MESSAGES = [{"role": "user", "content": "Write a long essay."}]


def bodies(tokens: int) -> dict[str, dict[str, Any]]:
    """One streaming request per route, each asking for `tokens` tokens with the end of generation ignored."""
    return {
        "/v1/chat/completions": {"model": "fake", "messages": MESSAGES, "max_tokens": tokens, "stream": True,
                                 "ignore_eos": True, "temperature": 0},
        "/api/chat": {"model": "fake", "messages": MESSAGES, "stream": True,
                      "options": {"num_predict": tokens, "temperature": 0}},
        "/v1/messages": {"model": "fake", "messages": MESSAGES, "max_tokens": tokens, "stream": True,
                         "ignore_eos": True},
        "/v1/responses": {"model": "fake", "input": "Write a long essay.", "max_output_tokens": tokens,
                          "stream": True, "ignore_eos": True},
    }


async def post(app: ASGIApp, path: str, body: dict[str, Any]) -> int:
    """POST `body` to `path` at the ASGI level; the bytes of the response body."""
    payload = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "", "scheme": "http",
             "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 5000),
             "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(payload)).encode())]}
    sent = False
    done = asyncio.Event()
    received = 0
    status = 0

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal received, status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            received += len(message.get("body", b""))
            if not message.get("more_body", False):
                done.set()

    await app(scope, receive, send)
    if status != 200:
        raise SystemExit(f"{path} answered {status}")
    return received


def floor_app(tokens: int) -> Starlette:
    """The floor: a bare StreamingResponse of `tokens` pre-encoded SSE frames, one per await."""
    frame = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'

    async def frames() -> AsyncIterator[bytes]:
        for _ in range(tokens):
            await asyncio.sleep(0)
            yield frame

    async def route(request: Request) -> StreamingResponse:
        await request.body()
        return StreamingResponse(frames(), media_type="text/event-stream")

    return Starlette(routes=[Route("/floor", route, methods=["POST"])])


async def cost_us(app: ASGIApp, path: str, body: dict[str, Any], tokens: int, streams: int) -> float:
    """CPU microseconds per token of `streams` concurrent requests to `path` (process time: every thread)."""
    started = time.process_time()
    await asyncio.gather(*(post(app, path, body) for _ in range(streams)))
    return (time.process_time() - started) * 1e6 / (tokens * streams)


async def measure(tokens: int, rounds: int, streams: int) -> dict[str, list[float]]:
    engine = BatchingEngine(FakeBackend(num_ctx=tokens + 256, num_parallel=max(streams, 1)))
    model = LoadedModel(name="fake", engine=engine, template=ChatTemplate(None))
    app = create_app(static_service([model]), ServerConfig())
    floor = floor_app(tokens)
    costs: dict[str, list[float]] = {path: [] for path in ["floor", *BUDGET]}
    try:
        for path, body in bodies(tokens).items():  # warm-up: imports, first-request paths
            await post(app, path, body)
        for _ in range(rounds):
            costs["floor"].append(await cost_us(floor, "/floor", {}, tokens, streams))
            for path, body in bodies(tokens).items():
                costs[path].append(await cost_us(app, path, body, tokens, streams))
    finally:
        engine.close()
    return costs


def report(costs: dict[str, list[float]], streams: int) -> bool:
    floor = statistics.median(costs["floor"])
    print(f"\nCPU per streamed token, {streams} stream(s), median of {len(costs['floor'])} rounds")
    print(f"{'route':24} {'us/token':>9} {'x floor':>8} {'budget':>7}")
    print(f"{'floor (bare Starlette)':24} {floor:9.1f} {1.0:8.2f}")
    ok = True
    for path, budget in BUDGET.items():
        cost = statistics.median(costs[path])
        passed = cost / floor <= budget
        ok &= passed
        print(f"{path:24} {cost:9.1f} {cost / floor:8.2f} {budget:7.1f}  {'PASS' if passed else 'FAIL'}")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", type=int, default=1)
    args = parser.parse_args()
    ok = True
    for streams in sorted({1, args.streams}):
        ok &= report(asyncio.run(measure(args.tokens, args.rounds, streams)), streams)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
