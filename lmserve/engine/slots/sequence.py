"""One request's state in the slot engine (`Sequence`): its prompt, slot, phase, output, and what it shares with other
sequences; the scheduler (engine/slots/scheduler.py) moves it through its phases."""

from __future__ import annotations

from dataclasses import dataclass, field

from lmserve.engine.protocol import PromptImage
from lmserve.engine.slots.phases import MOVES, Phase
from lmserve.types import Adapter, SamplingParams


def adapter_names(sequences: list[Sequence]) -> tuple[str, ...]:
    """The names of the LoRA adapters these sequences run with, each once, sorted."""
    return tuple(sorted({adapter.name for seq in sequences for adapter in seq.adapters if adapter.name}))


@dataclass(slots=True, eq=False)
class Sequence:
    """Engine-side state of one request."""

    prompt: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    special: bool = False
    slot: int = -1
    num_prefilled: int = 0
    num_cached: int = 0
    output: list[int] = field(default_factory=list)
    phase: Phase = Phase.WAITING
    images: list[PromptImage] = field(default_factory=list)
    """Images in the prompt, in order; their positions hold placeholder ids."""
    copy_from: int = -1
    """At admission: a slot holding a longer prefix of the prompt than this one's, to copy `copy_len` from."""
    copy_len: int = 0
    leader: Sequence | None = None
    """While following: a sequence prefilling the first `share_len` tokens of this prompt, to copy them from."""
    share_len: int = 0
    checkpoints: list[int] = field(default_factory=list)
    """Prompt positions where prefill pauses so the engine can snapshot the slot (models that cannot cut memory)."""
    draft: list[int] = field(default_factory=list)
    """Tokens the engine drafted to follow the pending one (speculative decoding), verified in the next step."""
    fork_of: Sequence | None = None
    """Another choice of the same prompt (the OpenAI `n`) that prefills it: admitted while that one still prefills,
    this one is forking: it waits, then takes a whole copy of its memory and samples its first token from the same
    logits."""
    num_refill: int = 0
    """Output tokens prefilled after the prompt, once parked or preempted: the prefill recomputes what was lost."""
    evicts: list[int] = field(default_factory=list)
    """At admission: the tokens the slot held before this sequence took it (it keeps `num_cached` of them)."""

    @property
    def priority(self) -> int:
        return self.sampling.priority

    @property
    def adapters(self) -> tuple[Adapter, ...]:
        """The LoRA adapter set it runs with: its memory is computed under it, so only a slot computed under the same
        set can lend it a prefix, and a step runs one set."""
        return self.sampling.adapters

    def move(self, phase: Phase) -> None:
        """Move to `phase`; AssertionError when `MOVES` has no such edge. Leaving following or forking forgets the
        sequence waited for."""
        if phase not in MOVES[self.phase]:
            raise AssertionError(f"a sequence cannot move from {self.phase.name} to {phase.name}")
        if self.phase is Phase.FOLLOWING:
            self.leader, self.share_len = None, 0
        elif self.phase is Phase.FORKING:
            self.fork_of = None
        self.phase = phase

    @property
    def held(self) -> list[int]:
        """The tokens whose state this sequence's slot holds now."""
        if self.num_prefilled < len(self.prompt) + self.num_refill:
            return self.prefill_tokens[: self.num_prefilled]
        return self.prompt + self.output[:-1]

    @property
    def num_held(self) -> int:
        """How many tokens `held` has (without copying them)."""
        if self.num_prefilled < len(self.prompt) + self.num_refill:
            return self.num_prefilled
        return len(self.prompt) + max(len(self.output) - 1, 0)

    @property
    def prefill_tokens(self) -> list[int]:
        """What prefill puts in the slot: the prompt, and after a park the output tokens sampled before it."""
        return self.prompt + self.output[: self.num_refill] if self.num_refill else self.prompt

    def image_at(self, pos: int) -> PromptImage | None:
        """The image starting at prompt position `pos`, if any."""
        for image in self.images:
            if image.start == pos:
                return image
        return None

    def text_end(self, pos: int) -> int:
        """Where the run of text tokens starting at `pos` ends: the next image or checkpoint, or the prompt's end."""
        stops = [image.start for image in self.images if image.start >= pos]
        stops += [checkpoint for checkpoint in self.checkpoints if checkpoint > pos]
        return min(stops, default=len(self.prompt) + self.num_refill)

    def cut_outside_images(self, pos: int) -> int:
        """`pos`, moved back to an image's start when it falls inside that image (an image is decoded whole)."""
        for image in self.images:
            if image.start < pos < image.end:
                return image.start
        return pos

    @property
    def reuse_limit(self) -> int:
        """The most prompt tokens computed before that this sequence may reuse (SamplingParams.reuse_limit)."""
        limit = self.sampling.reuse_limit
        return len(self.prompt) + self.num_refill if limit is None else limit

    def reusable(self, length: int) -> int:
        """How much of a `length`-token prefix computed before this sequence may reuse: at most all but the last
        prefill token (decoded for the next token's logits) and `reuse_limit`, never part of an image; and with a
        `reuse_limit`, a prefix reaching past the first checkpoint is cut back to the last checkpoint it reaches, so
        each stretch between checkpoints is always computed in one piece (SamplingParams.reuse_limit)."""
        pos = min(length, len(self.prefill_tokens) - 1, self.reuse_limit)
        if self.sampling.reuse_limit is not None and self.checkpoints and pos > min(self.checkpoints):
            pos = max(c for c in self.checkpoints if c <= pos)
        return self.cut_outside_images(pos)

    @property
    def num_tokens(self) -> int:
        """Tokens in the slot's memory after this step's input (prompt + generated, minus the pending one)."""
        return len(self.prompt) + max(len(self.output) - 1, 0)
