"""vLLM's log-probabilities (per token `{token id: Logprob}`) as lmserve's `TokenLogprob`s, for the reply and for
the prompt.
"""

from __future__ import annotations

import math
from typing import Any

from lmserve.engine.detokenize import IncrementalDecoder
from lmserve.engine.logprobs import LogprobAligner, token_logprob
from lmserve.engine.pieces import piece_bytes
from lmserve.types import TokenLogprob


class LogprobMapper:
    """One request's logprobs from vLLM's deltas (one `{token id: Logprob}` per new token) as `TokenLogprob`s that
    travel with their text (engine/logprobs.py). A token's bytes come from the tokenizer's token text
    (engine/pieces.py); the token that ended the reply (end of turn) is left out, as on llama.cpp, but for a scored
    prompt (`keep_end`: echo with logprobs), whose one reply token lm-evaluation-harness reads as the last entry."""

    def __init__(self, tokenizer: Any, *, special: bool, k: int, keep_end: bool = False) -> None:
        self._tokenizer = tokenizer
        self._keep_end = keep_end
        self._hidden = frozenset() if special else frozenset(int(t) for t in tokenizer.all_special_ids)
        self._k = k
        self._pieces: dict[int, bytes] = {}
        self._decoder = IncrementalDecoder()
        self._aligner = LogprobAligner()

    def piece(self, token: int) -> bytes:
        """The bytes a token adds to the text (none for a special token the text leaves out)."""
        data = self._pieces.get(token)
        if data is None:
            data = b"" if token in self._hidden else piece_bytes(str(self._tokenizer.convert_ids_to_tokens(token)))
            self._pieces[token] = data
        return data

    def push(self, token_ids: list[int], logprobs: list[dict[int, Any]] | None, text: str, *, finished: bool,
             finish_reason: str | None, stop_reason: int | str | None) -> list[TokenLogprob]:
        """The logprobs of this delta's tokens whose text is out (`text`: the delta's); at the end, all that remain
        but a stop string's tokens."""
        entries = list(logprobs or [])
        if finished and finish_reason == "stop" and not isinstance(stop_reason, str) and not self._keep_end:
            token_ids = token_ids[:-1]  # the end-of-turn token (vLLM leaves its text out)
        for token, entry in zip(token_ids, entries, strict=False):
            top = sorted((lp.rank, t, float(lp.logprob)) for t, lp in entry.items()
                         if lp.rank is not None and lp.rank <= self._k and math.isfinite(lp.logprob))
            ranked = (token, float(entry[token].logprob), [(t, value) for _, t, value in top])
            decoded = self._decoder.push(self.piece(token))
            self._aligner.add(token_logprob(ranked, self.piece), len(decoded), unfinished=self._decoder.is_holding)
        if not finished:
            return self._aligner.emit(len(text))
        if isinstance(stop_reason, str):  # a stop string: vLLM cut it from the text
            return self._aligner.finish(len(text))
        return self._aligner.drain()

    def prompt(self, prompt: list[int], entries: list[dict[int, Any] | None]) -> list[TokenLogprob]:
        """vLLM's `prompt_logprobs` (None for the first token, then `{token id: Logprob}` per prompt token) as one
        `TokenLogprob` per prompt token after the first (engine/prompt_logprobs.py)."""
        out: list[TokenLogprob] = []
        for token, entry in zip(prompt[1:], entries[1:], strict=False):
            if entry is None or token not in entry:
                continue
            top = sorted((lp.rank, t, float(lp.logprob)) for t, lp in entry.items()
                         if lp.rank is not None and lp.rank <= self._k and math.isfinite(lp.logprob))
            out.append(token_logprob((token, float(entry[token].logprob), [(t, v) for _, t, v in top]), self.piece))
        return out
