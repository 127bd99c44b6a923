"""Judging over the fake engine: answers' probabilities by the chain rule over their tokens, renormalized; the same
question alone and among others; the limits; reranking with a dedicated reranker and with a chat model."""

from __future__ import annotations

import asyncio
import math
import zlib
from collections.abc import Iterator

import numpy as np
import pytest

from lmserve.chat.template import ChatTemplate
from lmserve.engine.logprobs import score_tokens
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.fake import FakeBackend
from lmserve.errors import InvalidRequest
from lmserve.service import Service, judging, static_service
from lmserve.service.judging import (
    MAX_QUESTIONS,
    answer_tokens,
    asked,
    check_questions,
    plan_nodes,
    question_text,
    renormalized,
)
from lmserve.service.residency import LoadedModel
from lmserve.types import Message, Question

INPUT = [Message("user", "The weather report for the week. " * 8)]


def choice(instructions: str, *answers: str) -> Question:
    return Question("choice", instructions, list(answers))


@pytest.fixture
def engine() -> Iterator[BatchingEngine]:
    engine = BatchingEngine(FakeBackend(num_ctx=4096, num_parallel=3))
    yield engine
    engine.close()


@pytest.fixture
def service(engine: BatchingEngine) -> Service:
    return static_service([LoadedModel(name="m", engine=engine, template=ChatTemplate(None))])


def fake_log_prob(prompt: list[int], token: int, num_vocab: int = 257) -> float:
    """What the fake backend scores `token` after `prompt` (FakeBackend.take_scores)."""

    offset = zlib.crc32(bytes(t % 256 for t in prompt))
    logits = -((np.arange(num_vocab) + offset) % 7).astype(np.float64)
    return score_tokens(logits, [token])[0]


async def test_probabilities_follow_the_chain_rule_and_sum_to_one(service: Service) -> None:
    question = choice("Which day was sunny?", "Monday", "Tuesday")  # bytes: several tokens each
    decision = await service.judging.decide("m", INPUT, [question])
    [judgment] = decision.judgments
    assert math.fsum(judgment.probabilities) == pytest.approx(1, abs=1e-9)
    prompt = list(ChatTemplate(None).render(asked(INPUT, question_text(question)), add_generation_prompt=True).encode())
    expected = []
    for answer in ("Monday", "Tuesday"):
        tokens = list(answer.encode())
        expected.append(math.fsum(fake_log_prob(prompt + tokens[:k], tokens[k]) for k in range(len(tokens))))
    assert judgment.probabilities[0] / judgment.probabilities[1] == pytest.approx(math.exp(expected[0] - expected[1]))


def test_an_answer_that_begins_another_ends_with_the_end_token(engine: BatchingEngine) -> None:
    spelled = answer_tokens(engine, ["1", "10", "2"], end=0)
    assert spelled == [[ord("1"), 0], [ord("1"), ord("0")], [ord("2")]]
    with pytest.raises(InvalidRequest):
        answer_tokens(engine, ["1", "10"], end=None)


def test_shared_beginnings_are_read_once() -> None:
    nodes = plan_nodes([7, 8], [[1, 2], [1, 3], [4]])
    assert {key: node.tokens for key, node in nodes.items()} == {(): [1, 4], (1,): [2, 3]}
    assert nodes[(1,)].prompt == [7, 8, 1]


def test_renormalized() -> None:
    assert renormalized([math.log(1), math.log(3)]) == pytest.approx([0.25, 0.75])
    assert renormalized([-math.inf, -math.inf]) == [0.5, 0.5]
    assert math.fsum(renormalized([-1000.0, -1001.0, -999.5])) == pytest.approx(1)


async def test_alone_and_among_many_give_the_same_probabilities(service: Service) -> None:
    questions = [choice(f"What happened on day {i}?", "rain", "sun", "snow") for i in range(60)]
    many = await service.judging.decide("m", INPUT, questions)
    alone = await service.judging.decide("m", INPUT, questions[17:18])
    assert many.judgments[17].probabilities == alone.judgments[0].probabilities
    assert many.usage.cached_tokens > 0  # the input was computed once, then found


async def test_questions_that_open_alike_compute_their_opening_once_per_slot(
        service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    questions = [choice(f"What happened on day {i}?", "rain", "sun", "snow") for i in range(30)]
    questions += [Question("predicate", f"Day {i} was sunny.", ["Yes", "No"]) for i in range(30)]

    async def computed(tag: str) -> int:
        decision = await service.judging.decide("m", [Message("user", f"{tag}: {INPUT[0].content}")], questions)
        return decision.usage.prompt_tokens - decision.usage.cached_tokens

    shared_openings = await computed("A")
    monkeypatch.setattr(judging, "_MIN_HEADER", 10**6)  # no opening is worth a stretch of its own
    each_its_own = await computed("B")
    # the fake tokenizes bytes: an opening is ~40 of the ~65 tokens each of the 360 answer positions computes
    assert shared_openings < 0.75 * each_its_own


async def test_decisions_from_several_users_at_once_answer_as_each_alone(service: Service) -> None:
    weather = [choice(f"What happened on day {i}?", "rain", "sun", "snow") for i in range(20)]
    sunny = [Question("predicate", f"Day {i} was sunny.", ["Yes", "No"]) for i in range(20)]
    other = [Message("user", "Another report, of another week. " * 6)]
    asks = [(INPUT, weather), (other, sunny), (INPUT, weather[5:8] + sunny[:2])]  # 45 sequences, 3 slots
    alone = [await service.judging.decide("m", messages, questions) for messages, questions in asks]
    together = await asyncio.gather(*(service.judging.decide("m", messages, questions) for messages, questions in asks))
    for one, other_time in zip(alone, together, strict=True):
        assert [j.probabilities for j in other_time.judgments] == [j.probabilities for j in one.judgments]


@pytest.mark.parametrize("questions", [
    [],
    [choice("x", "a")],
    [choice("x", "a", "a")],
    [choice("x", "a", " ")],
    [choice(" ", "a", "b")],
    [Question("score", "x", [str(i) for i in range(11)])],
    [choice("x", "a", "b")] * (MAX_QUESTIONS + 1),
])
def test_bad_questions_are_refused(questions: list[Question]) -> None:
    with pytest.raises(InvalidRequest):
        check_questions(questions)


def test_question_text_says_how_to_answer_first_then_asks() -> None:
    text = question_text(Question("score", "Rate it.", ["low", "high"], ["", "very good"]))
    assert text == "Answer with one of these from lowest to highest:\n- low\n- high: very good\nRate it."
    assert question_text(choice("Which?", "a", "b")) == "Answer with one of: a, b.\nWhich?"
    predicate = question_text(Question("predicate", "It rains.", ["Yes", "No"]))
    assert predicate == "Say whether the statement is true. Answer Yes or No.\nStatement: It rains."


async def test_a_chat_model_reranks_by_judging(service: Service) -> None:
    ranking = await service.judging.rerank("m", "query", ["first document", "second document"])
    assert len(ranking.scores) == 2 and all(0 < s < 1 for s in ranking.scores)
    with pytest.raises(InvalidRequest):
        await service.judging.rerank("m", "query", [])


async def test_a_dedicated_reranker_ranks_and_answers_no_questions() -> None:
    engine = BatchingEngine(FakeBackend(reranker=True))
    try:
        service = static_service([LoadedModel(name="r", engine=engine, template=ChatTemplate(None))])
        ranking = await service.judging.rerank("r", "query", ["a", "bb", "a"])
        assert ranking.scores[0] == ranking.scores[2] and all(0 < s < 1 for s in ranking.scores)
        with pytest.raises(InvalidRequest, match="reranker"):
            await service.judging.decide("r", INPUT, [choice("x", "a", "b")])
    finally:
        engine.close()
