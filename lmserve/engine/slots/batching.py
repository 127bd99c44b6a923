"""The batching engine: one thread runs the scheduler and a slot backend; asyncio callers get a stream per request.

`BatchingEngine` implements the engine seam (engine/protocol.py) over any `Backend` (engine/slots/backend.py): llama.cpp
in production, the fake backend in tests. This module is the only bridge between the engine thread and asyncio.
A request is submitted from the event loop; the engine thread decodes, detokenizes and matches stop strings,
and hands finished pieces back to the event loop in one callback per step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from lmserve.engine.detokenize import IncrementalDecoder
from lmserve.engine.logprobs import LogprobAligner, token_logprob
from lmserve.engine.protocol import (
    EngineStats,
    ModelInfo,
    PromptImage,
    check_choices,
    check_score_tokens,
    choice_sampling,
    unit_vector,
)
from lmserve.engine.slots.backend import Backend, BatchEntry, PoolFull
from lmserve.engine.slots.drafting import DraftLength, NgramDrafter
from lmserve.engine.slots.prompt_cache import CacheStats, PromptCache, Tier
from lmserve.engine.slots.scheduler import Phase, Scheduler, Sequence
from lmserve.engine.stops import StopMatcher
from lmserve.errors import ContextOverflow, EngineFailure, EngineStopped, InvalidRequest, LmserveError, Overloaded
from lmserve.types import Bitmap, Chunk, FinishReason, SamplingParams, Timings, TokenLogprob, Usage

log = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 256 * 2**20
"""The prompt cache of an engine made without one (tests, library use): RAM only."""


class RequestStream:
    """Output of one submitted request: an async iterator of chunks, the last one with a finish reason."""

    def __init__(self, engine: BatchingEngine, seq: Sequence, loop: asyncio.AbstractEventLoop) -> None:
        self._engine = engine
        self.seq = seq
        self.loop = loop
        self.queue: asyncio.Queue[Chunk] = asyncio.Queue()
        self.is_done = False

    @property
    def prompt_tokens(self) -> list[int]:
        return self.seq.prompt

    @property
    def output_tokens(self) -> list[int]:
        return self.seq.output

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        while not self.is_done:
            chunk = await self.queue.get()
            if chunk.finish_reason is not None:
                self.is_done = True
            yield chunk

    def abort(self) -> None:
        """Stop generating; the slot and its memory are freed before the next step."""
        if not self.is_done:
            self.is_done = True
            self._engine.abort(self.seq)


@dataclass(slots=True, eq=False)
class _Tracker:
    """Per-request state the engine thread keeps beside the scheduler's sequence."""

    stream: RequestStream
    decoder: IncrementalDecoder = field(default_factory=IncrementalDecoder)
    stops: StopMatcher = field(default_factory=lambda: StopMatcher([]))
    submitted_ns: int = 0
    admitted_ns: int = 0
    first_token_ns: int = 0
    is_stop_hit: bool = False
    logprobs: LogprobAligner | None = None
    """With `SamplingParams.logprobs`: the tokens whose text is not out yet (made at the first token)."""
    drafter: DraftLength | None = None
    """With speculative decoding: the adaptive draft length, and with prompt lookup (an NgramDrafter) the n-gram
    index of the prompt and output (made at the first draft)."""
    num_drafted: int = 0
    num_accepted: int = 0
    scores: list[float] = field(default_factory=list)
    """With `SamplingParams.score_tokens`: their log-probabilities at the first token (for the final chunk)."""


@dataclass(slots=True, eq=False)
class _EmbedJob:
    """One text to embed; the engine thread settles `future` on `loop`."""

    tokens: list[int]
    future: asyncio.Future[list[float]]
    loop: asyncio.AbstractEventLoop


@dataclass(slots=True, eq=False)
class _RankJob:
    """(query, document) pairs for a dedicated reranker to score, in the embedding jobs' queue; the engine thread
    settles `future` on `loop` with one score per pair."""

    pairs: list[list[int]]
    future: asyncio.Future[list[float]]
    loop: asyncio.AbstractEventLoop


class BatchingEngine:
    """Continuous batching over a backend. Thread-safe `submit`/`abort`/`embed`; the rest runs in its thread.

    Embedding jobs share the engine thread with decoding (llama.cpp is not thread-safe): the thread runs
    at most one of them between two decode steps, so generations keep moving while texts are embedded.
    """

    def __init__(
        self, backend: Backend, *, max_batch_tokens: int = 512, max_prefill_tokens: int = 256, max_queue: int = 512,
        prompt_cache: PromptCache | None = None, cache_key: str = "", slot_similarity: float = 0.5,
        draft_max: int = 0,
    ) -> None:
        self.backend = backend
        self.draft_max = draft_max
        """Speculative decoding's draft cap for requests that do not set their own (SamplingParams.draft_max)."""
        self.max_queue = max_queue
        """Requests allowed to wait for a slot; beyond it `submit` raises Overloaded (503)."""
        self.info: ModelInfo = backend.info
        self.cache = prompt_cache if prompt_cache is not None else PromptCache(DEFAULT_CACHE_BYTES)
        """Saved prompt states beyond the slots (engine/slots/prompt_cache.py), maybe shared with other engines."""
        self.cache_key = cache_key or f"engine-{id(self):x}"
        """This model's name in the prompt cache: the weights and the load options that shape its states."""
        self.cache_stats = CacheStats()
        self._snapshots = not backend.info.can_cut_memory and self.cache.ram_budget > 0
        """A model whose memory cannot be cut also saves its state at the end of prompts and at checkpoints."""
        self.scheduler = Scheduler(backend.info.num_parallel, max_batch_tokens, max_prefill_tokens,
                                   can_copy=backend.info.can_cut_memory, can_snapshot=self._snapshots,
                                   slot_similarity=slot_similarity)
        self._trackers: dict[Sequence, _Tracker] = {}
        self._judged: set[int] = set()
        """Slots whose last sequence only scored (SamplingParams.score_tokens): the tail it left is not worth saving
        in the prompt cache (its shared beginning is saved, or held by another slot, already)."""
        self._inbox: list[Sequence] = []
        self._aborts: list[Sequence] = []
        self._embeds: deque[_EmbedJob | _RankJob] = deque()
        self._failure: str | None = None
        self._death: str | None = None
        """Why the engine thread ended before the engine was closed (`failure`)."""
        self._cond = threading.Condition()
        self._is_closing = False
        self.step_ns = 0
        """Wall time the engine thread spent in decode steps (scheduling, decoding, sampling, detokenizing)."""
        self.decode_ns = 0
        """The part of `step_ns` inside the backend's batch decode and sampling: the rest is Python overhead."""
        self.num_evicted = 0
        """Idle slots' prefix caches dropped to make room in a shared KV pool (`--kv-unified`)."""
        self.num_parked = 0
        """Running sequences paused (and later recomputed) to make room in a shared KV pool."""
        self.num_preempted = 0
        """Sequences that gave their slot to a request of higher priority (and later recomputed)."""
        self.num_prompt_tokens = 0
        """Prompt tokens of the sequences admitted since load (what the prefix and prompt caches were asked for)."""
        self._thread = threading.Thread(target=self._run, name="lmserve-engine", daemon=True)
        self._thread.start()

    # ---- called from the event loop -------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self.backend.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.backend.token_bytes(t, special=False) for t in tokens).decode("utf-8", "replace")

    def token_bytes(self, token: int) -> bytes:
        return self.backend.token_bytes(token, special=True)

    def tokenize_images(self, text: str, images: list[Bitmap]) -> tuple[list[int], list[PromptImage]]:
        """Tokenize a prompt in which each `info.image_marker` stands for the next image (see Backend)."""
        if self.info.image_marker is None:
            raise InvalidRequest("this model has no vision projector; images are not supported", param="images")
        return self.backend.tokenize_images(text, images)

    def submit(
        self, prompt: list[int], sampling: SamplingParams, *, special: bool = False,
        images: list[PromptImage] | None = None, checkpoints: list[int] | None = None,
    ) -> RequestStream:
        """Queue a request; raise ContextOverflow when the prompt cannot fit in one sequence's context.

        `images` are the places of images in `prompt` (from `tokenize_images`); every other position must be
        a token id of the vocabulary, and the prompt must end with text (the next token is sampled after it).
        `checkpoints` are prompt positions worth a snapshot (e.g. the end of the system prompt) for a model whose
        memory cannot be cut; other models ignore them, but for a sequence with a `reuse_limit`, whose prefill stops
        at each (SamplingParams.reuse_limit).
        """
        return self.submit_many(prompt, sampling, 1, special=special, images=images, checkpoints=checkpoints)[0]

    def submit_many(
        self, prompt: list[int], sampling: SamplingParams, n: int, *, special: bool = False,
        images: list[PromptImage] | None = None, checkpoints: list[int] | None = None,
    ) -> list[RequestStream]:
        """Queue `n` choices of one prompt (as `submit`): the first prefills it; the others admitted meanwhile copy
        its whole memory when it is done and sample their first token from the same logits (see the scheduler).

        Choice i samples with `choice_sampling(sampling, i)`. The n sequences count against the queue: Overloaded
        when the queue is full or slots and queue cannot take all n now; InvalidRequest when they never could.
        """
        if self.info.can_rank:
            raise InvalidRequest("model is a reranker: it scores documents against a query (rerank) and generates "
                                 "no text", param="model")
        num_ctx = self.info.num_ctx
        check_choices(n, self.info, self.max_queue)
        images = images or []
        if not prompt:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if len(prompt) >= num_ctx:
            raise ContextOverflow(len(prompt), num_ctx, self.info.num_ctx_train)
        num_vocab = self.info.num_vocab
        _check_prompt(prompt, images, num_vocab)
        if any(not 0 <= token < num_vocab for token in sampling.logit_bias):
            raise InvalidRequest(f"logit_bias token ids must be in [0, {num_vocab}) for this model", param="logit_bias")
        check_score_tokens(sampling, num_vocab)
        if sampling.grammar is not None:
            if sampling.ignore_eos:  # the grammar ends the output; with the end token banned it could not
                raise InvalidRequest("ignore_eos cannot be combined with structured output", param="ignore_eos")
            self.backend.check_grammar(sampling.grammar)
        room = num_ctx - len(prompt)
        max_new = room if sampling.max_tokens is None else min(sampling.max_tokens, room)
        scored = sampling.prompt_logprobs is not None  # each choice computes its whole prompt, for its logprobs
        if scored:
            sampling = replace(sampling, reuse_limit=0)
        seqs = [Sequence(prompt=list(prompt), sampling=choice_sampling(sampling, i), max_new_tokens=max_new,
                         special=special, images=list(images)) for i in range(n)]
        leader = seqs[0]
        for seq in seqs[1:]:
            seq.fork_of = None if scored else leader
        if checkpoints and (self._snapshots or sampling.reuse_limit is not None):  # snapshots, or stretches to
            # compute in one piece (SamplingParams.reuse_limit)
            inside = [c for c in checkpoints if 0 < c < len(prompt) - 1 and leader.cut_outside_images(c) == c]
            leader.checkpoints = sorted(set(inside))
        if self._snapshots and n > self.info.num_parallel:
            # Some choices must wait for a slot: the state before the prompt's last token lets them skip the prompt.
            leader.checkpoints = sorted({*leader.checkpoints, leader.cut_outside_images(len(prompt) - 1)} - {0})
        loop = asyncio.get_running_loop()
        submitted = time.perf_counter_ns()
        streams = [RequestStream(self, seq, loop) for seq in seqs]
        with self._cond:
            if self._is_closing:
                raise InvalidRequest("the server is shutting down")
            if self._death is not None:
                raise EngineStopped(f"the engine stopped: {self._death}")
            # submitted sequences not yet admitted take the free slots first: only the rest wait (a burst of as many
            # requests as free slots is admitted whole, whatever the queue's size)
            num_free = max(self.info.num_parallel - len(self.scheduler.running), 0)  # read across threads: an estimate
            num_queued = len(self._inbox) + len(self.scheduler.waiting)
            num_waiting = max(num_queued - num_free, 0)
            if num_queued + n - num_free > self.max_queue:
                raise Overloaded(f"{num_waiting} sequences are already waiting for this model (at most "
                                 f"{self.max_queue}); retry shortly")
            for seq, stream in zip(seqs, streams, strict=True):
                self._trackers[seq] = _Tracker(stream=stream, stops=StopMatcher(seq.sampling.stop),
                                               submitted_ns=submitted)
            self._inbox += seqs
            self._cond.notify()
        return streams

    def embedding_tokens(self, text: str, *, truncate: bool = True) -> list[int]:
        """`text` tokenized for embedding: cut to one sequence's context when `truncate`, else ContextOverflow."""
        tokens = self.tokenize(text)
        if not tokens:
            raise InvalidRequest("the input to embed is empty", param="input")
        num_ctx = self.info.num_ctx
        if len(tokens) > num_ctx:
            if not truncate:
                raise _input_overflow(len(tokens), num_ctx, self.info.num_ctx_train)
            tokens = tokens[:num_ctx]
        return tokens

    async def embed(self, texts: list[str], *, truncate: bool = True, normalize: bool = True) -> list[list[float]]:
        """One vector per text (unit length unless `normalize` is false), computed on the engine thread."""
        prompts = [self.embedding_tokens(text, truncate=truncate) for text in texts]
        return await self.embed_tokens(prompts, normalize=normalize)

    async def embed_tokens(self, prompts: list[list[int]], *, normalize: bool = True) -> list[list[float]]:
        """One vector per token list; each list must be non-empty and fit in one sequence's context."""
        for tokens in prompts:
            if not tokens:
                raise InvalidRequest("the input to embed is empty", param="input")
            if len(tokens) > self.info.num_ctx:
                raise _input_overflow(len(tokens), self.info.num_ctx, self.info.num_ctx_train)
        loop = asyncio.get_running_loop()
        jobs = [_EmbedJob(list(tokens), loop.create_future(), loop) for tokens in prompts]
        with self._cond:
            if self._is_closing:
                raise InvalidRequest("the server is shutting down")
            if self._death is not None:
                raise EngineStopped(f"the engine stopped: {self._death}")
            self._embeds.extend(jobs)
            self._cond.notify()
        try:
            vectors = await asyncio.gather(*(job.future for job in jobs))
        finally:
            for job in jobs:
                job.future.cancel()  # no-op for settled ones; the thread skips the rest
        return [unit_vector(v) for v in vectors] if normalize else list(vectors)

    async def rank(self, query: str, documents: list[str], *, truncate: bool = True) -> list[float]:
        """A dedicated reranker's relevance logit of each document to `query` (see the Engine protocol), computed on
        the engine thread. A pair longer than one sequence's context has its document cut when `truncate`, else it is
        a ContextOverflow (param "documents")."""
        if not self.info.can_rank:
            raise InvalidRequest("this model is not a dedicated reranker; it reranks by judging relevance",
                                 param="model")
        pairs = [self._rank_pair(query, document, truncate) for document in documents]
        if not pairs:
            return []
        loop = asyncio.get_running_loop()
        job = _RankJob(pairs, loop.create_future(), loop)
        with self._cond:
            if self._is_closing:
                raise InvalidRequest("the server is shutting down")
            if self._death is not None:
                raise EngineStopped(f"the engine stopped: {self._death}")
            self._embeds.append(job)
            self._cond.notify()
        try:
            return list(await job.future)
        finally:
            job.future.cancel()  # no-op once settled; the thread skips a cancelled job

    def _rank_pair(self, query: str, document: str, truncate: bool) -> list[int]:
        """The reranker's tokens of (query, document), fitted to one sequence's context (see `rank`)."""
        num_ctx = self.info.num_ctx
        pair = self.backend.rank_tokens(query, document, num_ctx if truncate else None)
        if len(pair) > num_ctx:
            error = ContextOverflow(len(pair), num_ctx, self.info.num_ctx_train)
            error.param = "documents"
            raise error
        if not pair:
            raise InvalidRequest("a query and document make no tokens to rank", param="documents")
        return pair

    def abort(self, seq: Sequence) -> None:
        with self._cond:
            self._aborts.append(seq)
            self._cond.notify()

    def fail_all(self, message: str) -> None:
        """End every request in flight with an error chunk carrying `message` (graceful shutdown's deadline).

        The streams end now, whatever step the engine thread is in (one step of a busy machine can take seconds, and
        the deadline must not wait for it); the thread frees their sequences after its step (what it sends them
        after their error chunk is never read)."""
        with self._cond:
            self._failure = message
            trackers = list(self._trackers.values())  # one call: the engine thread drops trackers without the lock
            self._cond.notify()
        self._deliver([(tracker.stream, Chunk(finish_reason="error", error=message)) for tracker in trackers])

    @property
    def failure(self) -> str | None:
        """Why the engine thread ended on an error (it then ended every request), or None while it runs."""
        return self._death

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self._inbox)

    @property
    def stats(self) -> EngineStats:
        cache = self.cache_stats
        cells = self.info.num_kv_cells or self.info.num_ctx * self.info.num_parallel
        usage = min(1.0, self.scheduler.num_held_tokens() / cells)
        return EngineStats(step_ns=self.step_ns, decode_ns=self.decode_ns,
                           preemptions=self.num_parked + self.num_preempted,
                           kv_cache_usage=usage, kv_block_size=1, kv_num_blocks=cells,
                           prefix_cache_queries=self.num_prompt_tokens, prefix_cache_hits=sum(cache.tokens.values()),
                           cache_hits={str(k): v for k, v in cache.hits.items()},
                           cache_tokens={str(k): v for k, v in cache.tokens.items()}, cache_misses=cache.misses,
                           cache_bytes=self.cache.model_bytes(self.cache_key))

    def close(self) -> None:
        with self._cond:
            self._is_closing = True
            self._cond.notify()
        self._thread.join()
        try:
            if self._death is None:  # a failed engine's slots may hold anything: none is saved
                for slot, tokens in enumerate(self.scheduler.slot_tokens):
                    self._save(slot, tokens, 0)  # so a returning conversation skips its prefill after a reload
        except Exception:  # a model that cannot save its slots still closes
            log.exception("saving the slots' prompts on close failed")
        self.backend.close()

    # ---- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        """The engine thread: steps until the engine closes. An error that escapes a step's own handling ends the
        thread: the engine has failed (`failure`), and every request in flight ends with an error."""
        try:
            self._loop()
        except BaseException as exc:
            log.exception("the engine thread failed")
            self._die(f"its engine thread failed: {type(exc).__name__}: {exc}")

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (
                    self._inbox or self._aborts or self._embeds or self.scheduler.has_work or self._is_closing
                    or self._failure
                ):
                    self._cond.wait()
                if self._is_closing:
                    break
                failure, self._failure = self._failure, None
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
                job = self._embeds.popleft() if self._embeds else None
            for seq in inbox:
                self.scheduler.add(seq)
            for seq in aborts:
                self._drop(seq)
            if failure is not None:
                self._fail_all(failure)
            if job is not None:
                self._embed(job)
            started = time.perf_counter_ns()
            try:
                self._step()
            except Exception as exc:  # a failed decode fails the requests in it, never the thread
                log.exception("engine step failed")
                self._fail_all(str(exc))
            self.step_ns += time.perf_counter_ns() - started
        self._fail_all("the server is shutting down")
        while self._embeds:
            self._settle(self._embeds.popleft(), None, EngineFailure("the server is shutting down"))

    def _embed(self, job: _EmbedJob | _RankJob) -> None:
        if job.future.cancelled():  # the caller is gone (a benign race: at worst one wasted embedding)
            return
        try:
            vector = self.backend.embed(job.tokens) if isinstance(job, _EmbedJob) else self.backend.rank(job.pairs)
        except LmserveError as exc:
            self._settle(job, None, exc)
        except Exception as exc:  # a failed embedding fails its request, never the thread
            what = "embedding" if isinstance(job, _EmbedJob) else "ranking"
            log.exception("%s failed", what)
            self._settle(job, None, EngineFailure(f"{what} failed: {exc}"))
        else:
            self._settle(job, vector, None)

    @staticmethod
    def _settle(job: _EmbedJob | _RankJob, vector: list[float] | None, error: Exception | None) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            job.loop.call_soon_threadsafe(_set_future, job.future, vector, error)

    def _step(self) -> None:
        outbox: list[tuple[RequestStream, Chunk]] = []
        now = time.perf_counter_ns()
        while (victim := self.scheduler.preemptible()) is not None:
            slot = victim.slot
            self.scheduler.preempt(victim)
            self.backend.release(slot)
            self.num_preempted += 1
        while self.scheduler.can_admit():
            seq = self.scheduler.admit()
            tracker = self._trackers[seq]
            if not tracker.admitted_ns:  # not when it comes back after a preemption
                tracker.admitted_ns = now
                self.num_prompt_tokens += len(seq.prompt)
            self.scheduler.reused(seq, self._start(seq))
        for seq, source, length in self.scheduler.ready_shares():
            if self.backend.copy_prefix(source, seq.slot, length):
                self.scheduler.reused(seq, length)
            else:
                self.scheduler.reused(seq, self._restore_cached(seq, seq.num_prefilled)[0] or seq.num_prefilled)
        self._draft([seq for seq in self.scheduler.running if seq.phase is Phase.DECODING])
        decode_started = time.perf_counter_ns()
        decoded = self._decode(outbox)
        now = time.perf_counter_ns()
        self.decode_ns += now - decode_started
        if decoded is None:
            self._deliver(outbox)
            return
        plan, sampled = decoded
        forked: list[tuple[Sequence, int]] = []
        for (seq, entry), token in zip(plan, sampled, strict=True):
            if seq.phase is Phase.PREFILLING:
                is_done = self.scheduler.prefilled(seq, entry.num_positions)
                if self._snapshots and (
                        (is_done and not seq.sampling.score_tokens) or seq.num_prefilled in seq.checkpoints):
                    self._snapshot(seq)
                if is_done:
                    forked += self._fork(seq)
            if token is not None:
                tokens = [token, *self.backend.take_drafted(seq.slot)] if entry.draft else [token]
                if entry.draft:
                    self._drafted(seq, entry.draft, len(tokens) - 1)
                for taken in tokens:
                    if seq not in self._trackers:  # finished by an earlier one (its end, a stop, the limit)
                        break
                    self._take(seq, taken, now, outbox)
        for seq, token in forked:
            self._take(seq, token, now, outbox)
        self._deliver(outbox)

    def _snapshot(self, seq: Sequence) -> None:
        """Save the state of `seq`'s slot after the prompt positions it has prefilled (a model that cannot cut its
        memory shares prefixes so), unless the prompt cache holds that state already."""
        held = seq.prefill_tokens[: seq.num_prefilled]
        if self.cache.covers(self.cache_key, held, False):
            return
        snapshot = self.backend.save_state(seq.slot)
        if snapshot is not None:
            self.cache.put(self.cache_key, held, snapshot, can_cut=False)

    def _decode(
        self, outbox: list[tuple[RequestStream, Chunk]]
    ) -> tuple[list[tuple[Sequence, BatchEntry]], list[int | None]] | None:
        """Plan a step and decode it: the plan and the sampled tokens, or None when there is nothing to decode.

        When the slots' shared KV pool (`--kv-unified`) has no room for the step, make room and plan again: the
        prefix cache of an idle slot goes first, then the newest running sequence is parked (engine/slots/scheduler.py);
        a sequence that does not fit even alone ends, with finish reason "length" (its context could not grow).
        """
        while True:
            plan = self.scheduler.schedule()
            if not plan:
                return None
            try:
                return plan, self._step_entries(plan)
            except PoolFull:
                self._make_room(plan, outbox)

    def _step_entries(self, plan: list[tuple[Sequence, BatchEntry]]) -> list[int | None]:
        """Decode the plan's entries: together, except that a scoring sequence's (SamplingParams.score_tokens) go
        each in a batch of its own first, so its scores do not depend on what else runs (batched kernels round
        differently for different batches). Not with a KV pool the slots share, where a later batch could find no
        room after an earlier one changed memory."""
        alone = [i for i, (seq, _) in enumerate(plan) if seq.sampling.score_tokens]
        shared_pool = 0 < self.info.num_kv_cells != self.info.num_ctx * self.info.num_parallel
        if not alone or len(plan) == 1 or shared_pool:
            return self.backend.step([entry for _, entry in plan])
        sampled: list[int | None] = [None] * len(plan)
        for i in alone:
            sampled[i] = self.backend.step([plan[i][1]])[0]
        rest = [i for i in range(len(plan)) if i not in set(alone)]
        if rest:
            for i, token in zip(rest, self.backend.step([plan[i][1] for i in rest]), strict=True):
                sampled[i] = token
        return sampled

    def _make_room(self, plan: list[tuple[Sequence, BatchEntry]], outbox: list[tuple[RequestStream, Chunk]]) -> None:
        """Free memory in the shared KV pool for a step it could not take (see `_decode`)."""
        idle = self.scheduler.evict_idle()
        if idle is not None:
            slot, tokens = idle
            self._save(slot, tokens, 0)
            self.backend.clear(slot)
            self.num_evicted += 1
            return
        parked = self.scheduler.park()
        if parked is not None:
            self.backend.clear(parked.slot)
            self.num_parked += 1
            log.info("the KV pool is full: a sequence of %d tokens pauses, to be recomputed",
                     len(parked.prefill_tokens))
            return
        seq = plan[0][0]  # only one sequence can run, and it does not fit alone
        log.warning("the KV pool is full with one sequence of %d tokens: it ends", seq.num_tokens)
        tracker = self._trackers[seq]
        outbox.append((tracker.stream, self._final_chunk(seq, tracker, "length", time.perf_counter_ns())))
        self._drop(seq)

    def _draft(self, decoding: list[Sequence]) -> None:
        """Set the tokens each decoding sequence drafts after its pending one: from the draft model when the backend
        has one (engine/llamacpp/draft_model.py), else looked up in its own context (engine/slots/drafting.py).
        None unless
        speculative decoding is on for it and no logprobs or images are asked (a rejected draft is cut off the
        slot's memory, or a hybrid model's is rewound: engine/llamacpp/recurrent_state.py)."""
        caps: dict[Sequence, tuple[int, int]] = {}
        for seq in decoding:
            seq.draft = []
            most = self.draft_max if seq.sampling.draft_max is None else seq.sampling.draft_max
            limit = min(most, seq.max_new_tokens - len(seq.output) - 1)
            if limit > 0 and seq.sampling.logprobs is None and not seq.images:
                caps[seq] = most, limit
        if not caps:
            return
        if self.info.draft_model is not None:
            contexts: dict[int, tuple[list[int], int]] = {}
            for seq, (most, limit) in caps.items():
                pace = self._trackers[seq].drafter
                if pace is None:
                    pace = self._trackers[seq].drafter = DraftLength(most)
                size = pace.next(limit)
                if size > 0:
                    contexts[seq.slot] = (seq.prompt + seq.output, size)
            drafts = self.backend.draft(contexts) if contexts else {}
            for seq in caps:
                seq.draft = drafts.get(seq.slot, [])
            return
        for seq, (most, limit) in caps.items():
            tracker = self._trackers[seq]
            held = len(seq.prompt) + len(seq.output)
            drafter = tracker.drafter
            if not isinstance(drafter, NgramDrafter):
                drafter = tracker.drafter = NgramDrafter(seq.prompt + seq.output, most)
            elif drafter.size < held:
                drafter.extend(seq.output[drafter.size - held:])
            seq.draft = drafter.draft(limit)

    def _drafted(self, seq: Sequence, drafted: int, taken: int) -> None:
        tracker = self._trackers[seq]
        tracker.num_drafted += drafted
        tracker.num_accepted += taken
        if tracker.drafter is not None:
            tracker.drafter.accepted(drafted, taken)

    def _fork(self, seq: Sequence) -> list[tuple[Sequence, int]]:
        """Fork the choices waiting for `seq`, which has just prefilled their prompt: (choice, its first token).

        A choice the backend could not fork prefills the prompt itself."""
        choices = self.scheduler.forks(seq)
        if not choices:
            return []
        tokens = self.backend.fork(seq.slot, [choice.slot for choice in choices])
        out = []
        for choice, token in zip(choices, tokens, strict=True):
            if token is None:
                self.scheduler.fork_failed(choice)
                continue
            self.scheduler.forked(choice)
            out.append((choice, token))
        return out

    def _take(self, seq: Sequence, token: int, now: int, outbox: list[tuple[RequestStream, Chunk]]) -> None:
        """Take a sampled token of `seq`: emit its text; end the sequence when it is finished."""
        tracker = self._trackers[seq]
        if not seq.output:
            tracker.first_token_ns = now
            if seq.sampling.score_tokens:
                tracker.scores = self.backend.take_scores(seq.slot) or []
            if seq.sampling.prompt_logprobs is not None:
                outbox.append((tracker.stream, self._prompt_logprobs(seq)))
        finish = self._accept(seq, tracker, token, outbox)
        if finish is not None:
            outbox.append((tracker.stream, self._final_chunk(seq, tracker, finish, now)))
            self._drop(seq)

    def _prompt_logprobs(self, seq: Sequence) -> Chunk:
        """A chunk carrying the prompt's log-probabilities (the prompt's tokens with their special text)."""
        ranked = self.backend.take_prompt_logprobs(seq.slot) or []
        piece = lambda token: self.backend.token_bytes(token, special=True)  # noqa: E731
        return Chunk(prompt_logprobs=[token_logprob(entry, piece) for entry in ranked])

    def _start(self, seq: Sequence) -> int:
        """Prepare the sequence's slot; return how many prompt positions it holds already (own slot, a copy from
        another slot, or a saved state). What the slot held before and loses now is saved in the prompt cache.

        A saved state is looked up before any copy: a copy between slots lands at the next decode, so a state
        restored after it would be overwritten (the backend refuses that)."""
        if seq.slot not in self._judged:
            self._save(seq.slot, seq.evicts, seq.num_cached)
        generated = seq.output[: seq.num_refill] if seq.num_refill else None  # back after a preemption
        kept = self.backend.start(seq.slot, seq.sampling, seq.prompt, seq.num_cached, generated)
        copy = seq.copy_len if seq.copy_from >= 0 and seq.copy_len > kept else 0
        restored, tier = self._restore_cached(seq, max(kept, copy))
        if restored:
            self._count(tier, restored)
            return restored
        if copy and self.backend.copy_prefix(seq.copy_from, seq.slot, copy):
            kept = copy
        self._count("slot", kept)
        return kept

    def _save(self, slot: int, tokens: list[int], num_kept: int, *, persist: bool = True) -> None:
        """Save the state of `slot`, which holds `tokens`, in the prompt cache before it keeps only `num_kept` of
        them (a model that cannot cut keeps all or none): unless too little is lost or an entry covers them."""
        can_cut = self.info.can_cut_memory
        lost = len(tokens) - num_kept if can_cut or num_kept < len(tokens) else 0
        if not self.cache.is_enabled or lost < self.scheduler.min_share or len(tokens) < self.scheduler.min_share:
            return
        if self.cache.covers(self.cache_key, tokens, can_cut):
            return
        state = self.backend.save_state(slot)
        if state is not None:
            self.cache.put(self.cache_key, tokens, state, can_cut=can_cut, persist=persist)

    def _restore_cached(self, seq: Sequence, floor: int) -> tuple[int, Tier]:
        """Restore into the slot the saved state of the longest prefix of the prompt when it holds at least
        `min_share` more than `floor` positions: (the positions held now, where they came from), or (0, "slot")."""
        tokens = seq.prefill_tokens
        limit = len(tokens) - 1
        hit = self.cache.lookup(self.cache_key, tokens, limit, self.info.can_cut_memory) \
            if self.cache.is_enabled and floor < limit else None
        if hit is None:
            return 0, "slot"
        length = seq.reusable(hit.length)
        if length >= floor + self.scheduler.min_share and self.backend.restore_state(seq.slot, hit.state, length):
            return length, hit.tier
        return 0, "slot"

    def _count(self, tier: Tier, num_tokens: int) -> None:
        if num_tokens <= 0:
            self.cache_stats.misses += 1
            return
        self.cache_stats.hits[tier] += 1
        self.cache_stats.tokens[tier] += num_tokens

    def _accept(
        self, seq: Sequence, tracker: _Tracker, token: int, outbox: list[tuple[RequestStream, Chunk]]
    ) -> FinishReason | None:
        """Take one sampled token: emit its text and say whether the sequence is finished. An end-of-generation
        token has no text; a scored prompt (echo with logprobs) still gets its logprob, as vLLM gives it:
        lm-evaluation-harness reads the reply's token as the last entry, the prompt's before it."""
        if self.backend.is_eog(token) and not seq.sampling.ignore_eos:
            if seq.sampling.prompt_logprobs is not None and (end := self._logprobs(seq, tracker, 0, 0, False)):
                outbox.append((tracker.stream, Chunk(text="", logprobs=end)))  # a scored prompt's one reply token
            return "stop"
        seq.output.append(token)
        piece = self.backend.token_bytes(token, special=seq.special)
        decoded = tracker.decoder.push(piece)
        text, is_stopped = tracker.stops.push(decoded)
        logprobs = self._logprobs(seq, tracker, len(decoded), len(text), is_stopped)
        if text or logprobs:
            outbox.append((tracker.stream, Chunk(text=text, logprobs=logprobs)))
        if is_stopped:
            tracker.is_stop_hit = True
            return "stop"
        if len(seq.output) >= seq.max_new_tokens:
            return "length"
        return None

    def _logprobs(self, seq: Sequence, tracker: _Tracker, num_decoded: int, num_emitted: int,
                  is_stopped: bool) -> list[TokenLogprob]:
        """Place the token just sampled (its text `num_decoded` characters, `num_emitted` characters out now) and
        return the logprobs whose text is out; a stop string ends the reply (see engine/logprobs.py)."""
        if seq.sampling.logprobs is None:
            return []
        ranked = self.backend.take_logprobs(seq.slot)
        if tracker.logprobs is None:
            tracker.logprobs = LogprobAligner()
        if ranked is not None:
            logprob = token_logprob(ranked, lambda token: self.backend.token_bytes(token, special=seq.special))
            tracker.logprobs.add(logprob, num_decoded, unfinished=tracker.decoder.is_holding)
        return tracker.logprobs.finish(num_emitted) if is_stopped else tracker.logprobs.emit(num_emitted)

    def _final_chunk(self, seq: Sequence, tracker: _Tracker, finish: FinishReason, now: int) -> Chunk:
        tail = ""
        if not tracker.is_stop_hit:
            tail = tracker.stops.push(tracker.decoder.flush())[0] + tracker.stops.flush()
        logprobs = tracker.logprobs.finish(len(tail)) if tracker.logprobs is not None else []
        usage = Usage(prompt_tokens=len(seq.prompt), completion_tokens=len(seq.output), cached_tokens=seq.num_cached,
                      draft_tokens=tracker.num_drafted, draft_accepted_tokens=tracker.num_accepted)
        first = tracker.first_token_ns or now
        timings = Timings(
            prompt_eval_ns=first - tracker.admitted_ns,
            eval_ns=now - first,
            total_ns=now - tracker.submitted_ns,
        )
        return Chunk(text=tail, finish_reason=finish, usage=usage, timings=timings, logprobs=logprobs,
                     scores=tracker.scores)

    def _drop(self, seq: Sequence) -> None:
        if self.scheduler.remove(seq):
            self.backend.release(seq.slot)
            if seq.sampling.score_tokens:
                self._judged.add(seq.slot)
            else:
                self._judged.discard(seq.slot)
        self._trackers.pop(seq, None)

    def _fail_all(self, message: str) -> None:
        with self._cond:
            self._inbox.clear()
            trackers = list(self._trackers.items())
        outbox = []
        for seq, tracker in trackers:
            outbox.append((tracker.stream, Chunk(finish_reason="error", error=message)))
            self._drop(seq)
            if seq.slot >= 0:
                self.scheduler.forget(seq.slot)
        self._deliver(outbox)

    def _die(self, reason: str) -> None:
        """Mark the engine failed and end every request with an error, touching neither backend nor scheduler."""
        with self._cond:
            self._death = reason
            self._inbox.clear()
            trackers, self._trackers = list(self._trackers.values()), {}
            embeds, self._embeds = list(self._embeds), deque()
        message = f"the engine stopped: {reason}"
        self._deliver([(tracker.stream, Chunk(finish_reason="error", error=message)) for tracker in trackers])
        for job in embeds:
            self._settle(job, None, EngineStopped(message))

    @staticmethod
    def _deliver(outbox: list[tuple[RequestStream, Chunk]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Chunk]]] = {}
        for stream, chunk in outbox:
            by_loop.setdefault(stream.loop, []).append((stream, chunk))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
                loop.call_soon_threadsafe(_put_all, items)


def _set_future(future: asyncio.Future[list[float]], vector: list[float] | None, error: Exception | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(vector or [])


def _check_prompt(prompt: list[int], images: list[PromptImage], num_vocab: int) -> None:
    """Every position outside `images` holds a vocabulary id; images lie in order inside, before the end."""
    text = prompt
    if images:
        text, previous_end = [], 0
        for image in images:
            if image.start < previous_end or image.length < 1 or image.end >= len(prompt):
                raise InvalidRequest("an image must be followed by text in the prompt", param="images")
            text += prompt[previous_end : image.start]
            previous_end = image.end
        text += prompt[previous_end:]
    if text and (min(text) < 0 or max(text) >= num_vocab):
        raise InvalidRequest(f"token ids must be in [0, {num_vocab}) for this model", param="context")


def _input_overflow(num_tokens: int, num_ctx: int, num_ctx_train: int) -> ContextOverflow:
    error = ContextOverflow(num_tokens, num_ctx, num_ctx_train)
    error.param = "input"
    return error


def _put_all(items: list[tuple[RequestStream, Chunk]]) -> None:
    for stream, chunk in items:
        stream.queue.put_nowait(chunk)
