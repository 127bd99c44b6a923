"""End to end on the vLLM engine: `n` choices through a real `lmserve serve`, read by the official `openai` client.

The run's shared vLLM server (tests/conftest.py: the embedded SmolLM2 as a safetensors repository, float32 so
greedy output is batch invariant on CPU, 2 slots and a queue of 16). The same checks as tests/test_choices_e2e.py
makes on llama.cpp.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import openai
import pytest

from tests.conftest import SHARED_VLLM_QUEUE

MESSAGES: Any = [{"role": "user", "content": "Name one animal."}]


@pytest.fixture(scope="module")
def client(vllm_client: openai.OpenAI) -> openai.OpenAI:
    return vllm_client


@pytest.fixture(scope="module")
def model(vllm_model: str) -> str:
    return vllm_model


def test_greedy_choices_equal_one_answer_and_usage_sums(client: openai.OpenAI, model: str) -> None:
    one = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=12)
    three = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=12, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert {c.message.content for c in three.choices} == {one.choices[0].message.content}
    assert one.usage is not None and three.usage is not None
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens


def test_seeded_choices_stream_by_index_as_the_whole_reply(client: openai.OpenAI, model: str) -> None:
    def whole() -> list[str | None]:
        reply = client.chat.completions.create(model=model, messages=MESSAGES, temperature=1.0, seed=5,
                                               max_tokens=10, n=3)
        return [c.message.content for c in reply.choices]

    first = whole()
    assert first == whole() and len(set(first)) > 1
    texts: dict[int, str] = defaultdict(str)
    finishes: dict[int, str] = {}
    for chunk in client.chat.completions.create(model=model, messages=MESSAGES, temperature=1.0, seed=5,
                                                max_tokens=10, n=3, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
    assert sorted(finishes) == [0, 1, 2]
    assert [texts[i] for i in range(3)] == first


def test_completion_choices_and_the_bound_on_n(client: openai.OpenAI, model: str) -> None:
    reply = client.completions.create(model=model, prompt="The sky is", temperature=1.0, seed=2, max_tokens=6, n=2)
    assert [c.index for c in reply.choices] == [0, 1] and reply.choices[0].text != reply.choices[1].text
    most = 2 + SHARED_VLLM_QUEUE  # 2 sequences and the queue can never hold one more
    with pytest.raises(openai.BadRequestError) as never:
        client.chat.completions.create(model=model, messages=MESSAGES, n=most + 1)
    assert never.value.param == "n" and "--parallel" in never.value.message
