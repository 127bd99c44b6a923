"""The inputs of an embeddings request: texts, or token ids (OpenAI's `input` as a list of ints, or of lists).

A text is tokenized for embedding by the engine (its special tokens added, as the model expects); token ids are
embedded as given, with no re-tokenization, once each is checked to be in the model's vocabulary. Either is cut
to one sequence's context when `truncate`; otherwise a longer input is the engine's ContextOverflow.
"""

from __future__ import annotations

from collections.abc import Sequence

from lmserve.engine.protocol import Engine
from lmserve.errors import InvalidRequest

EmbeddingInput = str | list[int]
"""One input to embed: a text, or the token ids of one."""


def check_inputs(inputs: Sequence[EmbeddingInput]) -> None:
    """InvalidRequest (param `input`) unless there is at least one input and none is empty."""
    if not inputs:
        raise InvalidRequest("input must contain at least one text or list of token ids", param="input")
    for i, item in enumerate(inputs):
        if not item:
            raise InvalidRequest(f"input[{i}] is empty", param="input")


def embedding_prompt(engine: Engine, item: EmbeddingInput, index: int, *, truncate: bool) -> list[int]:
    """The tokens to embed for input number `index`: a text tokenized for embedding, or token ids as given (each
    in the model's vocabulary, else InvalidRequest naming `input`)."""
    if isinstance(item, str):
        return engine.embedding_tokens(item, truncate=truncate)
    size = engine.info.num_vocab
    for at, token in enumerate(item):
        if not 0 <= token < size:
            raise InvalidRequest(f"input[{index}][{at}] = {token} is not a token id of this model (0 to {size - 1})",
                                 param="input")
    return list(item[: engine.info.num_ctx]) if truncate else list(item)
