"""The OpenAI `n` over the fake engine, in-process: choices indexed 0..n-1, streams interleaved by index with a
finish per choice, usage summed (prompt once), and the interleaving helper on its own."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from lmserve.chat.template import ChatTemplate
from lmserve.config import ServerConfig
from lmserve.dialects.openai.choices import interleave, summed_usage
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.fake import FakeBackend
from lmserve.http.app import create_app
from lmserve.service import static_service
from lmserve.service.residency import LoadedModel

pytestmark = pytest.mark.asyncio

USER = [{"role": "user", "content": "hello"}]


def events(text: str) -> list[Any]:
    return [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
            for line in text.splitlines() if line.startswith("data: ")]


async def test_whole_chat_lists_every_choice_and_sums_usage(client: httpx.AsyncClient) -> None:
    one = (await client.post("/v1/chat/completions", json={"model": "fake", "messages": USER, "max_tokens": 5,
                                                          "seed": 1})).json()
    many = (await client.post("/v1/chat/completions", json={"model": "fake", "messages": USER, "max_tokens": 5,
                                                           "seed": 1, "n": 3})).json()
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    assert many["choices"][0]["message"] == one["choices"][0]["message"]
    assert len({c["message"]["content"] for c in many["choices"]}) == 3  # seeds 1, 2, 3
    assert many["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert many["usage"]["completion_tokens"] == 3 * one["usage"]["completion_tokens"]
    assert many["usage"]["total_tokens"] == many["usage"]["prompt_tokens"] + many["usage"]["completion_tokens"]


async def test_streamed_chat_interleaves_choices_with_one_usage_at_the_end(client: httpx.AsyncClient) -> None:
    body = {"model": "fake", "messages": USER, "max_tokens": 5, "seed": 1, "n": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    whole = (await client.post("/v1/chat/completions", json={**body, "stream": False})).json()
    frames = events((await client.post("/v1/chat/completions", json=body)).text)
    assert frames[-1] == "[DONE]"
    usage = frames[-2]
    assert usage["choices"] == []
    tokens = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [usage["usage"][k] for k in tokens] == [whole["usage"][k] for k in tokens]
    texts: dict[int, str] = defaultdict(str)
    finishes: dict[int, list[str]] = defaultdict(list)
    for frame in frames[:-2]:
        assert frame["usage"] is None and len(frame["choices"]) == 1
        choice = frame["choices"][0]
        texts[choice["index"]] += choice["delta"].get("content") or ""
        if choice["finish_reason"] is not None:
            finishes[choice["index"]].append(choice["finish_reason"])
    assert [texts[i] for i in range(3)] == [c["message"]["content"] for c in whole["choices"]]
    assert dict(finishes) == {0: ["length"], 1: ["length"], 2: ["length"]}


async def test_streamed_completion_choices_without_usage(client: httpx.AsyncClient) -> None:
    body = {"model": "fake", "prompt": "abc", "max_tokens": 4, "seed": 2, "n": 2, "stream": True}
    frames = events((await client.post("/v1/completions", json=body)).text)
    whole = (await client.post("/v1/completions", json={**body, "stream": False})).json()
    texts: dict[int, str] = defaultdict(str)
    for frame in frames[:-1]:
        assert "usage" not in frame
        texts[frame["choices"][0]["index"]] += frame["choices"][0]["text"]
    assert [texts[0], texts[1]] == [c["text"] for c in whole["choices"]]
    assert whole["usage"]["completion_tokens"] == 8


async def test_n_beyond_what_the_engine_can_hold_is_a_400(client: httpx.AsyncClient,
                                                          engine: BatchingEngine) -> None:
    engine.max_queue = 2
    r = await client.post("/v1/chat/completions", json={"model": "fake", "messages": USER, "n": 7})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert "--parallel" in r.json()["error"]["message"]


async def test_the_lease_ends_with_the_last_choice(client: httpx.AsyncClient, engine: BatchingEngine) -> None:
    r = await client.post("/v1/chat/completions", json={"model": "fake", "messages": USER, "n": 4, "max_tokens": 3})
    assert r.status_code == 200
    await asyncio.sleep(0.05)
    assert engine.num_running == 0 and engine.num_waiting == 0


async def gen(items: list[int], delay: float) -> AsyncIterator[int]:
    for item in items:
        await asyncio.sleep(delay)
        yield item


async def test_interleave_keeps_each_order_and_raises_the_first_error() -> None:
    merged = [item async for item in interleave([gen([1, 2, 3], 0.01), gen([10, 20], 0.015)])]
    assert sorted(merged) == [1, 2, 3, 10, 20]
    assert [i for i in merged if i < 10] == [1, 2, 3] and [i for i in merged if i >= 10] == [10, 20]

    async def failing() -> AsyncIterator[int]:
        yield 0
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        _ = [item async for item in interleave([gen([1, 2, 3], 0.05), failing()])]


async def test_summed_usage_counts_the_prompt_once() -> None:
    usage = summed_usage([
        {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14, "prompt_tokens_details": {"cached_tokens": 2},
         "completion_tokens_details": {"reasoning_tokens": 1}},
        {"prompt_tokens": 10, "completion_tokens": 6, "total_tokens": 16, "prompt_tokens_details": {"cached_tokens": 9},
         "completion_tokens_details": {"reasoning_tokens": 3}},
    ])
    assert usage == {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20,
                     "prompt_tokens_details": {"cached_tokens": 2},
                     "completion_tokens_details": {"reasoning_tokens": 4}}



async def test_a_failing_choice_ends_the_stream_with_an_error() -> None:
    engine = BatchingEngine(FakeBackend(num_ctx=2048, num_parallel=4, step_delay=0.005))
    service = static_service([LoadedModel(name="fake", engine=engine, template=ChatTemplate(None))])
    transport = httpx.ASGITransport(create_app(service, ServerConfig()))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            async def fail_once_both_run() -> None:
                while not (engine.num_running == 2 and all(seq.output for seq in list(engine.scheduler.running))):
                    await asyncio.sleep(0.01)  # both choices have begun
                engine.fail_all("the engine broke")

            failing = asyncio.create_task(fail_once_both_run())
            body = {"model": "fake", "messages": USER, "max_tokens": 1900, "n": 2, "stream": True}
            frames = events((await client.post("/v1/chat/completions", json=body)).text)
            await failing
    finally:
        engine.close()
    assert frames[-1] != "[DONE]" and frames[-1]["error"]["message"] == "the engine broke"
    assert any(frame != "[DONE]" and frame.get("choices") for frame in frames[:-1])
