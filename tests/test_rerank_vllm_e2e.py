"""End to end on the vLLM engine: a dedicated reranker (a tiny random BERT cross-encoder, tests/hf_repos.py) served
by a real `lmserve serve` on vLLM's pooling runner, through the rerank routes (endpoints/rerank.py).

`relevance_score` is the head's logit through a sigmoid: transformers' logit of the same pair, squashed, within
float32 noise. A reranker generates nothing: a chat request or a decision is a clear 400.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.hf_repos import tiny_reranker_repo
from tests.test_server import Server

QUERY = "What is the capital of France?"
DOCUMENTS = ["Bananas are yellow.", "Paris is the capital of France.", "The Seine is a river in Paris."]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server(str(tiny_reranker_repo("bert")), "--dtype", "float32", "-c", "512", "-np", "4")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def model(server: Server) -> str:
    return server.repository_model()


def expected_scores() -> list[float]:
    """transformers' logits of (QUERY, document) through a sigmoid."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = tiny_reranker_repo("bert")
    tokenizer = AutoTokenizer.from_pretrained(path)
    head = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = [float(head(**tokenizer(QUERY, d, return_tensors="pt")).logits[0, 0]) for d in DOCUMENTS]
    return [1 / (1 + math.exp(-x)) for x in logits]


def test_rerank_scores_are_the_heads_logits_through_a_sigmoid(server: Server, model: str) -> None:
    reply = httpx.post(server.base_url + "/v1/rerank", json={"model": model, "query": QUERY, "documents": DOCUMENTS},
                       timeout=60)
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True) and sorted(r["index"] for r in results) == [0, 1, 2]
    by_index = {r["index"]: r["relevance_score"] for r in results}
    assert [by_index[i] for i in range(3)] == pytest.approx(expected_scores(), abs=1e-4)


def test_the_rerank_routes_agree(server: Server, model: str) -> None:
    body: dict[str, Any] = {"model": model, "query": QUERY, "documents": DOCUMENTS}
    ranked = httpx.post(server.base_url + "/v1/rerank", json=body, timeout=60).json()["results"]
    native = httpx.post(server.base_url + "/api/rerank", json=body, timeout=60)
    assert native.status_code == 200, native.text
    score = httpx.post(server.base_url + "/v1/score", json={"model": model, "text_1": QUERY, "text_2": DOCUMENTS},
                       timeout=60)
    assert score.status_code == 200, score.text
    by_index = {r["index"]: r["relevance_score"] for r in ranked}
    assert [d["score"] for d in score.json()["data"]] == pytest.approx([by_index[i] for i in range(3)], abs=1e-6)


def test_a_reranker_answers_no_chat_and_no_decision(server: Server, model: str) -> None:
    with server.client() as client:
        with pytest.raises(openai.BadRequestError, match="reranker"):
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        with pytest.raises(openai.BadRequestError, match="reranker"):
            client.decisions.create(model=model, input=QUERY, questions=[
                {"type": "predicate", "instructions": "The text asks a question."}])
