"""DIALECTS: the one table of the API's dialects. Every place that asks "which dialect does this request speak?" reads
it: the routes the app serves (lmserve/http/app.py), the error body of a route (lmserve/http/errors.py), the error
that ends a broken stream (lmserve/replicas/), the body fields whose text replicas route on, and the endpoints a
batch line may name (the batch runner, `lmserve batch`).

A path belongs to the dialect with the longest root it starts with; a path under none is the OpenAI dialect's
(its error body is also that of the routes that are no dialect: tokens, infill, judgments, health).

Adding a dialect: its package under lmserve/dialects/ and one row here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter

from lmserve.dialects.anthropic import routes as anthropic_routes
from lmserve.dialects.anthropic.errors import anthropic_error
from lmserve.dialects.anthropic.output import error_event
from lmserve.dialects.native import routes as native_routes
from lmserve.dialects.native.ndjson import NDJSON, error_line, native_error
from lmserve.dialects.openai import routes as openai_routes
from lmserve.dialects.openai import stored
from lmserve.dialects.openai.output import error_frame
from lmserve.dialects.responses import conversations
from lmserve.dialects.responses import routes as responses_routes
from lmserve.dialects.responses.output import Framer
from lmserve.dialects.shared.errors import openai_error
from lmserve.errors import LmserveError

SSE = "text/event-stream"


@dataclass(frozen=True, slots=True)
class Dialect:
    name: str
    routers: tuple[APIRouter, ...]
    """Its routes (each package's module-level routers), as the app serves them."""
    roots: tuple[str, ...]
    """The paths it serves and everything under them ("/api" serves /api/chat, not /apichat)."""
    error_body: Callable[[LmserveError], dict[str, Any]]
    """An error as a whole response's body."""
    stream_media: str
    """The media type of its streams."""
    stream_error: Callable[[Exception], bytes]
    """An error after a stream started: the last frame of the stream."""
    prompt_keys: tuple[str, ...]
    """The request's fields whose text starts the prompt, in the order a chat template lays them out (Ray Serve's
    prefix-aware routing matches replicas on that text)."""
    batch_endpoints: tuple[str, ...] = ()
    """Its routes a line of the Batch API may name."""


def _responses_error(exc: Exception) -> bytes:
    return Framer().error(exc)


OPENAI = Dialect(
    "openai", (openai_routes.router, stored.router), ("/v1",), openai_error, SSE, error_frame,
    prompt_keys=("tools", "messages", "input", "prompt", "suffix"),
    batch_endpoints=("/v1/chat/completions", "/v1/completions", "/v1/embeddings"))
NATIVE = Dialect(
    "native", (native_routes.router,), ("/api",), native_error, NDJSON, error_line,
    prompt_keys=("tools", "system", "messages", "input", "prompt", "suffix"))
ANTHROPIC = Dialect(
    "anthropic", (anthropic_routes.router,), ("/v1/messages",), anthropic_error, SSE, error_event,
    prompt_keys=("tools", "system", "messages"))
RESPONSES = Dialect(
    "responses", (responses_routes.router, conversations.router), ("/v1/responses", "/v1/conversations"),
    openai_error, SSE, _responses_error, prompt_keys=("tools", "instructions", "input"),
    batch_endpoints=("/v1/responses",))

DIALECTS = (OPENAI, NATIVE, ANTHROPIC, RESPONSES)
_BY_ROOT = sorted(((root, dialect) for dialect in DIALECTS for root in dialect.roots), key=lambda r: -len(r[0]))


def dialect_of(path: str) -> Dialect:
    """The dialect of the route at `path` (OpenAI's for a path under no dialect's root)."""
    for root, dialect in _BY_ROOT:
        if path == root or path.startswith(root + "/"):
            return dialect
    return OPENAI


def error_body(path: str, err: LmserveError) -> dict[str, Any]:
    """The error body in the dialect of the route at `path`."""
    return dialect_of(path).error_body(err)


def batch_endpoints() -> tuple[str, ...]:
    """Every dialect's batch endpoints, in the table's order."""
    return tuple(endpoint for dialect in DIALECTS for endpoint in dialect.batch_endpoints)
