"""A deterministic fake backend: no weights, same engine loop. For HTTP and scheduler tests.

Its vocabulary is the 256 byte values plus an end-of-generation token (256). A prompt's continuation is
a pure function of the prompt and the sampling seed, so a test can predict it (`FakeBackend.expected`).
"""

from __future__ import annotations

import threading
import time
import zlib
from pathlib import Path

import numpy as np

from lmserve.engine.logprobs import Ranked, score_tokens
from lmserve.engine.prompt_logprobs import PromptLogprobs
from lmserve.engine.protocol import ModelInfo, PromptImage
from lmserve.engine.slots.backend import BatchEntry, PoolFull
from lmserve.engine.slots.prompt_disk import SavedState
from lmserve.errors import InvalidRequest
from lmserve.types import Adapter, Bitmap, Media, SamplingParams

EOG = 256
EMBED_SIZE = 256
IMAGE_MARKER = "<image>"
PIXELS_PER_IMAGE_TOKEN = 256
_TEXT = b"The quick brown fox jumps over the lazy dog. "


class FakeBackend:
    """Decodes by echoing a fixed sentence, rotated by the prompt length and the seed."""

    def __init__(
        self, *, num_ctx: int = 2048, num_parallel: int = 4, eog_after: int | None = None, step_delay: float = 0.0,
        script: str | None = None, vision: bool = False, draft_model: bool = False, pool_size: int | None = None,
        num_ctx_train: int = 0, reranker: bool = False,
    ) -> None:
        self.info = ModelInfo(
            path="fake.gguf",
            architecture="fake",
            num_ctx=num_ctx,
            num_parallel=num_parallel,
            num_vocab=257,
            num_ctx_train=num_ctx_train,
            chat_template=None,
            image_marker=IMAGE_MARKER if vision else None,
            draft_model="fake-draft" if draft_model else None,
            num_kv_cells=pool_size if pool_size is not None else num_ctx * num_parallel,
            can_rank=reranker,
        )
        self.eog_after = eog_after
        self.step_delay = step_delay
        self.script = script.encode() if script is not None else None
        """When set, every sequence answers exactly these bytes, then ends."""
        self.steps: list[list[BatchEntry]] = []
        self.step_adapters: list[tuple[Adapter, ...]] = []
        """The adapter set of each step, in order (a sequence's adapters shift its text: `start`)."""
        self.slot_adapters: dict[int, tuple[Adapter, ...]] = {}
        self.copies: list[tuple[int, int, int]] = []
        self.forks: list[tuple[int, list[int]]] = []
        self._slots: dict[int, tuple[int, int]] = {}
        self._counts: dict[int, int] = {}
        self._score_tokens: dict[int, tuple[list[int], int]] = {}
        self._prompt_scoring: dict[int, PromptLogprobs] = {}
        self._prompt_ranked: dict[int, list[Ranked]] = {}
        """Slots whose request named score tokens → (those tokens, a hash of the prompt)."""
        self._drafted: dict[int, list[int]] = {}
        self.pool_size = pool_size
        """When set, the slots share a KV pool of this many positions (`--kv-unified`): a step that would hold more
        raises PoolFull and changes nothing."""
        self.held: dict[int, int] = {}
        """Positions each slot's memory holds (kept for every slot, counted against `pool_size`)."""
        self.num_full = 0
        """Steps refused with PoolFull."""
        self.draft_requests: list[dict[int, tuple[list[int], int]]] = []
        self.ranked: list[list[list[int]]] = []
        """The pairs of each `rank` call (a reranker's)."""
        self.unpaused = threading.Event()  # cleared, steps wait for it (as on a hung device they never return)
        self.unpaused.set()
        self.is_freed = False  # its memory freed (sleep level 1): a step now is an error
        self.fault: str | None = None
        """When set, every step and every release of a slot raises RuntimeError(fault), as a backend made unusable
        (a device fault) would: the next step fails, failing its requests releases their slots, which fails outside
        any step's handling and so ends the engine thread."""

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return list(text.encode("utf-8"))

    def tokenize_media(self, text: str, media: list[Media]) -> tuple[list[int], list[PromptImage]]:
        """Text as bytes; each marker becomes one position per 256 pixels (at least one) of its image. No audio."""
        images = [item for item in media if isinstance(item, Bitmap)]
        if len(images) != len(media):
            raise InvalidRequest("the fake engine hears no audio", param="messages")
        pieces = text.split(IMAGE_MARKER)
        if len(pieces) != len(images) + 1:
            raise InvalidRequest("the prompt's image markers do not match its images", param="images")
        tokens = list(pieces[0].encode("utf-8"))
        places: list[PromptImage] = []
        for image, piece in zip(images, pieces[1:], strict=True):
            length = max(1, image.width * image.height // PIXELS_PER_IMAGE_TOKEN)
            places.append(PromptImage(len(tokens), length, image))
            tokens += [-1 - zlib.crc32(image.rgb)] * length
            tokens += piece.encode("utf-8")
        return tokens, places

    def token_bytes(self, token: int, *, special: bool) -> bytes:
        return b"" if token == EOG else bytes([token])

    def is_eog(self, token: int) -> bool:
        return token == EOG

    def start(self, slot: int, sampling: SamplingParams, prompt: list[int], num_reused: int,
              generated: list[int] | None = None) -> int:
        shift = sum(round(Path(a.path).read_bytes()[0] * a.scale * 2) for a in sampling.adapters)  # their effect
        self._slots[slot] = (len(prompt) + (sampling.seed or 0) + shift, len(prompt))
        self.slot_adapters[slot] = sampling.adapters
        self._counts[slot] = len(generated or ())  # its text goes on where it stopped
        if sampling.score_tokens:
            self._score_tokens[slot] = (list(sampling.score_tokens), zlib.crc32(bytes(t % 256 for t in prompt)))
        else:
            self._score_tokens.pop(slot, None)
        self.held[slot] = num_reused
        self._prompt_ranked.pop(slot, None)
        if sampling.prompt_logprobs is None:
            self._prompt_scoring.pop(slot, None)
        else:
            self._prompt_scoring[slot] = PromptLogprobs(sampling.prompt_logprobs)
        return num_reused

    def prompt_row(self, token: int) -> np.ndarray:
        """The fake's logits after `token`: token t gets -((t + token) mod 7), whatever came before."""
        return -((np.arange(self.info.num_vocab) + token) % 7).astype(np.float32)

    def check_grammar(self, grammar: str) -> None:
        """Any grammar with a root rule passes; the fake never constrains what it echoes."""
        if "root ::=" not in grammar:
            raise InvalidRequest("the output grammar is invalid: it has no root rule")

    adapter_bytes = 0
    held_bytes = (0, 0)
    max_adapters = 4

    def check_adapters(self, adapters: tuple[Adapter, ...]) -> None:
        """An adapter is any existing file: its first byte times its scale times 2 shifts a sequence's text; a path that
        does not exist is refused."""
        for adapter in adapters:
            if not Path(adapter.path).is_file():
                raise InvalidRequest(f"LoRA adapter not found: {adapter.path}", param="lora")

    def step(self, entries: list[BatchEntry], adapters: tuple[Adapter, ...] = ()) -> list[int | None]:
        self.unpaused.wait()
        if self.fault is not None:
            raise RuntimeError(self.fault)
        if self.is_freed:
            raise AssertionError("a step ran on freed memory (asleep)")
        if any(self.slot_adapters.get(entry.slot, ()) != adapters for entry in entries):
            raise AssertionError("a step mixed sequences of different adapter sets")
        self.step_adapters.append(adapters)
        after = dict(self.held)
        for entry in entries:
            after[entry.slot] = entry.pos + entry.num_positions
        if self.pool_size is not None and sum(after.values()) > self.pool_size:
            self.num_full += 1
            raise PoolFull(f"{sum(after.values())} positions do not fit in a pool of {self.pool_size}")
        self.held = after
        self.steps.append(entries)
        if self.step_delay:
            time.sleep(self.step_delay)
        sampled: list[int | None] = []
        for entry in entries:
            scoring = self._prompt_scoring.get(entry.slot)
            if scoring is not None and not entry.draft:
                scoring.add(np.stack([self.prompt_row(t) for t in entry.tokens]), entry.tokens, last=entry.wants_sample)
                if entry.wants_sample:
                    self._prompt_ranked[entry.slot] = scoring.take()
                    del self._prompt_scoring[entry.slot]
            if not entry.wants_sample:
                sampled.append(None)
                continue
            first = token = self._next(entry.slot)
            draft = entry.tokens[len(entry.tokens) - entry.draft:]
            taken: list[int] = []
            while len(taken) < entry.draft and token == draft[len(taken)]:  # verify as a model would
                token = self._next(entry.slot)
                taken.append(token)
            self._drafted[entry.slot] = taken
            self.held[entry.slot] = entry.pos + len(entry.tokens) - entry.draft + len(taken)  # rejected: forgotten
            sampled.append(first)
        return sampled

    def take_drafted(self, slot: int) -> list[int]:
        return self._drafted.pop(slot, [])

    def take_prompt_logprobs(self, slot: int) -> list[Ranked] | None:
        return self._prompt_ranked.pop(slot, None)

    def take_logprobs(self, slot: int) -> None:
        """The fake ranks no tokens: a request that asks for log-probabilities gets none (not a failure)."""
        return None

    def take_scores(self, slot: int) -> list[float] | None:
        """A made-up distribution over the whole vocabulary, a function of the slot's prompt only: token t has logit
        -((t + a hash of the prompt) mod 7), so the same prompt scores the same wherever and with whatever it runs."""
        scored = self._score_tokens.get(slot)
        if scored is None:
            return None
        tokens, offset = scored
        logits = -((np.arange(self.info.num_vocab) + offset) % 7).astype(np.float64)
        return score_tokens(logits, tokens)

    def draft(self, requests: dict[int, tuple[list[int], int]]) -> dict[int, list[int]]:
        """With `draft_model`: guess that the sentence goes on after the first place the last token occurs in it
        (right after a unique letter, wrong after a repeated one, as a small model would be)."""
        self.draft_requests.append(requests)
        drafts: dict[int, list[int]] = {}
        for slot, (tokens, most) in requests.items():
            at = _TEXT.find(bytes([tokens[-1]])) if 0 <= tokens[-1] < 256 else -1
            drafts[slot] = [] if at < 0 else [_TEXT[(at + 1 + i) % len(_TEXT)] for i in range(most)]
        return drafts

    def _next(self, slot: int) -> int:
        """The slot's next token: a function of its prompt length, its seed and how many it produced."""
        offset, _ = self._slots[slot]
        count = self._counts[slot]
        self._counts[slot] = count + 1
        if self.script is not None:
            return self.script[count] if count < len(self.script) else EOG
        if self.eog_after is not None and count >= self.eog_after:
            return EOG
        return _TEXT[(offset + count) % len(_TEXT)]

    def release(self, slot: int) -> None:
        if self.fault is not None:
            raise RuntimeError(self.fault)
        self._slots.pop(slot, None)

    def clear(self, slot: int) -> None:
        self.held[slot] = 0

    def copy_prefix(self, source: int, slot: int, length: int) -> bool:
        """The fake's memory is positions counted (`held`); copies are recorded for tests (`copies`)."""
        self.copies.append((source, slot, length))
        self.held[slot] = length
        return True

    def fork(self, source: int, slots: list[int]) -> list[int | None]:
        """Each slot answers as a fresh sequence would (its own seed); forks are recorded for tests (`forks`)."""
        self.forks.append((source, list(slots)))
        self.held.update({slot: self.held.get(source, 0) for slot in slots})
        return [self._next(slot) for slot in slots]

    def save_state(self, slot: int) -> SavedState | None:
        return b"fake-state-%d" % slot

    def restore_state(self, slot: int, state: SavedState, length: int) -> bool:
        if bytes(state[:11]) != b"fake-state-":
            return False
        self.held[slot] = length
        return True

    def embed(self, tokens: list[int], adapters: tuple[Adapter, ...] = ()) -> list[float]:
        """A histogram of the token (byte) values, shifted by the adapters' effect (as their text: `start`): texts with
        the same bytes point the same way."""
        shift = sum(round(Path(a.path).read_bytes()[0] * a.scale * 2) for a in adapters)
        counts = [0.0] * EMBED_SIZE
        for token in tokens:
            counts[(token + shift) % EMBED_SIZE] += 1.0
        return counts

    def rank_tokens(self, query: str, document: str, limit: int | None) -> list[int]:
        """A reranker's pair: the query's bytes, EOG, then the document's bytes (cut to make at most `limit`)."""
        if not self.info.can_rank:
            raise InvalidRequest("this model is not a dedicated reranker", param="model")
        head = [*query.encode("utf-8"), EOG]
        body = list(document.encode("utf-8"))
        return head + (body if limit is None else body[: max(limit - len(head), 0)])

    def rank(self, pairs: list[list[int]]) -> list[float]:
        """How many distinct bytes of the query the document holds: a pure function of the pair."""
        if not self.info.can_rank:
            raise InvalidRequest("this model is not a dedicated reranker", param="model")
        self.ranked.append([list(pair) for pair in pairs])
        scores = []
        for pair in pairs:
            end = pair.index(EOG)
            scores.append(float(len(set(pair[:end]) & set(pair[end + 1:]))))
        return scores

    def free_memory(self) -> None:
        """Sleep level 1: every slot's memory forgotten; a step before `restore_memory` is an error."""
        self.held = {}
        self.is_freed = True

    def restore_memory(self) -> None:
        self.is_freed = False

    def close(self) -> None:
        pass

    @staticmethod
    def expected(prompt_len: int, num_tokens: int, seed: int = 0) -> str:
        """The text the fake produces for a prompt of `prompt_len` tokens."""
        offset = prompt_len + seed
        return bytes(_TEXT[(offset + i) % len(_TEXT)] for i in range(num_tokens)).decode()
