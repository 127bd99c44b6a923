"""End to end on the vLLM engine: POST /v1/decisions through a real `lmserve serve` (the shared vLLM server over the
embedded SmolLM2, float32), read by the official `openai` client's `decisions.create`.

The probabilities are exact: read from vLLM's next-token distributions (`score_tokens`, vLLM's
`logprob_token_ids`), so a choice's probabilities sum to 1 and a question's answer does not depend on the questions
asked beside it. tests/test_judging_e2e.py makes the same checks on llama.cpp.
"""

from __future__ import annotations

import math
from typing import Any

import openai
import pytest

CAPITALS: Any = [{"type": "choice", "instructions": "Answer the question.",
                  "choices": [{"value": "Paris"}, {"value": "Berlin"}, {"value": "Tokyo"}]}]


def test_a_choice_has_probabilities_that_sum_to_one(vllm_client: openai.OpenAI, vllm_model: str) -> None:
    decision = vllm_client.decisions.create(model=vllm_model, input="What is the capital of France?",
                                            questions=CAPITALS)
    [answer] = decision.answers
    assert answer.type == "choice"
    values = {p.value: p.probability for p in answer.probabilities}
    assert set(values) == {"Paris", "Berlin", "Tokyo"} and all(0 <= p <= 1 for p in values.values())
    assert abs(math.fsum(values.values()) - 1) < 1e-6
    assert max(values, key=values.__getitem__) == "Paris" == answer.choice
    assert answer.confidence == values["Paris"]
    assert decision.usage.input_tokens > 0 and decision.usage.output_tokens == 0


def test_a_question_alone_and_among_others_has_the_same_probabilities(vllm_client: openai.OpenAI,
                                                                      vllm_model: str) -> None:
    text = "The sun is shining over Paris and I feel great today."
    others: Any = [{"type": "predicate", "instructions": f"The text mentions the number {i}."} for i in range(6)]
    questions: Any = [*others[:3], *CAPITALS, *others[3:]]
    many = vllm_client.decisions.create(model=vllm_model, input=text, questions=questions)
    alone = vllm_client.decisions.create(model=vllm_model, input=text, questions=CAPITALS)
    assert len(many.answers) == 7
    among = [p.probability for p in many.answers[3].probabilities]  # type: ignore[union-attr]
    assert among == pytest.approx([p.probability for p in alone.answers[0].probabilities], abs=1e-4)  # type: ignore[union-attr]
    for predicate in many.answers[:3] + many.answers[4:]:
        assert predicate.type == "predicate" and 0 < predicate.probability < 1
