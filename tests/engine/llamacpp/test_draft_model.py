"""Speculative decoding with a draft model (`--model-draft`) on real llama.cpp: the output is the output of plain
decoding, token for token, greedy or seeded, alone or beside others, whether the draft model agrees with the target
(the same weights) or not (other weights); a draft model must share the vocabulary and be able to cut its memory.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from lmserve.engine.llamacpp.backend import LlamaCppBackend
from lmserve.engine.llamacpp.draft_model import common_prefix
from lmserve.engine.llamacpp.options import LlamaCppLaunch
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.errors import EngineFailure
from lmserve.types import LoadOptions
from tests.engine.test_speculative import REWRITE, STORY, reply
from tests.tiny_gguf import write_tiny_llama
from tests.tiny_lfm2 import write_tiny_lfm2

ASYNC = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two tiny random F32 llamas with the same vocabulary: the target, and one with other weights."""
    folder = tmp_path_factory.mktemp("draft")
    return write_tiny_llama(folder / "target.gguf"), write_tiny_llama(folder / "other.gguf", seed=1)


def open_engine(path: Path, draft: Path | None = None, parallel: int = 1, p_min: float = 0.0) -> BatchingEngine:
    options = LoadOptions(num_ctx=1024, num_parallel=parallel, num_batch=256)
    launch = LlamaCppLaunch(model_draft=str(draft) if draft else None, draft_p_min=p_min)
    return BatchingEngine(LlamaCppBackend(path, options, launch), draft_max=8 if draft else 0)


@ASYNC
@pytest.mark.parametrize("same", [True, False], ids=["same-weights", "other-weights"])
async def test_greedy_and_seeded_replies_are_the_replies_without_a_draft_model(tiny: tuple[Path, Path],
                                                                              same: bool) -> None:
    target, other = tiny
    plain, drafting = open_engine(target), open_engine(target, target if same else other)
    try:
        for seed in (None, 7):
            sampling = {"temperature": 0 if seed is None else 1.0, "seed": seed, "max_tokens": 80}
            expected, _ = await reply(plain, "abcabcabc", **sampling)
            got, last = await reply(drafting, "abcabcabc", **sampling)
            assert got == expected
            usage = last.usage
            assert usage is not None and usage.draft_tokens > 0
            if same and seed is None:  # the same weights, greedy: every draft is the target's own choice
                assert usage.draft_accepted_tokens == usage.draft_tokens
    finally:
        plain.close()
        drafting.close()


@ASYNC
async def test_concurrent_requests_each_match_plain_decoding(tiny: tuple[Path, Path]) -> None:
    target, other = tiny
    plain, drafting = open_engine(target), open_engine(target, other, parallel=4)
    try:
        prompts = ["abcabcabc", "hello world", "zzz", "The quick brown fox"]
        expected = [(await reply(plain, prompt, temperature=0, max_tokens=60))[0] for prompt in prompts]
        got = await asyncio.gather(*(reply(drafting, prompt, temperature=0, max_tokens=60) for prompt in prompts))
        assert [tokens for tokens, _ in got] == expected
        assert all(last.usage is not None and last.usage.draft_tokens > 0 for _, last in got)
    finally:
        plain.close()
        drafting.close()


@ASYNC
async def test_the_default_model_drafting_for_itself_keeps_its_greedy_text(model_path: Path) -> None:
    plain, drafting = open_engine(model_path), open_engine(model_path, model_path)
    unsure = open_engine(model_path, model_path, p_min=1.0)  # no guess is that sure: nothing is drafted
    try:
        expected = {}
        for prompt in (REWRITE, STORY):
            expected[prompt], _ = await reply(plain, prompt, temperature=0, max_tokens=48)
            got, last = await reply(drafting, prompt, temperature=0, max_tokens=48)
            assert got == expected[prompt]
            assert last.usage is not None and last.usage.draft_accepted_tokens > 0
        # The first prompt of a fresh engine, as it was for `plain` (a prompt reusing a cached prefix can differ in
        # its last bits from one computed whole).
        got, last = await reply(unsure, REWRITE, temperature=0, max_tokens=16)
        assert got == expected[REWRITE][:16] and last.usage is not None and last.usage.draft_tokens == 0
        assert drafting.info.draft_model == model_path.name
    finally:
        plain.close()
        drafting.close()
        unsure.close()


def test_a_draft_model_of_another_vocabulary_is_refused_naming_both(model_path: Path, tiny: tuple[Path, Path]) -> None:
    with pytest.raises(EngineFailure, match=rf"the draft model target.gguf does not share {model_path.name}'s "
                                            r"vocabulary \(its tokenizer is of another kind\)"):
        LlamaCppBackend(model_path, LoadOptions(num_ctx=512, num_parallel=1), LlamaCppLaunch(model_draft=str(tiny[0])))


def test_a_missing_draft_model_is_refused(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    with pytest.raises(EngineFailure, match="draft model file not found"):
        LlamaCppBackend(tiny[0], LoadOptions(num_ctx=512, num_parallel=1),
                        LlamaCppLaunch(model_draft=str(tmp_path / "none.gguf")))


@ASYNC
async def test_an_lfm2_drafts_for_an_lfm2_and_both_rewind_their_state(tmp_path: Path) -> None:
    """Hybrid memory on both sides: the draft model rewinds to the context after each draft, the target after each
    rejected draft (engine/llamacpp/recurrent_state.py); the output is plain decoding's."""
    target = write_tiny_lfm2(tmp_path / "target.gguf")
    other = write_tiny_lfm2(tmp_path / "other.gguf", seed=1)
    plain = open_engine(target)
    try:
        for draft in (target, other):
            drafting = open_engine(target, draft, parallel=2)
            try:
                prompts = ["abcabcabc", "hello hello"]
                expected = [(await reply(plain, prompt, temperature=0, max_tokens=60))[0] for prompt in prompts]
                got = await asyncio.gather(*(reply(drafting, prompt, temperature=0, max_tokens=60)
                                             for prompt in prompts))
                assert [tokens for tokens, _ in got] == expected
                usages = [last.usage for _, last in got if last.usage is not None]
                assert sum(usage.draft_tokens for usage in usages) > 0
                if draft == target:  # the same weights, greedy: every draft is the target's own choice
                    assert all(usage.draft_accepted_tokens == usage.draft_tokens for usage in usages)
            finally:
                drafting.close()
    finally:
        plain.close()


@pytest.mark.parametrize(("a", "b", "most", "shared"), [
    ([1, 2, 3], [1, 2, 3, 4], 3, 3), ([1, 2, 3, 7, 8], [1, 2, 3, 9], 3, 3), ([1, 2, 3, 7], [1, 2, 9, 9], 3, 2),
    ([5, 2], [1, 2, 3], 2, 0), ([], [1], 0, 0), ([*range(1000), 1], [*range(1000), 2, 3], 1001, 1000),
])
def test_the_common_prefix_of_what_a_slot_holds_and_its_context(a: list[int], b: list[int], most: int,
                                                                 shared: int) -> None:
    assert common_prefix(a, b, most) == shared
