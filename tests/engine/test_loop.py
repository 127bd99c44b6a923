"""The engine loop over a fake backend: streaming, stops, limits, aborts, concurrency."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from lmserve.engine.fake import FakeBackend
from lmserve.engine.loop import Engine
from lmserve.errors import ContextOverflow, InvalidRequest, Overloaded
from lmserve.types import Chunk, SamplingParams


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    eng = Engine(FakeBackend(num_ctx=64, num_parallel=2), max_batch_tokens=16, max_prefill_tokens=8)
    yield eng
    eng.close()


async def collect(engine: Engine, prompt: str, **sampling: object) -> tuple[str, Chunk]:
    chunks = [c async for c in engine.submit(engine.tokenize(prompt), SamplingParams(**sampling))]  # type: ignore[arg-type]
    return "".join(c.text for c in chunks), chunks[-1]


async def test_generates_until_max_tokens(engine: Engine) -> None:
    text, last = await collect(engine, "hello", max_tokens=12)
    assert text == FakeBackend.expected(5, 12)
    assert last.finish_reason == "length"
    assert last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (5, 12)


async def test_stop_string_ends_and_is_not_emitted(engine: Engine) -> None:
    full = FakeBackend.expected(5, 30)
    stop = full[10:14]
    text, last = await collect(engine, "hello", max_tokens=30, stop=[stop])
    assert text == full[: full.index(stop)]
    assert last.finish_reason == "stop"


async def test_end_of_generation_token_stops() -> None:
    eng = Engine(FakeBackend(num_ctx=64, num_parallel=1, eog_after=3))
    try:
        text, last = await collect(eng, "abc", max_tokens=30)
        assert text == FakeBackend.expected(3, 3)
        assert last.finish_reason == "stop"
    finally:
        eng.close()


async def test_context_limit_caps_generation(engine: Engine) -> None:
    _text, last = await collect(engine, "x" * 60)
    assert last.finish_reason == "length"
    assert last.usage is not None and last.usage.completion_tokens == 4


async def test_prompt_longer_than_context_is_refused(engine: Engine) -> None:
    with pytest.raises(ContextOverflow) as info:
        engine.submit(engine.tokenize("x" * 64), SamplingParams())
    assert "64" in info.value.message


async def test_more_requests_than_slots_all_complete(engine: Engine) -> None:
    prompts = [f"prompt number {i}" for i in range(7)]
    results = await asyncio.gather(*(collect(engine, p, max_tokens=9) for p in prompts))
    for prompt, (text, last) in zip(prompts, results, strict=True):
        assert text == FakeBackend.expected(len(prompt), 9)
        assert last.finish_reason == "length"
    assert engine.num_running == 0


async def test_abort_frees_the_slot() -> None:
    engine = Engine(FakeBackend(num_ctx=4096, num_parallel=2, step_delay=0.01))
    stream = engine.submit(engine.tokenize("hello"), SamplingParams(max_tokens=1000))
    async for _ in stream:
        break
    assert engine.num_running == 1
    stream.abort()
    for _ in range(100):
        if engine.num_running == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.num_running == 0
    text, _ = await collect(engine, "again", max_tokens=3)
    assert text == FakeBackend.expected(5, 3)
    engine.close()


@pytest.mark.parametrize(
    ("prompt", "bias"),
    [([1, 2, 257], {}), ([-1, 2], {}), ([1, 2], {300: 1.0}), ([1, 2], {-5: 1.0})],
)
async def test_token_ids_outside_the_vocabulary_are_refused(
    engine: Engine, prompt: list[int], bias: dict[int, float]
) -> None:
    with pytest.raises(InvalidRequest):
        engine.submit(prompt, SamplingParams(logit_bias=bias))
    assert engine.num_waiting == 0


async def test_a_full_queue_refuses_with_overloaded_and_the_rest_complete() -> None:
    engine = Engine(FakeBackend(num_ctx=256, num_parallel=1, step_delay=0.01), max_queue=2)
    try:
        streams, refused = [], 0
        for i in range(6):
            try:
                streams.append(engine.submit(engine.tokenize(f"request {i}"), SamplingParams(max_tokens=3)))
            except Overloaded:
                refused += 1
        assert refused >= 3  # one may be running, at most two wait
        for stream in streams:
            chunks = [c async for c in stream]
            assert chunks[-1].finish_reason == "length"
    finally:
        engine.close()
