"""Dedicated rerankers on llama.cpp (rank pooling): tiny BERT and Qwen3 rerankers score pairs formatted as llama-server
formats them, through the engine thread; a chat model ranks nothing, a reranker generates nothing. Then the same
engine paths over the fake backend, and the pure helpers of engine/llamacpp/rerank.py."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator

import pytest

from lmserve.engine.llamacpp import rerank
from lmserve.engine.llamacpp.backend import LlamaCppBackend
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.fake import EOG, FakeBackend
from lmserve.errors import ContextOverflow, InvalidRequest
from lmserve.types import LoadOptions, SamplingParams
from tests.tiny_gguf import write_tiny_llama
from tests.tiny_reranker import RERANK_TEMPLATE, write_tiny_reranker

NUM_CTX = 512
QUERY = "what do foxes eat"
DOCUMENTS = [
    "Foxes eat rodents, birds and berries.",
    "The stock market closed higher today.",
    "A fox hunts mice at dusk in the field.",
    "Paris is the capital of France.",
    "Quantum chromodynamics describes quarks.",
]
LONG_DOCUMENT = "the quick brown fox jumps over the lazy dog " * 20


@pytest.fixture(scope="module", params=["bert", "qwen3"])
def reranker(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BatchingEngine]:
    """A tiny reranker's engine: 3 pairs a decode at most, so 5 documents take two."""
    path = write_tiny_reranker(tmp_path_factory.mktemp("rerank") / f"{request.param}.gguf", arch=request.param)
    engine = BatchingEngine(LlamaCppBackend(path, LoadOptions(num_ctx=NUM_CTX, num_parallel=3)))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BatchingEngine]:
    path = write_tiny_llama(tmp_path_factory.mktemp("rerank") / "tiny-llama.gguf")
    engine = BatchingEngine(LlamaCppBackend(path, LoadOptions(num_ctx=NUM_CTX, num_parallel=2)))
    yield engine
    engine.close()


async def test_a_rank_pooling_gguf_loads_as_a_reranker(reranker: BatchingEngine) -> None:
    info = reranker.info
    assert info.can_rank and not info.can_embed
    assert info.num_ctx == NUM_CTX


async def test_rank_gives_one_finite_score_per_document_and_documents_differ(reranker: BatchingEngine) -> None:
    scores = await reranker.rank(QUERY, DOCUMENTS)
    assert len(scores) == len(DOCUMENTS)
    assert all(isinstance(s, float) and math.isfinite(s) for s in scores)
    assert len({round(s, 6) for s in scores}) == len(DOCUMENTS)
    assert await reranker.rank(QUERY, []) == []


async def test_a_pair_scores_the_same_alone_and_among_others(
    reranker: BatchingEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = reranker.backend
    assert isinstance(backend, LlamaCppBackend)
    decoded: list[int] = []
    decode = backend._rank_group
    monkeypatch.setattr(backend, "_rank_group", lambda pairs: decoded.append(len(pairs)) or decode(pairs))
    beside = await reranker.rank(QUERY, DOCUMENTS)
    assert sum(decoded) == len(DOCUMENTS) and max(decoded) > 1  # some pairs were decoded together
    alone = [(await reranker.rank(QUERY, [document]))[0] for document in DOCUMENTS]
    reversed_order = await reranker.rank(QUERY, DOCUMENTS[::-1])
    concurrent = await asyncio.gather(*(reranker.rank(QUERY, [d]) for d in DOCUMENTS))
    assert beside == pytest.approx(alone, abs=1e-5)
    assert reversed_order[::-1] == pytest.approx(alone, abs=1e-5)
    assert [s for (s,) in concurrent] == pytest.approx(alone, abs=1e-5)


async def test_pairs_are_formatted_as_llama_server_formats_them(reranker: BatchingEngine) -> None:
    """BERT-style: BOS query EOS SEP document EOS (`<s> q </s></s> d </s>`); Qwen3: the GGUF's rerank template."""
    pair = reranker.backend.rank_tokens(QUERY, DOCUMENTS[0], None)
    if reranker.info.architecture == "bert":
        query = reranker.tokenize(QUERY, add_special=False, parse_special=False)
        document = reranker.tokenize(DOCUMENTS[0], add_special=False, parse_special=False)
        assert pair == [1, *query, 2, 2, *document, 2]
    else:
        prompt = RERANK_TEMPLATE.replace("{query}", QUERY).replace("{document}", DOCUMENTS[0])
        assert pair == reranker.tokenize(prompt, add_special=False, parse_special=True)
        assert pair[0] == reranker.tokenize("<|im_start|>", add_special=False, parse_special=True)[0]


async def test_a_long_document_is_cut_to_the_context_or_refused(reranker: BatchingEngine) -> None:
    uncut = reranker.backend.rank_tokens(QUERY, LONG_DOCUMENT, None)
    assert len(uncut) > NUM_CTX
    with pytest.raises(ContextOverflow) as info:
        await reranker.rank(QUERY, [DOCUMENTS[0], LONG_DOCUMENT], truncate=False)
    assert info.value.param == "documents" and info.value.num_ctx == NUM_CTX
    cut = reranker.backend.rank_tokens(QUERY, LONG_DOCUMENT, NUM_CTX)
    assert NUM_CTX - 2 <= len(cut) <= NUM_CTX
    assert cut[:NUM_CTX // 2] == uncut[:NUM_CTX // 2] and cut[-1] == uncut[-1]  # the format's end stays
    short, long = await reranker.rank(QUERY, [DOCUMENTS[0], LONG_DOCUMENT])
    assert math.isfinite(long) and short == pytest.approx((await reranker.rank(QUERY, [DOCUMENTS[0]]))[0], abs=1e-5)


async def test_a_reranker_refuses_to_generate(reranker: BatchingEngine) -> None:
    prompt = reranker.tokenize("hello")
    with pytest.raises(InvalidRequest, match="model is a reranker") as info:
        reranker.submit(prompt, SamplingParams(max_tokens=4))
    assert info.value.param == "model"
    with pytest.raises(InvalidRequest, match="model is a reranker"):
        reranker.submit_many(prompt, SamplingParams(max_tokens=4), 2)


async def test_a_chat_model_is_no_reranker(chat_model: BatchingEngine) -> None:
    assert not chat_model.info.can_rank and chat_model.info.can_embed
    with pytest.raises(InvalidRequest, match="not a dedicated reranker"):
        await chat_model.rank(QUERY, DOCUMENTS)
    with pytest.raises(InvalidRequest):
        chat_model.backend.rank_tokens(QUERY, DOCUMENTS[0], None)
    with pytest.raises(InvalidRequest):
        chat_model.backend.rank([[1, 2, 3]])


# ---- the same engine paths over the fake backend -------------------------------------------------------------


async def test_fake_reranker_ranks_through_the_engine_thread() -> None:
    backend = FakeBackend(reranker=True, num_ctx=32)
    engine = BatchingEngine(backend)
    try:
        scores = await engine.rank("abc", ["cab", "xyz", "a"])
        cut = await engine.rank("abc", ["c" * 100])
        with pytest.raises(ContextOverflow):
            await engine.rank("abc", ["c" * 100], truncate=False)
        with pytest.raises(InvalidRequest, match="model is a reranker"):
            engine.submit([1, 2, 3], SamplingParams(max_tokens=2))
    finally:
        engine.close()
    assert scores == [3.0, 0.0, 1.0] and cut == [1.0]
    assert backend.ranked[0][0] == [*b"abc", EOG, *b"cab"]
    assert len(backend.ranked[1][0]) == 32


async def test_fake_chat_model_ranks_nothing() -> None:
    engine = BatchingEngine(FakeBackend())
    try:
        with pytest.raises(InvalidRequest, match="not a dedicated reranker"):
            await engine.rank("abc", ["abc"])
    finally:
        engine.close()


# ---- engine/llamacpp/rerank.py -------------------------------------------------------------------------------


def test_score_is_the_first_value_or_the_log_odds_of_a_softmax() -> None:
    assert rerank.score([0.25], softmaxed=False) == 0.25
    assert rerank.score([-3.5, 9.0], softmaxed=False) == -3.5
    assert rerank.score([0.75, 0.25], softmaxed=True) == pytest.approx(math.log(3))
    assert rerank.score([1.0, 1e-30], softmaxed=True) == pytest.approx(math.log(1e30))
    assert rerank.score([1.0, 0.0], softmaxed=True) == rerank.LOGIT_LIMIT
    assert rerank.score([0.0, 1.0], softmaxed=True) == -rerank.LOGIT_LIMIT


def test_groups_keep_order_and_respect_both_limits() -> None:
    assert list(rerank.groups([5, 5, 5, 5], max_tokens=100, max_pairs=3)) == [[0, 1, 2], [3]]
    assert list(rerank.groups([60, 50, 10, 90], max_tokens=100, max_pairs=8)) == [[0], [1, 2], [3]]
    assert list(rerank.groups([], max_tokens=10, max_pairs=2)) == []


def test_pair_tokens_cut_only_the_document() -> None:
    def tokenize(text: str, add_special: bool, parse_special: bool) -> list[int]:
        return [ord(c) for c in text]

    plain = rerank.PairFormat(template=None, bos=1, end=2, sep=3)
    assert rerank.pair_tokens(plain, tokenize, "ab", "cde", None) == [1, 97, 98, 2, 3, 99, 100, 101, 2]
    assert rerank.pair_tokens(plain, tokenize, "ab", "cde", 7) == [1, 97, 98, 2, 3, 99, 2]
    templated = rerank.PairFormat(template="<{query}|{document}>", bos=None, end=None, sep=None)
    assert rerank.pair_tokens(templated, tokenize, "q", "doc", None) == tokenize("<q|doc>", False, True)
    assert rerank.pair_tokens(templated, tokenize, "q", "doc", 5) == tokenize("<q|d>", False, True)
    assert rerank.pair_tokens(templated, tokenize, "q", "dé€x", 6) == tokenize("<q|dé>", False, True)
    assert rerank.pair_tokens(templated, tokenize, "query", "doc", 3) == tokenize("<query|>", False, True)
