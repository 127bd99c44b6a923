"""Property tests: schemathesis over lmserve's own OpenAPI document; no generated request may get a 5xx.

Every operation of /openapi.json (which describes the routes' typed JSON bodies, see
lmserve.dialects.shared.json_body) is fuzzed in-process against a fresh app over the fake engine: valid and invalid
bodies, path parameters and headers. The only check is `not_a_server_error`: a 4xx for a bad request is the point, a
500 is a bug.

Each operation gets a fresh app, so a failure belongs to the operation fuzzed, not to what ran before it.
Each operation's hypothesis test is built when it runs, not when the module is collected (test_no_server_errors).
Output stays short: the fake ends every sequence after a few tokens, its context is small, and a body's
`max_tokens`, `max_completion_tokens` and `options.num_predict` are clamped before the request is sent.
Generated model names are often replaced by the served model's, so that generation is reached at all.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.generation.meta import TestPhase
from schemathesis.pytest.lazy import get_all_tests
from schemathesis.python import asgi as schemathesis_asgi

from lmserve.chat.template import ChatTemplate
from lmserve.config import ServerConfig
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.fake import FakeBackend
from lmserve.http.app import create_app
from lmserve.service import static_service
from lmserve.service.residency import LoadedModel

MODEL = "fake"
MAX_OUTPUT = 8
"""The most tokens any generated request may ask for."""
MODEL_FIELDS = ("model", "name", "source")
"""Body fields that name a served model (the native routes take `name` too; /api/copy takes `source`)."""

BODILESS = {
    ("delete", "/v1/responses/{response_id}"),
    ("delete", "/v1/conversations/{conversation_id}"),
    ("delete", "/v1/conversations/{conversation_id}/items/{item_id}"),
    ("delete", "/v1/chat/completions/{completion_id}"),
    ("delete", "/v1/models/{model_id}"),
    ("delete", "/v1/files/{file_id}"),
    ("post", "/v1/batches/{batch_id}/cancel"),
    ("post", "/sleep"),
    ("post", "/wake_up"),
}
"""Operations of a body-taking method that take no body (the id is in the path, or the query says it all)."""
OPTIONAL_BODIES = {("post", "/v1/conversations")}
"""Operations whose body may be left out."""
FORM_BODIES = {("post", "/v1/files"), ("post", "/v1/audio/transcriptions"), ("post", "/v1/audio/translations")}
"""Operations whose body is a multipart form (an upload: a file, an audio clip)."""

# The document comes from an app over no models: routes and bodies do not depend on what is served.
DOCUMENT = create_app(static_service([]), ServerConfig()).openapi()
schema = schemathesis.openapi.from_dict(DOCUMENT)
OPERATIONS = [(method.upper(), path) for path, ops in DOCUMENT["paths"].items() for method in ops]
"""Every operation of the document, as (METHOD, path)."""


@contextmanager
def served_app(models_dir: Path) -> Iterator[FastAPI]:
    """A real Service over the fake engine, the default config (stored responses in `models_dir`)."""
    engine = BatchingEngine(FakeBackend(num_ctx=512, num_parallel=4, eog_after=4))
    model = LoadedModel(name=MODEL, engine=engine, template=ChatTemplate(None), aliases=("fake-alias",))
    try:
        yield create_app(static_service([model]), ServerConfig(models_dir=str(models_dir)))
    finally:
        schemathesis_asgi.shutdown_lifespans()  # its ASGI transport keeps each app's lifespan running until exit
        engine.close()


@pytest.fixture
def fuzzed_app(tmp_path: Path) -> Iterator[FastAPI]:
    """A fresh app (per test): see served_app."""
    with served_app(tmp_path) as app:
        yield app


# ---- generation: reach the served model, ask for little output ------------------------------------------


def _served_sometimes(value: Any, fields: tuple[str, ...]) -> st.SearchStrategy[Any]:
    """The generated value, or the same with its model-naming fields set to the served model."""
    if not isinstance(value, dict) or not any(isinstance(value.get(f), str) for f in fields):
        return st.just(value)
    served = {k: MODEL if k in fields and isinstance(v, str) else v for k, v in value.items()}
    return st.sampled_from([served, value])


@schema.hook
def flatmap_body(context: schemathesis.HookContext, body: Any) -> st.SearchStrategy[Any]:
    return _served_sometimes(body, MODEL_FIELDS)


@schema.hook
def flatmap_path_parameters(context: schemathesis.HookContext, path_parameters: Any) -> st.SearchStrategy[Any]:
    return _served_sometimes(path_parameters, ("model_id",))


def serve_valid_coverage_cases(case: schemathesis.Case) -> None:
    """The coverage phase (boundary values, one field at a time; no hooks) names the served model in its valid cases.

    Its generated names ('', '0') are unknown models: without this, no valid case of it would get past the lookup.
    """
    meta = case.meta
    if meta is None or meta.phase.name != TestPhase.COVERAGE or meta.generation.mode != GenerationMode.POSITIVE:
        return
    if isinstance(case.body, dict):
        for field in MODEL_FIELDS:
            if isinstance(case.body.get(field), str):
                case.body[field] = MODEL
    if case.path_parameters and isinstance(case.path_parameters.get("model_id"), str):
        case.path_parameters["model_id"] = MODEL


def _number(value: Any) -> float | None:
    """A value pydantic's lax mode would read as a number (a JSON number, or a numeric string)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def cap_output(body: Any) -> None:
    """Clamp every output-length field of a body to MAX_OUTPUT tokens (a negative num_predict means no limit)."""
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        n = _number(body.get(key))
        if n is not None and n > MAX_OUTPUT:
            body[key] = MAX_OUTPUT
    if "ignore_eos" in body and _number(body.get("max_completion_tokens")) is None:
        n = _number(body.get("max_tokens"))
        if n is None or n > MAX_OUTPUT:
            body["max_tokens"] = MAX_OUTPUT  # the end-of-generation token is ignored: only the limit stops it
    options = body.get("options")
    if isinstance(options, dict):
        n = _number(options.get("num_predict"))
        if n is not None and (n > MAX_OUTPUT or n < 0):
            options["num_predict"] = MAX_OUTPUT


# ---- the document ---------------------------------------------------------------------------------------


def test_openapi_json_is_served_with_every_request_body(fuzzed_app: FastAPI) -> None:
    response = TestClient(fuzzed_app).get("/openapi.json")
    assert response.status_code == 200
    served = response.json()
    assert served == DOCUMENT
    with_body = {
        (method, path)
        for path, ops in served["paths"].items()
        for method, op in ops.items()
        if method in ("post", "put", "patch", "delete")
    }
    described = {(method, path) for method, path in with_body if "requestBody" in served["paths"][path][method]}
    assert with_body - described == BODILESS
    for method, path in described:
        body = served["paths"][path][method]["requestBody"]
        assert body.get("required", False) is ((method, path) not in OPTIONAL_BODIES), (method, path)
        kind = ("multipart/form-data" if (method, path) in FORM_BODIES
                else "application/octet-stream" if "blobs" in path else "application/json")
        assert set(body["content"]) == {kind}, (method, path)
    assert "422" not in str(served["paths"])
    operation_ids = [op["operationId"] for ops in served["paths"].values() for op in ops.values()]
    assert len(operation_ids) == len(set(operation_ids))


def test_openapi_body_schemas_resolve() -> None:
    """Every $ref of the document names a component (pydantic's $defs were moved there)."""
    refs: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str):
                refs.add(ref)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(DOCUMENT)
    components = DOCUMENT["components"]["schemas"]
    assert refs
    assert all(ref.startswith("#/components/schemas/") for ref in refs), refs
    assert {ref.removeprefix("#/components/schemas/") for ref in refs} <= set(components)
    assert "$defs" not in str(DOCUMENT)


# ---- the fuzzing ----------------------------------------------------------------------------------------


SETTINGS = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


def fuzz_case(case: schemathesis.Case, app: FastAPI) -> None:
    serve_valid_coverage_cases(case)
    cap_output(case.body)
    case.call_and_validate(app=app, checks=[not_a_server_error])


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_no_server_errors(method: str, path: str, fuzzed_app: FastAPI) -> None:
    """schemathesis's phases (examples, coverage, fuzzing) for one operation. Its hypothesis test is built here, when
    the test runs: building it (the coverage phase's cases above all; ~40 s for all operations) would otherwise be
    paid by every pytest process that collects this module, those that deselect it or leave it to another worker
    included."""
    one = schema.include(method=method, path=path)
    built = list(get_all_tests(schema=one, test_func=fuzz_case, settings=SETTINGS, given_kwargs=None))
    assert len(built) == 1, built
    operation, run = built[0].ok()
    assert operation.label == f"{method} {path}"
    run(app=fuzzed_app)


# ---- found while fuzzing: a keep_alive that was accepted, then broke /api/ps ---------------------------------


@pytest.mark.parametrize("keep_alive", ["nan", 1e308, "99999999999999h"])
def test_a_keep_alive_accepted_never_breaks_ps(fuzzed_app: FastAPI, keep_alive: str | float) -> None:
    client = TestClient(fuzzed_app)
    loaded = client.post("/api/generate", json={"model": MODEL, "keep_alive": keep_alive, "stream": False})
    assert loaded.status_code < 500  # NaN is a 400; a huge value means forever
    assert client.get("/api/ps").status_code == 200
