#!/usr/bin/env python3
"""What OpenTelemetry tracing (issue 46, lmserve/http/tracing.py) costs a request: the real app in process over the
fake engine (whose steps cost nothing), one-token chats one after another through the ASGI interface, without an
endpoint (nothing installed) and with one (a span per request, its queue/prefill/decode children, exported in
batches to an OTLP/HTTP collector on a local socket that accepts and drops them), alternating rounds.

Printed per round: the median latency of a one-token chat off and on, the difference (what a traced request adds)
and on ÷ off; off is the figure every untraced server pays, and it has no tracing code on its path.

    .venv/bin/python bench/tracing.py [--requests 400] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lmserve.chat.template import ChatTemplate
from lmserve.config import ServerConfig
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.fake import FakeBackend
from lmserve.http.app import create_app
from lmserve.service import static_service
from lmserve.service.residency import LoadedModel

WARM_UP = 50


class Drop(BaseHTTPRequestHandler):
    """An OTLP/HTTP collector that accepts every export and keeps nothing."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


async def median_ms(endpoint: str | None, requests: int) -> float:
    engine = BatchingEngine(FakeBackend(num_ctx=2048, num_parallel=4))
    service = static_service([LoadedModel(name="fake", engine=engine, template=ChatTemplate(None))])
    app = create_app(service, ServerConfig(otlp_traces_endpoint=endpoint))
    body = {"model": "fake", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    times: list[float] = []
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://bench") as client:
            for _ in range(requests + WARM_UP):
                started = time.perf_counter()
                (await client.post("/v1/chat/completions", json=body)).raise_for_status()
                times.append(time.perf_counter() - started)
    finally:
        if app.state.tracing is not None:
            app.state.tracing.shutdown()
        engine.close()
    return statistics.median(times[WARM_UP:]) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    collector = ThreadingHTTPServer(("127.0.0.1", 0), Drop)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{collector.server_address[1]}"
    print("| round | off ms | on ms | added ms | on / off |\n|---|---|---|---|---|")
    for round_ in range(1, args.rounds + 1):
        off = asyncio.run(median_ms(None, args.requests))
        on = asyncio.run(median_ms(url, args.requests))
        print(f"| {round_} | {off:.3f} | {on:.3f} | {on - off:+.3f} | {on / off:.2f}x |", flush=True)
    collector.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
