"""Log-probabilities of generated tokens: what they measure, how they are computed, and how they follow the text.

Which distribution: the one the token was drawn from, after every transformation of the sampler, the same on both
engines (vLLM runs with `logprobs_mode="processed_logprobs"`):

- greedy decoding (temperature 0): a log-softmax over the logits after logit bias, the repetition/presence/
  frequency penalties and the grammar (structured output, a forced tool call); no temperature;
- sampling: the same, then top-k, typical-p, top-p and min-p (tokens they drop have probability 0) and the
  temperature, then a log-softmax over the tokens that are left. llama.cpp filters before the temperature,
  vLLM after it (its top-p and min-p see the tempered distribution): the two agree unless top_p or min_p is set
  with a temperature other than 1.

So a reported value is the log-probability the token really had when it was picked, and the sampled token is
always among the finite values. Alternatives with probability 0 (banned by the grammar or a filter) are left out,
so `top` may be shorter than asked. Values are natural logarithms (<= 0).

Which tokens: those whose text reaches the reply, in the chunk that carries their text (`LogprobAligner`). A
token that ends generation (end of turn) has no entry; a token held back (part of a UTF-8 character, or maybe
the start of a stop string) travels with the chunk that releases its text; tokens that only make up a stop
string (cut from the reply) are left out, and a token whose text is partly cut (text, then the stop string) is
kept.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

import numpy as np

from lmserve.types import TokenLogprob

Ranked = tuple[int, float, list[tuple[int, float]]]
"""A sampled token's (id, logprob, [(alternative id, logprob), …] likeliest first)."""


def rank_candidates(ids: np.ndarray, logits: np.ndarray, selected: int, k: int) -> Ranked:
    """The log-softmax of `logits` (the candidates the sampler kept, ids `ids`), as the sampled candidate's
    (index `selected`) id and logprob and the `k` likeliest candidates with finite logprobs.

    Vectorised (no Python loop over the vocabulary): one pass for the log-sum-exp; the top k are selected among
    the candidates within `_NEAR` of the best (few, usually) and only when there are fewer than k of those among
    all of them.
    """
    peak = float(logits.max()) if len(logits) else 0.0
    if not math.isfinite(peak):  # nothing left but banned tokens (the sampler still picked one)
        peak = 0.0
    total = peak + math.log(float(np.exp(logits - np.float32(peak)).sum(dtype=np.float64)) or 1.0)
    chosen = float(logits[selected]) - total
    if k <= 0:
        return int(ids[selected]), chosen, []
    near = np.flatnonzero(logits >= np.float32(peak - _NEAR))
    pool = near if len(near) >= k else np.arange(len(logits))
    if len(pool) > k:
        pool = pool[np.argpartition(logits[pool], len(pool) - k)[len(pool) - k:]]
    best = pool[np.argsort(-logits[pool], kind="stable")]
    top = [(int(ids[i]), float(logits[i]) - total) for i in best if math.isfinite(float(logits[i]))]
    return int(ids[selected]), chosen, top


_NEAR = 10.0
"""Logit distance from the best candidate within which the top k are looked for first (e^-10 ≈ 4.5e-5 of it)."""


def token_logprob(ranked: Ranked, piece: Callable[[int], bytes]) -> TokenLogprob:
    """A `TokenLogprob` of a ranked token; `piece(id)` gives a token's bytes."""
    token, logprob, top = ranked

    def entry(token_id: int, value: float) -> TokenLogprob:
        data = piece(token_id)
        return TokenLogprob(token_id, data.decode("utf-8", "replace"), data, value)

    first = entry(token, logprob)
    first.top = [entry(t, v) for t, v in top]
    return first


class LogprobAligner:
    """Holds each token's logprob until the text it produced has been emitted, so a chunk's logprobs cover exactly
    the tokens of its text.

    Positions count characters of the reply's text before stop strings are cut. `add` places a token: the
    `length` characters it completes, and whether it leaves a character unfinished (part of a UTF-8 character,
    whose end comes with a later token). `emit` says how many characters were emitted and returns the tokens
    whose text is now all out. `finish` ends the reply: tokens whose text started before the end of the emitted
    text come out; the rest (a stop string's tokens, a cut character) are dropped.
    """

    __slots__ = ("_emitted", "_pending", "_position")

    def __init__(self) -> None:
        self._pending: deque[tuple[int, int, TokenLogprob]] = deque()
        self._position = 0
        self._emitted = 0

    def add(self, logprob: TokenLogprob, length: int, *, unfinished: bool = False) -> None:
        start = self._position
        self._position += length
        self._pending.append((start, self._position + (1 if unfinished else 0), logprob))

    def emit(self, num_chars: int) -> list[TokenLogprob]:
        self._emitted += num_chars
        out: list[TokenLogprob] = []
        while self._pending and self._pending[0][1] <= self._emitted:
            out.append(self._pending.popleft()[2])
        return out

    def drain(self) -> list[TokenLogprob]:
        """All the tokens still held (the end of a reply no stop string cut, when the emitted text's length may not
        be known exactly)."""
        out = [logprob for _, _, logprob in self._pending]
        self._pending.clear()
        return out

    def finish(self, num_chars: int) -> list[TokenLogprob]:
        self._emitted += num_chars
        out = [logprob for start, end, logprob in self._pending if start < self._emitted or end <= self._emitted]
        self._pending.clear()
        return out


def score_tokens(logits: np.ndarray, tokens: list[int]) -> list[float]:
    """log P(t) of each of `tokens` under a log-softmax of a whole row of raw `logits` (SamplingParams.score_tokens:
    the model's own distribution, before bias, penalties, grammar, filters or temperature)."""
    values = np.asarray(logits, dtype=np.float64)
    peak = float(values.max())
    total = peak + math.log(float(np.exp(values - peak).sum()))
    return [float(values[t]) - total for t in tokens]
