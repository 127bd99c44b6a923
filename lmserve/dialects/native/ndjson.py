"""The native dialect's lines: a stream is newline-delimited JSON, one object per line; an error is
{"error": "message"}, the whole body or, after a stream started, its last line."""

from __future__ import annotations

import json
from typing import Any

from lmserve.dialects.shared.errors import INTERNAL_ERROR
from lmserve.errors import LmserveError

NDJSON = "application/x-ndjson"


def line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n").encode()


def native_error(err: LmserveError) -> dict[str, Any]:
    return {"error": err.message}


def error_line(exc: Exception) -> bytes:
    """An error after the stream started: one `{"error": …}` line, then the stream ends."""
    return line({"error": exc.message if isinstance(exc, LmserveError) else INTERNAL_ERROR})
