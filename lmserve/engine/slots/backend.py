"""What the batching engine needs from a backend: a model that decodes batches of several sequences, one slot each."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from lmserve.engine.logprobs import Ranked
from lmserve.engine.protocol import ModelInfo, PromptImage
from lmserve.engine.slots.prompt_disk import SavedState
from lmserve.types import Adapter, Media, SamplingParams

if TYPE_CHECKING:
    from lmserve.engine.slots.sequence import Sequence


@dataclass(slots=True)
class BatchEntry:
    """Tokens of one sequence to decode in this step, starting at position `pos` of its slot.

    An image entry has no tokens: the backend encodes `image` into its `length` positions from `pos`.
    """

    slot: int
    tokens: list[int]
    pos: int
    wants_sample: bool
    image: PromptImage | None = None
    draft: int = 0
    """The last `draft` tokens are drafted (speculative decoding): the backend samples after the first token, then
    after each drafted token while its samples agree with the draft (`take_drafted`), and forgets the rest."""

    @property
    def num_positions(self) -> int:
        return self.image.length if self.image is not None else len(self.tokens)


class PoolFull(Exception):
    """`Backend.step` found no room for the batch in a KV pool shared by the slots (`--kv-unified`).

    The backend left every slot's memory as it was before the step and sampled nothing: the engine may free
    memory (`clear` idle slots, or pause a sequence) and step again.
    """


class Backend(Protocol):
    """A model that decodes batches of several sequences, one slot per sequence.

    Called from the engine thread only. `start` prepares a slot for a new prompt: it keeps the first
    `num_reused` positions of the slot's memory (a prefix the slot already holds) when the model can cut its
    memory there, drops the rest, builds a fresh sampler from `sampling` primed with `prompt`, and returns
    how many positions it kept. `step` decodes one batch and returns, for each entry that wants a sample,
    the token sampled after its last token (image entries are decoded first, each on its own), or raises
    PoolFull when the slots' shared memory has no room for the batch (nothing changed then). `release`
    frees the slot's sampler; its memory stays as a prefix cache for the next request in that slot. `embed`
    pools one text's hidden states into a vector without touching any slot. A dedicated reranker
    (`info.can_rank`) scores (query, document) pairs with `rank_tokens` and `rank` and runs no sequences.
    """

    info: ModelInfo

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]: ...

    def tokenize_media(self, text: str, media: list[Media]) -> tuple[list[int], list[PromptImage]]:
        """Tokenize `text` in which each media marker (`info.image_marker`, `info.audio_marker`) stands for the next
        of `media` (specials parsed).

        Returns the tokens, with each image's or clip's positions filled by its placeholder id, and their places.
        Raises InvalidRequest when the markers and media do not match or one cannot be preprocessed.
        Callable from any thread.
        """
        ...

    def token_bytes(self, token: int, *, special: bool) -> bytes: ...

    def is_eog(self, token: int) -> bool: ...

    def start(self, slot: int, sampling: SamplingParams, prompt: list[int], num_reused: int,
              generated: list[int] | None = None) -> int:
        """Give `slot` a fresh sampler for a sequence and keep at most `num_reused` positions of its memory; return
        how many it kept. `generated`: what the sequence output before it lost its slot to a request of higher
        priority; the sampler takes those tokens as it took them then (penalties, grammar), its random draw restarts."""
        ...

    def check_grammar(self, grammar: str) -> None:
        """Raise InvalidRequest unless `grammar` (GBNF) can constrain sampling; callable from any thread."""
        ...

    def check_adapters(self, adapters: tuple[Adapter, ...]) -> None:
        """Raise InvalidRequest unless the model can run with these LoRA adapters (files that fit it, within its
        limits); callable from any thread."""
        ...

    @property
    def adapter_bytes(self) -> int:
        """RAM the LoRA adapters it has loaded for requests hold (readable from any thread)."""
        ...

    @property
    def held_bytes(self) -> tuple[int, int]:
        """The bytes its weights and its KV cache hold now, as allocated (readable from any thread)."""
        ...

    @property
    def max_adapters(self) -> int:
        """The most LoRA adapters it keeps loaded at once (0: it runs none)."""
        ...

    def step(self, entries: list[BatchEntry], adapters: tuple[Adapter, ...] = ()) -> list[int | None]:
        """Decode the entries, every one under the LoRA `adapters` (() the model's own; the scheduler gives a step
        the sequences of one set)."""
        ...

    def release(self, slot: int) -> None: ...

    def clear(self, slot: int) -> None:
        """Drop everything the slot's memory holds; its sampler (a running sequence's) stays as it is."""
        ...

    def take_drafted(self, slot: int) -> list[int]:
        """The tokens the last `step` sampled for `slot` after its first one, verifying its entry's draft: the i-th
        was sampled after the i-th drafted token, because every earlier sample equalled the draft. The slot's memory
        keeps the pending token and the drafted tokens those samples accepted, nothing after them."""
        ...

    def draft(self, requests: dict[int, tuple[list[int], int]]) -> dict[int, list[int]]:
        """With a draft model (`info.draft_model`): for each slot → (its sequence's tokens, the last one not yet
        decoded; most tokens to draft), the tokens the draft model predicts next (maybe fewer, or none)."""
        ...

    def take_logprobs(self, slot: int) -> Ranked | None:
        """The ranked log-probabilities (engine/logprobs.py) of the token the last `step` sampled for `slot`, when
        its request asked for them (`SamplingParams.logprobs`); None otherwise."""
        ...

    def take_prompt_logprobs(self, slot: int) -> list[Ranked] | None:
        """With `SamplingParams.prompt_logprobs`, once the last `step` put the prompt's last token in: each prompt
        token's after the first, ranked under the raw distribution (engine/prompt_logprobs.py); None otherwise."""
        ...

    def take_scores(self, slot: int) -> list[float] | None:
        """log P(t) of each of the slot's `SamplingParams.score_tokens` at the place the last `step` sampled from
        (the raw distribution, engine/logprobs.py `score_tokens`); None when its request named none."""
        ...

    def copy_prefix(self, source: int, slot: int, length: int) -> bool:
        """Make `slot` hold the first `length` positions of `source`'s memory; False when it cannot."""
        ...

    def fork(self, source: int, slots: list[int]) -> list[int | None]:
        """Give each of `slots` (started, as `start` does) a whole copy of `source`'s memory, and sample each one's
        first token from the logits `source` sampled from in the last `step` (n choices of one prefilled prompt).

        None for a slot it could not fork (that slot's memory is then empty)."""
        ...

    def save_state(self, slot: int) -> SavedState | None:
        """The slot's whole memory state (a snapshot to restore later with `restore_state`); None while a copy into
        the slot waits for the next decode (its memory is not what it will be)."""
        ...

    def restore_state(self, slot: int, state: SavedState, length: int) -> bool:
        """Replace the slot's memory with a state from `save_state` and keep its first `length` positions (a model
        whose memory cannot be cut is given whole states only); False when it does not fit, or while a copy from or
        into the slot waits for the next decode (it would overwrite the state, or read it)."""
        ...

    def embed(self, tokens: list[int], adapters: tuple[Adapter, ...] = ()) -> list[float]:
        """The mean of the model's last hidden states over `tokens` (not normalized), with the LoRA `adapters`; uses no
        slot."""
        ...

    def rank_tokens(self, query: str, document: str, limit: int | None) -> list[int]:
        """A dedicated reranker's tokens for the pair (query, document), as it reads them; the document cut so they
        are at most `limit` where that is enough (None: never cut; the caller checks the length). InvalidRequest for
        a model that is not a reranker. Callable from any thread."""
        ...

    def rank(self, pairs: list[list[int]]) -> list[float]:
        """Each pair's (from `rank_tokens`, non-empty, at most `info.num_ctx` tokens) relevance score: the reranker
        head's logit, higher for a more relevant document. InvalidRequest for a model that is not a reranker."""
        ...

    def free_memory(self) -> None:
        """Sleep level 1: free the slots' KV cache, keeping the weights (no sequence runs); `restore_memory` makes it
        again, empty. InvalidRequest naming why where the backend cannot."""
        ...

    def restore_memory(self) -> None: ...

    def close(self) -> None: ...


def step_plan(backend: Backend, plan: list[tuple[Sequence, BatchEntry]]) -> list[int | None]:
    """Decode a step's plan (its sequences all of one adapter set): together, except that a scoring sequence's
    entries (SamplingParams.score_tokens) go each in a batch of its own first, so its scores do not depend on what else
    runs (batched kernels round differently for different batches). Not with a KV pool the slots share, where a later
    batch could find no room after an earlier one changed memory."""
    info = backend.info
    alone = [i for i, (seq, _) in enumerate(plan) if seq.sampling.score_tokens]
    shared_pool = 0 < info.num_kv_cells != info.num_ctx * info.num_parallel
    adapters = plan[0][0].adapters
    if not alone or len(plan) == 1 or shared_pool:
        return backend.step([entry for _, entry in plan], adapters)
    sampled: list[int | None] = [None] * len(plan)
    for i in alone:
        sampled[i] = backend.step([plan[i][1]], adapters)[0]
    rest = [i for i in range(len(plan)) if i not in set(alone)]
    if rest:
        for i, token in zip(rest, backend.step([plan[i][1] for i in rest], adapters), strict=True):
            sampled[i] = token
    return sampled
