"""One sequence's sampler on the MLX engine: a row of logits in, the next token out, in numpy.

The order is llama.cpp's chain, so both engines pick from the same distribution (engine/logprobs.py describes it):
logit bias (and the end tokens banned by `ignore_eos`), the repetition/presence/frequency penalties over the last
`repeat_last_n` tokens (the prompt's included), the grammar's mask, then greedy, Mirostat, or top-k, typical-p,
top-p, min-p, the temperature and a seeded draw. A row is one sequence's logits (a numpy copy of MLX's row): the
vocabulary is tens of thousands of floats, and every filter is one vectorised pass over what is left.
"""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from typing import Protocol

import numpy as np

from lmserve.engine.logprobs import Ranked, rank_candidates, score_tokens
from lmserve.types import SamplingParams

MIROSTAT_M = 100
"""Mirostat 1 estimates the distribution's shape from this many of the likeliest tokens (llama.cpp's m)."""


class Constraint(Protocol):
    """A grammar's state for one sequence (engine/mlx/grammar.py)."""

    def allowed(self) -> np.ndarray:
        """A boolean mask over the vocabulary: the tokens the grammar accepts next."""
        ...

    def accept(self, token: int) -> None: ...


class Sampler:
    """Picks one sequence's tokens (see the module docstring) and remembers what it picked."""

    def __init__(self, sampling: SamplingParams, prompt: list[int], *, num_ctx: int, end_tokens: frozenset[int],
                 constraint: Constraint | None = None) -> None:
        self.sampling = sampling
        self.constraint = constraint
        self._bias = dict(sampling.logit_bias)
        if sampling.ignore_eos:
            self._bias.update({token: -math.inf for token in end_tokens})
        s = sampling
        self._penalized = s.repeat_last_n != 0 and (
            s.repeat_penalty != 1.0 or s.presence_penalty != 0.0 or s.frequency_penalty != 0.0)
        window = num_ctx if s.repeat_last_n < 0 else min(s.repeat_last_n, num_ctx)
        self._recent: deque[int] = deque((t for t in prompt if t >= 0), maxlen=max(window, 1))
        seed = s.seed if s.seed is not None else random.getrandbits(32)
        self._rng = np.random.default_rng(seed & 0xFFFFFFFF)
        self._mu = 2.0 * s.mirostat_tau
        self.last: Ranked | None = None
        """The last pick's ranked log-probabilities, when the request asked for them."""
        self.scores: list[float] | None = None
        """The last pick's `score_tokens` log-probabilities (raw distribution), when the request named any."""

    def pick(self, logits: np.ndarray) -> int:
        """The next token after a row of logits; the sampler (penalties, grammar) accepts it."""
        s = self.sampling
        if s.score_tokens:
            self.scores = score_tokens(logits, s.score_tokens)
        values = self._shaped(np.array(logits, dtype=np.float32))
        ids = np.arange(len(values))
        if s.is_greedy:
            chosen = int(np.argmax(values))
        elif s.mirostat:
            values = values / np.float32(s.temperature)
            ids, values, chosen = self._mirostat(ids, values)
        else:
            ids, values = self._filtered(ids, values)
            values = values / np.float32(s.temperature)
            chosen = self._draw(values)
        token = int(ids[chosen])
        if s.logprobs is not None:
            self.last = rank_candidates(ids, values, chosen, s.logprobs)
        self.accept(token)
        return token

    def accept(self, token: int) -> None:
        if self._penalized:
            self._recent.append(token)
        if self.constraint is not None:
            self.constraint.accept(token)

    # ---- the chain -----------------------------------------------------------------------------------------------

    def _shaped(self, values: np.ndarray) -> np.ndarray:
        """Logit bias, penalties and the grammar's mask, over the whole vocabulary."""
        for token, bias in self._bias.items():
            values[token] += np.float32(bias)
        if self._penalized and self._recent:
            s = self.sampling
            counts = Counter(self._recent)
            tokens = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
            times = np.fromiter(counts.values(), dtype=np.float32, count=len(counts))
            picked = values[tokens]
            picked = np.where(picked > 0, picked / np.float32(s.repeat_penalty), picked * np.float32(s.repeat_penalty))
            values[tokens] = picked - times * np.float32(s.frequency_penalty) - np.float32(s.presence_penalty)
        if self.constraint is not None:
            values[~self.constraint.allowed()[: len(values)]] = -np.inf
        return values

    def _filtered(self, ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """top-k, typical-p, top-p and min-p, each keeping at least one token; what is left, likeliest first."""
        s = self.sampling
        keep = len(values) if s.top_k <= 0 else min(s.top_k, len(values))
        if keep < len(values):
            top = np.argpartition(values, len(values) - keep)[len(values) - keep:]
            ids, values = ids[top], values[top]
        order = np.argsort(-values, kind="stable")
        ids, values = ids[order], values[order]
        if s.typical_p < 1.0:
            probs = _softmax(values)
            surprise = -np.log(np.maximum(probs, 1e-38))
            entropy = float((probs * surprise).sum())
            rank = np.argsort(np.abs(surprise - entropy), kind="stable")
            cut = int(np.searchsorted(np.cumsum(probs[rank]), s.typical_p)) + 1
            kept = np.sort(rank[: max(cut, 1)])
            ids, values = ids[kept], values[kept]
        if s.top_p < 1.0:
            cut = int(np.searchsorted(np.cumsum(_softmax(values)), s.top_p)) + 1
            ids, values = ids[: max(cut, 1)], values[: max(cut, 1)]
        if s.min_p > 0.0 and len(values) > 1:
            floor = values[0] + np.float32(math.log(s.min_p))
            cut = max(int(np.count_nonzero(values >= floor)), 1)
            ids, values = ids[:cut], values[:cut]
        return ids, values

    def _draw(self, values: np.ndarray) -> int:
        probs = _softmax(values).astype(np.float64)
        return int(self._rng.choice(len(probs), p=probs / probs.sum()))

    def _mirostat(self, ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """Mirostat 1 or 2 (llama.cpp's): keep the tokens whose surprise fits the running target `mu`, draw one,
        and move `mu` by the gap between its surprise and tau."""
        s = self.sampling
        order = np.argsort(-values, kind="stable")
        ids, values = ids[order], values[order]
        probs = _softmax(values)
        if s.mirostat == 1:
            m = min(MIROSTAT_M, len(probs) - 1)
            t = np.log((np.arange(m) + 2) / (np.arange(m) + 1))
            b = np.log(np.maximum(probs[:m], 1e-38) / np.maximum(probs[1 : m + 1], 1e-38))
            s_hat = float((t * b).sum() / (t * t).sum()) if m > 0 else 1.0
            epsilon = s_hat - 1.0
            k = ((epsilon * 2.0**self._mu) / (1.0 - len(probs) ** -epsilon)) ** (1.0 / s_hat) if epsilon else 1.0
            keep = int(min(max(k, 1.0), len(probs)))
        else:
            keep = max(int(np.count_nonzero(-np.log2(np.maximum(probs, 1e-38)) <= self._mu)), 1)
        ids, values = ids[:keep], values[:keep]
        chosen = self._draw(values)
        surprise = -math.log2(max(float(_softmax(values)[chosen]), 1e-38))
        self._mu -= s.mirostat_eta * (surprise - s.mirostat_tau)
        return ids, values, chosen


def _softmax(values: np.ndarray) -> np.ndarray:
    peak = values.max() if len(values) else np.float32(0)
    exps = np.exp(values - (peak if np.isfinite(peak) else np.float32(0)))
    total = exps.sum()
    return exps / total if total > 0 else np.full_like(values, 1.0 / max(len(values), 1))
