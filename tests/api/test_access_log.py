"""One access-log line per request (logger `lmserve.access`): method, route, status, model, tokens, duration."""

from __future__ import annotations

import logging
import re
from typing import Any

import httpx
import pytest

CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
NATIVE = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "options": {"num_predict": 3}}


@pytest.mark.parametrize(
    ("method", "route", "body", "line"),
    [
        ("POST", "/v1/chat/completions", CHAT, r"POST /v1/chat/completions 200 model=fake tokens=\d+\+3 \d+\.\d\ds"),
        ("POST", "/v1/chat/completions", {**CHAT, "stream": True},
         r"POST /v1/chat/completions 200 model=fake tokens=\d+\+3 \d+\.\d\ds"),
        ("POST", "/v1/chat/completions", {**CHAT, "temperature": "hot"}, r"POST /v1/chat/completions 400 \d"),
        ("POST", "/api/chat", {**NATIVE, "stream": False}, r"POST /api/chat 200 model=fake tokens=\d+\+3 "),
        ("POST", "/api/chat", NATIVE, r"POST /api/chat 200 model=fake tokens=\d+\+3 "),
        ("GET", "/api/tags", None, r"GET /api/tags 200 \d+\.\d\ds"),
        ("GET", "/nowhere", None, r"GET /nowhere 404 \d+\.\d\ds"),
        ("POST", "/v1/chat/completions", {**CHAT, "model": "nope"}, r"POST /v1/chat/completions 404 \d"),
    ],
)
async def test_one_line_per_request(client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture, method: str,
                                    route: str, body: dict[str, Any] | None, line: str) -> None:
    with caplog.at_level(logging.INFO, logger="lmserve.access"):
        response = await client.request(method, route, json=body)
        await response.aread()
    lines = [r.getMessage() for r in caplog.records if r.name == "lmserve.access"]
    assert len(lines) == 1, lines
    assert re.match(line, lines[0]), lines[0]


async def test_a_refused_key_is_logged_too(secured_client: httpx.AsyncClient,
                                           caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="lmserve.access"):
        await secured_client.get("/api/tags")
    assert [r.getMessage().split()[:3] for r in caplog.records if r.name == "lmserve.access"] == [
        ["GET", "/api/tags", "401"]]
