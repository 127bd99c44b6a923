"""The reply to a request for no tokens (`max_tokens: 0`): nothing generated, finish "length", the prompt counted.

The OpenAI schema allows `max_tokens: 0` on completions (with `echo`, the prompt alone). No engine is asked: the
prompt is only checked to fit the context, and the stream ends at once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from lmserve.engine.protocol import Engine
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
