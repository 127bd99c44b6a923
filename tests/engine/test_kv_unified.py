"""One KV pool shared by all slots (`kv_unified`) on real llama.cpp: a sequence may grow to the whole pool, a
request alone decodes exactly as with a pool per slot, and requests that together outgrow the pool all finish whole
(idle prefix caches evicted, the newest sequences paused and recomputed).

Under concurrency a shared pool changes the numbers (llama.cpp attends over the cells of every sequence, masked, so
a sequence's sums depend on where its neighbours' cells lie: 8 concurrent greedy stories all diverged from the same
stories alone, with no pause at all), so concurrent replies are checked whole here, not token for token; the fake
backend's tests (test_kv_pool.py) check that a pause changes no output.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import llama_cpp as lc
import pytest

from lmserve.engine.llamacpp.backend import LlamaCppBackend
from lmserve.engine.llamacpp.options import LlamaCppLaunch
from lmserve.engine.slots.backend import BatchEntry, PoolFull
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.types import Chunk, LoadOptions, SamplingParams
from tests.tiny_lfm2 import write_tiny_lfm2

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOPICS = ["a dragon", "a robot", "the sea", "a lighthouse", "a cat", "the moon", "a forest", "a city"]
PROMPTS = [f"<|im_start|>user\nWrite a long story about {topic}.<|im_end|>\n<|im_start|>assistant\n"
           for topic in TOPICS]


def open_engine(path: Path, *, parallel: int, unified: bool, ctx: int = 1024) -> BatchingEngine:
    options = LoadOptions(num_ctx=ctx, num_parallel=parallel, num_batch=256)
    backend = LlamaCppBackend(path, options, LlamaCppLaunch(kv_unified=unified))
    return BatchingEngine(backend, max_batch_tokens=256)  # as the factory: -b per step


async def reply(engine: BatchingEngine, prompt: str, max_tokens: int) -> tuple[list[int], str, Chunk]:
    sampling = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    stream = engine.submit(engine.tokenize(prompt), sampling)
    chunks = [chunk async for chunk in stream]
    return list(stream.output_tokens), "".join(chunk.text for chunk in chunks), chunks[-1]


async def test_the_pool_is_the_context_and_each_sequence_may_fill_it(model_path: Path) -> None:
    engine = open_engine(model_path, parallel=8, unified=True, ctx=256)
    try:
        assert engine.info.num_ctx == 256  # not 256 / 8: one sequence may use the whole pool
        prompt = engine.tokenize(PROMPTS[0])
        stream = engine.submit(prompt, SamplingParams(temperature=0, ignore_eos=True))
        last = [chunk async for chunk in stream][-1]
        assert last.finish_reason == "length" and len(prompt) + len(stream.output_tokens) == 256
    finally:
        engine.close()


async def test_a_batch_the_pool_cannot_take_changes_nothing_and_fits_once_room_is_made(model_path: Path) -> None:
    backend = LlamaCppBackend(model_path, LoadOptions(num_ctx=256, num_parallel=2, num_batch=256),
                              LlamaCppLaunch(kv_unified=True))
    memory = lc.llama_get_memory(backend._ctx)
    try:
        tokens = backend.tokenize("once upon a time " * 80, add_special=False, parse_special=False)
        for slot in (0, 1):
            backend.start(slot, SamplingParams(temperature=0), tokens, 0)
        backend.step([BatchEntry(0, tokens[:200], 0, True)])
        with pytest.raises(PoolFull):  # 200 + 100 cells of a pool of 256: llama_decode returns 1
            backend.step([BatchEntry(0, [tokens[200]], 200, True), BatchEntry(1, tokens[:100], 0, True)])
        assert lc.llama_memory_seq_pos_max(memory, 0) == 199  # nothing of the failed batch was placed
        assert lc.llama_memory_seq_pos_max(memory, 1) == -1
        backend.clear(0)
        assert backend.step([BatchEntry(1, tokens[:100], 0, True)])[0] is not None
        assert lc.llama_memory_seq_pos_max(memory, 1) == 99
    finally:
        backend.close()


async def test_a_request_alone_decodes_exactly_as_with_a_pool_per_slot(model_path: Path) -> None:
    separate = open_engine(model_path, parallel=1, unified=False)
    shared = open_engine(model_path, parallel=8, unified=True)
    try:
        for prompt in PROMPTS[:2]:
            expected, _, _ = await reply(separate, prompt, 64)
            got, _, _ = await reply(shared, prompt, 64)
            assert got == expected
    finally:
        separate.close()
        shared.close()


async def test_requests_outgrowing_the_pool_all_finish_whole(model_path: Path) -> None:
    engine = open_engine(model_path, parallel=8, unified=True)
    try:
        replies = await asyncio.gather(*(reply(engine, prompt, 150) for prompt in PROMPTS))
        assert engine.num_parked >= 1  # 8 times up to 17 + 150 tokens do not fit in 1024
        for tokens, text, last in replies:
            assert last.finish_reason in ("length", "stop") and last.error is None
            assert last.usage is not None and last.usage.completion_tokens == len(tokens) > 40
            assert text == engine.detokenize(tokens)  # nothing lost or repeated across a pause
        assert engine.num_running == 0 and not engine.scheduler.waiting
        tokens, _, last = await reply(engine, PROMPTS[0], 16)  # the engine goes on
        assert len(tokens) == 16 and last.finish_reason == "length"
    finally:
        engine.close()


async def test_a_hybrid_models_sequences_outgrowing_the_pool_all_finish(tmp_path: Path) -> None:
    path = write_tiny_lfm2(tmp_path / "tiny-lfm2.gguf")  # conv state per slot, attention cells in the shared pool
    engine = open_engine(path, parallel=6, unified=True, ctx=256)
    try:
        prompts = [f"{word} " * (3 + i) for i, word in enumerate(["abc", "hello", "sea", "light", "cat", "moon"])]
        replies = await asyncio.gather(*(reply(engine, prompt, 150) for prompt in prompts))
        assert engine.num_parked >= 1
        for tokens, text, last in replies:
            assert last.finish_reason == "length" and len(tokens) == 150 and text == engine.detokenize(tokens)
    finally:
        engine.close()


@pytest.mark.parametrize("unified", [False, True])
@pytest.mark.parametrize("hybrid", [False, True])
async def test_kv_usage_is_the_cells_llama_cpp_holds_over_the_contexts_cells(
    model_path: Path, tmp_path: Path, unified: bool, hybrid: bool
) -> None:
    """vllm:kv_cache_usage_perc on llama.cpp: the slots' tokens (a finished reply's stay, its slot's prefix cache)
    over the context's cells, num_ctx per slot or one pool of num_ctx; a hybrid model counts its attention cells."""
    path = write_tiny_lfm2(tmp_path / "tiny-lfm2.gguf") if hybrid else model_path
    engine = open_engine(path, parallel=2, unified=unified, ctx=256)
    try:
        cells = 256 if unified else 2 * 256
        assert (engine.stats.kv_block_size, engine.stats.kv_num_blocks, engine.stats.kv_cache_usage) == (1, cells, 0)
        prompt = engine.tokenize(PROMPTS[0])
        await reply(engine, PROMPTS[0], 16)
        backend = engine.backend
        assert isinstance(backend, LlamaCppBackend)
        held_by_llama_cpp = sum(lc.llama_memory_seq_pos_max(backend._memory, slot) + 1 for slot in range(2))
        assert held_by_llama_cpp == len(prompt) + 16 - 1  # the last sampled token is never decoded
        assert engine.stats.kv_cache_usage == pytest.approx(held_by_llama_cpp / cells)
    finally:
        engine.close()
