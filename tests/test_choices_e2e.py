"""End to end: `n` choices from a real `lmserve serve` (llama.cpp), read by the official `openai` client.

n choices share one prefilled prompt; whole replies list them indexed 0..n-1, streams interleave their chunks by
`index`, each finishes on its own, and usage counts the prompt once and sums the completions.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.test_server import MODEL, Server

MESSAGES: Any = [{"role": "user", "content": "Name one animal."}]
WEATHER: Any = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server(env={"LMSERVE_MAX_QUEUE": "4"})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with server.client() as c:
        yield c


def test_greedy_chat_choices_all_equal_the_single_answer(client: openai.OpenAI) -> None:
    one = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=16)
    three = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=16, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert {c.message.content for c in three.choices} == {one.choices[0].message.content}
    assert one.usage is not None and three.usage is not None
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert three.usage.total_tokens == three.usage.prompt_tokens + three.usage.completion_tokens


def test_seeded_chat_choices_differ_and_repeat(client: openai.OpenAI) -> None:
    def ask() -> list[str | None]:
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0, seed=7,
                                               max_tokens=12, n=4)
        return [c.message.content for c in reply.choices]

    first = ask()
    assert first == ask()
    assert len(set(first)) > 1


def test_streamed_chat_choices_interleave_by_index_and_sum_usage(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0, seed=3, max_tokens=12,
                                           n=3)
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0, seed=3, max_tokens=12,
                                            n=3, stream=True, stream_options={"include_usage": True})
    texts: dict[int, str] = defaultdict(str)
    finishes: dict[int, str] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert not chunk.choices
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                assert choice.index not in finishes
                finishes[choice.index] = choice.finish_reason
    assert sorted(finishes) == [0, 1, 2]
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert [finishes[i] for i in range(3)] == [c.finish_reason for c in whole.choices]
    assert usage is not None and whole.usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)


def test_completion_choices_whole_and_streamed(client: openai.OpenAI, server: Server) -> None:
    whole = client.completions.create(model=MODEL, prompt="The sky is", temperature=1.0, seed=11, max_tokens=8, n=2)
    assert [c.index for c in whole.choices] == [0, 1]
    assert whole.choices[0].text != whole.choices[1].text
    texts: dict[int, str] = defaultdict(str)
    usage = None
    # A streamed legacy completion's finish_reason is null until the end, which the client's strict type refuses.
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="placeholder", max_retries=0) as plain:
        for chunk in plain.completions.create(model=MODEL, prompt="The sky is", temperature=1.0, seed=11,
                                              max_tokens=8, n=2, stream=True, stream_options={"include_usage": True}):
            usage = chunk.usage or usage
            for choice in chunk.choices:
                texts[choice.index] += choice.text
    assert [texts[0], texts[1]] == [c.text for c in whole.choices]
    assert usage is not None and whole.usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_each_choice_makes_its_own_forced_tool_call(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=WEATHER, n=2,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0, max_tokens=64)
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls and choice.message.tool_calls[0].function.name == "get_weather"


def test_bad_n_and_best_of_are_clear_400s(client: openai.OpenAI, server: Server) -> None:
    for n in (0, 129):
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, n=n)
        assert bad.value.param == "n"
    with pytest.raises(openai.BadRequestError) as never:  # 8 slots and a queue of 4 can never hold 13
        client.chat.completions.create(model=MODEL, messages=MESSAGES, n=13)
    assert never.value.param == "n" and "--parallel" in never.value.message
    with pytest.raises(openai.BadRequestError) as best:
        client.completions.create(model=MODEL, prompt="Hi", n=2, best_of=3)
    assert best.value.param == "best_of"
    # n = 1 is the ordinary reply
    reply = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                       json={"model": MODEL, "messages": MESSAGES, "n": 1, "max_tokens": 4})
    assert reply.status_code == 200 and len(reply.json()["choices"]) == 1


def test_each_choice_carries_its_own_logprobs(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=6, n=2,
                                           logprobs=True, top_logprobs=2)
    contents = [choice.logprobs.content if choice.logprobs else None for choice in reply.choices]
    assert contents[0] and contents[1] and [t.token for t in contents[0]] == [t.token for t in contents[1]]
    assert reply.usage is not None and reply.usage.completion_tokens == 2 * len(contents[0])
