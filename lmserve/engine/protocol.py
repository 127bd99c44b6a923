"""The engine seam: what any engine offers the service (model facts, tokenizing, submitting, embedding).

llama.cpp (engine/slots/batching.py over engine/llamacpp/backend.py) is one implementation; a second engine
implements the same
protocol without the layers above (service, chat, store, api) changing.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from lmserve.errors import InvalidRequest
from lmserve.types import MAX_SCORE_TOKENS, Adapter, Chunk, Media, SamplingParams


@dataclass(frozen=True, slots=True)
class FimTokens:
    """Token ids of a fill-in-the-middle vocabulary (engine/fim.py finds them). `repo` and `separator`
    (repository-level FIM) are None when absent."""

    prefix: int
    suffix: int
    middle: int
    repo: int | None = None
    separator: int | None = None


@dataclass(slots=True)
class ModelInfo:
    """Facts about a loaded model that the layers above the engine need."""

    path: str
    architecture: str
    num_ctx: int
    """Context length per sequence in force (what -c asked for, capped at the trained length; or auto)."""
    num_parallel: int
    num_vocab: int
    num_ctx_train: int = 0
    """The context length the model was trained for (0: not known)."""
    chat_template: str | None = None
    bos_token: str = ""
    eos_token: str = ""
    size_bytes: int = 0
    num_params: int = 0
    description: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    image_marker: str | None = None
    """The text that stands for one image in a prompt; None when the model has no vision projector."""
    audio_marker: str | None = None
    """The text that stands for one audio clip in a prompt; None when the model has no audio encoder."""
    audio_rate: int = 0
    """The sample rate (Hz) the model's audio encoder takes clips at; 0 when it has none."""
    audio_missing: str = ""
    """Why this engine cannot hear any model's clips, where it cannot (said in the 400 for a clip); "" otherwise."""
    transcriber: bool = False
    """A speech-to-text model with an encoder and a decoder (Whisper): it answers transcriptions and translations
    only; its prompt is its decoder's (chat/whisper.py) and a clip goes to its encoder (`tokenize_media`)."""
    can_cut_memory: bool = True
    """A slot's memory can be cut at any position (attention KV only); False for hybrid/recurrent models, whose
    state at a prefix must be saved as a snapshot to be reused."""
    engine: str = "llamacpp"
    """Which engine serves the model (`llamacpp`, `vllm`)."""
    can_embed: bool = True
    """`embed_tokens` works (pooled hidden states)."""
    can_constrain: bool = True
    """`SamplingParams.grammar` (GBNF) is honoured: structured output and forced tool calls."""
    fim: FimTokens | None = None
    """The vocabulary's fill-in-the-middle tokens (engine/fim.py); None: the model cannot fill in (no `suffix`)."""
    draft_model: str | None = None
    """The name of the model that drafts for speculative decoding (`--model-draft`); None: drafts come from the
    sequence's own context (prompt lookup)."""
    can_rank: bool = False
    """A dedicated reranker (a relevance head: llama.cpp's rank pooling, vLLM's score task): `rank` scores
    (query, document) pairs. Any chat model reranks too, judged (service/judging.py)."""
    inert_load_options: frozenset[str] = frozenset()
    """LoadOptions fields that change nothing on this instance (GPU placement where the engine has no GPU to
    offload to): a request whose load options differ from the loaded ones only in these is served by it."""
    num_kv_cells: int = 0
    """Cells (one token each) in the KV cache of all slots together: `num_ctx` * `num_parallel`, or `num_ctx` when
    the slots share one pool (--kv-unified); 0: not known (engines whose cache is not cells)."""

    @property
    def has_vision(self) -> bool:
        return self.image_marker is not None


@dataclass(slots=True, eq=False)
class PromptImage:
    """An image's place in a tokenized prompt: `length` positions from `start`, encoded by the backend.

    Those positions hold one placeholder id (negative, derived from the image's pixels, so the same image
    gives the same placeholders and a slot's prefix cache can match it). `handle` is the backend's own
    record of the preprocessed image.
    """

    start: int
    length: int
    handle: object

    @property
    def end(self) -> int:
        return self.start + self.length




@dataclass(slots=True)
class EngineStats:
    """Where an engine's time went since it was loaded, in nanoseconds (for /metrics)."""

    step_ns: int = 0
    """Wall time spent in decode steps (scheduling, decoding, sampling, detokenizing)."""
    decode_ns: int = 0
    """The part of `step_ns` inside the model's forward pass and sampling: the rest is overhead."""
    progress: int = 0
    """Grows with every decode step (the slot engines) or output (vLLM's deltas) since load: what the decode health
    check (service/decode_health.py) watches move while the engine works."""
    kv_cache_usage: float | None = None
    """The fraction of the KV cache in use, 0 to 1 (None: the engine does not say)."""
    kv_block_size: int = 0
    """Tokens per block of the KV cache: vLLM's paged blocks; 1 on llama.cpp, whose cache is cells of one token each
    (0: the engine does not say)."""
    kv_num_blocks: int = 0
    """Blocks in the KV cache: vLLM's num_gpu_blocks; llama.cpp's cells, its context's n_ctx for all slots together
    (0: the engine does not say). Its capacity in tokens is kv_block_size * kv_num_blocks."""
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache since load."""
    prefix_cache_hits: int = 0
    """Of those, tokens found (their prefill was skipped)."""
    preemptions: int = 0
    """Sequences evicted to make room and recomputed later, since load."""
    cache_hits: dict[str, int] = field(default_factory=dict)
    """Prompts that reused a saved prefix, by tier (slot, ram, disk; engines with a prompt cache beyond the slots)."""
    cache_tokens: dict[str, int] = field(default_factory=dict)
    """Prompt tokens not computed again, by tier."""
    cache_misses: int = 0
    """Prompts that found nothing to reuse."""
    cache_bytes: int = 0
    """RAM this model's entries hold in the prompt cache beyond the slots."""
    adapter_bytes: int = 0
    """RAM the LoRA adapters loaded for requests hold (engines that load them per request)."""
    weights_bytes: int = 0
    """What the loaded weights hold, as the engine allocated them (0: the engine does not say)."""
    kv_bytes: int = 0
    """What the KV cache holds now, as allocated: 0 while it sleeps at level 1 (and where the engine does not say)."""
    max_adapters: int = 0
    """LoRA adapters it keeps loaded at once (--max-loras); 0: it runs none per request."""
    running_adapters: tuple[str, ...] = ()
    """The names of the adapters of the requests running now, and of those waiting (vLLM's lora_requests_info)."""
    waiting_adapters: tuple[str, ...] = ()


class GenerationStream(Protocol):
    """The output of one submitted prompt: chunks in order, the last one with a finish reason and usage."""

    def __aiter__(self) -> AsyncIterator[Chunk]: ...

    def abort(self) -> None:
        """Stop generating and free what the request holds; no further chunk arrives."""
        ...

    @property
    def prompt_tokens(self) -> list[int]: ...

    @property
    def output_tokens(self) -> list[int]:
        """The tokens generated so far."""
        ...


class Engine(Protocol):
    """A loaded model, as the service uses it: facts, tokenizing, generation streams, embeddings.

    Methods are called from the event loop's thread; an implementation keeps its own threads and processes.
    """

    info: ModelInfo

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]: ...

    def detokenize(self, tokens: list[int]) -> str: ...

    def token_bytes(self, token: int) -> bytes:
        """The bytes of one token's text, special tokens as their text (a piece may be part of a UTF-8 character)."""
        ...

    def tokenize_media(self, text: str, media: list[Media]) -> tuple[list[int], list[PromptImage]]:
        """Tokenize `text` in which each `info.image_marker` or `info.audio_marker` stands for the next of `media`
        (images, and clips at `info.audio_rate`; specials parsed).

        Blocking (media are preprocessed, maybe encoded): call it off the event loop.
        """
        ...

    def submit(
        self, prompt: list[int], sampling: SamplingParams, *, special: bool = False,
        images: list[PromptImage] | None = None, checkpoints: list[int] | None = None,
    ) -> GenerationStream:
        """Queue a prompt (token ids; `images` placed in it) for generation.

        `special` keeps special tokens in the text (tool-call markers often are). `checkpoints` are prompt
        positions worth remembering for later prompts that share them (e.g. the end of the system prompt); with a
        `reuse_limit` (SamplingParams), the ends of stretches each computed in one piece. Raises ContextOverflow,
        InvalidRequest (bad ids, bad grammar) or Overloaded (queue full).
        """
        ...

    def submit_many(
        self, prompt: list[int], sampling: SamplingParams, n: int, *, special: bool = False,
        images: list[PromptImage] | None = None, checkpoints: list[int] | None = None,
    ) -> Sequence[GenerationStream]:
        """Queue `n` choices of one prompt (the OpenAI `n`): the prompt is computed once and shared by all of them.

        Choice i samples with `choice_sampling(sampling, i)` (a fixed seed gives seed + i). The n sequences count
        against the queue bound; more than the engine can ever hold is InvalidRequest (param "n"), a full queue
        Overloaded. Otherwise as `submit`.
        """
        ...

    def embedding_tokens(self, text: str, *, truncate: bool = True) -> list[int]:
        """`text` tokenized for embedding: cut to the context when `truncate`, else ContextOverflow."""
        ...

    async def embed_tokens(self, prompts: list[list[int]], *, normalize: bool = True,
                           adapters: tuple[Adapter, ...] = ()) -> list[list[float]]:
        """One pooled vector per token list (unit length unless `normalize` is false), computed with the LoRA
        `adapters` (a model made with ADAPTER)."""
        ...

    async def rank(self, query: str, documents: list[str], *, truncate: bool = True) -> list[float]:
        """A dedicated reranker's (`info.can_rank`) relevance of each document to `query`: its head's raw score (a
        logit; higher is more relevant). A pair longer than the context is cut to it when `truncate`, else it is a
        ContextOverflow. InvalidRequest for a model that is not a reranker."""
        ...

    def fail_all(self, message: str) -> None:
        """End every request in flight with an error chunk carrying `message`."""
        ...

    @property
    def failure(self) -> str | None:
        """Why the engine can no longer answer (its engine process died, its thread ended on an error), or None
        while it works. A failed engine stays failed: its requests in flight have ended with an error, new ones are
        refused, and the service closes it and opens another."""
        ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def stats(self) -> EngineStats: ...

    async def sleep(self) -> None:
        """Sleep level 1: free the KV cache and the slots, keep the weights; the next request or `wake_up` makes them
        again. Conflict while requests run; InvalidRequest naming why where the engine cannot."""
        ...

    async def wake_up(self) -> None: ...

    def close(self) -> None:
        """Free the model; requests still in flight end with an error."""
        ...


def check_choices(n: int, info: ModelInfo, max_queue: int) -> None:
    """InvalidRequest (param "n") unless `n` choices of one prompt can ever be held: at least one, and no more than
    the slots (--parallel) and the queue (LMSERVE_MAX_QUEUE) together."""
    if n < 1:
        raise InvalidRequest("n must be at least 1", param="n")
    if n > info.num_parallel + max_queue:
        raise InvalidRequest(f"n={n} choices is more than this model can ever hold: {info.num_parallel} running "
                             f"(--parallel) and {max_queue} waiting (LMSERVE_MAX_QUEUE)", param="n")


def choice_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """The sampling of choice `index` of n: with a fixed seed, seed + index (different choices, reproducible), as
    vLLM does for its own `n`; otherwise the same (each choice draws a random seed of its own)."""
    if index == 0 or sampling.seed is None:
        return sampling
    return replace(sampling, seed=sampling.seed + index, logit_bias=dict(sampling.logit_bias), stop=list(sampling.stop))


def unit_vector(vector: list[float]) -> list[float]:
    """`vector` scaled to L2 norm 1 (a zero vector stays zero)."""
    norm = math.sqrt(math.fsum(x * x for x in vector))
    return [x / norm for x in vector] if norm > 0 else list(vector)


def check_score_tokens(sampling: SamplingParams, num_vocab: int) -> None:
    """InvalidRequest unless `sampling.score_tokens` are at most MAX_SCORE_TOKENS ids of the vocabulary."""
    if len(sampling.score_tokens) > MAX_SCORE_TOKENS:
        raise InvalidRequest(f"at most {MAX_SCORE_TOKENS} tokens can be scored at once", param="score_tokens")
    if any(not 0 <= token < num_vocab for token in sampling.score_tokens):
        raise InvalidRequest(f"score token ids must be in [0, {num_vocab}) for this model", param="score_tokens")


def check_no_adapters(engine: str, adapters: tuple[Adapter, ...]) -> None:
    """InvalidRequest (param "lora") for LoRA adapters on an engine that does not run them per request, naming it."""
    if adapters:
        raise InvalidRequest(f"the {engine} engine does not run LoRA adapters per request: serve this model with "
                             "--engine llamacpp (GGUF weights and a GGUF LoRA) to use them", param="lora")
