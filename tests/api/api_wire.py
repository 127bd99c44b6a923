"""Helpers shared by the API tests: SSE parsing and the OpenAI error-body check."""

from __future__ import annotations

import json
from typing import Any

API_KEY = "sekrit-key"


def sse_events(text: str) -> list[str]:
    """The data payloads of an SSE body, in order; every event must be a single `data:` line."""
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e[len("data: ") :] for e in events]


def sse_json(text: str) -> tuple[list[dict[str, Any]], bool]:
    """Decoded SSE chunks and whether the stream ended with [DONE]."""
    events = sse_events(text)
    is_done = events[-1] == "[DONE]"
    if is_done:
        events = events[:-1]
    return [json.loads(e) for e in events], is_done


def assert_openai_error(body: Any, *, error_type: str | None = None) -> dict[str, Any]:
    """The OpenAI error body: message str, type str, param present (str|None), code str|None."""
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] is None or isinstance(error["code"], str)
    if error_type is not None:
        assert error["type"] == error_type
    return dict(error)
