"""Graceful shutdown: after SIGTERM every open stream ends (finished, or with an error event at the deadline) and
the process exits 0.

On an idle machine a stream keeps its pace after the signal. When the two cores are also busy with other work,
llama.cpp's spin-waiting threads slow decoding to a crawl (before the signal as much as after), so even short
requests may reach the deadline; the test therefore checks that every stream ends, not how. (At the deadline the
streams end at once, even while one step of the engine is still running: tests/engine/slots/test_batching.py.)
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx

from tests.test_server import MODEL, Server


def stream_events(base_url: str, max_tokens: int, out: list[str]) -> None:
    """Append each line of a streamed chat as it comes; a broken stream appends `broken: <error>` last."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}], "stream": True,
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    try:
        with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    out.append(line)
    except httpx.HTTPError as exc:
        out.append(f"broken: {exc!r}")


def test_sigterm_finishes_short_requests_and_ends_long_ones_with_an_error() -> None:
    srv = Server("-np", "2", "-c", "4096", env={"LMSERVE_SHUTDOWN_GRACE": "5"})
    short: list[str] = []
    long: list[str] = []
    threads = [threading.Thread(target=stream_events, args=(srv.base_url, 8, short)),
               threading.Thread(target=stream_events, args=(srv.base_url, 3500, long))]
    for t in threads:
        t.start()
    started = time.monotonic()
    while not (short and long) and time.monotonic() - started < 60:  # both requests are being answered
        time.sleep(0.05)
    srv.process.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=60)
    srv.process.wait(timeout=60)
    srv.stop()  # already exited: collects its output and closes the pipe
    code = srv.process.returncode
    assert code == 0
    assert short[-1] == "data: [DONE]" or "shutting down" in short[-1]
    assert long[-1].startswith("data: {") and "error" in json.loads(long[-1][6:])
    assert "shutting down" in long[-1]
