"""The engine seam over a real vLLM engine (the option mapping: test_vllm_options.py).

The real engine serves the embedded SmolLM2 converted to a safetensors repository (tests/hf_repos.py); one engine
is started for the run and shared with tests/engine/test_vllm_scores.py (tests/conftest.py `vllm_engine`: a start
costs ~25 s on 2 cores).
"""

from __future__ import annotations

import asyncio

import pytest

from lmserve.engine.vllm.engine import VllmEngine
from lmserve.errors import ContextOverflow, InvalidRequest, Overloaded
from lmserve.types import Chunk, SamplingParams
from tests.conftest import VLLM_ENGINE_QUEUE

pytestmark = pytest.mark.asyncio(loop_scope="session")  # vLLM's output handler lives on the loop that first used it

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"

# ---- a real vLLM engine -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(vllm_engine: VllmEngine) -> VllmEngine:
    """The run's shared engine (8 sequences, VLLM_ENGINE_QUEUE waiting; its requests all run on the session's
    event loop)."""
    return vllm_engine


async def collect(engine: VllmEngine, prompt: list[int], sampling: SamplingParams) -> list[Chunk]:
    return [chunk async for chunk in engine.submit(prompt, sampling)]


def text(chunks: list[Chunk]) -> str:
    return "".join(c.text for c in chunks)


async def test_the_model_answers_and_the_last_chunk_has_usage_and_timings(engine: VllmEngine) -> None:
    assert (engine.info.engine, engine.info.num_ctx, engine.info.num_parallel) == ("vllm", 1024, 8)
    assert "im_start" in (engine.info.chat_template or "")
    prompt = engine.tokenize(PROMPT)
    chunks = await collect(engine, prompt, SamplingParams(temperature=0, max_tokens=20))
    assert text(chunks) == "The capital of France is Paris."
    last = chunks[-1]
    assert last.finish_reason == "stop" and last.usage is not None and last.timings is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), 8)
    assert engine.detokenize(engine.tokenize("Paris is nice")) == "Paris is nice"


async def test_a_stop_string_ends_the_reply_and_never_leaks(engine: VllmEngine) -> None:
    chunks = await collect(engine, engine.tokenize(PROMPT), SamplingParams(temperature=0, stop=["Paris"]))
    assert text(chunks) == "The capital of France is " and chunks[-1].finish_reason == "stop", chunks


async def test_max_tokens_ends_with_length(engine: VllmEngine) -> None:
    chunks = await collect(engine, engine.tokenize(PROMPT), SamplingParams(temperature=0, max_tokens=3))
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage and chunks[-1].usage.completion_tokens == 3


async def test_a_grammar_constrains_the_output(engine: VllmEngine) -> None:
    grammar = 'root ::= "{\\"answer\\": \\"" [A-Za-z]+ "\\"}"'
    chunks = await collect(engine, engine.tokenize(PROMPT), SamplingParams(temperature=0, grammar=grammar))
    assert text(chunks).startswith('{"answer": "') and text(chunks).endswith('"}')


async def test_a_repeated_long_prompt_reuses_its_cached_prefix(engine: VllmEngine) -> None:
    prompt = engine.tokenize("Facts about rivers. " * 60 + PROMPT)
    first = await collect(engine, prompt, SamplingParams(temperature=0, max_tokens=2))
    second = await collect(engine, prompt, SamplingParams(temperature=0, max_tokens=2))
    assert first[-1].usage and second[-1].usage
    assert first[-1].usage.cached_tokens < second[-1].usage.cached_tokens <= len(prompt)
    assert second[-1].usage.cached_tokens >= len(prompt) // 2
    stats = engine.stats  # vLLM's own scheduler stats, for /metrics
    assert stats.prefix_cache_hits >= second[-1].usage.cached_tokens
    assert stats.prefix_cache_queries >= 2 * len(prompt) - 2 and stats.kv_cache_usage is not None


async def test_temperature_zero_alone_equals_beside_seven_others(engine: VllmEngine) -> None:
    prompts = [engine.tokenize(f"<|im_start|>user\nTell me about the number {i}.<|im_end|>\n<|im_start|>assistant\n")
               for i in range(8)]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    alone = [text(await collect(engine, p, greedy)) for p in prompts]
    together = await asyncio.gather(*(collect(engine, p, greedy) for p in prompts))
    assert [text(chunks) for chunks in together] == alone


async def test_an_aborted_request_frees_its_place(engine: VllmEngine) -> None:
    stream = engine.submit(engine.tokenize(PROMPT), SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
    async for _ in stream:
        break
    stream.abort()
    assert engine.num_running == 0
    await asyncio.sleep(0.2)
    assert text(await collect(engine, engine.tokenize(PROMPT), SamplingParams(temperature=0, max_tokens=20)))


async def test_fail_all_ends_streams_in_flight_with_the_reason(engine: VllmEngine) -> None:
    stream = engine.submit(engine.tokenize(PROMPT), SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
    asyncio.get_running_loop().call_later(0.3, engine.fail_all, "the server is shutting down")
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].finish_reason == "error" and chunks[-1].error == "the server is shutting down"


async def test_the_queue_is_bounded(engine: VllmEngine) -> None:
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    streams = []
    try:
        for _ in range(8 + VLLM_ENGINE_QUEUE):  # running, then waiting
            streams.append(engine.submit(engine.tokenize(PROMPT), long))
        with pytest.raises(Overloaded):
            engine.submit(engine.tokenize(PROMPT), long)
    finally:  # the engine is the run's: leave it as found
        for stream in streams:
            stream.abort()
    assert engine.num_running == engine.num_waiting == 0


@pytest.mark.parametrize(("prompt", "sampling", "error"), [
    ([], SamplingParams(), InvalidRequest),
    ([1] * 1024, SamplingParams(), ContextOverflow),
    ([10**9], SamplingParams(), InvalidRequest),
    ([1, 2], SamplingParams(logit_bias={10**9: 1.0}), InvalidRequest),
    ([1, 2], SamplingParams(grammar="root ::= ("), InvalidRequest),
])
async def test_bad_requests_are_refused_before_they_reach_vllm(
    engine: VllmEngine, prompt: list[int], sampling: SamplingParams, error: type[Exception],
) -> None:
    with pytest.raises(error):
        engine.submit(prompt, sampling)


async def test_embeddings_are_a_clear_400(engine: VllmEngine) -> None:
    assert not engine.info.can_embed
    with pytest.raises(InvalidRequest, match="embeddings"):
        engine.embedding_tokens("hello")
