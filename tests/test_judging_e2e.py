"""End to end: judgments with exact probabilities from a real `lmserve serve` (llama.cpp, the embedded default model,
as `make serve` runs it), through the official `openai` client's `decisions.create`, the `cohere` client's `rerank`
and `classify`, and plain HTTP for vLLM's /v1/score and the native /api/rerank."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import cohere
import httpx
import openai
import pytest

from tests.docs_pages import section
from tests.test_server import MODEL, Server

CAPITALS: Any = [{"type": "choice", "name": "capital", "instructions": "Answer the question.",
                  "choices": [{"value": "Berlin"}, {"value": "Paris"}, {"value": "Tokyo"}]}]
PARIS = "Paris is the capital of France."
BANANAS = "Bananas are yellow."


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def co(server: Server, http: httpx.Client) -> cohere.ClientV2:
    return cohere.ClientV2(api_key="placeholder", base_url=server.base_url, httpx_client=http)


def test_most_probability_goes_to_paris(client: openai.OpenAI) -> None:
    decision = client.decisions.create(model=MODEL, input="What is the capital of France?", questions=CAPITALS)
    [answer] = decision.answers
    assert answer.type == "choice" and answer.name == "capital"
    values = {p.value: p.probability for p in answer.probabilities}
    assert max(values, key=values.__getitem__) == "Paris" == answer.choice
    assert values["Paris"] > 0.5 and answer.confidence == values["Paris"]
    assert abs(math.fsum(values.values()) - 1) < 1e-6
    assert decision.model == MODEL and decision.usage.input_tokens > 0 and decision.usage.output_tokens == 0


def test_every_kind_of_question_in_one_decision(client: openai.OpenAI) -> None:
    questions: Any = [
        {"type": "predicate", "name": "about_weather", "instructions": "The text is about the weather."},
        {"type": "choice", "instructions": "How does the writer feel?",
         "choices": [{"value": "happy", "description": "glad, pleased"}, {"value": "sad"}, {"value": True}]},
        {"type": "score", "name": "rating", "instructions": "How sunny is the day described?",
         "levels": [{"label": "not at all"}, {"label": "somewhat"}, {"label": "very", "description": "no cloud"}]},
    ]
    decision = client.decisions.create(model=MODEL, input="The sun is shining and I feel great today.",
                                       questions=questions)
    predicate, choice, score = decision.answers
    assert predicate.type == "predicate" and 0 < predicate.probability < 1
    assert choice.type == "choice" and [p.value for p in choice.probabilities] == ["happy", "sad", True]
    assert score.type == "score" and [(p.label, p.value) for p in score.probabilities] == [
        ("not at all", 0), ("somewhat", 1), ("very", 2)]
    for answer in (choice, score):
        assert abs(math.fsum(p.probability for p in answer.probabilities) - 1) < 1e-6  # type: ignore[union-attr]
    expected = math.fsum(p.value * p.probability for p in score.probabilities)  # type: ignore[union-attr]
    assert score.score == pytest.approx(expected) and 0 <= score.score <= 2  # type: ignore[union-attr]


def test_a_question_alone_and_among_30_on_8_slots_has_the_same_probability(client: openai.OpenAI) -> None:
    report = " ".join(f"In town {i} the weather was {('mild', 'cold', 'hot')[i % 3]}." for i in range(40))
    questions: Any = [{"type": "choice", "instructions": f"What was the weather in town {i}?",
                       "choices": [{"value": "mild"}, {"value": "cold"}, {"value": "hot"}]} for i in range(30)]
    many = client.decisions.create(model=MODEL, input=report, questions=questions)
    alone = client.decisions.create(model=MODEL, input=report, questions=questions[7:8])
    assert len(many.answers) == 30
    seven = [p.probability for p in many.answers[7].probabilities]  # type: ignore[union-attr]  ("mild": 2 tokens)
    assert seven == pytest.approx([p.probability for p in alone.answers[0].probabilities], abs=1e-6)  # type: ignore[union-attr]
    # the report is prefilled once: nearly every prompt token of the 30 questions was found computed
    usage = many.usage
    assert usage.input_tokens_details.cached_tokens > 0.8 * usage.input_tokens


def test_messages_with_a_tool_call_as_input(client: openai.OpenAI) -> None:
    conversation: Any = [
        {"role": "user", "content": "What's the weather in Paris?"},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny, 24 C"},
        {"role": "assistant", "content": "It is sunny and 24 C in Paris."},
    ]
    questions: Any = [{"type": "predicate", "instructions": "The assistant's answer agrees with the tool output."}]
    [answer] = client.decisions.create(model=MODEL, input=conversation, questions=questions).answers
    assert answer.type == "predicate" and 0 < answer.probability < 1


@pytest.mark.parametrize(("questions", "param"), [
    ([], "questions"),
    ([{"type": "choice", "instructions": "x", "choices": [{"value": "a"}]}], "questions[0].choices"),
    ([{"type": "choice", "instructions": "x", "choices": [{"value": "a"}, {"value": "a"}]}], "questions[0].choices"),
    ([{"type": "score", "instructions": "x", "levels": [{"label": str(i)} for i in range(11)]}], "questions[0].levels"),
    ([{"type": "predicate", "instructions": "x"}] * 401, "questions"),
])
def test_bad_questions_are_400s_in_openai_shape(client: openai.OpenAI, questions: Any, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.decisions.create(model=MODEL, input="text", questions=questions)
    assert caught.value.body["param"] == param  # type: ignore[index]


def test_an_output_without_its_call_is_a_400(client: openai.OpenAI) -> None:
    orphan: Any = [{"type": "function_call_output", "call_id": "nope", "output": "x"}]
    with pytest.raises(openai.BadRequestError, match="call_id"):
        client.decisions.create(model=MODEL, input=orphan, questions=CAPITALS)


def test_cohere_rerank_puts_paris_first(co: cohere.ClientV2) -> None:
    result = co.rerank(model=MODEL, query="What is the capital of France?", documents=[BANANAS, PARIS])
    assert [r.index for r in result.results] == [1, 0]
    assert 0 <= result.results[1].relevance_score < result.results[0].relevance_score <= 1


def test_rerank_routes_agree(server: Server, http: httpx.Client) -> None:
    body = {"model": MODEL, "query": "What is the capital of France?", "documents": [BANANAS, {"text": PARIS}],
            "top_n": 1, "return_documents": True}
    answers = [http.post(server.base_url + path, json=body).json() for path in
               ("/v1/rerank", "/rerank", "/v2/rerank", "/api/rerank")]
    for answer in answers:
        assert [(r["index"], r["document"]["text"]) for r in answer["results"]] == [(1, PARIS)]
    assert len({a["results"][0]["relevance_score"] for a in answers}) == 1


def test_vllm_style_score_pairs(server: Server, http: httpx.Client) -> None:
    body = {"model": MODEL, "text_1": "What is the capital of France?", "text_2": [PARIS, BANANAS]}
    answer = http.post(server.base_url + "/v1/score", json=body).json()
    first, second = (d["score"] for d in answer["data"])
    assert first > second
    pairwise = {"model": MODEL, "text_1": ["What is the capital of France?"] * 2, "text_2": [PARIS, BANANAS]}
    again = http.post(server.base_url + "/v1/score", json=pairwise).json()
    assert [d["score"] for d in again["data"]] == pytest.approx([first, second], abs=1e-9)


def test_rerank_bad_input_is_a_400(server: Server, http: httpx.Client) -> None:
    for body in ({"model": MODEL, "query": "q", "documents": []}, {"model": MODEL, "query": " ", "documents": ["d"]},
                 {"model": MODEL, "documents": ["d"]}):
        r = http.post(server.base_url + "/v1/rerank", json=body)
        assert r.status_code == 400 and r.json()["error"]["message"]
    r = http.post(server.base_url + "/api/rerank", json={"model": MODEL, "query": "q", "documents": []})
    assert r.status_code == 400 and isinstance(r.json()["error"], str)


def test_cohere_classify_with_examples(server: Server, http: httpx.Client) -> None:
    co = cohere.Client(api_key="placeholder", base_url=server.base_url, httpx_client=http)
    examples = [cohere.ClassifyExample(text=t, label=label) for t, label in [
        ("I love this product", "positive"), ("This is wonderful", "positive"),
        ("I hate it", "negative"), ("This is awful", "negative")]]
    result = co.classify(model=MODEL, inputs=["What a great day", "Terrible service"], examples=examples)
    assert len(result.classifications) == 2
    for item in result.classifications:
        assert set(item.labels) == {"positive", "negative"}
        assert abs(math.fsum(v.confidence or 0 for v in item.labels.values()) - 1) < 1e-6
        assert item.prediction in item.labels and item.confidence == item.labels[item.prediction].confidence


def test_docs_examples_run_as_written(server: Server) -> None:
    """The Python examples of docs/judgments.md, pointed at this server (they print; they must not fail)."""
    page = section("judgments.md", "Judgments with exact probabilities")
    blocks = [block.split("```", 1)[0] for block in page.split("```python\n")[1:]]
    assert len(blocks) == 2
    for block in blocks:
        names: dict[str, Any] = {}
        exec(compile(block.replace("http://localhost:11434", server.base_url), "docs/judgments.md", "exec"), names)
        for name in ("client", "co"):  # close what the example opened
            if name == "client" and name in names:
                names[name].close()
            elif name in names:
                names[name]._client_wrapper.httpx_client.httpx_client.close()


def test_show_lists_rerank(server: Server, http: httpx.Client) -> None:
    shown = http.post(server.base_url + "/api/show", json={"model": MODEL}).json()
    assert shown["capabilities"][:3] == ["completion", "tools", "rerank"]
