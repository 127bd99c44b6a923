"""Dedicated rerankers on the vLLM engine (engine/vllm/rerank.py): cross-encoders on vLLM's pooling runner.

Two tiny random repositories (tests/hf_repos.py `tiny_reranker_repo`): a BERT cross-encoder (token types, the
first token pooled) and a Llama sequence classifier (the last token pooled), each loaded once on vLLM's CPU build.
`rank` must give the head's raw logit (no sigmoid) of the pair as transformers computes it.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmserve.engine.vllm.args import VllmOptions, engine_args
from lmserve.engine.vllm.engine import VllmEngine
from lmserve.engine.vllm.rerank import is_reranker, num_labels, pair_tokens, second_segment
from lmserve.errors import ContextOverflow, InvalidRequest
from lmserve.types import SamplingParams
from tests.hf_repos import tiny_reranker_repo

pytestmark = pytest.mark.asyncio(loop_scope="module")  # vLLM's output handler lives on the loop that first used it

QUERY = "What is the capital of France?"
DOCUMENTS = ["Paris is the capital of France.", "Bananas are yellow.", "The Seine is a river in Paris.",
             "Tokyo is a city.", "Berlin"]
NUM_CTX = 128
TOLERANCE = 1e-4
"""float32 on both sides; vLLM's CPU kernels sum in another order than transformers'."""


@pytest.fixture(scope="module", params=["bert", "llama"])
def arch(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def engine(arch: str) -> Iterator[VllmEngine]:
    """One reranker engine per architecture (its requests all run on the module's event loop)."""
    opened = VllmEngine(tiny_reranker_repo(arch), VllmOptions(num_ctx=NUM_CTX, num_parallel=4, max_queue=8,
                                                              dtype="float32"))
    yield opened
    opened.close()


def reference(path: Path, pairs: list[tuple[str, str]], *, max_length: int | None = None) -> list[float]:
    """transformers' logits of the pairs, each encoded as the tokenizer pairs texts (cut to `max_length`)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    logits = []
    for query, document in pairs:
        cut = {"truncation": "only_second", "max_length": max_length} if max_length else {}
        encoded = tokenizer(query, document, return_tensors="pt", **cut)
        with torch.no_grad():
            logits.append(float(model(**encoded).logits[0, 0]))
    return logits


# ---- a real reranker on vLLM --------------------------------------------------------------------------------------


async def test_a_reranker_ranks_and_generates_nothing(engine: VllmEngine) -> None:
    assert engine.info.can_rank and not engine.info.can_constrain and engine.info.num_ctx == NUM_CTX
    with pytest.raises(InvalidRequest, match="reranker"):
        engine.submit(engine.tokenize(QUERY), SamplingParams(temperature=0.0, max_tokens=1))


async def test_the_scores_are_the_heads_raw_logits(engine: VllmEngine, arch: str) -> None:
    scores = await engine.rank(QUERY, DOCUMENTS)
    expected = reference(tiny_reranker_repo(arch), [(QUERY, d) for d in DOCUMENTS])
    assert scores == pytest.approx(expected, abs=TOLERANCE)
    assert all(math.isfinite(s) for s in scores)
    assert len(set(scores)) == len(scores)


async def test_a_document_scores_the_same_alone_and_among_many(engine: VllmEngine) -> None:
    many = [f"Document number {i} is about {('paris', 'bananas', 'the weather')[i % 3]}." for i in range(30)]
    together = await engine.rank(QUERY, many)
    alone = [(await engine.rank(QUERY, [d]))[0] for d in many[:4]]
    assert len(together) == 30 and together[:4] == pytest.approx(alone, abs=1e-5)
    concurrent = await asyncio.gather(engine.rank(QUERY, many[:10]), engine.rank(QUERY, many[10:]))
    assert concurrent[0] + concurrent[1] == pytest.approx(together, abs=1e-5)
    assert await engine.rank(QUERY, []) == []


async def test_a_long_pair_is_cut_to_the_context_or_refused(engine: VllmEngine, arch: str) -> None:
    long = "the river seine flows in paris and " * 40
    pair = engine.rank_pair(QUERY, long)
    assert len(pair.tokens) == NUM_CTX
    [score] = await engine.rank(QUERY, [long])
    if arch == "bert":  # the document is cut, its closing [SEP] kept
        assert score == pytest.approx(reference(tiny_reranker_repo(arch), [(QUERY, long)], max_length=NUM_CTX)[0],
                                      abs=TOLERANCE)
    assert math.isfinite(score)
    with pytest.raises(ContextOverflow) as raised:
        await engine.rank(QUERY, [long], truncate=False)
    assert raised.value.param == "documents"


# ---- recognising and pairing ------------------------------------------------------------------------------------


async def test_a_reranker_is_a_sequence_classifier_with_one_label() -> None:
    assert is_reranker({"architectures": ["BertForSequenceClassification"], "id2label": {"0": "LABEL_0"}})
    assert is_reranker({"architectures": ["Qwen3ForSequenceClassification"], "num_labels": 1})
    assert not is_reranker({"architectures": ["BertForSequenceClassification"]})  # transformers' default: 2 labels
    assert not is_reranker({"architectures": ["LlamaForSequenceClassification"],
                            "id2label": {"0": "negative", "1": "positive"}})
    assert not is_reranker({"architectures": ["Qwen3ForCausalLM"], "num_labels": 1})
    assert num_labels({}) == 2 and num_labels({"num_labels": 3, "id2label": {"0": "a"}}) == 3


async def test_a_reranker_loads_on_the_pooling_runner() -> None:
    config = {"architectures": ["BertForSequenceClassification"], "num_labels": 1, "model_type": "bert"}
    args = engine_args(Path("/models/reranker"), VllmOptions(num_ctx=512), config=config)
    assert args["runner"] == "pooling" and "logprobs_mode" not in args and "enable_prefix_caching" not in args
    chat = engine_args(Path("/models/chat"), VllmOptions(num_ctx=512), config={"architectures": ["LlamaForCausalLM"]})
    assert "runner" not in chat and chat["logprobs_mode"] == "processed_logprobs"


async def test_pairs_are_formed_as_vllm_forms_them() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_reranker_repo("bert"))
    pair = pair_tokens(tokenizer, "paris", "a city", limit=64, truncate=True)
    assert tokenizer.decode(pair.tokens) == "[CLS] paris [SEP] a city [SEP]" and pair.second_from == 3
    joined = pair_tokens(tokenizer, "paris", " a city", limit=64, truncate=True, use_sep_token=False)
    assert tokenizer.decode(joined.tokens) == "[CLS] paris a city [SEP]"
    templated = pair_tokens(tokenizer, "q", "d", limit=64, truncate=True, score_template="paris: a city")
    assert tokenizer.decode(templated.tokens) == "[CLS] paris : a city [SEP]"
    with pytest.raises(ContextOverflow):
        pair_tokens(tokenizer, "paris " * 80, "a city", limit=64, truncate=False)
    assert len(pair_tokens(tokenizer, "paris " * 80, "a city", limit=64, truncate=True).tokens) == 64
    assert second_segment([0, 0, 1, 1]) == 2 and second_segment([0, 0]) == 2
