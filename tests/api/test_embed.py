"""Embeddings over the fake engine, in both dialects: /api/embed, /api/embeddings and /v1/embeddings."""

from __future__ import annotations

import base64
import math
import struct
from typing import Any

import httpx
import pytest
from api_wire import assert_openai_error

from lmserve.engine.slots.fake import EMBED_SIZE

NUM_CTX = 2048  # the fake engine's context in conftest.py


def unit_histogram(text: str, dimensions: int = EMBED_SIZE) -> list[float]:
    counts = [0.0] * EMBED_SIZE
    for byte in text.encode():
        counts[byte] += 1.0
    counts = counts[:dimensions]
    norm = math.sqrt(sum(c * c for c in counts))
    return [c / norm for c in counts]


# ---- native ---------------------------------------------------------------------------------------


async def test_embed_one_string(client: httpx.AsyncClient) -> None:
    r = await client.post("/api/embed", json={"model": "fake", "input": "hello"})
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"model", "embeddings", "total_duration", "load_duration", "prompt_eval_count"}
    assert body["model"] == "fake"
    assert body["prompt_eval_count"] == 5
    assert body["embeddings"] == [pytest.approx(unit_histogram("hello"))]
    assert all(isinstance(body[k], int) for k in ("total_duration", "load_duration"))


async def test_embed_a_list_keeps_the_order(client: httpx.AsyncClient) -> None:
    texts = ["abc", "zzz", "cab"]
    r = await client.post("/api/embed", json={"model": "fake-alias", "input": texts})
    body = r.json()
    assert [pytest.approx(unit_histogram(t)) for t in texts] == body["embeddings"]
    assert body["embeddings"][0] == body["embeddings"][2]
    assert body["prompt_eval_count"] == 9


async def test_embed_dimensions_cut_and_renormalize(client: httpx.AsyncClient) -> None:
    r = await client.post("/api/embed", json={"model": "fake", "input": "aAb", "dimensions": 98})
    (vector,) = r.json()["embeddings"]
    assert len(vector) == 98
    assert vector == pytest.approx(unit_histogram("aAb", 98))  # "b" (98) is cut off


async def test_embed_empty_string_only_loads_the_model(client: httpx.AsyncClient) -> None:
    r = await client.post("/api/embed", json={"model": "fake", "input": ""})
    assert r.status_code == 200
    assert r.json()["embeddings"] == [] and r.json()["prompt_eval_count"] == 0


async def test_embed_truncates_by_default_and_refuses_when_asked_not_to(client: httpx.AsyncClient) -> None:
    long_text = "x" * (NUM_CTX + 10)
    r = await client.post("/api/embed", json={"model": "fake", "input": long_text})
    assert r.status_code == 200 and r.json()["prompt_eval_count"] == NUM_CTX
    r = await client.post("/api/embed", json={"model": "fake", "input": [long_text], "truncate": False})
    assert r.status_code == 400
    assert str(NUM_CTX) in r.json()["error"] and str(NUM_CTX + 10) in r.json()["error"]


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"model": "fake", "input": []}, 400),
        ({"model": "fake", "input": ["ok", ""]}, 400),
        ({"model": "fake", "input": [1, 2]}, 400),
        ({"model": "fake", "input": "x", "dimensions": 0}, 400),
        ({"input": "x"}, 400),
        ({"model": "nope", "input": "x"}, 404),
    ],
)
async def test_embed_errors(client: httpx.AsyncClient, body: dict[str, Any], status: int) -> None:
    r = await client.post("/api/embed", json=body)
    assert r.status_code == status
    assert set(r.json()) == {"error"} and isinstance(r.json()["error"], str)


async def test_legacy_embeddings_are_not_normalized(client: httpx.AsyncClient) -> None:
    r = await client.post("/api/embeddings", json={"model": "fake", "prompt": "aab"})
    assert r.status_code == 200
    vector = r.json()["embedding"]
    assert set(r.json()) == {"embedding"}
    assert (vector[ord("a")], vector[ord("b")], sum(vector)) == (2.0, 1.0, 3.0)
    r = await client.post("/api/embeddings", json={"model": "fake", "prompt": ""})
    assert r.json() == {"embedding": []}
    r = await client.post("/api/embeddings", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404


# ---- OpenAI ---------------------------------------------------------------------------------------


async def test_openai_embeddings_shape(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/embeddings", json={"model": "fake-alias", "input": ["hi", "there"]})
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"object", "data", "model", "usage"}
    assert body["object"] == "list" and body["model"] == "fake"
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    assert [set(d) for d in body["data"]] == [{"object", "index", "embedding"}] * 2
    assert [(d["object"], d["index"]) for d in body["data"]] == [("embedding", 0), ("embedding", 1)]
    assert body["data"][1]["embedding"] == pytest.approx(unit_histogram("there"))


async def test_openai_embeddings_base64_is_little_endian_float32(client: httpx.AsyncClient) -> None:
    floats = await client.post("/v1/embeddings", json={"model": "fake", "input": "hello"})
    packed = await client.post("/v1/embeddings", json={"model": "fake", "input": "hello", "encoding_format": "base64"})
    raw = base64.b64decode(packed.json()["data"][0]["embedding"])
    assert len(raw) == 4 * EMBED_SIZE
    decoded = list(struct.unpack(f"<{EMBED_SIZE}f", raw))
    assert decoded == pytest.approx(floats.json()["data"][0]["embedding"], abs=1e-7)


async def test_openai_embeddings_refuse_long_inputs_unless_truncate(client: httpx.AsyncClient) -> None:
    long_text = "y" * (NUM_CTX + 1)
    r = await client.post("/v1/embeddings", json={"model": "fake", "input": long_text})
    assert r.status_code == 400
    error = assert_openai_error(r.json(), error_type="invalid_request_error")
    assert error["code"] == "context_length_exceeded" and error["param"] == "input"
    r = await client.post("/v1/embeddings", json={"model": "fake", "input": long_text, "truncate": True})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == NUM_CTX


@pytest.mark.parametrize(
    ("token_input", "texts"),
    [
        ([104, 105], ["hi"]),  # one input's token ids (the fake's tokens are the text's bytes)
        ([[104, 105], [116, 104, 101, 114, 101]], ["hi", "there"]),  # one list of ids per input
        ([[256, 97]], ["\u0000a"]),  # the end-of-generation id is in the vocabulary; 256 lands where byte 0 does
    ],
)
async def test_openai_embeddings_take_token_ids_as_given(
    client: httpx.AsyncClient, token_input: list[Any], texts: list[str]
) -> None:
    r = await client.post("/v1/embeddings", json={"model": "fake", "input": token_input})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d["embedding"] for d in body["data"]] == [pytest.approx(unit_histogram(t)) for t in texts]
    assert [d["index"] for d in body["data"]] == list(range(len(texts)))
    num_tokens = sum(len(t.encode()) for t in texts)
    assert body["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens}


async def test_openai_embeddings_cut_long_token_ids_only_when_asked(client: httpx.AsyncClient) -> None:
    ids = [121] * (NUM_CTX + 1)
    r = await client.post("/v1/embeddings", json={"model": "fake", "input": ids})
    assert r.status_code == 400
    error = assert_openai_error(r.json(), error_type="invalid_request_error")
    assert error["code"] == "context_length_exceeded" and error["param"] == "input"
    r = await client.post("/v1/embeddings", json={"model": "fake", "input": [ids], "truncate": True})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == NUM_CTX


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "fake", "input": []}, 400, "input"),
        ({"model": "fake", "input": ""}, 400, "input"),
        ({"model": "fake", "input": [[]]}, 400, "input"),
        ({"model": "fake", "input": [[104], []]}, 400, "input"),
        ({"model": "fake", "input": [257]}, 400, "input"),  # the fake's vocabulary is ids 0 to 256
        ({"model": "fake", "input": [[1, 2], [3, -1]]}, 400, "input"),
        ({"model": "fake", "input": ["a", 1]}, 400, "input"),
        ({"model": "fake", "input": [[1], "a"]}, 400, "input"),
        ({"model": "fake", "input": [1.5]}, 400, "input"),
        ({"model": "fake", "input": [1.0, 2.0]}, 400, "input"),  # ids are whole numbers, not floats or booleans
        ({"model": "fake", "input": [True, False]}, 400, "input"),
        ({"model": "fake", "input": [[1, True]]}, 400, "input"),
        ({"model": "fake", "input": "x", "encoding_format": "hex"}, 400, "encoding_format"),
        ({"model": "fake"}, 400, "input"),
        ({"model": "nope", "input": "x"}, 404, "model"),
    ],
)
async def test_openai_embeddings_errors(
    client: httpx.AsyncClient, body: dict[str, Any], status: int, param: str
) -> None:
    r = await client.post("/v1/embeddings", json=body)
    assert r.status_code == status
    error = assert_openai_error(r.json())
    assert param in (error["param"] or "")
