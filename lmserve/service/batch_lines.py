"""The lines of a batch (OpenAI's batch input and output format), checked, and run through the server's own routes.

One input line is one request:

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": …, "messages": …}}

and its result is one output line:

    {"id": "batch_req_…", "custom_id": "q1", "response": {"status_code": 200, "request_id": …, "body": {…}},
     "error": null}

A line the server answered with an error has that answer as its response; a line refused before it ran (not JSON, no
custom_id, another url…) has `response: null` and `error: {code, message}`. The Batch API (service/batch_runner.py)
and `lmserve batch` (cli/batch.py) share this module: `check_lines` reads a whole input, `run_lines` sends the lines
to a `Send` (the app itself in process, or a server over HTTP) at the lowest priority, a bounded number at a time,
and retries those refused as overloaded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from lmserve.types import BATCH_PRIORITY

log = logging.getLogger(__name__)

PRIORITIZED = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
"""The routes whose requests take a `priority` (embeddings are computed between decode steps, not scheduled)."""
RETRY_STATUSES = frozenset({429, 503})
"""Answers that mean "not now" (a full queue, a model still loading): the line is sent again, later."""
MAX_LINE_BYTES = 16 * 2**20


@dataclass(slots=True)
class BatchLine:
    """One request of a batch: its line number (1-based), custom_id, route and body."""

    number: int
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass(slots=True)
class CheckedInput:
    """An input read whole: the lines to run, result lines for those refused, whether anything was JSONL, and
    why the input cannot run at all (a custom_id used twice: results could not be told apart), if it cannot."""

    lines: list[BatchLine]
    refused: list[dict[str, Any]]
    is_jsonl: bool
    model: str | None
    fatal: str | None = None


def request_id() -> str:
    return f"batch_req_{secrets.token_hex(12)}"


def error_line(custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    """The result line of a request that did not run."""
    return {"id": request_id(), "custom_id": custom_id, "response": None, "error": {"code": code, "message": message}}


def response_line(custom_id: str, status: int, body: Any) -> dict[str, Any]:
    """The result line of a request the server answered (with `status`)."""
    return {"id": request_id(), "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id(), "body": body}, "error": None}


def check_lines(raw_lines: Iterable[bytes], endpoints: Sequence[str]) -> CheckedInput:
    """Read an input file's lines. `endpoints`: the urls a line may name: the batch's one endpoint (the Batch API), or
    every dialect's batch endpoints (`lmserve batch`; lmserve/dialects/table.py). Blank lines are skipped; a custom_id
    used twice makes the input `fatal`."""
    lines: list[BatchLine] = []
    refused: list[dict[str, Any]] = []
    seen: set[str] = set()
    is_jsonl = False
    model: str | None = None
    fatal: str | None = None
    for number, raw in enumerate(raw_lines, 1):
        if not raw.strip():
            continue
        line, custom_id, problem = _parse(raw, number, endpoints)
        if custom_id is not None or problem != "invalid_json_line":
            is_jsonl = True
        if custom_id is not None and custom_id in seen:
            fatal = fatal or (f"line {number}: custom_id '{custom_id[:100]}' is used by an earlier line; each must "
                              "be unique")
        if custom_id is not None:
            seen.add(custom_id)
        if problem is not None:
            code = "invalid_json_line" if problem == "invalid_json_line" else "invalid_request"
            message = f"line {number} is not a JSON object" if problem == "invalid_json_line" else problem
            refused.append(error_line(custom_id, code, message))
            continue
        assert line is not None
        lines.append(line)
        if model is None and isinstance(line.body.get("model"), str):
            model = line.body["model"]
    return CheckedInput(lines, refused, is_jsonl, model, fatal)


def _parse(raw: bytes, number: int, endpoints: Sequence[str]) -> tuple[BatchLine | None, str | None, str | None]:
    """(the line, its custom_id, None) or (None, its custom_id if any, what is wrong)."""
    if len(raw) > MAX_LINE_BYTES:
        return None, None, f"line {number} is longer than {MAX_LINE_BYTES} bytes"
    try:
        data = json.loads(raw)
    except ValueError:
        return None, None, "invalid_json_line"
    if not isinstance(data, dict):
        return None, None, "invalid_json_line"
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return None, None, f"line {number}: custom_id must be a non-empty string"
    method, url, body = data.get("method", "POST"), data.get("url"), data.get("body")
    if method != "POST":
        return None, custom_id, f"line {number}: method must be POST, not {str(method)[:20]!r}"
    if len(endpoints) == 1 and url != endpoints[0]:
        return None, custom_id, (f"line {number}: url must be the batch's endpoint {endpoints[0]}, "
                                 f"not {str(url)[:100]!r}")
    if not isinstance(url, str) or url not in endpoints:
        return None, custom_id, f"line {number}: url must be one of {', '.join(endpoints)}, not {str(url)[:100]!r}"
    if not isinstance(body, dict):
        return None, custom_id, f"line {number}: body must be a JSON object"
    if body.get("stream"):
        return None, custom_id, f"line {number}: a batch line cannot stream; drop \"stream\""
    return BatchLine(number, custom_id, url, body), custom_id, None


Send = Callable[[str, dict[str, Any]], Awaitable[tuple[int, Any]]]
"""Send one request (route, JSON body) and return its answer: (HTTP status, JSON body)."""
OnResult = Callable[[BatchLine, dict[str, Any]], None]
"""Take the result line of one request (the caller writes it; called on the event loop, one at a time)."""


async def run_lines(lines: Iterable[BatchLine], send: Send, on_result: OnResult, *, concurrency: int,
                    stop: asyncio.Event | None = None, retry_delay: float = 0.25) -> None:
    """Send every line (at BATCH_PRIORITY on the routes that take one), at most `concurrency` at a time, and hand
    each result line to `on_result` as it comes. A line answered 429 or 503 is sent again after a pause (growing to
    5 s). When `stop` is set no line is sent any more and those in flight are cancelled (their results are not
    given); it returns when nothing runs."""
    pending: Iterator[BatchLine] = iter(lines)
    stop = stop or asyncio.Event()

    async def worker() -> None:
        for line in pending:
            if stop.is_set():
                return
            result = await _run_one(line, send, stop, retry_delay)
            if result is None:
                return
            on_result(line, result)

    workers = [asyncio.create_task(worker()) for _ in range(max(1, concurrency))]
    stopper = asyncio.create_task(stop.wait())
    try:
        while True:
            running = [task for task in workers if not task.done()]
            if not running:
                break
            await asyncio.wait([*running, stopper], return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set():
                for task in workers:
                    task.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
                break
        for task in workers:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    finally:
        stopper.cancel()
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, stopper, return_exceptions=True)


async def _run_one(line: BatchLine, send: Send, stop: asyncio.Event, retry_delay: float) -> dict[str, Any] | None:
    """The result line of one request; None when `stop` was set while it waited to retry."""
    body = dict(line.body)
    if line.url in PRIORITIZED:
        body["priority"] = BATCH_PRIORITY
    delay = retry_delay
    while True:
        try:
            status, answer = await send(line.url, body)
        except httpx.TransportError as exc:  # a server over HTTP that went away: try again, it may come back
            log.warning("batch line %s could not be sent (%s); retrying", line.custom_id, exc)
            status, answer = 503, None
        if status not in RETRY_STATUSES:
            return response_line(line.custom_id, status, answer)
        try:
            await asyncio.wait_for(stop.wait(), timeout=delay)
            return None
        except TimeoutError:
            delay = min(delay * 2, 5.0)


def asgi_send(app: Any, api_key: str | None) -> tuple[Send, Callable[[], Awaitable[None]]]:
    """A Send through the application itself, in process (no socket), and the function that closes it."""
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return _client_send(httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=None), api_key)


def http_send(url: str, api_key: str | None) -> tuple[Send, Callable[[], Awaitable[None]]]:
    """A Send to a running server at `url` over HTTP, and the function that closes it."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    return _client_send(httpx.AsyncClient(base_url=url.rstrip("/"), timeout=None, limits=limits), api_key)


def _client_send(client: httpx.AsyncClient, api_key: str | None) -> tuple[Send, Callable[[], Awaitable[None]]]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def send(url: str, body: dict[str, Any]) -> tuple[int, Any]:
        response = await client.post(url, json=body, headers=headers)
        try:
            answer = response.json()
        except ValueError:
            answer = {"error": {"message": response.text[:1000], "type": "server_error"}}
        return response.status_code, answer

    return send, client.aclose
