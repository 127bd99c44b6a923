"""Prefix reuse with real models: shared prompts are computed once and copied, hybrid chats restore snapshots,
and every reuse answers exactly as computing from scratch does."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from lmserve.engine.llamacpp.backend import LlamaCppBackend
from lmserve.engine.llamacpp.options import LlamaCppLaunch
from lmserve.engine.slots.backend import BatchEntry
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.prompt_cache import PromptCache
from lmserve.engine.slots.scheduler import common_prefix_length
from lmserve.types import Chunk, LoadOptions, SamplingParams
from tests.tiny_gguf import write_tiny_llama
from tests.tiny_lfm2 import write_tiny_lfm2

pytestmark = pytest.mark.asyncio(loop_scope="module")

SYSTEM = "You are a careful assistant. " + " ".join(f"Rule {i}: answer briefly and politely." for i in range(40))


def chatml(user: str) -> str:
    return f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


async def run(engine: BatchingEngine, prompt: str, max_tokens: int = 12) -> tuple[str, Chunk]:
    stream = engine.submit(engine.tokenize(prompt), SamplingParams(temperature=0, max_tokens=max_tokens))
    chunks = [c async for c in stream]
    return "".join(c.text for c in chunks), chunks[-1]


def cached(final: Chunk) -> int:
    assert final.usage is not None
    return final.usage.cached_tokens


async def shared_and_alone(path: Path, prompts: list[str]) -> tuple[list[tuple[str, Chunk]], list[str], int]:
    """Answers with four slots sharing (prompts arriving together), each prompt alone in a fresh slot, and the
    number of tokens the prompts share."""
    alone = BatchingEngine(LlamaCppBackend(path, LoadOptions(num_ctx=1024, num_parallel=1, num_batch=512)),
                   max_prefill_tokens=128)
    try:
        expected = []
        for prompt in prompts:
            expected.append((await run(alone, prompt))[0])
            alone.scheduler.forget(0)  # no reuse between them
            alone.backend.start(0, SamplingParams(), [], 0)
    finally:
        alone.close()
    shared = BatchingEngine(LlamaCppBackend(path, LoadOptions(num_ctx=1024, num_parallel=4, num_batch=512)),
                    max_prefill_tokens=128)
    try:
        results = await asyncio.gather(*(run(shared, prompt) for prompt in prompts))
        tokenized = [shared.tokenize(prompt) for prompt in prompts]
        num_shared = min(common_prefix_length(tokenized[0], tokens) for tokens in tokenized[1:])
    finally:
        shared.close()
    return list(results), expected, num_shared


async def test_users_sharing_a_system_prompt_compute_it_once(model_path: Path) -> None:
    questions = ["What is 2+2?", "Name a color.", "Say hello.", "What is the sun?"]
    results, expected, num_shared = await shared_and_alone(model_path, [chatml(q) for q in questions])
    assert num_shared > 300
    # The leader computed the shared prefix; the others copied it (and any more they share with the leader).
    copied = sorted(cached(final) for _, final in results)
    assert copied[0] == 0 and all(n >= num_shared for n in copied[1:])
    # Quantized kernels round differently for other batch shapes, so a long greedy answer may drift; the start agrees.
    assert [text.split()[:2] for text, _ in results] == [text.split()[:2] for text in expected]


async def test_a_copied_prefix_answers_exactly_as_computing_it(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "tiny-llama.gguf")  # F32: no quantization rounding
    prompts = [SYSTEM[:180] + f" question {i}: what next?" for i in range(4)]  # bytes: its context is 256
    results, expected, num_shared = await shared_and_alone(path, prompts)
    assert sorted(cached(final) for _, final in results) == [0] + [num_shared] * 3
    assert [text for text, _ in results] == expected


async def test_a_hybrid_chat_turn_restores_its_snapshot_after_another_request_took_the_slot(tmp_path: Path) -> None:
    path = write_tiny_lfm2(tmp_path / "tiny-lfm2.gguf")
    turn1 = "<|startoftext|>" + chatml("hello there")

    async def conversation(engine: BatchingEngine) -> tuple[str, Chunk]:
        answer, _ = await run(engine, turn1)
        await run(engine, "<|startoftext|><|im_start|>user\nsomething else entirely<|im_end|>\n")  # takes the slot
        return await run(engine, turn1 + answer + "<|im_end|>\n<|im_start|>user\nand then?<|im_end|>\n"
                         "<|im_start|>assistant\n")

    options = LoadOptions(num_ctx=2048, num_parallel=1, num_batch=512)
    with_snapshots = BatchingEngine(LlamaCppBackend(path, options))
    without = BatchingEngine(LlamaCppBackend(path, options), prompt_cache=PromptCache(0))
    try:
        assert not with_snapshots.info.can_cut_memory
        reused_text, reused = await conversation(with_snapshots)
        fresh_text, fresh = await conversation(without)
        num_turn1 = len(with_snapshots.tokenize(turn1))
    finally:
        with_snapshots.close()
        without.close()
    assert cached(reused) >= num_turn1  # the prompt-end snapshot, or the state saved when the slot was taken
    assert cached(fresh) == 0
    assert reused_text == fresh_text


async def test_hybrid_users_sharing_a_system_prompt_restore_its_checkpoint(tmp_path: Path) -> None:
    """A hybrid model cannot copy a cut prefix: the leader's prefill pauses at the system prompt's end, the slot's
    state is snapshotted there, and the followers (and later users) restore it; answers equal computing alone."""
    path = write_tiny_lfm2(tmp_path / "tiny-lfm2.gguf")
    system = "<|startoftext|><|im_start|>system\n" + SYSTEM[:600] + "<|im_end|>\n"
    prompts = [system + f"<|im_start|>user\nquestion {i}<|im_end|>\n<|im_start|>assistant\n" for i in range(4)]
    options = LoadOptions(num_ctx=2048, num_parallel=4, num_batch=512)

    async def answers(engine: BatchingEngine, together: bool) -> list[tuple[str, Chunk]]:
        checkpoint = len(engine.tokenize(system))

        async def one(prompt: str) -> tuple[str, Chunk]:
            stream = engine.submit(engine.tokenize(prompt), SamplingParams(temperature=0, max_tokens=10),
                                   checkpoints=[checkpoint])
            chunks = [c async for c in stream]
            return "".join(c.text for c in chunks), chunks[-1]

        if together:
            return list(await asyncio.gather(*(one(p) for p in prompts)))
        return [await one(p) for p in prompts]

    shared = BatchingEngine(LlamaCppBackend(path, options))
    alone = BatchingEngine(LlamaCppBackend(path, options), prompt_cache=PromptCache(0))
    try:
        num_system = len(shared.tokenize(system))
        together = await answers(shared, together=True)
        later, final = await run(shared, prompts[0].replace("question 0", "another question"), max_tokens=10)
        expected = await answers(alone, together=False)
        expected_later, _ = await run(alone, prompts[0].replace("question 0", "another question"), max_tokens=10)
    finally:
        shared.close()
        alone.close()
    assert sorted(cached(f) for _, f in together) == [0] + [num_system] * 3
    assert cached(final) >= num_system  # a later user starts from the snapshot too
    assert [text for text, _ in together] == [text for text, _ in expected]
    assert later == expected_later


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
async def test_a_conversation_whose_slot_was_taken_restores_its_saved_state(
    tmp_path: Path, kv_type: str, request: pytest.FixtureRequest
) -> None:
    """One slot, two conversations taking turns: the slot's state is saved before the other takes it, and the
    returning turn restores it (quantized KV cells too) and answers as computing it all again does."""
    exact = kv_type == "f16"  # F32 tiny llama: bit-exact; SmolLM2 Q4_1 (head size 64 for q8_0 KV): rounding
    path = write_tiny_llama(tmp_path / "tiny-llama.gguf") if exact else request.getfixturevalue("model_path")
    options = LoadOptions(num_ctx=256, num_parallel=1, num_batch=256)
    launch = LlamaCppLaunch(cache_type_k=kv_type, cache_type_v=kv_type, flash_attn="on")
    turn1 = SYSTEM[:120] + " first question?"

    async def conversation(engine: BatchingEngine) -> tuple[str, Chunk]:
        answer, _ = await run(engine, turn1)
        await run(engine, "Another user asks about something else entirely, at length.")  # takes the slot
        return await run(engine, turn1 + answer + " and then?")

    cached_engine = BatchingEngine(LlamaCppBackend(path, options, launch), prompt_cache=PromptCache(2**26))
    fresh_engine = BatchingEngine(LlamaCppBackend(path, options, launch), prompt_cache=PromptCache(0))
    try:
        reused_text, reused = await conversation(cached_engine)
        fresh_text, fresh = await conversation(fresh_engine)
        num_turn1 = len(cached_engine.tokenize(turn1))
        stats = cached_engine.stats
    finally:
        cached_engine.close()
        fresh_engine.close()
    assert cached(reused) >= num_turn1 and cached(fresh) < 16
    assert stats.cache_hits["ram"] == 1 and stats.cache_tokens["ram"] == cached(reused)
    if exact:
        assert reused_text == fresh_text
    else:
        assert reused_text.split()[:2] == fresh_text.split()[:2]


async def test_no_state_is_saved_from_or_restored_into_a_slot_a_pending_copy_touches(tmp_path: Path) -> None:
    """llama.cpp copies KV streams at the next decode: until then the copy's target holds no saved-worthy state,
    and a state restored into its source (or target) would be overwritten or copied in its place."""
    backend = LlamaCppBackend(write_tiny_llama(tmp_path / "tiny-llama.gguf"),
                              LoadOptions(num_ctx=256, num_parallel=3, num_batch=256))
    try:
        tokens = list(range(10, 60))
        for slot in (0, 2):
            backend.start(slot, SamplingParams(temperature=0), tokens, 0)
        backend.step([BatchEntry(0, tokens, 0, True)])
        state = backend.save_state(0)
        assert state is not None
        assert backend.copy_prefix(0, 1, 40)
        assert backend.save_state(1) is None
        assert not backend.restore_state(0, state, 50)
        backend.step([BatchEntry(2, tokens[:5], 0, True)])  # any decode makes the copy
        assert backend.save_state(1) is not None
        assert backend.restore_state(0, state, 50)
    finally:
        backend.close()
