"""The reply to a request for no tokens (`max_tokens: 0`): nothing generated, finish "length", the prompt counted.

The OpenAI schema allows `max_tokens: 0` on completions (with `echo`, the prompt alone). No engine is asked: the
prompt is only checked to fit the context, and the stream ends at once. Unless the prompt's log-probabilities are
asked for (`echo` with `logprobs`, as evaluation harnesses score a text): then the engine computes them with one
token of reply, which `PromptOnly` leaves out (as vLLM does).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

from lmserve.engine.protocol import Engine, GenerationStream
from lmserve.errors import ContextOverflow, InvalidRequest
from lmserve.types import Chunk, Usage


class EmptyReply:
    """A GenerationStream of one final chunk: no text, finish "length", usage with the prompt's tokens."""

    def __init__(self, engine: Engine, prompt: list[int]) -> None:
        if not prompt:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if len(prompt) >= engine.info.num_ctx:
            raise ContextOverflow(len(prompt), engine.info.num_ctx, engine.info.num_ctx_train)
        self._prompt = list(prompt)

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        yield Chunk(finish_reason="length", usage=Usage(prompt_tokens=len(self._prompt)))

    def abort(self) -> None:
        """Nothing runs: nothing to stop."""

    @property
    def prompt_tokens(self) -> list[int]:
        return self._prompt

    @property
    def output_tokens(self) -> list[int]:
        return []


class PromptOnly:
    """A GenerationStream of the prompt's log-probabilities alone: `stream` (asked for one token) with its reply
    left out: no text or logprobs, finish "length", no completion tokens."""

    def __init__(self, stream: GenerationStream) -> None:
        self._stream = stream

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        async for chunk in self._stream:
            if chunk.prompt_logprobs is not None:
                yield Chunk(prompt_logprobs=chunk.prompt_logprobs)
            if chunk.finish_reason is not None:
                if chunk.is_failed:
                    yield chunk
                else:
                    usage = replace(chunk.usage, completion_tokens=0) if chunk.usage is not None else None
                    yield Chunk(finish_reason="length", usage=usage, timings=chunk.timings)
                return

    def abort(self) -> None:
        self._stream.abort()

    @property
    def prompt_tokens(self) -> list[int]:
        return self._stream.prompt_tokens

    @property
    def output_tokens(self) -> list[int]:
        return []
