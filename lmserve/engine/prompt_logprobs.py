"""Log-probabilities of a prompt's own tokens (`SamplingParams.prompt_logprobs`: a legacy completion's `echo` with
`logprobs`, what evaluation harnesses score multiple-choice answers by).

Each prompt token after the first gets log P(token | the tokens before it) under the model's raw distribution (a
log-softmax of the logits, before any sampling transform: what vLLM's `prompt_logprobs` report), with the `k`
likeliest tokens at that place. The first token has none (nothing comes before it). A backend computes the logits
of every prompt position of such a sequence only; prefill may take several steps, so the row after a step's last
token is held until the next step brings the token it predicts (`PromptLogprobs`).
"""

from __future__ import annotations

import math

import numpy as np

from lmserve.engine.logprobs import Ranked


def rank_row(logits: np.ndarray, token: int, k: int) -> Ranked:
    """`token`'s log-probability under a log-softmax of a whole row of raw `logits`, and the `k` likeliest tokens."""
    values = np.asarray(logits, dtype=np.float64)
    peak = float(values.max())
    total = peak + math.log(float(np.exp(values - peak).sum()))
    if k <= 0:
        return token, float(values[token]) - total, []
    best = np.argpartition(-values, k - 1)[:k] if k < len(values) else np.arange(len(values))
    best = best[np.argsort(-values[best], kind="stable")]
    return token, float(values[token]) - total, [(int(i), float(values[i]) - total) for i in best]


class PromptLogprobs:
    """One sequence's prompt log-probabilities, gathered over its prefill steps."""

    __slots__ = ("_pending", "k", "ranked")

    def __init__(self, k: int) -> None:
        self.k = k
        self.ranked: list[Ranked] = []
        """One entry per prompt token after the first, in order (so far)."""
        self._pending: np.ndarray | None = None

    def add(self, rows: np.ndarray, tokens: list[int], *, last: bool) -> None:
        """A prefill step's `tokens` and the logits after them: `rows[i]` follows `tokens[i]` (`rows` may leave out
        the row after the last token). `last`: the prompt ends with this step (the row after it predicts the reply,
        not a prompt token); otherwise that row is held for the next step's first token."""
        if self._pending is not None and tokens:
            self.ranked.append(rank_row(self._pending, tokens[0], self.k))
            self._pending = None
        for i in range(min(len(rows), len(tokens) - 1)):
            self.ranked.append(rank_row(rows[i], tokens[i + 1], self.k))
        if not last and tokens and len(rows) == len(tokens):
            self._pending = np.array(rows[-1], dtype=np.float32)

    def take(self) -> list[Ranked]:
        """Every entry so far (the prompt's, once it is prefilled), given once."""
        ranked, self.ranked = self.ranked, []
        return ranked
