"""Scoring named tokens on the vLLM engine (`SamplingParams.score_tokens`, vLLM's `logprob_token_ids`).

A real engine serves the embedded SmolLM2 as a float32 safetensors repository (tests/hf_repos.py): the scores are
log-probabilities of the raw next-token distribution (they sum to 1 over the whole vocabulary), the greedy token's
is the largest, and a prompt's scores do not depend on what shares its steps. vLLM 0.32's sampler gives every
request of a step the named tokens' gather once one asks for it (engine/vllm/gate.py): a top-logprobs request
beside scoring ones keeps its alternatives only because the engine keeps the two kinds apart.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterable

import pytest

from lmserve.engine.vllm.engine import VllmEngine
from lmserve.engine.vllm.gate import SCORES, TOP_LOGPROBS, KindGate
from lmserve.engine.vllm.sampling import check_scoring
from lmserve.errors import InvalidRequest
from lmserve.types import MAX_SCORE_TOKENS, Chunk, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="session")  # vLLM's output handler lives on the loop that first used it

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
WORDS = ["Paris", " Paris", "Berlin", "Tokyo", "I", "L"]
CONCURRENT_TOLERANCE = 1e-4
"""How far a score may move when other requests share its steps (float32; the batch changes the kernels' sums)."""


@pytest.fixture(scope="module")
def engine(vllm_engine: VllmEngine) -> VllmEngine:
    """The run's shared engine (tests/conftest.py), with room for 8 sequences at once and 64 waiting."""
    return vllm_engine


def scoring(tokens: list[int]) -> SamplingParams:
    """What service/judging.py asks: one greedy token, and the scores of `tokens`."""
    return SamplingParams(temperature=0.0, max_tokens=1, score_tokens=tokens, draft_max=0)


async def final(engine: VllmEngine, prompt: list[int], sampling: SamplingParams) -> Chunk:
    chunks = [chunk async for chunk in engine.submit(prompt, sampling)]
    assert chunks[-1].error is None, chunks[-1].error
    return chunks[-1]


def candidates(engine: VllmEngine) -> list[int]:
    """The first token of each of WORDS."""
    return [engine.tokenize(word, add_special=False)[0] for word in WORDS]


async def settle() -> None:
    """Let every task that can run, run."""
    for _ in range(5):
        await asyncio.sleep(0)


def logsumexp(values: list[float]) -> float:
    top = max(values)
    return top + math.log(math.fsum(math.exp(v - top) for v in values))


# ---- the scores themselves --------------------------------------------------------------------------------------


async def test_scores_are_log_probabilities_and_the_greedy_token_scores_highest(engine: VllmEngine) -> None:
    prompt = engine.tokenize(PROMPT)
    tokens = candidates(engine)
    stream = engine.submit(prompt, scoring(tokens))
    chunks = [chunk async for chunk in stream]
    scores = chunks[-1].scores
    assert chunks[-1].finish_reason is not None and chunks[-1].error is None
    assert len(scores) == len(tokens) and all(math.isfinite(s) and s <= 0.0 for s in scores), scores
    assert logsumexp(scores) <= 1e-6
    greedy = stream.output_tokens[0]

    with_greedy = await final(engine, prompt, scoring([*tokens, greedy]))
    assert with_greedy.scores[-1] == max(with_greedy.scores)
    assert with_greedy.scores[:-1] == pytest.approx(scores, abs=1e-6)
    top = await final(engine, prompt, SamplingParams(temperature=0.0, max_tokens=1, logprobs=1))
    assert top.logprobs[0].token == greedy  # vLLM's top-logprobs path says the same of the greedy token
    assert top.logprobs[0].logprob == pytest.approx(with_greedy.scores[-1], abs=1e-5)


async def test_the_scores_over_the_whole_vocabulary_sum_to_one(engine: VllmEngine) -> None:
    prompt = engine.tokenize(PROMPT)
    vocab = engine.info.num_vocab
    batches = [list(range(start, min(start + MAX_SCORE_TOKENS, vocab))) for start in range(0, vocab, MAX_SCORE_TOKENS)]
    window = asyncio.Semaphore(48)  # within the engine's queue

    async def scored(batch: list[int]) -> Chunk:
        async with window:
            return await final(engine, prompt, scoring(batch))

    finals = await asyncio.gather(*(scored(batch) for batch in batches))
    scores = [score for chunk in finals for score in chunk.scores]
    assert len(scores) == vocab
    assert math.exp(logsumexp(scores)) == pytest.approx(1.0, abs=1e-4)


async def test_repeated_tokens_are_scored_in_order(engine: VllmEngine) -> None:
    tokens = candidates(engine)
    once = await final(engine, engine.tokenize(PROMPT), scoring(tokens))
    twice = await final(engine, engine.tokenize(PROMPT), scoring([tokens[2], tokens[0], tokens[2]]))
    assert twice.scores == pytest.approx([once.scores[2], once.scores[0], once.scores[2]], abs=1e-6)


async def test_a_prompt_scores_the_same_alone_and_beside_twenty_others(engine: VllmEngine) -> None:
    prompt = engine.tokenize(PROMPT)
    tokens = candidates(engine)
    alone = (await final(engine, prompt, scoring(tokens))).scores

    def asked(i: int) -> list[int]:
        return engine.tokenize(f"<|im_start|>user\nTell me about the number {i}.<|im_end|>\n<|im_start|>assistant\n")

    others: list[tuple[list[int], SamplingParams]] = []
    for i in range(20):
        kind = i % 4
        if kind == 0:  # greedy replies
            others.append((asked(i), SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)))
        elif kind == 1:  # sampled replies: the step is not all greedy
            others.append((asked(i), SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=i, max_tokens=24,
                                                    ignore_eos=True)))
        elif kind == 2:  # other scoring requests, other lengths of token lists
            others.append((asked(i), scoring(list(range(100 + i, 100 + i + 1 + 6 * i)))))
        else:  # top-logprobs replies (kept out of the scoring requests' steps)
            others.append((asked(i), SamplingParams(temperature=0.0, max_tokens=8, logprobs=3)))
    calls = [final(engine, p, s) for p, s in others[:10]]
    calls += [final(engine, prompt, scoring(tokens))]
    calls += [final(engine, p, s) for p, s in others[10:]]
    results = await asyncio.gather(*calls)
    assert results[10].scores == pytest.approx(alone, abs=CONCURRENT_TOLERANCE)
    for (_, sampling), chunk in zip(others, results[:10] + results[11:], strict=True):
        assert len(chunk.scores) == len(sampling.score_tokens)


async def test_top_logprobs_beside_scoring_requests_keep_their_alternatives(engine: VllmEngine) -> None:
    reply = engine.tokenize("<|im_start|>user\nWrite a poem about the sea.<|im_end|>\n<|im_start|>assistant\n")
    question = engine.tokenize(PROMPT)
    wanted = SamplingParams(temperature=0.0, max_tokens=24, logprobs=3, ignore_eos=True)

    async def replied() -> list[tuple[int, list[int], list[float]]]:
        chunks = [chunk async for chunk in engine.submit(reply, wanted)]
        return [(t.token, [a.token for a in t.top], [t.logprob, *(a.logprob for a in t.top)])
                for chunk in chunks for t in chunk.logprobs]

    async def scored() -> list[list[float]]:
        return [(await final(engine, question, scoring(candidates(engine)[: 1 + i % 6]))).scores for i in range(12)]

    alone = await replied()
    assert len(alone) == 24 and all(len(top) == 3 for _, top, _ in alone)
    beside, scores = await asyncio.gather(replied(), scored())
    assert [(token, top) for token, top, _ in beside] == [(token, top) for token, top, _ in alone]
    for (_, _, values), (_, _, expected) in zip(beside, alone, strict=True):
        assert values == pytest.approx(expected, abs=CONCURRENT_TOLERANCE)
    assert [len(s) for s in scores] == [1 + i % 6 for i in range(12)]
    assert engine.gate.waiting == 0 and engine.gate.inside(SCORES) == engine.gate.inside(TOP_LOGPROBS) == 0


async def test_a_scoring_request_waiting_for_its_turn_can_be_aborted_or_cancelled(engine: VllmEngine) -> None:
    reply = engine.tokenize("<|im_start|>user\nWrite a poem about the sea.<|im_end|>\n<|im_start|>assistant\n")
    question = engine.tokenize(PROMPT)
    long = engine.submit(reply, SamplingParams(temperature=0.0, max_tokens=300, logprobs=2, ignore_eos=True))
    chunks = aiter(long)
    await anext(chunks)
    assert engine.gate.inside(TOP_LOGPROBS) == 1

    async def collect(sampling: SamplingParams) -> list[Chunk]:
        return [chunk async for chunk in engine.submit(question, sampling)]

    aborted = engine.submit(question, scoring(candidates(engine)))
    waited = asyncio.ensure_future(collect_stream(aborted))
    cancelled = asyncio.ensure_future(collect(scoring(candidates(engine))))
    await asyncio.sleep(0.2)
    assert engine.gate.waiting == 2 and not waited.done() and not cancelled.done()
    cancelled.cancel()
    aborted.abort()
    await asyncio.sleep(0.1)
    assert engine.gate.waiting == 1 and not waited.done()
    long.abort()  # the gate lets the scoring requests in once vLLM has the abort
    await chunks.aclose()
    assert await waited == []  # aborted before it ran: nothing, not even an error
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    await settle()
    assert engine.gate.waiting == engine.gate.inside(SCORES) == engine.gate.inside(TOP_LOGPROBS) == 0
    assert engine.num_running == engine.num_waiting == 0  # the cancelled one holds no place in the queue
    assert len((await final(engine, question, scoring(candidates(engine)))).scores) == len(WORDS)


async def collect_stream(stream: AsyncIterable[Chunk]) -> list[Chunk]:
    return [chunk async for chunk in stream]


# ---- what is refused --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=0.7, max_tokens=1, score_tokens=[1]),
    SamplingParams(temperature=0.0, repeat_penalty=1.1, max_tokens=1, score_tokens=[1]),
    SamplingParams(temperature=0.0, presence_penalty=0.5, max_tokens=1, score_tokens=[1]),
    SamplingParams(temperature=0.0, logit_bias={1: 2.0}, max_tokens=1, score_tokens=[1]),
    SamplingParams(temperature=0.0, grammar='root ::= "a"', max_tokens=1, score_tokens=[1]),
    SamplingParams(temperature=0.0, logprobs=2, max_tokens=1, score_tokens=[1]),
])
async def test_scoring_needs_the_raw_distribution(sampling: SamplingParams) -> None:
    with pytest.raises(InvalidRequest, match="score_tokens"):
        check_scoring(sampling)


async def test_greedy_scoring_without_transforms_is_accepted() -> None:
    check_scoring(SamplingParams(temperature=0.0, repeat_penalty=1.0, max_tokens=1, score_tokens=[1, 2]))


async def test_too_many_or_unknown_score_tokens_are_refused_before_they_reach_vllm(engine: VllmEngine) -> None:
    prompt = engine.tokenize(PROMPT)
    with pytest.raises(InvalidRequest, match="at most"):
        engine.submit(prompt, scoring(list(range(MAX_SCORE_TOKENS + 1))))
    with pytest.raises(InvalidRequest, match="score token ids"):
        engine.submit(prompt, scoring([engine.info.num_vocab]))
    with pytest.raises(InvalidRequest, match="greedy"):
        engine.submit(prompt, SamplingParams(temperature=0.5, max_tokens=1, score_tokens=[1]))
    assert (await final(engine, prompt, scoring(list(range(MAX_SCORE_TOKENS))))).scores


# ---- the gate ---------------------------------------------------------------------------------------------------


async def test_the_gate_lets_one_kind_in_at_a_time_in_order() -> None:
    gate = KindGate()
    await gate.enter(SCORES)
    await gate.enter(SCORES)
    top = asyncio.ensure_future(gate.enter(TOP_LOGPROBS))
    late_score = asyncio.ensure_future(gate.enter(SCORES))  # behind the waiting top-logprobs request
    await settle()
    assert not top.done() and not late_score.done() and gate.waiting == 2
    gate.leave(SCORES)
    await settle()
    assert not top.done()
    gate.leave(SCORES)
    await settle()
    assert top.done() and not late_score.done() and gate.inside(TOP_LOGPROBS) == 1
    gate.leave(TOP_LOGPROBS)
    await settle()
    assert late_score.done() and gate.inside(SCORES) == 1 and gate.waiting == 0


async def test_a_request_cancelled_while_it_waits_leaves_the_queue() -> None:
    gate = KindGate()
    await gate.enter(TOP_LOGPROBS)
    waiting = asyncio.ensure_future(gate.enter(SCORES))
    behind = asyncio.ensure_future(gate.enter(TOP_LOGPROBS))
    await settle()
    assert not behind.done()
    waiting.cancel()
    await settle()
    assert behind.done() and gate.inside(TOP_LOGPROBS) == 2 and gate.inside(SCORES) == 0 and gate.waiting == 0
