"""Errors on the wire: the OpenAI body, the native body, and request-validation errors as InvalidRequest.

OpenAI dialect (every path but /api/…): {"error": {"message", "type", "param", "code"}}
native dialect (/api/…):                {"error": "message"}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lmserve.errors import InvalidRequest, LmserveError

NATIVE_PREFIX = "/api/"
INTERNAL_ERROR = "The server had an error while processing your request."

# pydantic adds the union member it tried to a location; these are not field names
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})


def is_native_path(path: str) -> bool:
    return path.startswith(NATIVE_PREFIX)


def openai_error(err: LmserveError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


def native_error(err: LmserveError) -> dict[str, Any]:
    return {"error": err.message}


def error_body(path: str, err: LmserveError) -> dict[str, Any]:
    """The error body in the dialect of the route at `path`."""
    return native_error(err) if is_native_path(path) else openai_error(err)


def invalid_from_validation(errors: Sequence[Mapping[str, Any]], *, strip: int = 0) -> InvalidRequest:
    """Turn pydantic/FastAPI validation errors into one InvalidRequest naming the offending field.

    `strip` drops leading location parts (FastAPI prefixes "body", "query" …). `param` is the top-level
    field; the message names the full path of the first error.
    """
    if not errors:
        return InvalidRequest("invalid request body")
    first = errors[0]
    loc = tuple(first.get("loc", ()))[strip:]
    kind = str(first.get("type", ""))
    message = str(first.get("msg", "invalid value"))
    if kind == "json_invalid":
        return InvalidRequest(f"We could not parse the JSON body of your request: {message}", code="invalid_json")
    if not loc or not isinstance(loc[0], str):
        return InvalidRequest(f"Invalid request body: {message}")
    param = loc[0]
    path = location(loc)
    if kind == "missing":
        return InvalidRequest(f"Missing required parameter: '{path}'.", param=param)
    return InvalidRequest(f"Invalid value for '{path}': {message}", param=param)


def location(loc: Sequence[int | str]) -> str:
    """("messages", 0, "content") → "messages[0].content", without pydantic's union-member tags."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in _UNION_TAGS:
            continue
        else:
            out += f".{part}" if out else part
    return out
