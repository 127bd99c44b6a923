"""n choices of one prompt (the OpenAI `n`): the prompt is prefilled once, the other choices fork from it, and each
choice answers exactly as the same request alone would (greedy: the same text; seeded: seed + its index)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from lmserve.engine.llamacpp.backend import LlamaCppBackend
from lmserve.engine.protocol import choice_sampling
from lmserve.engine.slots.backend import BatchEntry
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.bridge import RequestStream
from lmserve.engine.slots.fake import FakeBackend
from lmserve.errors import InvalidRequest, Overloaded
from lmserve.types import Adapter, Chunk, LoadOptions, SamplingParams
from tests.tiny_gguf import write_tiny_llama
from tests.tiny_lfm2 import write_tiny_lfm2

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = "Once upon a time, in a land far away, there lived a curious fox who asked: what next?"


async def answer(stream: RequestStream) -> tuple[str, Chunk]:
    chunks = [chunk async for chunk in stream]
    return "".join(chunk.text for chunk in chunks), chunks[-1]


async def answers(streams: list[RequestStream]) -> list[str]:
    return [text for text, _ in await asyncio.gather(*(answer(s) for s in streams))]


def prefilled(steps: list[list[BatchEntry]], prompt_len: int) -> int:
    """Prompt tokens decoded over `steps` (decode steps feed one generated token at a position past the prompt)."""
    return sum(len(entry.tokens) for entry in (e for step in steps for e in step) if entry.pos < prompt_len)


# ---- the scheduler and engine, over the fake backend ----------------------------------------------------------


async def test_choices_prefill_the_prompt_once_and_fork_the_rest() -> None:
    backend = FakeBackend(num_parallel=4)
    engine = BatchingEngine(backend, max_prefill_tokens=16)
    try:
        prompt = engine.tokenize(PROMPT)
        texts = await answers(engine.submit_many(prompt, SamplingParams(seed=5, max_tokens=6), 3))
    finally:
        engine.close()
    assert prefilled(backend.steps, len(prompt)) == len(prompt)
    assert len(backend.forks) == 1 and len(backend.forks[0][1]) == 2
    assert texts == [FakeBackend.expected(len(prompt), 6, seed=5 + i) for i in range(3)]


async def test_more_choices_than_slots_wait_for_one_and_all_answer() -> None:
    backend = FakeBackend(num_parallel=2)
    engine = BatchingEngine(backend, max_prefill_tokens=16)
    try:
        prompt = engine.tokenize(PROMPT)
        texts = await answers(engine.submit_many(prompt, SamplingParams(seed=1, max_tokens=4), 5))
    finally:
        engine.close()
    assert texts == [FakeBackend.expected(len(prompt), 4, seed=1 + i) for i in range(5)]
    assert [len(slots) for _, slots in backend.forks] == [1]  # the others came later, sharing as any request does


async def test_choices_go_on_when_the_first_is_aborted_while_prefilling() -> None:
    backend = FakeBackend(num_parallel=3, step_delay=0.01)
    engine = BatchingEngine(backend, max_prefill_tokens=8)
    try:
        prompt = engine.tokenize(PROMPT)
        first, *others = engine.submit_many(prompt, SamplingParams(seed=2, max_tokens=3), 3)
        await asyncio.sleep(0.03)
        first.abort()
        texts = await answers(others)
    finally:
        engine.close()
    assert texts == [FakeBackend.expected(len(prompt), 3, seed=2 + i) for i in (1, 2)]


async def test_n_counts_against_the_queue() -> None:
    engine = BatchingEngine(FakeBackend(num_parallel=2, step_delay=0.01), max_queue=3)
    try:
        prompt = engine.tokenize(PROMPT)
        with pytest.raises(InvalidRequest) as never:
            engine.submit_many(prompt, SamplingParams(max_tokens=2), 6)
        assert never.value.param == "n" and "--parallel" in never.value.message
        streams = engine.submit_many(prompt, SamplingParams(max_tokens=2), 5)  # 2 running, 3 waiting: full
        with pytest.raises(Overloaded):
            engine.submit_many(prompt, SamplingParams(max_tokens=2), 2)
        await answers(streams)
    finally:
        engine.close()


async def test_choice_i_samples_with_seed_plus_i() -> None:
    sampling = SamplingParams(seed=10, logit_bias={3: 1.0})
    assert [choice_sampling(sampling, i).seed for i in range(3)] == [10, 11, 12]
    assert choice_sampling(SamplingParams(), 2).seed is None


# ---- real models ------------------------------------------------------------------------------------------------


def recording_steps(engine: BatchingEngine) -> list[list[BatchEntry]]:
    """Record every batch the engine decodes."""
    steps: list[list[BatchEntry]] = []
    step = engine.backend.step

    def recorded(entries: list[BatchEntry], adapters: tuple[Adapter, ...] = ()) -> list[int | None]:
        steps.append(list(entries))
        return step(entries, adapters)

    engine.backend.step = recorded  # type: ignore[method-assign]
    return steps


async def alone(engine: BatchingEngine, prompt: list[int], sampling: SamplingParams) -> str:
    engine.scheduler.slot_tokens = [[] for _ in engine.scheduler.slot_tokens]  # no prefix reuse between them
    text, _ = await answer(engine.submit(prompt, sampling))
    return text


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("choices") / "tiny-llama.gguf")  # F32: exact numbers


@pytest.fixture(scope="module")
def tiny_lfm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_lfm2(tmp_path_factory.mktemp("choices") / "tiny-lfm2.gguf")


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_lfm2"])
async def test_greedy_choices_equal_one_request_and_the_prompt_is_prefilled_once(
    model: str, request: pytest.FixtureRequest
) -> None:
    path: Path = request.getfixturevalue(model)
    engine = BatchingEngine(LlamaCppBackend(path, LoadOptions(num_ctx=256, num_parallel=4, num_batch=256)))
    try:
        prompt = engine.tokenize(PROMPT[:150])
        greedy = SamplingParams(temperature=0, max_tokens=12)
        expected = await alone(engine, prompt, greedy)
        engine.scheduler.slot_tokens = [[] for _ in engine.scheduler.slot_tokens]
        steps = recording_steps(engine)
        texts = await answers(engine.submit_many(prompt, greedy, 3))
    finally:
        engine.close()
    assert texts == [expected] * 3
    assert prefilled(steps, len(prompt)) == len(prompt)


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_lfm2"])
@pytest.mark.parametrize("num_parallel", [4, 2])
async def test_seeded_choices_are_reproducible_and_each_is_its_seed_alone(
    model: str, num_parallel: int, request: pytest.FixtureRequest
) -> None:
    """Choice i answers as the request alone with seed + i: forked (4 slots) or admitted later (2 slots)."""
    path: Path = request.getfixturevalue(model)
    engine = BatchingEngine(LlamaCppBackend(path, LoadOptions(num_ctx=256, num_parallel=num_parallel,
                                                              num_batch=256)))
    try:
        prompt = engine.tokenize(PROMPT[:150])
        sampling = SamplingParams(temperature=1.0, seed=42, max_tokens=10, repeat_penalty=1.3, repeat_last_n=-1)
        first = await answers(engine.submit_many(prompt, sampling, 3))
        again = await answers(engine.submit_many(prompt, sampling, 3))
        each = [await alone(engine, prompt, choice_sampling(sampling, i)) for i in range(3)]
    finally:
        engine.close()
    assert first == again == each
    assert len(set(first)) == 3
