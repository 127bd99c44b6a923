"""`/v1/decisions`, the rerank routes, `/v1/score` and `/v1/classify` in-process over the fake engine: the wire
shapes the official `openai` client parses, typed choice values, the input's items as messages, and every bad input
a 400 in its dialect's shape."""

from __future__ import annotations

import math
from typing import Any

import httpx
import openai
import pytest
from api_wire import assert_openai_error

from lmserve.endpoints.decisions import (
    CallItem,
    CallOutputItem,
    JsonPart,
    MessageItem,
    TextPart,
    parts_text,
    to_messages,
)
from lmserve.endpoints.rerank import ScoreRequest, document_text, score_pairs
from lmserve.errors import InvalidRequest


def client_of(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http,  # type: ignore[arg-type]
                              max_retries=0, _strict_response_validation=True)


async def test_the_openai_client_reads_every_kind_of_answer(client: httpx.AsyncClient) -> None:
    questions: Any = [
        {"type": "predicate", "name": "p", "instructions": "It rains."},
        {"type": "choice", "name": "c", "instructions": "Which?",
         "choices": [{"value": "true"}, {"value": True}, {"value": "no", "description": "not at all"}]},
        {"type": "score", "instructions": "How much?", "levels": [{"label": "low"}, {"label": "high"}]},
    ]
    with pytest.raises(openai.BadRequestError, match="distinct"):  # "true" and true read alike to the model
        await client_of(client).decisions.create(model="fake", input="text", questions=questions)
    questions[1]["choices"][0]["value"] = "maybe"
    decision = await client_of(client).decisions.create(model="fake", input="text", questions=questions)
    predicate, choice, score = decision.answers
    assert predicate.type == "predicate" and predicate.name == "p" and 0 < predicate.probability < 1
    assert choice.type == "choice" and [p.value for p in choice.probabilities] == ["maybe", True, "no"]
    assert math.fsum(p.probability for p in choice.probabilities) == pytest.approx(1)
    assert choice.confidence == max(p.probability for p in choice.probabilities)
    assert score.type == "score" and score.score == pytest.approx(score.probabilities[1].probability)
    assert decision.model == "fake" and decision.usage.input_tokens > 0


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x", "questions": []}, "questions"),
    ({"input": "x", "questions": [{"type": "choice", "instructions": "x", "choices": [{"value": "a"}] * 2}]},
     "questions[0].choices"),
    ({"input": "x", "questions": [{"type": "bogus", "instructions": "x"}]}, None),
    ({"input": [], "questions": [{"type": "predicate", "instructions": "x"}]}, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "o"}],
      "questions": [{"type": "predicate", "instructions": "x"}]}, "input[0].call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]}],
      "questions": [{"type": "predicate", "instructions": "x"}]}, "input"),
    ({"input": "x", "questions": [{"type": "predicate", "instructions": "x"}], "priority": 5000}, None),
])
async def test_bad_decisions_are_400s_in_the_openai_shape(client: httpx.AsyncClient, body: dict[str, Any],
                                                          param: str | None) -> None:
    r = await client.post("/v1/decisions", json={"model": "fake", **body})
    assert r.status_code == 400
    error = assert_openai_error(r.json())
    if param is not None:
        assert error["param"] == param


def test_input_items_become_messages() -> None:
    items: list[Any] = [
        MessageItem(role="developer", content="Be strict."),
        MessageItem(role="user", content=[TextPart(type="input_text", text="a"), JsonPart(type="input_json",
                                                                                          data={"k": [1, "é"]})]),
        CallItem(type="function_call", call_id="1", name="f", arguments='{"x": 1}'),
        CallItem(type="custom_tool_call", call_id="2", name="g", input="raw"),
        CallOutputItem(type="custom_tool_call_output", call_id="2", output="done"),
    ]
    messages, images = to_messages(items)
    assert [m.role for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[1].content == 'a\n\n{"k":[1,"é"]}'
    assert [(c.name, c.arguments) for c in messages[2].tool_calls] == [("f", '{"x": 1}'), ("g", '{"input": "raw"}')]
    assert (messages[3].name, messages[3].content) == ("g", "done") and images == [[], [], [], []]


def test_a_json_part_over_the_limit_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="bytes"):
        parts_text([JsonPart(type="input_json", data={"k": "x" * 300_000})], "input[0].content")


async def test_rerank_routes_answer_in_cohere_and_native_shapes(client: httpx.AsyncClient) -> None:
    body = {"model": "fake", "query": "q", "documents": ["one", {"title": "T", "body": "B"}, "three"], "top_n": 2,
            "return_documents": True}
    cohere = (await client.post("/v2/rerank", json=body)).json()
    native = (await client.post("/api/rerank", json=body)).json()
    assert len(cohere["results"]) == 2 and cohere["results"] == native["results"]
    scores = [r["relevance_score"] for r in cohere["results"]]
    assert scores == sorted(scores, reverse=True) and all(0 < s < 1 for s in scores)
    bad = await client.post("/api/rerank", json={"model": "fake", "query": "q", "documents": []})
    assert bad.status_code == 400 and isinstance(bad.json()["error"], str)


def test_documents_and_score_pairs() -> None:
    assert document_text({"title": "T", "body": "B"}) == "title: T\nbody: B"
    assert document_text({"text": "t", "id": 3}) == "t"
    assert score_pairs(ScoreRequest(text_1="q", text_2=["a", "b"])) == [("q", "a"), ("q", "b")]
    assert score_pairs(ScoreRequest(text_1=["q", "r"], text_2=["a", "b"])) == [("q", "a"), ("r", "b")]
    with pytest.raises(InvalidRequest):
        score_pairs(ScoreRequest(text_1=["q", "r"], text_2=["a", "b", "c"]))


async def test_classify_gives_every_label_a_probability(client: httpx.AsyncClient) -> None:
    examples = [{"text": "good", "label": "pos"}, {"text": "bad", "label": "neg"}]
    r = await client.post("/v1/classify", json={"model": "fake", "inputs": ["fine", "awful"], "examples": examples})
    [first, second] = r.json()["classifications"]
    assert set(first["labels"]) == {"pos", "neg"}
    assert math.fsum(v["confidence"] for v in first["labels"].values()) == pytest.approx(1)
    assert first["prediction"] in ("pos", "neg") and second["input"] == "awful"
    one_label = await client.post("/v1/classify", json={"model": "fake", "inputs": ["x"], "examples": examples[:1]})
    assert one_label.status_code == 400


async def test_options_that_are_not_served_are_refused(client: httpx.AsyncClient) -> None:
    score = await client.post("/v1/score", json={"model": "fake", "text_1": "q", "text_2": "a",
                                                 "truncate_prompt_tokens": 5})
    assert score.status_code == 400 and assert_openai_error(score.json())["param"] == "truncate_prompt_tokens"
    classify = await client.post("/v1/classify", json={"model": "fake", "inputs": ["x"], "truncate": "START",
                                                       "examples": [{"text": "a", "label": "p"},
                                                                    {"text": "b", "label": "n"}]})
    assert classify.status_code == 400
    bad_keep_alive = await client.post("/v1/rerank", json={"model": "fake", "query": "q", "documents": ["d"],
                                                           "keep_alive": "soon"})
    assert bad_keep_alive.status_code == 400
