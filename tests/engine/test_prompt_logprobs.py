"""engine/prompt_logprobs.py: each prompt token's log-probability under the raw distribution of the row before it,
gathered over prefill steps."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lmserve.engine.prompt_logprobs import PromptLogprobs, rank_row


def log_softmax(row: np.ndarray) -> np.ndarray:
    values = row.astype(np.float64)
    return values - (values.max() + math.log(np.exp(values - values.max()).sum()))


def test_a_row_ranks_the_token_and_the_likeliest_under_a_log_softmax() -> None:
    row = np.array([0.5, 3.0, -1.0, 2.0, 3.0], dtype=np.float32)
    expected = log_softmax(row)
    token, logprob, top = rank_row(row, 2, 3)
    assert token == 2 and logprob == pytest.approx(expected[2])
    assert [t for t, _ in top] == [1, 4, 3]  # likeliest first, ties in id order
    assert [v for _, v in top] == pytest.approx([expected[1], expected[4], expected[3]])
    assert rank_row(row, 0, 0)[2] == [] and len(rank_row(row, 0, 9)[2]) == 5


def rows_after(tokens: list[int], vocab: int = 6) -> np.ndarray:
    """Made-up logits after each token: token t favours t + 1."""
    return np.stack([np.eye(vocab, dtype=np.float32)[(t + 1) % vocab] * 4 for t in tokens])


@pytest.mark.parametrize("steps", [[6], [1, 5], [3, 3], [2, 1, 3], [1, 1, 1, 1, 1, 1]])
def test_a_prompt_split_over_steps_ranks_every_token_after_the_first_once(steps: list[int]) -> None:
    prompt = [0, 1, 2, 4, 5, 0]
    whole = PromptLogprobs(1)
    whole.add(rows_after(prompt), prompt, last=True)
    expected = whole.take()
    assert [token for token, _, _ in expected] == prompt[1:]
    assert expected[0][1] == pytest.approx(log_softmax(rows_after([0])[0])[1])  # 1 follows 0: likely
    split = PromptLogprobs(1)
    start = 0
    for i, size in enumerate(steps):
        chunk = prompt[start:start + size]
        rows = rows_after(chunk)
        last = i == len(steps) - 1
        split.add(rows[:-1] if last and size > 1 else rows, chunk, last=last)  # the last row may be left out
        start += size
    assert split.take() == expected
    assert split.take() == []  # given once
