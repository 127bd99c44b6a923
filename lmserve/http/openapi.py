"""The OpenAPI document (/openapi.json): FastAPI's, generated from the routes' typed bodies (json_body.py), with
one operationId per method and without FastAPI's 422 answers.

A route serving GET and HEAD has one operationId for both in FastAPI's document (and FastAPI warns); `install`
gives each method its own. Bad input is a 400 in the route's dialect (http/errors.py), never FastAPI's 422, so the
422 responses FastAPI lists, and their schemas, are left out.
"""

from __future__ import annotations

import re
import warnings
from collections import Counter
from typing import Any

from fastapi import FastAPI

_METHOD_SUFFIX = re.compile(r"_(get|head|post|put|patch|delete|options)$")


def install(app: FastAPI) -> None:
    """Make `app.openapi()` (and so GET /openapi.json) give each operation its own operationId, and list no 422."""
    described: list[dict[str, Any]] = []

    def openapi() -> dict[str, Any]:
        with warnings.catch_warnings():  # the shared operationIds of GET/HEAD routes, made unique below
            warnings.filterwarnings("ignore", message="Duplicate Operation ID", category=UserWarning)
            document = FastAPI.openapi(app)  # cached by FastAPI until the routes change
        if not described or described[0] is not document:
            unique_operation_ids(document.setdefault("paths", {}))
            without_422(document)
            described[:] = [document]
        return document

    app.openapi = openapi  # type: ignore[method-assign]


def unique_operation_ids(paths: dict[str, dict[str, Any]]) -> None:
    """A route serving GET and HEAD has one operationId for both; suffix each with its own method instead."""
    operations = [op for ops in paths.values() for op in ops.values() if isinstance(op, dict)]
    counts = Counter(op.get("operationId") for op in operations)
    for ops in paths.values():
        for method, op in ops.items():
            op_id = op.get("operationId") if isinstance(op, dict) else None
            if op_id is not None and counts[op_id] > 1:
                op["operationId"] = f"{_METHOD_SUFFIX.sub('', op_id)}_{method}"


def without_422(document: dict[str, Any]) -> None:
    """Drop FastAPI's 422 "Validation Error" responses and their schemas (lmserve answers bad input with a 400)."""
    for ops in document.get("paths", {}).values():
        for op in ops.values():
            if isinstance(op, dict):
                op.get("responses", {}).pop("422", None)
    schemas = document.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
