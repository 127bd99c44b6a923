"""Embeddings through the engine loop: the real model's geometry, and the loop's handling over the fake."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from lmserve.engine.llamacpp.backend import LlamaCppBackend
from lmserve.engine.protocol import unit_vector
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.bridge import RequestStream
from lmserve.engine.slots.fake import FakeBackend
from lmserve.errors import ContextOverflow, EngineFailure, InvalidRequest
from lmserve.types import Adapter, Chunk, LoadOptions, SamplingParams

NUM_CTX = 256


def norm(vector: list[float]) -> float:
    return math.sqrt(sum(x * x for x in vector))


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / (norm(a) * norm(b))


# ---- the real model -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_engine(model_path: Path) -> Iterator[BatchingEngine]:
    # num_batch 64 < NUM_CTX: a long text is decoded in several batches and pooled across them.
    eng = BatchingEngine(LlamaCppBackend(model_path, LoadOptions(num_ctx=NUM_CTX, num_parallel=2, num_batch=64)))
    yield eng
    eng.close()


@pytest.mark.model
@pytest.mark.asyncio(loop_scope="module")
async def test_similar_texts_are_closer_than_unrelated_ones(real_engine: BatchingEngine) -> None:
    cat, kitten, physics = await real_engine.embed([
        "The cat sat on the mat.",
        "A kitten is sitting on a rug.",
        "Quantum chromodynamics describes the strong interaction between quarks.",
    ])
    assert len(cat) == len(physics) > 100
    assert all(norm(v) == pytest.approx(1.0, abs=1e-6) for v in (cat, kitten, physics))
    assert cosine(cat, kitten) > cosine(cat, physics) + 0.1
    assert cosine(cat, kitten) > cosine(kitten, physics) + 0.1


@pytest.mark.model
@pytest.mark.asyncio(loop_scope="module")
async def test_embedding_is_deterministic_and_independent_of_generation(real_engine: BatchingEngine) -> None:
    text = "Paris is the capital of France."
    alone = (await real_engine.embed([text]))[0]
    prompt = real_engine.tokenize("<|im_start|>user\nCount to twenty.<|im_end|>\n<|im_start|>assistant\n")
    stream = real_engine.submit(prompt, SamplingParams(temperature=0, max_tokens=30))
    beside, chunks = await asyncio.gather(real_engine.embed([text]), _drain(stream))
    assert chunks[-1].finish_reason is not None and chunks[-1].error is None
    assert cosine(alone, beside[0]) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.model
@pytest.mark.asyncio(loop_scope="module")
async def test_long_text_is_truncated_or_refused(real_engine: BatchingEngine) -> None:
    long_text = "word " * (NUM_CTX * 2)
    assert len(real_engine.tokenize(long_text)) > NUM_CTX
    with pytest.raises(ContextOverflow) as info:
        await real_engine.embed([long_text], truncate=False)
    assert info.value.num_ctx == NUM_CTX and info.value.param == "input"
    tokens = real_engine.embedding_tokens(long_text, truncate=True)
    assert len(tokens) == NUM_CTX
    (vector,) = await real_engine.embed([long_text])
    assert norm(vector) == pytest.approx(1.0, abs=1e-6)
    (raw,) = await real_engine.embed_tokens([tokens], normalize=False)
    assert unit_vector(raw) == pytest.approx(vector, abs=1e-6)


async def _drain(stream: RequestStream) -> list[Chunk]:
    return [chunk async for chunk in stream]


# ---- the loop, over the fake ------------------------------------------------------------------------


class FailingBackend(FakeBackend):
    def embed(self, tokens: list[int], adapters: tuple[Adapter, ...] = ()) -> list[float]:
        if tokens == list(b"boom"):
            raise RuntimeError("kaboom")
        return super().embed(tokens, adapters)


@pytest.fixture
async def engine() -> AsyncIterator[BatchingEngine]:
    eng = BatchingEngine(FailingBackend(num_ctx=32, num_parallel=2, step_delay=0.002), max_batch_tokens=16)
    yield eng
    eng.close()


async def test_fake_vectors_are_unit_histograms_in_input_order(engine: BatchingEngine) -> None:
    ab, ba, zz = await engine.embed(["aab", "baa", "zz"])
    assert ab == ba
    assert ab[ord("a")] == pytest.approx(2 / math.sqrt(5)) and ab[ord("b")] == pytest.approx(1 / math.sqrt(5))
    assert zz[ord("z")] == pytest.approx(1.0)
    (raw,) = await engine.embed(["aab"], normalize=False)
    assert raw[ord("a")] == 2.0


@pytest.mark.parametrize(
    ("texts", "error"),
    [([""], InvalidRequest), (["x" * 33], ContextOverflow), (["boom"], EngineFailure)],
)
async def test_bad_inputs_fail_only_their_request(
    engine: BatchingEngine, texts: list[str], error: type[Exception]
) -> None:
    with pytest.raises(error):
        await engine.embed(texts, truncate=False)
    assert (await engine.embed(["ok"]))[0][ord("o")] == pytest.approx(math.sqrt(0.5))


async def test_embeddings_run_between_decode_steps(engine: BatchingEngine) -> None:
    stream = engine.submit(engine.tokenize("hi"), SamplingParams(max_tokens=20))
    chunks, vectors = await asyncio.gather(_drain(stream), engine.embed(["hello"] * 5))
    assert len(vectors) == 5 and all(v == vectors[0] for v in vectors)
    assert chunks[-1].finish_reason == "length"


async def test_a_cancelled_embedding_leaves_the_engine_working(engine: BatchingEngine) -> None:
    task = asyncio.create_task(engine.embed(["x"] * 50))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(await engine.embed(["y"])) == 1


class SlowBackend(FakeBackend):
    def embed(self, tokens: list[int], adapters: tuple[Adapter, ...] = ()) -> list[float]:
        time.sleep(0.01)
        return super().embed(tokens, adapters)


async def test_close_fails_waiting_embeddings_and_refuses_new_ones() -> None:
    eng = BatchingEngine(SlowBackend(num_ctx=32))
    task = asyncio.create_task(eng.embed(["a"] * 50))
    await asyncio.sleep(0.03)
    await asyncio.to_thread(eng.close)
    with pytest.raises(EngineFailure, match="shutting down"):
        await task
    with pytest.raises(InvalidRequest):
        await eng.embed(["late"])
