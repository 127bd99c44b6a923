"""Log-probabilities on the llama.cpp engine (engine/logprobs.py): the sampling distribution's values, computed from
the slot's own logits, travelling with the text they belong to."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path

import llama_cpp as lc
import numpy as np
import pytest

from lmserve.engine.llamacpp.backend import LlamaCppBackend
from lmserve.engine.logprobs import LogprobAligner, rank_candidates
from lmserve.engine.slots.backend import BatchEntry
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.types import Chunk, LoadOptions, SamplingParams, TokenLogprob

aio = pytest.mark.asyncio(loop_scope="module")


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def engine(model_path: Path) -> Iterator[BatchingEngine]:
    eng = BatchingEngine(LlamaCppBackend(model_path, LoadOptions(num_ctx=512, num_parallel=4, num_batch=256)))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def backend(model_path: Path) -> Iterator[LlamaCppBackend]:
    """A backend driven by hand (no engine thread), to read the logits a step leaves behind."""
    back = LlamaCppBackend(model_path, LoadOptions(num_ctx=256, num_parallel=1, num_batch=128))
    yield back
    back.close()


async def generate(engine: BatchingEngine, prompt: str, **sampling: object) -> list[Chunk]:
    stream = engine.submit(engine.tokenize(prompt), SamplingParams(**sampling))  # type: ignore[arg-type]
    return [chunk async for chunk in stream]


def logprobs_of(chunks: list[Chunk]) -> list[TokenLogprob]:
    return [entry for chunk in chunks for entry in chunk.logprobs]


def reply(chunks: list[Chunk]) -> str:
    return "".join(chunk.text for chunk in chunks)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    values = logits.astype(np.float64)
    peak = values.max()
    return values - peak - math.log(float(np.exp(values - peak).sum()))


# ---- the numbers -------------------------------------------------------------------------------------------------


@aio
async def test_the_greedy_token_is_the_likeliest_and_every_value_is_a_log_probability(engine: BatchingEngine) -> None:
    chunks = await generate(engine, chat("What is the capital of France?"), temperature=0, max_tokens=24, logprobs=5)
    entries = logprobs_of(chunks)
    assert len(entries) == chunks[-1].usage.completion_tokens > 0  # type: ignore[union-attr]
    for entry in entries:
        assert len(entry.top) == 5
        assert entry.top[0].token == entry.token and entry.top[0].logprob == entry.logprob
        values = [alt.logprob for alt in entry.top]
        assert values == sorted(values, reverse=True)
        assert all(v <= 0 for v in values) and entry.logprob <= 0
        assert sum(math.exp(v) for v in values) <= 1 + 1e-6
        assert entry.text == entry.piece.decode("utf-8", "replace")


@aio
async def test_the_tokens_spell_the_reply(engine: BatchingEngine) -> None:
    chunks = await generate(engine, chat("Name three animals."), temperature=0, max_tokens=40, logprobs=0)
    assert "".join(entry.text for entry in logprobs_of(chunks)) == reply(chunks)
    assert all(entry.top == [] for entry in logprobs_of(chunks))
    for chunk in chunks:  # each chunk carries the logprobs of its own text
        assert "".join(entry.text for entry in chunk.logprobs) == chunk.text


@aio
async def test_no_logprobs_unless_asked(engine: BatchingEngine) -> None:
    chunks = await generate(engine, chat("Name three animals."), temperature=0, max_tokens=10)
    assert logprobs_of(chunks) == []


def test_values_are_a_log_softmax_of_the_slots_logits(backend: LlamaCppBackend) -> None:
    prompt = backend.tokenize(chat("Say hello."), add_special=True, parse_special=True)
    backend.start(0, SamplingParams(temperature=0, logprobs=20), prompt, 0)
    try:
        [token] = backend.step([BatchEntry(slot=0, tokens=prompt, pos=0, wants_sample=True)])
        ranked = backend.take_logprobs(0)
        logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(backend._ctx, -1), shape=(backend.info.num_vocab,))
        expected = log_softmax(logits)
    finally:
        backend.release(0)
    assert ranked is not None and ranked[0] == token == int(np.argmax(expected))
    assert ranked[1] == pytest.approx(expected[token], abs=1e-5)
    best = np.argsort(-expected)[:20]
    assert [t for t, _ in ranked[2]] == [int(t) for t in best]
    assert [v for _, v in ranked[2]] == pytest.approx([float(expected[t]) for t in best], abs=1e-5)


def test_sampled_values_are_after_the_filters_and_the_temperature(backend: LlamaCppBackend) -> None:
    prompt = backend.tokenize(chat("Say hello."), add_special=True, parse_special=True)
    backend.start(0, SamplingParams(temperature=0.5, top_k=3, seed=7, logprobs=5), prompt, 0)
    try:
        [token] = backend.step([BatchEntry(slot=0, tokens=prompt, pos=0, wants_sample=True)])
        ranked = backend.take_logprobs(0)
        logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(backend._ctx, -1), shape=(backend.info.num_vocab,))
        best = np.argsort(-logits.astype(np.float64))[:3]
        expected = log_softmax(logits[best] / 0.5)
    finally:
        backend.release(0)
    assert ranked is not None and ranked[0] == token and token in best
    assert len(ranked[2]) == 3  # top_k=3 left three tokens: the others had probability 0
    assert [t for t, _ in ranked[2]] == [int(t) for t in best]
    assert [v for _, v in ranked[2]] == pytest.approx(list(expected), abs=1e-5)
    assert sum(math.exp(v) for _, v in ranked[2]) == pytest.approx(1.0, abs=1e-5)


@aio
async def test_logit_bias_shows_in_the_values(engine: BatchingEngine) -> None:
    plain = logprobs_of(await generate(engine, chat("Say hello."), temperature=0, max_tokens=1, logprobs=2))
    first = plain[0].token
    banned = logprobs_of(await generate(engine, chat("Say hello."), temperature=0, max_tokens=1, logprobs=2,
                                        logit_bias={first: -100.0}))
    assert banned[0].token != first and banned[0].token == plain[0].top[1].token
    assert banned[0].logprob > plain[0].top[1].logprob


@aio
async def test_identical_alone_and_beside_other_requests(engine: BatchingEngine) -> None:
    prompts = [chat(text) for text in ("Count from 1 to 10.", "Name five fruits.", "What is 12 times 7?")]
    alone = [logprobs_of(await generate(engine, p, temperature=0, max_tokens=24, logprobs=3)) for p in prompts]
    together = await asyncio.gather(*(generate(engine, p, temperature=0, max_tokens=24, logprobs=3) for p in prompts))
    for before, chunks in zip(alone, together, strict=True):
        after = logprobs_of(chunks)
        assert [e.token for e in after] == [e.token for e in before]
        assert [e.logprob for e in after] == [e.logprob for e in before]
        assert [[a.token for a in e.top] for e in after] == [[a.token for a in e.top] for e in before]


@aio
async def test_a_stop_string_keeps_its_tokens_out(engine: BatchingEngine) -> None:
    prompt = chat("Count from 1 to 10, one number per line.")
    full = await generate(engine, prompt, temperature=0, max_tokens=40, logprobs=1)
    text = reply(full)
    words = text.split()
    stop = f"{words[3]} {words[4]}"  # the fourth word's token begins with a space: that token is partly out
    assert stop in text and not text.startswith(stop)
    cut = await generate(engine, prompt, temperature=0, max_tokens=40, logprobs=1, stop=[stop])
    spelled = "".join(entry.text for entry in logprobs_of(cut))
    assert reply(cut) == text[: text.index(stop)]
    assert spelled.startswith(reply(cut)) and stop not in spelled[: len(reply(cut))]
    assert len(spelled) - len(reply(cut)) < len(stop) + 8  # at most the one token the stop string began in


@aio
async def test_structured_output_has_logprobs_of_allowed_tokens_only(engine: BatchingEngine) -> None:
    grammar = 'root ::= "yes" | "no"'
    chunks = await generate(engine, chat("Is the sky blue?"), temperature=0, max_tokens=5, logprobs=20,
                            grammar=grammar)
    entries = logprobs_of(chunks)
    assert "".join(e.text for e in entries) == reply(chunks) in ("yes", "no")
    first = entries[0]
    assert all(("yes".startswith(alt.text) or "no".startswith(alt.text)) and alt.text for alt in first.top)
    assert sum(math.exp(alt.logprob) for alt in first.top) == pytest.approx(1.0, abs=1e-4)


# ---- which chunk carries them ------------------------------------------------------------------------------------


def entry(text: str) -> TokenLogprob:
    return TokenLogprob(0, text, text.encode(), -0.5)


def test_a_character_split_over_tokens_travels_with_its_end() -> None:
    aligner = LogprobAligner()
    aligner.add(entry("a"), 1)
    assert [e.text for e in aligner.emit(1)] == ["a"]
    aligner.add(entry("\ufffd"), 0, unfinished=True)  # the first bytes of "é"
    assert aligner.emit(0) == []
    aligner.add(entry("\ufffd"), 1)  # its last byte
    assert len(aligner.emit(1)) == 2


def test_held_text_holds_its_tokens_and_a_stop_string_drops_them() -> None:
    aligner = LogprobAligner()
    aligner.add(entry("Hi"), 2)
    aligner.add(entry("\n"), 1)  # held back: maybe the start of the stop string "\n\n"
    assert [e.text for e in aligner.emit(2)] == ["Hi"]
    aligner.add(entry("\n"), 1)
    assert aligner.finish(0) == []


def test_a_token_partly_before_the_stop_string_is_kept() -> None:
    aligner = LogprobAligner()
    aligner.add(entry("one."), 4)  # the stop string "." cuts it: "one" is out
    assert [e.text for e in aligner.finish(3)] == ["one."]


def test_a_character_cut_at_the_end_drops_its_tokens() -> None:
    aligner = LogprobAligner()
    aligner.add(entry("a"), 1)
    aligner.add(entry("\ufffd"), 0, unfinished=True)
    assert [e.text for e in aligner.finish(1)] == ["a"]


def test_rank_candidates_leaves_out_banned_tokens() -> None:
    ids = np.array([10, 11, 12, 13], dtype=np.int32)
    logits = np.array([1.0, -np.inf, 3.0, 2.0], dtype=np.float32)
    token, value, top = rank_candidates(ids, logits, 2, 4)
    assert token == 12 and [t for t, _ in top] == [12, 13, 10]
    assert value == pytest.approx(top[0][1]) and sum(math.exp(v) for _, v in top) == pytest.approx(1.0)
