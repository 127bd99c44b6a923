"""The vLLM engine on a hybrid model (LFM2: short-convolution layers beside attention), in process.

What the issue asks of hybrid models on vLLM: usage with cached prompt tokens (vLLM prefix caching: for a hybrid
model vLLM keeps the convolution state at block boundaries, `mamba_cache_mode="align"`, its default when prefix
caching is on), a convolution state whose dtype follows `--dtype` (float16 included) without the user's help, and
temperature 0 identical alone and beside 7 other requests.

The model is `tests.hf_repos.tiny_lfm2_repo()` (conv, conv, attention, conv; two attention heads of 32), with
weights loud enough that greedy output depends on the prompt. Batch invariance on it needs lmserve's CPU fix: vLLM's
CPU rotary kernel misreads LFM2's (tokens, heads, head_dim) query and key (engine_args turns the kernel off).

One float32 engine serves the module; the dtype tests start one engine each (a start costs ~20 s on 2 cores).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from lmserve.engine.vllm.args import VllmOptions
from lmserve.engine.vllm.engine import VllmEngine
from lmserve.types import Chunk, SamplingParams
from tests.hf_repos import tiny_lfm2_repo

pytestmark = pytest.mark.asyncio(loop_scope="module")  # vLLM's output handler lives on the loop that first used it

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPT = "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
LONG_PROMPT = "".join(f"Fact {i}: river {i} flows {i * 7 % 13} miles to sea {i * 3 % 11}. " for i in range(40)) + PROMPT
"""About 800 tokens, none of them a repetition of the last block (the reply must depend on the cached state)."""


@pytest.fixture(scope="module")
def repo() -> Path:
    return tiny_lfm2_repo()


def open_engine(repo: Path, dtype: str) -> VllmEngine:
    return VllmEngine(repo, VllmOptions(num_ctx=2048, num_parallel=8, dtype=dtype))


async def close(engine: VllmEngine) -> None:
    engine.close()
    await asyncio.sleep(0.2)  # the shutdown thread and the client's cancelled tasks finish


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(repo: Path) -> AsyncIterator[VllmEngine]:
    """One float32 engine for the module."""
    opened = open_engine(repo, "float32")
    yield opened
    await close(opened)


async def collect(engine: VllmEngine, prompt: list[int], sampling: SamplingParams = GREEDY) -> list[Chunk]:
    return [chunk async for chunk in engine.submit(prompt, sampling)]


def text(chunks: list[Chunk]) -> str:
    return "".join(c.text for c in chunks)


def cached(chunks: list[Chunk]) -> int:
    usage = chunks[-1].usage
    assert usage is not None, chunks[-1]
    return usage.cached_tokens


# ---- loading, per dtype ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "weights", "conv_state"), [
    ("auto", "torch.bfloat16", "auto"),  # the repository's dtype; vLLM keeps the conv state in it
    ("float16", "torch.float16", "float16"),  # --dtype float16: the conv state is float16 too, set by engine_args
])
async def test_the_hybrid_model_loads_and_reuses_a_cached_prompt_in_each_dtype(
    repo: Path, dtype: str, weights: str, conv_state: str,
) -> None:
    opened = open_engine(repo, dtype)
    try:
        vllm_config = opened.llm.vllm_config
        assert str(vllm_config.model_config.dtype) == weights
        assert vllm_config.cache_config.mamba_cache_dtype == conv_state
        assert vllm_config.cache_config.mamba_cache_mode == "align"  # hybrid prefix caching is on
        reply = await collect(opened, opened.tokenize(PROMPT))
        assert text(reply).strip() and reply[-1].finish_reason == "length"
        prompt = opened.tokenize(LONG_PROMPT)
        first, second = await collect(opened, prompt), await collect(opened, prompt)
        assert cached(first) == 0 < cached(second)
        assert text(second) == text(first)
    finally:
        await close(opened)


# ---- prefix caching (float32) ----------------------------------------------------------------------------------


async def test_a_repeated_long_prompt_reuses_its_cached_prefix_and_says_so(engine: VllmEngine) -> None:
    prompt = engine.tokenize(LONG_PROMPT.replace("Fact", "Note"))
    assert len(prompt) >= 600
    first = await collect(engine, prompt)
    second = await collect(engine, prompt)
    assert cached(first) == 0
    assert len(prompt) // 2 <= cached(second) < len(prompt)  # whole blocks only; the last one is computed again
    assert text(second) == text(first) and len(text(first)) > 16  # the same greedy reply from the cached state


async def test_a_chats_next_turn_reuses_the_previous_prompt(engine: VllmEngine) -> None:
    turn = LONG_PROMPT.replace("Fact", "Item")
    first = await collect(engine, engine.tokenize(turn))
    follow_up = engine.tokenize(turn + text(first) + "<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n"
                                "<|im_start|>assistant\n")
    assert cached(await collect(engine, follow_up)) >= len(engine.tokenize(turn)) // 2


async def test_the_reply_depends_on_the_prompt(engine: VllmEngine) -> None:
    replies = {text(await collect(engine, engine.tokenize(f"<|im_start|>user\n{word}<|im_end|>\n")))
               for word in ("rivers", "mountains", "the sea")}
    assert len(replies) == 3, replies  # otherwise the identity checks here prove nothing


# ---- batching (float32) ----------------------------------------------------------------------------------------


async def test_temperature_zero_alone_equals_beside_seven_others(engine: VllmEngine) -> None:
    prompts = [engine.tokenize(f"<|im_start|>user\nTell me about the number {i}.<|im_end|>\n<|im_start|>assistant\n")
               for i in range(8)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [text(await collect(engine, p, greedy)) for p in prompts]
    together = await asyncio.gather(*(collect(engine, p, greedy) for p in prompts))
    assert [text(chunks) for chunks in together] == alone
    assert len(set(alone)) > 1
