"""Structured output that always parses: a constrained reply is closed in time, within its `max_tokens`.

No anchor does this: llama-server, vLLM and the local runner cut a JSON reply where `max_tokens` falls. Here a
reply under a grammar (response_format / format: chat/structured/) with a token limit runs through
`ClosingStream`, which follows the reply token by token in the grammar (chat/json_closing.py) and keeps a token
only if, after it, the shortest text that completes the document still fits in what is left of the limit. The
first token that would leave too little room is not kept: the engine's request is aborted and the stream ends
with that closing text (open strings closed, missing required properties filled, arrays and objects closed),
finishing with "length" (the limit forced the close) and usage that counts the closing's tokens. The content
then parses as JSON and validates against the schema, at any limit from the minimum up; a limit below the
minimal document's tokens is refused before anything runs (`check_budget`).

A forced tool call (chat/tools/forcing.py) is closed the same way: its grammar holds the call format's markers, so
the closing finishes the JSON, then the end marker (`</tool_call>`, `]<|tool_call_end|>`), or the list of calls
after the call under way; the tool-call parser then reads a complete call. Its markers are often special tokens:
with `special`, the reply is read as the engine writes it with special tokens kept (each token's bytes,
`Engine.token_bytes`) and the closing is tokenized with special tokens parsed.

Engine-neutral: it reads the engine's output tokens (`GenerationStream.output_tokens`), `Engine.detokenize`
and `Engine.tokenize`, and aborts the stream; no margin is needed, because a token is judged before it is
shown and the closing's tokens are counted exactly (the closing tokenized on its own, as it is reported). Tokens
are judged in order whatever the chunking, so a streamed reply and a whole one close at the same point. A
reply whose text leaves the grammar (a user stop string, special-token text) is passed through as the engine
ends it.
"""

from __future__ import annotations

import codecs
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from lmserve.chat.json_closing import Closer, closer_for
from lmserve.engine.protocol import Engine, GenerationStream
from lmserve.errors import InvalidRequest
from lmserve.types import Chunk, SamplingParams, Timings, TokenLogprob, Usage

__all__ = ["ClosingStream", "check_budget", "close_in_budget", "minimum_tokens", "thinking_cap"]

_CONTEXT = 5
"""Prompt tokens put before the output when detokenizing it, so that its first token reads as it does in place."""


def _closer(sampling: SamplingParams) -> Closer | None:
    """The closer for `sampling`'s grammar when replies under it are closed at the limit; None otherwise."""
    if sampling.grammar is None or not sampling.closes_at_limit:
        return None
    try:
        return closer_for(sampling.grammar)
    except (ValueError, RecursionError):  # a grammar not written by chat/structured/: left as it is
        return None


def _count(engine: Engine, text: str, special: bool = False) -> int:
    return len(_tokens(engine, text, special))


def _tokens(engine: Engine, text: str, special: bool) -> list[int]:
    return engine.tokenize(text, add_special=False, parse_special=special) if text else []


def minimum_tokens(engine: Engine, sampling: SamplingParams, *, special: bool = False) -> int | None:
    """How many tokens the shortest reply `sampling`'s grammar allows takes (None: no grammar closed at the limit);
    `special`: its special-token text counted as the special tokens."""
    closer = _closer(sampling)
    return None if closer is None else _count(engine, closer.shortest, special)


def check_budget(engine: Engine, sampling: SamplingParams, *, special: bool = False,
                 what: str = "reply the requested format allows") -> None:
    """InvalidRequest (param `max_tokens`) when the token limit cannot hold even the shortest valid document (`what`
    names it in the message, after "the shortest")."""
    if sampling.max_tokens is None:
        return
    need = minimum_tokens(engine, sampling, special=special)
    if need is not None and sampling.max_tokens < need:
        shortest = closer_for(sampling.grammar or "").shortest
        raise InvalidRequest(
            f"max_tokens (num_predict in the native API) is {sampling.max_tokens}, but the shortest {what}, "
            f"{shortest[:200]}, takes {need} tokens: ask for at least {need}",
            param="max_tokens",
        )


def thinking_cap(engine: Engine, sampling: SamplingParams, close_tag: str, *, special: bool = False) -> int | None:
    """The most tokens a thinking phase before an answer under `sampling` may take: its `max_tokens`, less the room
    the close tag and the shortest document need when its grammar is closed at the limit (at least 1)."""
    need = minimum_tokens(engine, sampling, special=special)
    if sampling.max_tokens is None or need is None:
        return sampling.max_tokens
    return max(1, sampling.max_tokens - need - _count(engine, close_tag, special))


def close_in_budget(engine: Engine, stream: GenerationStream, sampling: SamplingParams, *,
                    special: bool = False) -> GenerationStream:
    """`stream` (submitted with `sampling`, keeping special tokens in its text when `special`), closed in time when
    its grammar's replies are and it has a limit."""
    closer = _closer(sampling)
    if closer is None or sampling.max_tokens is None:
        return stream
    return ClosingStream(engine, stream, closer, sampling.max_tokens, special=special)


class ClosingStream:
    """A generation stream whose constrained reply ends, within `budget` tokens, as a complete document.

    `special`: the inner stream's text keeps special tokens (tool-call markers): the reply is read token by token
    as the engine writes it, and the closing's special-token text is tokenized as special tokens."""

    def __init__(self, engine: Engine, inner: GenerationStream, closer: Closer, budget: int, *,
                 special: bool = False) -> None:
        self._engine = engine
        self._special = special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace") if special else None
        self._inner = inner
        self._closer = closer
        self._budget = budget
        self._costs: dict[str, int] = {}
        self._num_kept = 0
        """Output tokens judged and kept (their text may still be held back, waiting for the rest of a character)."""
        self._closed: list[int] | None = None
        """Once closed: the tokens of the reply as it ended (those kept, then the closing's)."""
        self._tokens = list(inner.prompt_tokens[-_CONTEXT:])
        """The end of the prompt, then the output tokens read so far: what `_piece` detokenizes windows of."""
        self._prefix_at = 0
        self._read_at = len(self._tokens)

    @property
    def prompt_tokens(self) -> list[int]:
        return self._inner.prompt_tokens

    @property
    def output_tokens(self) -> list[int]:
        return self._closed if self._closed is not None else self._inner.output_tokens

    def abort(self) -> None:
        self._inner.abort()

    def _cost(self, closing: str) -> int:
        cost = self._costs.get(closing)
        if cost is None:
            cost = self._costs[closing] = _count(self._engine, closing, self._special)
        return cost

    def _piece(self, index: int) -> str:
        """The text output token `index` adds (vLLM's incremental detokenization: the text of a short window of
        tokens with and without it; with special tokens kept, its bytes); empty while a character is incomplete."""
        if self._decoder is not None:
            return self._decoder.decode(self._engine.token_bytes(self._inner.output_tokens[index]))
        self._tokens.append(self._inner.output_tokens[index])
        before = self._engine.detokenize(self._tokens[self._prefix_at:self._read_at])
        after = self._engine.detokenize(self._tokens[self._prefix_at:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix_at, self._read_at = self._read_at, len(self._tokens)
        return after[len(before):]

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        started = time.perf_counter_ns()
        first_ns = 0
        tracker = self._closer.start()
        closing = tracker.closing()
        if self._cost(closing) > self._budget:  # the limit left (after thinking) holds no document: the shortest
            self._inner.abort()
            yield self._close("", closing, None, started, started)
            return
        kept: list[str] = []
        shown: list[str] = []
        num_shown = 0  # the log-probability entries of the chunks shown: one per output token they carry
        chunks = aiter(self._inner)
        async for chunk in chunks:
            first_ns = first_ns or time.perf_counter_ns()
            while not tracker.lost and self._num_kept < len(self._inner.output_tokens):
                piece = self._piece(self._num_kept)
                if not tracker.feed(piece):
                    break
                after = tracker.closing()
                if self._num_kept + 1 + self._cost(after) > self._budget:
                    text, before = "".join(kept), "".join(shown)
                    if not text.startswith(before):  # what was shown is not what was judged: leave it
                        tracker.lost = True
                        break
                    logprobs = list(chunk.logprobs)
                    wanted = self._num_kept - num_shown if logprobs or num_shown else 0
                    while chunk.finish_reason is None and len(logprobs) < wanted:  # kept tokens the engine ran
                        following = await anext(chunks, None)  # ahead with: their entries come in its next chunks
                        if following is None:
                            break
                        chunk = following
                        logprobs += chunk.logprobs
                    if chunk.finish_reason is None:
                        self._inner.abort()
                    yield self._close(text[len(before):], closing, chunk, started, first_ns, logprobs[:wanted])
                    return
                self._num_kept += 1
                kept.append(piece)
                closing = after
            shown.append(chunk.text)
            num_shown += len(chunk.logprobs)
            yield chunk

    def _close(self, text: str, closing: str, final: Chunk | None, started: int, first_ns: int,
               logprobs: list[TokenLogprob] | None = None) -> Chunk:
        """The last chunk of a reply the limit closed: the kept text not shown yet, then the closing. Its
        `logprobs` are those of the kept tokens not shown yet; the closing's tokens have none (lmserve wrote them,
        the model sampled none of them)."""
        now = time.perf_counter_ns()
        closing_tokens = _tokens(self._engine, closing, self._special)
        self._closed = list(self._inner.output_tokens[: self._num_kept]) + closing_tokens
        completion = len(self._closed)
        if final is not None and final.usage is not None:
            usage = replace(final.usage, completion_tokens=completion)
            timings = final.timings
        else:
            usage = Usage(prompt_tokens=len(self._inner.prompt_tokens), completion_tokens=completion)
            first = first_ns or now
            timings = Timings(prompt_eval_ns=first - started, eval_ns=now - first, total_ns=now - started)
        return Chunk(text=text + closing, finish_reason="length", usage=usage, timings=timings,
                     logprobs=logprobs or [])
