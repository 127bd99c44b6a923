"""The OpenAPI document (/openapi.json): FastAPI's, plus the request bodies the routes parse by hand.

Routes read their JSON bodies themselves (`parse_body(request, Model)`), so FastAPI sees no body parameter and
documents none. `install` wraps `app.openapi` to describe each body from the same pydantic model the route
parses with (REQUEST_BODIES), the models' definitions under `components/schemas`. It also gives each method
of a multi-method route (GET and HEAD) its own operationId: FastAPI gives them one, and warns.
"""

from __future__ import annotations

import re
import warnings
from collections import Counter
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from lmserve.api import anthropic_schemas, infill, responses_schemas, schemas, tokens
from lmserve.api import native_schemas as wire

REF_TEMPLATE = "#/components/schemas/{model}"

REQUEST_BODIES: dict[tuple[str, str], type[BaseModel]] = {
    ("post", "/v1/chat/completions"): schemas.ChatCompletionRequest,
    ("post", "/v1/completions"): schemas.CompletionRequest,
    ("post", "/v1/embeddings"): schemas.EmbeddingRequest,
    ("post", "/api/generate"): wire.GenerateBody,
    ("post", "/api/chat"): wire.ChatBody,
    ("post", "/api/create"): wire.CreateBody,
    ("post", "/api/pull"): wire.PullBody,
    ("post", "/api/show"): wire.ModelBody,
    ("post", "/api/copy"): wire.CopyBody,
    ("delete", "/api/delete"): wire.ModelBody,
    ("post", "/api/embed"): wire.EmbedBody,
    ("post", "/api/embeddings"): wire.EmbeddingsBody,
    ("post", "/v1/messages"): anthropic_schemas.MessagesRequest,
    ("post", "/v1/messages/count_tokens"): anthropic_schemas.CountTokensRequest,
    ("post", "/v1/responses"): responses_schemas.ResponseRequest,
    ("post", "/v1/conversations"): responses_schemas.ConversationCreate,
    ("post", "/v1/conversations/{conversation_id}"): responses_schemas.ConversationUpdate,
    ("post", "/v1/conversations/{conversation_id}/items"): responses_schemas.ConversationItems,
    ("post", "/tokenize"): tokens.TokenizeBody,
    ("post", "/detokenize"): tokens.DetokenizeBody,
    ("post", "/infill"): infill.InfillBody,
    ("post", "/v1/chat/completions/{completion_id}"): schemas.ChatCompletionUpdate,
}
"""(method, path) → the model its route parses the JSON body with."""

BODILESS: frozenset[tuple[str, str]] = frozenset({
    ("delete", "/v1/responses/{response_id}"),
    ("delete", "/v1/conversations/{conversation_id}"),
    ("delete", "/v1/conversations/{conversation_id}/items/{item_id}"),
    ("delete", "/v1/chat/completions/{completion_id}"),
    ("delete", "/v1/models/{model_id}"),
})
"""Routes of a body-taking method that take no body (the id is in the path)."""

RAW_BODIES: dict[tuple[str, str], dict[str, Any]] = {
    ("post", "/api/blobs/{digest}"): {
        "description": "The blob's bytes; their SHA-256 must be the digest in the path.",
        "required": True,
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    },
}
"""(method, path) → a request body that is not JSON."""

_METHOD_SUFFIX = re.compile(r"_(get|head|post|put|patch|delete|options)$")


def install(app: FastAPI) -> None:
    """Make `app.openapi()` (and so GET /openapi.json) describe every route's request body."""
    described: list[dict[str, Any]] = []

    def openapi() -> dict[str, Any]:
        with warnings.catch_warnings():  # the shared operationIds of GET/HEAD routes, made unique below
            warnings.filterwarnings("ignore", message="Duplicate Operation ID", category=UserWarning)
            document = FastAPI.openapi(app)  # cached by FastAPI until the routes change
        if not described or described[0] is not document:
            describe(document)
            described[:] = [document]
        return document

    app.openapi = openapi  # type: ignore[method-assign]


def describe(document: dict[str, Any]) -> None:
    """Add the request bodies to a FastAPI OpenAPI document, in place, and make its operationIds unique."""
    paths: dict[str, dict[str, Any]] = document.setdefault("paths", {})
    missing = [f"{m.upper()} {p}" for m, p in (*REQUEST_BODIES, *RAW_BODIES) if m not in paths.get(p, {})]
    if missing:
        raise RuntimeError(f"request bodies are described for operations the app does not have: {missing}")
    bodies, definitions = request_body_schemas(list(dict.fromkeys(REQUEST_BODIES.values())))
    components: dict[str, Any] = document.setdefault("components", {}).setdefault("schemas", {})
    for name, definition in definitions.items():
        if components.setdefault(name, definition) != definition:
            raise RuntimeError(f"two different schemas are named {name!r} in the OpenAPI document")
    for (method, path), model in REQUEST_BODIES.items():
        paths[path][method]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": bodies[model]}},
        }
    for (method, path), body in RAW_BODIES.items():
        paths[path][method]["requestBody"] = body
    unique_operation_ids(paths)


def request_body_schemas(
    models: list[type[BaseModel]],
) -> tuple[dict[type[BaseModel], dict[str, Any]], dict[str, Any]]:
    """Each model's schema (a `$ref` into components/schemas) and the definitions to put there.

    The models are rendered together, so two models of one name (each dialect has a ChatMessage) get distinct
    component names; in validation mode, as the routes parse (aliases such as CreateBody's `from`).
    """
    mapping, top = models_json_schema([(m, "validation") for m in models], ref_template=REF_TEMPLATE)
    bodies = {model: mapping[(model, "validation")] for model in models}
    return bodies, dict(top.get("$defs", {}))


def unique_operation_ids(paths: dict[str, dict[str, Any]]) -> None:
    """A route serving GET and HEAD has one operationId for both; suffix each with its own method instead."""
    operations = [op for ops in paths.values() for op in ops.values() if isinstance(op, dict)]
    counts = Counter(op.get("operationId") for op in operations)
    for ops in paths.values():
        for method, op in ops.items():
            op_id = op.get("operationId") if isinstance(op, dict) else None
            if op_id is not None and counts[op_id] > 1:
                op["operationId"] = f"{_METHOD_SUFFIX.sub('', op_id)}_{method}"
