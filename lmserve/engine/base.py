"""What the engine loop needs from a backend, and what it tells its callers about a loaded model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from lmserve.types import SamplingParams


@dataclass(slots=True)
class ModelInfo:
    """Facts about a loaded model that the layers above the engine need."""

    path: str
    architecture: str
    num_ctx: int
    """Context length per sequence (the -c flag)."""
    num_parallel: int
    num_vocab: int
    chat_template: str | None = None
    bos_token: str = ""
    eos_token: str = ""
    size_bytes: int = 0
    num_params: int = 0
    description: str = ""
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class BatchEntry:
    """Tokens of one sequence to decode in this step, starting at position `pos` of its slot."""

    slot: int
    tokens: list[int]
    pos: int
    wants_sample: bool


class Backend(Protocol):
    """A model that decodes batches of several sequences, one slot per sequence.

    Called from the engine thread only. `start` prepares a slot for a new prompt: it keeps the first
    `num_reused` positions of the slot's memory (a prefix the slot already holds) when the model can cut its
    memory there, drops the rest, builds a fresh sampler from `sampling` primed with `prompt`, and returns
    how many positions it kept. `step` decodes one batch and returns, for each entry that wants a sample,
    the token sampled after its last token. `release` frees the slot's sampler; its memory stays as a
    prefix cache for the next request in that slot. `embed` pools one text's hidden states into a vector
    without touching any slot.
    """

    info: ModelInfo

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]: ...

    def token_bytes(self, token: int, *, special: bool) -> bytes: ...

    def is_eog(self, token: int) -> bool: ...

    def start(self, slot: int, sampling: SamplingParams, prompt: list[int], num_reused: int) -> int: ...

    def check_grammar(self, grammar: str) -> None:
        """Raise InvalidRequest unless `grammar` (GBNF) can constrain sampling; callable from any thread."""
        ...

    def step(self, entries: list[BatchEntry]) -> list[int | None]: ...

    def release(self, slot: int) -> None: ...

    def embed(self, tokens: list[int]) -> list[float]:
        """The mean of the model's last hidden states over `tokens` (not normalized); uses no slot."""
        ...

    def close(self) -> None: ...
