"""Speculative decoding (prompt lookup) on real llama.cpp: the output is the output of plain decoding, token for
token, greedy or seeded, alone or beside others; drafts the model agrees with save steps.

A sampled token is drawn from the model's distribution after the tokens accepted so far, exactly as without a
draft, and the sampler's random draws come one per emitted token in both cases: so a seeded reply is the same
reply, which shows the distribution is kept (the engine never accepts a token it did not sample).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmserve.engine.llamacpp.backend import LlamaCppBackend
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.types import Chunk, LoadOptions, SamplingParams
from tests.tiny_gguf import write_tiny_llama
from tests.tiny_lfm2 import write_tiny_lfm2

pytestmark = pytest.mark.asyncio(loop_scope="module")

DOCUMENT = ("The lighthouse on Skerry Point was built in 1872 from granite quarried on the island. Its lamp burned "
            "paraffin until 1936, when it was electrified, and the last keeper, Ann Morrow, left in 1989 when the "
            "light was automated.")
REWRITE = f"<|im_start|>user\nCopy this text exactly:\n{DOCUMENT}<|im_end|>\n<|im_start|>assistant\n"
STORY = "<|im_start|>user\nWrite a story about a dragon.<|im_end|>\n<|im_start|>assistant\n"


def open_engine(path: Path, draft_max: int, parallel: int = 1) -> BatchingEngine:
    options = LoadOptions(num_ctx=1024, num_parallel=parallel, num_batch=256)
    return BatchingEngine(LlamaCppBackend(path, options), draft_max=draft_max)


@pytest.fixture
def plain(model_path: Path) -> Iterator[BatchingEngine]:
    """A fresh engine per test, as `drafting`: both start with empty slots, so a prompt is computed alike in both
    (a prompt reusing a cached prefix can differ in its last bits from one computed whole)."""
    engine = open_engine(model_path, 0)
    yield engine
    engine.close()


@pytest.fixture
def drafting(model_path: Path) -> Iterator[BatchingEngine]:
    engine = open_engine(model_path, 8)
    yield engine
    engine.close()


async def reply(engine: BatchingEngine, prompt: str, **sampling: object) -> tuple[list[int], Chunk]:
    stream = engine.submit(engine.tokenize(prompt), SamplingParams(**sampling))  # type: ignore[arg-type]
    chunks = [chunk async for chunk in stream]
    return list(stream.output_tokens), chunks[-1]


async def test_greedy_output_is_unchanged_and_drafts_save_steps(plain: BatchingEngine,
                                                                drafting: BatchingEngine) -> None:
    expected, _ = await reply(plain, REWRITE, temperature=0, max_tokens=96)
    got, copied = await reply(drafting, REWRITE, temperature=0, max_tokens=96)
    assert got == expected
    assert copied.usage is not None and copied.usage.draft_accepted_tokens > 30  # copying a text drafts well
    expected, _ = await reply(plain, STORY, temperature=0, max_tokens=96)
    got, _ = await reply(drafting, STORY, temperature=0, max_tokens=96)
    assert got == expected


async def test_concurrent_drafting_requests_each_match_plain_decoding(model_path: Path) -> None:
    # Two fresh engines of 4 slots, the same requests at once: the same slots, the same prefix sharing (a prompt
    # sharing a cached prefix can differ in its last bits from one computed whole), so only the drafts differ.
    prompts = [REWRITE, STORY, REWRITE.replace("1872", "1875"), STORY.replace("dragon", "robot")]
    outputs = []
    for draft_max in (0, 8):
        engine = open_engine(model_path, draft_max, parallel=4)
        try:
            replies = await asyncio.gather(*(reply(engine, prompt, temperature=0, max_tokens=64) for prompt in prompts))
        finally:
            engine.close()
        outputs.append([tokens for tokens, _ in replies])
        drafted = sum(last.usage.draft_accepted_tokens for _, last in replies if last.usage is not None)
        assert (drafted > 0) == (draft_max > 0)
    assert outputs[1] == outputs[0]


async def test_a_seeded_sampled_reply_is_the_same_reply(plain: BatchingEngine, drafting: BatchingEngine) -> None:
    drafted = 0
    for seed in (1, 2, 3):  # which seeds' samples copy the document (and so draft) depends on the CPU's kernels
        sampling = {"temperature": 0.9, "top_k": 40, "repeat_penalty": 1.1, "seed": seed, "max_tokens": 48}
        expected, _ = await reply(plain, REWRITE, **sampling)
        got, last = await reply(drafting, REWRITE, **sampling)
        assert got == expected, seed
        assert last.usage is not None
        drafted += last.usage.draft_tokens
    assert drafted > 0


async def test_structured_output_drafts_and_logprobs_do_not(plain: BatchingEngine, drafting: BatchingEngine) -> None:
    grammar = 'root ::= "{\\"copy\\": \\"" [^"]* "\\"}"'
    expected, _ = await reply(plain, REWRITE, temperature=0, max_tokens=80, grammar=grammar)
    got, last = await reply(drafting, REWRITE, temperature=0, max_tokens=80, grammar=grammar)
    assert got == expected and last.usage is not None and last.usage.draft_tokens > 0
    _, with_logprobs = await reply(drafting, REWRITE, temperature=0, max_tokens=16, logprobs=1)
    assert with_logprobs.usage is not None and with_logprobs.usage.draft_tokens == 0


async def test_a_tiny_random_model_decodes_the_same_with_drafts(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "tiny.gguf")  # F32: exact numbers; random weights loop, so drafts hit
    plain_engine, drafting_engine = open_engine(path, 0), open_engine(path, 16)
    try:
        prompt = "abcabcabc"
        for seed in (None, 7, 8):
            sampling = {"temperature": 0 if seed is None else 1.0, "seed": seed, "max_tokens": 120}
            expected, _ = await reply(plain_engine, prompt, **sampling)
            got, last = await reply(drafting_engine, prompt, **sampling)
            assert got == expected
            assert last.usage is not None and (last.usage.draft_accepted_tokens > 0 or seed is not None)
    finally:
        plain_engine.close()
        drafting_engine.close()


async def test_a_hybrid_lfm2_drafts_and_rewinds_to_the_same_output(tmp_path: Path) -> None:
    """LFM2's convolution state cannot be cut: a rejected draft rewinds it (engine/llamacpp/recurrent_state.py) and the
    accepted tokens are decoded again; alone and two at once, greedy and seeded, the output is plain decoding's."""
    path = write_tiny_lfm2(tmp_path / "lfm2.gguf")
    plain_engine, drafting_engine = open_engine(path, 0, parallel=2), open_engine(path, 8, parallel=2)
    try:
        prompts = ["abcabcabc", "hello hello hello"]
        drafted = accepted = 0
        for seed in (None, 7):
            sampling = {"temperature": 0 if seed is None else 1.0, "seed": seed, "max_tokens": 100}
            expected = [(await reply(plain_engine, prompt, **sampling))[0] for prompt in prompts]
            got = await asyncio.gather(*(reply(drafting_engine, prompt, **sampling) for prompt in prompts))
            assert [tokens for tokens, _ in got] == expected
            for _, last in got:
                assert last.usage is not None
                drafted += last.usage.draft_tokens
                accepted += last.usage.draft_accepted_tokens
        assert drafted > accepted > 0  # drafts both taken and rejected (rewound)
    finally:
        plain_engine.close()
        drafting_engine.close()
