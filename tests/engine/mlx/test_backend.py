"""The MLX backend (engine/mlx/backend.py) on real tiny models: batched decoding is the same as decoding alone,
slots copy, fork, save and restore their caches, drafts are verified, and states round-trip through bytes.

Models (tests/hf_repos.py): a random Llama (attention only: memory that can be cut) and a random hybrid LFM2
(convolutions: whole states only), computed in float32 on MLX's CPU build.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmserve.engine.mlx.backend import MlxBackend
from lmserve.engine.mlx.states import read_caches, write_caches
from lmserve.engine.slots.backend import BatchEntry
from lmserve.types import LoadOptions, SamplingParams
from tests.hf_repos import tiny_lfm2_repo, tiny_llama_repo

# find_spec, not an import: MLX is imported through the engine, which puts OpenBLAS under it (engine/mlx/runtime.py)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None, reason="the MLX engine needs mlx-lm")

GREEDY = SamplingParams(temperature=0)
PROMPTS = ([5, 17, 300, 42, 9, 1000, 77], [8, 8, 9, 2000, 31], [123, 456, 789])


def open_backend(repo: Path, slots: int = 4) -> MlxBackend:
    return MlxBackend(repo, LoadOptions(num_ctx=256, num_parallel=slots))


@pytest.fixture(scope="module", params=["llama", "lfm2"])
def backend(request: pytest.FixtureRequest) -> Iterator[MlxBackend]:
    repo = tiny_llama_repo() if request.param == "llama" else tiny_lfm2_repo()
    opened = open_backend(repo)
    yield opened
    opened.close()


def greedy_alone(backend: MlxBackend, prompt: list[int], steps: int, slot: int = 0) -> list[int]:
    backend.start(slot, GREEDY, prompt, 0)
    [token] = backend.step([BatchEntry(slot, prompt, 0, True)])
    assert token is not None
    out = [token]
    for _ in range(steps - 1):
        [token] = backend.step([BatchEntry(slot, [out[-1]], len(prompt) + len(out) - 1, True)])
        assert token is not None
        out.append(token)
    backend.release(slot)
    return out


def test_slots_decoded_as_one_batch_give_what_each_gives_alone(backend: MlxBackend) -> None:
    alone = [greedy_alone(backend, prompt, 6) for prompt in PROMPTS]
    outs: list[list[int]] = []
    for slot, prompt in enumerate(PROMPTS):
        backend.start(slot, GREEDY, prompt, 0)
        [token] = backend.step([BatchEntry(slot, prompt, 0, True)])
        assert token is not None
        outs.append([token])
    for step in range(5):
        # slot 2 sits one step out and joins again: rows leave and rejoin the batch
        active = [slot for slot in range(3) if not (slot == 2 and step == 2)]
        entries = [BatchEntry(slot, [outs[slot][-1]], len(PROMPTS[slot]) + len(outs[slot]) - 1, True)
                   for slot in active]
        for slot, token in zip(active, backend.step(entries), strict=True):
            assert token is not None
            outs[slot].append(token)
    outs[2].append(greedy_step(backend, 2, outs[2], PROMPTS[2]))
    assert [out[:6] for out in outs] == alone


def test_prompts_of_several_lengths_prefilled_as_one_batch_give_what_each_gives_alone(backend: MlxBackend) -> None:
    """Prompts prefilled in one step are right-padded to the longest (the padding rolled out after), and a slot that
    already holds a prefix (slot 1: its first chunk came in an earlier step) joins them."""
    alone = [greedy_alone(backend, prompt, 4) for prompt in PROMPTS]
    backend.start(1, GREEDY, PROMPTS[1], 0)
    backend.step([BatchEntry(1, PROMPTS[1][:2], 0, False)])
    for slot, prompt in enumerate(PROMPTS):
        if slot != 1:
            backend.start(slot, GREEDY, prompt, 0)
    entries = [BatchEntry(0, PROMPTS[0], 0, True), BatchEntry(1, PROMPTS[1][2:], 2, True),
               BatchEntry(2, PROMPTS[2], 0, True)]
    outs = [[token] for token in backend.step(entries)]
    for _ in range(3):
        steps = [BatchEntry(slot, [out[-1]], len(PROMPTS[slot]) + len(out) - 1, True) for slot, out in enumerate(outs)]
        for out, token in zip(outs, backend.step(steps), strict=True):
            out.append(token)
    assert outs == alone


def greedy_step(backend: MlxBackend, slot: int, out: list[int], prompt: list[int]) -> int:
    [token] = backend.step([BatchEntry(slot, [out[-1]], len(prompt) + len(out) - 1, True)])
    assert token is not None
    return token


def test_a_fork_continues_like_its_source(backend: MlxBackend) -> None:
    prompt = PROMPTS[0]
    expected = greedy_alone(backend, prompt, 3)
    backend.start(0, GREEDY, prompt, 0)
    [first] = backend.step([BatchEntry(0, prompt, 0, True)])
    backend.start(1, GREEDY, prompt, 0)
    assert backend.fork(0, [1]) == [first]
    second = greedy_step(backend, 1, [first], prompt)
    assert [first, second] == expected[:2]


def test_a_saved_state_restores_the_same_continuation(backend: MlxBackend) -> None:
    prompt = PROMPTS[1]
    expected = greedy_alone(backend, prompt, 3)
    backend.start(0, GREEDY, prompt, 0)
    backend.step([BatchEntry(0, prompt[:-1], 0, False)])
    state = backend.save_state(0)
    assert state is not None
    backend.clear(0)
    backend.start(1, GREEDY, prompt, 0)
    assert backend.restore_state(1, state, len(prompt) - 1)
    [token] = backend.step([BatchEntry(1, prompt[-1:], len(prompt) - 1, True)])
    assert token == expected[0]


def test_attention_memory_is_cut_for_a_shared_prefix_and_hybrid_memory_is_not() -> None:
    llama = open_backend(tiny_llama_repo(), slots=2)
    try:
        assert llama.info.can_cut_memory
        prompt = PROMPTS[0]
        expected = greedy_alone(llama, prompt, 2)
        llama.start(0, GREEDY, prompt, 0)
        llama.step([BatchEntry(0, [*prompt, 99, 98], 0, False)])
        assert llama.copy_prefix(0, 1, len(prompt) - 1)
        assert llama.start(1, GREEDY, prompt, len(prompt) - 1) == len(prompt) - 1
        [token] = llama.step([BatchEntry(1, prompt[-1:], len(prompt) - 1, True)])
        assert token == expected[0]
    finally:
        llama.close()
    lfm2 = open_backend(tiny_lfm2_repo(), slots=2)
    try:
        assert not lfm2.info.can_cut_memory
        lfm2.start(0, GREEDY, PROMPTS[0], 0)
        lfm2.step([BatchEntry(0, PROMPTS[0], 0, False)])
        assert not lfm2.copy_prefix(0, 1, 3)
        assert lfm2.start(0, GREEDY, PROMPTS[0], 3) == 0  # cannot cut: starts over
    finally:
        lfm2.close()


def test_a_draft_keeps_what_the_samples_agree_with(backend: MlxBackend) -> None:
    prompt = PROMPTS[2]
    expected = greedy_alone(backend, prompt, 5)
    backend.start(0, GREEDY, prompt, 0)
    [first] = backend.step([BatchEntry(0, prompt, 0, True)])
    assert first == expected[0]
    draft = [expected[1], expected[2], (expected[3] + 1) % 1000]  # two right, then a wrong one
    [token] = backend.step([BatchEntry(0, [first, *draft], len(prompt), True, draft=3)])
    assert [token, *backend.take_drafted(0)] == expected[1:4]
    after = greedy_step(backend, 0, [*expected[:4]], prompt)  # memory holds exactly what was accepted
    assert after == expected[4]


def test_states_round_trip_through_bytes(backend: MlxBackend) -> None:
    backend.start(3, GREEDY, PROMPTS[0], 0)
    backend.step([BatchEntry(3, PROMPTS[0], 0, False)])
    state = write_caches(backend._own(3))
    assert state is not None
    again = read_caches(state, backend._make_cache)
    assert again is not None and write_caches(again) == state
    assert read_caches(b"\x05\x00\x00\x00\x00\x00\x00\x00nope!", backend._make_cache) is None


def test_embeddings_are_the_mean_hidden_state(backend: MlxBackend) -> None:
    one = backend.embed([5, 6, 7])
    assert len(one) == 64 if backend.info.architecture == "lfm2" else len(one) == 128
    assert backend.embed([5, 6, 7]) == one != backend.embed([7, 6, 5])


def test_an_mlx_quantized_repository_loads_as_it_is(tmp_path: Path) -> None:
    """mlx-lm's own 4-bit layout (what mlx-community publishes; made here by mlx_lm.convert) loads as it is."""
    from mlx_lm import convert

    out = tmp_path / "tiny-llama-4bit"
    convert(str(tiny_llama_repo()), mlx_path=str(out), quantize=True, q_group_size=64, q_bits=4)
    quantized = open_backend(out, slots=1)
    try:
        assert quantized.info.description.endswith(" Q4")
        assert len(greedy_alone(quantized, PROMPTS[0], 3)) == 3
    finally:
        quantized.close()


def test_a_model_mlx_lm_builds_but_cannot_run_is_refused_at_load() -> None:
    """MLX's CPU build multiplies a mixture of experts in float32 only: asked for bfloat16, the two probe tokens of
    the load fail, and the load is a 400 naming why (not every request failing later)."""
    from lmserve.engine.mlx.options import MlxLaunch
    from lmserve.errors import InvalidRequest
    from tests.hf_repos import tiny_lfm2_moe_repo

    with pytest.raises(InvalidRequest, match=r"mlx-lm's lfm2_moe model fails on its first tokens .*float32") as refused:
        MlxBackend(tiny_lfm2_moe_repo(), LoadOptions(num_ctx=256, num_parallel=1), MlxLaunch(mlx_dtype="bfloat16"))
    assert refused.value.param == "model"


def test_special_tokens_in_text_are_parsed_only_when_asked(backend: MlxBackend) -> None:
    """A client's text (fill-in-the-middle's prefix and suffix) that spells a special token stays text."""
    end = backend.tokenize("<|im_end|>", add_special=False, parse_special=True)
    assert len(end) == 1 and backend.is_eog(end[0])
    spelled = backend.tokenize("<|im_end|>", add_special=False, parse_special=False)
    assert len(spelled) > 1 and not any(backend.is_eog(token) for token in spelled)
