"""Log-probabilities on the wire: what each dialect asks for, and the shapes it gets back.

The values are engine/logprobs.py's (the sampling distribution after the sampler's transformations); each chunk's
entries cover the tokens of that chunk's text, so a streamed reply carries them piece by piece.

- OpenAI chat: `logprobs: true` (+ `top_logprobs` 0..20) → `choices[].logprobs = {"content": [{token, logprob,
  bytes, top_logprobs: [{token, logprob, bytes}]}], "refusal": null}`;
- OpenAI legacy completions: `logprobs: N` (0..5) → `{tokens, token_logprobs, top_logprobs: [{text: logprob}],
  text_offset}` (each `top_logprobs` entry holds the N likeliest tokens and the chosen one); with `echo`, the
  prompt's tokens come first, the first with null log-probabilities (engine/prompt_logprobs.py: vLLM's shape);
- native chat and generate: `logprobs: true` (+ `top_logprobs` 0..20) → `logprobs: [{token, logprob, bytes,
  top_logprobs: [{token, logprob, bytes}]}]` on each chunk (as the local runner's).
"""

from __future__ import annotations

from typing import Any

from lmserve.errors import InvalidRequest
from lmserve.types import MAX_TOP_LOGPROBS, TokenLogprob

MAX_LEGACY_LOGPROBS = 5
"""The most alternatives the legacy completions' `logprobs` may ask for (OpenAI's limit)."""


def asked(logprobs: bool | None, top_logprobs: int | None) -> int | None:
    """`SamplingParams.logprobs` for a chat or native request's `logprobs` and `top_logprobs`: None when not asked;
    `top_logprobs` without `logprobs: true`, or outside 0..20, is a 400."""
    if top_logprobs is not None and not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param="top_logprobs")
    if not logprobs:
        if top_logprobs:
            raise InvalidRequest("top_logprobs needs logprobs set to true", param="top_logprobs")
        return None
    return top_logprobs or 0


def legacy_asked(logprobs: int | None) -> int | None:
    """`SamplingParams.logprobs` for a legacy completion's `logprobs` (0..5; with `echo`, its
    `prompt_logprobs` too)."""
    if logprobs is None:
        return None
    if not 0 <= logprobs <= MAX_LEGACY_LOGPROBS:
        raise InvalidRequest(f"logprobs must be between 0 and {MAX_LEGACY_LOGPROBS}", param="logprobs")
    return logprobs


def _token(entry: TokenLogprob) -> dict[str, Any]:
    return {"token": entry.text, "logprob": entry.logprob, "bytes": list(entry.piece)}


def token_entries(entries: list[TokenLogprob]) -> list[dict[str, Any]]:
    """Entries in the chat (and native) shape: token, logprob, bytes, top_logprobs."""
    return [{**_token(entry), "top_logprobs": [_token(alt) for alt in entry.top]} for entry in entries]


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """A chat choice's `logprobs` (whole or one streamed delta's)."""
    return {"content": token_entries(entries), "refusal": None}


class LegacyLogprobs:
    """A legacy completion's `logprobs`, chunk by chunk: `text_offset` counts characters from the start of the
    returned text (`start`: the echoed prompt's length)."""

    __slots__ = ("_offset",)

    def __init__(self, start: int = 0) -> None:
        self._offset = start

    def echoed(self, first: str, entries: list[TokenLogprob]) -> dict[str, Any]:
        """The echoed prompt's part: its first token's text `first` (no log-probability: nothing comes before it,
        so its `token_logprobs` and `top_logprobs` are null), then each later prompt token's."""
        head = {"tokens": [first], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [self._offset]}
        self._offset += len(first)
        return joined(head, self(entries))

    def __call__(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        offsets: list[int] = []
        for entry in entries:
            offsets.append(self._offset)
            self._offset += len(entry.text)
        return {
            "tokens": [entry.text for entry in entries],
            "token_logprobs": [entry.logprob for entry in entries],
            "top_logprobs": [{**{alt.text: alt.logprob for alt in entry.top}, entry.text: entry.logprob}
                             for entry in entries],
            "text_offset": offsets,
        }


def joined(*parts: dict[str, Any]) -> dict[str, Any]:
    """Legacy `logprobs` bodies one after the other as one (the echoed prompt's, then the reply's)."""
    return {key: [value for part in parts for value in part[key]]
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
