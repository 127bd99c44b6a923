"""End to end on llama.cpp: a dedicated reranker GGUF (tests/tiny_reranker.py, rank pooling) served by a real
`lmserve serve`, through the Cohere client and the rerank routes; it lists `rerank` only and refuses chat."""

from __future__ import annotations

import math
from collections.abc import Iterator

import cohere
import httpx
import pytest

from tests.test_server import Server
from tests.tiny_reranker import write_tiny_reranker

QUERY = "What is the capital of France?"
DOCUMENTS = ["Bananas are yellow.", "Paris is the capital of France.", "The Seine is a river in Paris."]


@pytest.fixture(scope="module", params=["bert", "qwen3"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str]]:
    path = write_tiny_reranker(tmp_path_factory.mktemp("reranker") / f"tiny-{request.param}-reranker.gguf",
                               arch=request.param)
    srv = Server(str(path), "-np", "4")
    with httpx.Client(timeout=120) as http:
        name = http.get(srv.base_url + "/api/tags").json()["models"][0]["name"]
    yield srv, name
    srv.stop()


def test_cohere_rerank_with_a_dedicated_reranker(served: tuple[Server, str]) -> None:
    server, name = served
    with httpx.Client(timeout=120) as http:
        co = cohere.ClientV2(api_key="placeholder", base_url=server.base_url, httpx_client=http)
        result = co.rerank(model=name, query=QUERY, documents=DOCUMENTS, top_n=3)
        alone = co.rerank(model=name, query=QUERY, documents=DOCUMENTS[1:2])
    scores = [r.relevance_score for r in result.results]
    assert sorted(r.index for r in result.results) == [0, 1, 2] and scores == sorted(scores, reverse=True)
    assert all(0 < s < 1 and math.isfinite(s) for s in scores)
    by_index = {r.index: r.relevance_score for r in result.results}
    assert alone.results[0].relevance_score == pytest.approx(by_index[1], abs=1e-5)


def test_a_reranker_lists_rerank_only_and_refuses_chat(served: tuple[Server, str]) -> None:
    server, name = served
    with httpx.Client(timeout=120) as http:
        shown = http.post(server.base_url + "/api/show", json={"model": name}).json()
        chat = http.post(server.base_url + "/v1/chat/completions",
                         json={"model": name, "messages": [{"role": "user", "content": "hi"}]})
        decision = http.post(server.base_url + "/v1/decisions", json={
            "model": name, "input": "x", "questions": [{"type": "predicate", "instructions": "y"}]})
    assert shown["capabilities"] == ["rerank"]
    assert chat.status_code == 400 and "reranker" in chat.json()["error"]["message"]
    assert decision.status_code == 400 and "reranker" in decision.json()["error"]["message"]


def test_native_rerank_and_score_agree(served: tuple[Server, str]) -> None:
    server, name = served
    with httpx.Client(timeout=120) as http:
        native = http.post(server.base_url + "/api/rerank", json={"model": name, "query": QUERY,
                                                                  "documents": DOCUMENTS}).json()
        scored = http.post(server.base_url + "/v1/score", json={"model": name, "text_1": QUERY,
                                                                "text_2": DOCUMENTS}).json()
    by_index = {r["index"]: r["relevance_score"] for r in native["results"]}
    assert [d["score"] for d in scored["data"]] == pytest.approx([by_index[i] for i in range(3)], abs=1e-5)

