"""The MLX engine's sampler (engine/mlx/sampling.py): llama.cpp's chain over a row of logits, in numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lmserve.engine.mlx.sampling import Sampler
from lmserve.types import SamplingParams

END = frozenset({0})


def sampler(prompt: list[int] | None = None, **options: object) -> Sampler:
    return Sampler(SamplingParams(**options), prompt or [], num_ctx=64, end_tokens=END)  # type: ignore[arg-type]


def row(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


class Only:
    """A grammar that allows a fixed set of tokens and records what it was given."""

    def __init__(self, allowed: set[int], size: int) -> None:
        self.mask = np.array([i in allowed for i in range(size)])
        self.accepted: list[int] = []

    def allowed(self) -> np.ndarray:
        return self.mask

    def accept(self, token: int) -> None:
        self.accepted.append(token)


def test_greedy_picks_the_largest_logit_after_the_bias() -> None:
    assert sampler(temperature=0).pick(row(0, 1, 3, 2)) == 2
    assert sampler(temperature=0, logit_bias={1: 5.0}).pick(row(0, 1, 3, 2)) == 1


def test_ignore_eos_bans_the_end_tokens() -> None:
    assert sampler(temperature=0, ignore_eos=True).pick(row(9, 1, 3)) == 2


def test_repeat_penalty_divides_positive_and_multiplies_negative_logits_of_recent_tokens() -> None:
    # token 2 (logit 3) was in the prompt: 3 / 2 = 1.5 < 2 (token 3) → 3 wins
    assert sampler([2], temperature=0, repeat_penalty=2.0).pick(row(0, 1, 3, 2)) == 3
    assert sampler([2], temperature=0, repeat_penalty=2.0, repeat_last_n=0).pick(row(0, 1, 3, 2)) == 2
    assert sampler([1], temperature=0, frequency_penalty=5.0).pick(row(0, 4, 3)) == 2
    assert sampler([1], temperature=0, presence_penalty=5.0).pick(row(0, 4, 3)) == 2


def test_the_window_holds_the_last_repeat_last_n_tokens() -> None:
    s = sampler([1, 2, 3], temperature=0, repeat_penalty=10.0, repeat_last_n=2)
    assert s.pick(row(0, 5, 4, 1)) == 1  # token 1 fell out of the window; 2 and 3 are penalized


def test_the_grammar_masks_and_accepts_what_was_picked() -> None:
    only = Only({1, 3}, 4)
    s = Sampler(SamplingParams(temperature=0), [], num_ctx=64, end_tokens=END, constraint=only)
    assert s.pick(row(0, 1, 9, 2)) == 3
    assert only.accepted == [3]


@pytest.mark.parametrize("options", [
    {"top_k": 1}, {"top_p": 0.01}, {"min_p": 0.9}, {"typical_p": 0.01},
])
def test_each_filter_keeping_one_token_makes_sampling_greedy(options: dict[str, object]) -> None:
    logits = row(0.0, 2.0, 5.0, 1.0)
    picks = {sampler(temperature=1.0, seed=seed, **options).pick(logits) for seed in range(20)}
    assert picks == {2}


def test_the_same_seed_draws_the_same_tokens_and_draws_follow_the_distribution() -> None:
    logits = row(0.0, math.log(3.0))  # p = 1/4, 3/4
    first = [sampler(temperature=1.0, seed=5).pick(logits) for _ in range(5)]
    assert first == [sampler(temperature=1.0, seed=5).pick(logits) for _ in range(5)]
    s = sampler(temperature=1.0, seed=1)
    ones = sum(s.pick(logits) for _ in range(4000)) / 4000
    assert 0.72 < ones < 0.78


def test_logprobs_rank_what_is_left_after_the_filters() -> None:
    s = sampler(temperature=0, logprobs=2)
    assert s.pick(row(0.0, math.log(3.0), -math.inf)) == 1
    assert s.last is not None
    token, logprob, top = s.last
    assert token == 1 and logprob == pytest.approx(math.log(0.75), abs=1e-6)
    assert [t for t, _ in top] == [1, 0]
    kept = sampler(temperature=1.0, top_k=1, logprobs=3, seed=0)
    kept.pick(row(0.0, 1.0, 2.0))
    assert kept.last is not None and kept.last[1] == 0.0 and [t for t, _ in kept.last[2]] == [2]


@pytest.mark.parametrize("version", [1, 2])
def test_mirostat_keeps_likely_tokens_and_moves_its_target(version: int) -> None:
    s = sampler(temperature=1.0, mirostat=version, mirostat_tau=1.0, mirostat_eta=0.5, seed=3)
    logits = np.array([8.0, 7.0, *([-8.0] * 200)], dtype=np.float32)
    picks = [s.pick(logits) for _ in range(30)]
    assert set(picks) <= {0, 1}
