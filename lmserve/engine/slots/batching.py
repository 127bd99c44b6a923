"""The batching engine: one thread runs the scheduler and a slot backend; asyncio callers get a stream per request.

`BatchingEngine` implements the engine seam (engine/protocol.py) over any `Backend` (engine/slots/backend.py): llama.cpp
in production, the fake backend in tests. A request is submitted from the event loop (checked and made into
sequences by engine/slots/submission.py) and handed to the engine thread through the bridge (engine/slots/bridge.py,
the only place threads and queues meet asyncio); the engine thread decodes, detokenizes and matches stop strings,
and hands finished pieces back to the event loop in one callback per step. Embedding and rerank jobs run on the same
thread between steps (engine/slots/jobs.py); drafts for speculative decoding come from engine/slots/drafting.py.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from lmserve.engine.protocol import EngineStats, ModelInfo, PromptImage
from lmserve.engine.slots.backend import Backend, BatchEntry, PoolFull, step_plan
from lmserve.engine.slots.bridge import Bridge, Outbox, RequestStream, Tracker, Work, deliver
from lmserve.engine.slots.drafting import set_drafts
from lmserve.engine.slots.jobs import Jobs, MemoryJob, settle
from lmserve.engine.slots.phases import Phase
from lmserve.engine.slots.prompt_cache import CacheStats, PromptCache, Tier
from lmserve.engine.slots.replies import accept, final_chunk, prompt_logprobs
from lmserve.engine.slots.scheduler import BACKGROUND_ROWS, Scheduler
from lmserve.engine.slots.sequence import Sequence
from lmserve.engine.slots.sleeping import set_asleep
from lmserve.engine.slots.stats import slot_engine_stats
from lmserve.engine.slots.submission import check_request, make_sequences
from lmserve.engine.stops import StopMatcher
from lmserve.errors import EngineFailure, EngineStopped, InvalidRequest
from lmserve.store.lora import adapters_identity
from lmserve.types import Adapter, Chunk, Media, SamplingParams

log = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 256 * 2**20
"""The prompt cache of an engine made without one (tests, library use): RAM only."""


class BatchingEngine:
    """Continuous batching over a backend. Thread-safe `submit`/`abort`/`embed`; the rest runs in its thread, which
    runs at most one embedding job between two decode steps (llama.cpp is not thread-safe)."""

    def __init__(
        self, backend: Backend, *, max_batch_tokens: int = 512, max_prefill_tokens: int = 256, max_queue: int = 512,
        prompt_cache: PromptCache | None = None, cache_key: str = "", slot_similarity: float = 0.5,
        draft_max: int = 0, background_rows: int = BACKGROUND_ROWS,
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
                                   slot_similarity=slot_similarity, background_rows=background_rows)
        self._bridge = Bridge(has_work=lambda: self.scheduler.has_work)
        self._trackers = self._bridge.trackers
        """The requests in flight (filled by the bridge; the same dict for the bridge's whole life)."""
        self._jobs = Jobs(backend, self._bridge)
        self._unsaved: set[int] = set()
        """Slots whose last sequence only scored (SamplingParams.score_tokens) or was a batch's line (priority > 0):
        the tail it left is not worth the prompt cache's copy and disk write (its beginning is saved or held)."""
        self._idle_saved: set[int] = set()  # free slots offered to the prompt cache since they ended (_save_idle)
        self.step_ns = 0
        """Wall time the engine thread spent in decode steps (scheduling, decoding, sampling, detokenizing)."""
        self.decode_ns = 0
        """The part of `step_ns` inside the backend's batch decode and sampling: the rest is Python overhead."""
        self.num_steps = 0
        """Steps that decoded something (the decode health check watches it grow)."""
        self.num_evicted = 0
        """Idle slots' prefix caches dropped to make room in a shared KV pool (`--kv-unified`)."""
        self.num_parked = 0
        """Running sequences paused (and later recomputed) to make room in a shared KV pool."""
        self.num_preempted = 0
        """Sequences that gave their slot to a request of higher priority (and later recomputed)."""
        self.num_prompt_tokens = 0
        """Prompt tokens of the sequences admitted since load (what the prefix and prompt caches were asked for)."""
        self.is_asleep = False
        """Its KV cache and slots are freed (sleep level 1)."""
        self._thread = threading.Thread(target=self._run, name="lmserve-engine", daemon=True)
        self._thread.start()

    # ---- called from the event loop -------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self.backend.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.backend.token_bytes(t, special=False) for t in tokens).decode("utf-8", "replace")

    def token_bytes(self, token: int) -> bytes:
        return self.backend.token_bytes(token, special=True)

    def tokenize_media(self, text: str, media: list[Media]) -> tuple[list[int], list[PromptImage]]:
        """Tokenize a prompt in which each media marker stands for the next image or clip (see Backend)."""
        if self.info.image_marker is None and self.info.audio_marker is None:
            raise InvalidRequest("this model has no projector; images and audio are not supported", param="images")
        return self.backend.tokenize_media(text, media)

    def submit(
        self, prompt: list[int], sampling: SamplingParams, *, special: bool = False,
        images: list[PromptImage] | None = None, checkpoints: list[int] | None = None,
    ) -> RequestStream:
        """Queue a request; raise ContextOverflow when the prompt cannot fit in one sequence's context.

        `images` are the places of images in `prompt` (from `tokenize_media`); every other position must be
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
        images = images or []
        check_request(self.backend, prompt, sampling, n, images, self.max_queue)
        seqs = make_sequences(self.info, prompt, sampling, n, special=special, images=images, checkpoints=checkpoints,
                              snapshots=self._snapshots)
        loop = asyncio.get_running_loop()
        submitted = time.perf_counter_ns()
        streams = [RequestStream(self._bridge, seq, loop) for seq in seqs]
        trackers = [Tracker(stream=stream, stops=StopMatcher(seq.sampling.stop), submitted_ns=submitted)
                    for seq, stream in zip(seqs, streams, strict=True)]
        num_free = max(self.info.num_parallel - len(self.scheduler.running), 0)  # read across threads: an estimate
        self._bridge.submit(seqs, trackers, num_free, len(self.scheduler.waiting), self.max_queue)
        return streams

    def embedding_tokens(self, text: str, *, truncate: bool = True) -> list[int]:
        """`text` tokenized for embedding: cut to one sequence's context when `truncate`, else ContextOverflow."""
        return self._jobs.embedding_tokens(text, truncate=truncate)

    async def embed(self, texts: list[str], *, truncate: bool = True, normalize: bool = True) -> list[list[float]]:
        """One vector per text (unit length unless `normalize` is false), computed on the engine thread."""
        prompts = [self.embedding_tokens(text, truncate=truncate) for text in texts]
        return await self.embed_tokens(prompts, normalize=normalize)

    async def embed_tokens(self, prompts: list[list[int]], *, normalize: bool = True,
                           adapters: tuple[Adapter, ...] = ()) -> list[list[float]]:
        """One vector per token list; each list must be non-empty and fit in one sequence's context."""
        self.backend.check_adapters(adapters)
        return await self._jobs.embed_tokens(prompts, normalize=normalize, adapters=adapters)

    async def rank(self, query: str, documents: list[str], *, truncate: bool = True) -> list[float]:
        """A dedicated reranker's relevance logit of each document to `query` (see the Engine protocol), computed on
        the engine thread. A pair longer than one sequence's context has its document cut when `truncate`, else it is
        a ContextOverflow (param "documents")."""
        return await self._jobs.rank(query, documents, truncate=truncate)

    def abort(self, seq: Sequence) -> None:
        self._bridge.abort(seq)

    def fail_all(self, message: str) -> None:
        """End every request in flight with an error chunk carrying `message` (graceful shutdown's deadline), now,
        whatever step the engine thread is in; the thread frees their sequences after its step."""
        trackers = self._bridge.fail(message)
        deliver([(tracker.stream, Chunk(finish_reason="error", error=message)) for tracker in trackers])

    @property
    def failure(self) -> str | None:
        """Why the engine thread ended on an error (it then ended every request), or None while it runs."""
        return self._bridge.death

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + self._bridge.num_submitted

    @property
    def stats(self) -> EngineStats:
        return slot_engine_stats(self)

    async def sleep(self) -> None:  # level 1 (engine/slots/sleeping.py)
        await self._jobs.memory(asleep=True)

    async def wake_up(self) -> None:
        await self._jobs.memory(asleep=False)

    def close(self) -> None:
        self._bridge.close()
        self._thread.join()
        try:
            if self._bridge.death is None:  # a failed engine's slots may hold anything: none is saved
                self.save_slots()  # so a returning conversation skips its prefill after a reload
        except Exception:  # a model that cannot save its slots still closes
            log.exception("saving the slots' prompts on close failed")
        self.backend.close()

    def save_slots(self) -> None:
        """Save every slot's prompt in the prompt cache (engine thread, or once it has ended)."""
        for slot, tokens in enumerate(self.scheduler.slot_tokens):
            self._save(slot, tokens, 0)

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
        while (work := self._next_work()) is not None:
            for seq in work.inbox:
                self.scheduler.add(seq)
            for seq in work.aborts:
                self._drop(seq)
            if work.failure is not None:
                self._fail_all(work.failure)
            if isinstance(work.job, MemoryJob):
                set_asleep(self, work.job)
            else:
                if self.is_asleep and (work.job is not None or self.scheduler.has_work):
                    set_asleep(self, None)  # whatever comes for a sleeping engine wakes it
                if work.job is not None:
                    self._jobs.run(work.job)
            started = time.perf_counter_ns()
            try:
                self._step()
            except Exception as exc:  # a failed decode fails the requests in it, never the thread
                log.exception("engine step failed")
                self._fail_all(str(exc))
            self.step_ns += time.perf_counter_ns() - started
        self._fail_all("the server is shutting down")
        for job in self._bridge.take_jobs():
            settle(job, None, EngineFailure("the server is shutting down"))

    def _next_work(self) -> Work | None:
        """Wait for work; while none comes (Bridge.stays_quiet), save free slots' states one at a time."""
        while not self.scheduler.has_work and self._bridge.stays_quiet() and self._save_idle():
            pass
        return self._bridge.wait()

    def _save_idle(self) -> bool:
        """Save the state of one free slot not saved since its sequence ended (True: there was one), as llama-server
        caches idle slots: the request that later takes the slot finds it saved. Skips slots in `_unsaved`."""
        for slot in self.scheduler.free_slots:
            if slot not in self._idle_saved and slot not in self._unsaved:
                self._idle_saved.add(slot)
                self._save(slot, self.scheduler.slot_tokens[slot], 0)
                return True
        return False

    def _step(self) -> None:
        outbox: Outbox = []
        now = time.perf_counter_ns()
        self._preempt()
        self._admit(now)
        self._share_prefixes()
        set_drafts([seq for seq in self.scheduler.running if seq.phase is Phase.DECODING], self._trackers,
                   self.backend, self.draft_max)
        decode_started = time.perf_counter_ns()
        decoded = self._decode(outbox)
        now = time.perf_counter_ns()
        self.decode_ns += now - decode_started
        if decoded is not None:
            self.num_steps += 1
            self._take_sampled(*decoded, now, outbox)
        deliver(outbox)

    def _preempt(self) -> None:
        """Give the slots of sequences that yield to requests of higher priority to those (see the scheduler)."""
        while (victim := self.scheduler.preemptible()) is not None:
            slot = victim.slot
            self.scheduler.preempt(victim)
            self.backend.release(slot)
            self.num_preempted += 1

    def _admit(self, now: int) -> None:
        """Admit what the scheduler can, each sequence started in its slot (`_start`)."""
        while self.scheduler.can_admit():
            seq = self.scheduler.admit()
            tracker = self._trackers[seq]
            if not tracker.admitted_ns:  # not when it comes back after a preemption
                tracker.admitted_ns = now
                self.num_prompt_tokens += len(seq.prompt)
            self.scheduler.reused(seq, self._start(seq))

    def _share_prefixes(self) -> None:
        """Give the sequences waiting for another's prefix that prefix, now that it is in (see the scheduler)."""
        for seq, source, length in self.scheduler.ready_shares():
            if self.backend.copy_prefix(source, seq.slot, length):
                self.scheduler.reused(seq, length)
            else:
                self.scheduler.reused(seq, self._restore_cached(seq, seq.num_prefilled)[0] or seq.num_prefilled)

    def _take_sampled(self, plan: list[tuple[Sequence, BatchEntry]], sampled: list[int | None], now: int,
                      outbox: Outbox) -> None:
        """Take what a step decoded: note the prompt positions prefilled (snapshots, forks) and take each sampled
        token (with those a draft accepted); then the forked choices' first tokens."""
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

    def _snapshot(self, seq: Sequence) -> None:
        """Save the state of `seq`'s slot after the prompt positions it has prefilled (a model that cannot cut its
        memory shares prefixes so), unless the prompt cache holds that state already."""
        held = seq.prefill_tokens[: seq.num_prefilled]
        key = self._key(seq.adapters)
        if self.cache.covers(key, held, False):
            return
        snapshot = self.backend.save_state(seq.slot)
        if snapshot is not None:
            self.cache.put(key, held, snapshot, can_cut=False)

    def _decode(
        self, outbox: Outbox
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
                return plan, step_plan(self.backend, plan)
            except PoolFull:
                self._make_room(plan, outbox)

    def _make_room(self, plan: list[tuple[Sequence, BatchEntry]], outbox: Outbox) -> None:
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
        outbox.append((tracker.stream, final_chunk(seq, tracker, "length", time.perf_counter_ns())))
        self._drop(seq)

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

    def _take(self, seq: Sequence, token: int, now: int, outbox: Outbox) -> None:
        """Take a sampled token of `seq`: emit its text; end the sequence when it is finished."""
        tracker = self._trackers[seq]
        if not seq.output:
            tracker.first_token_ns = now
            if seq.sampling.score_tokens:
                tracker.scores = self.backend.take_scores(seq.slot) or []
            if seq.sampling.prompt_logprobs is not None:
                outbox.append((tracker.stream, prompt_logprobs(self.backend, seq)))
        finish = accept(self.backend, seq, tracker, token, outbox)
        if finish is not None:
            outbox.append((tracker.stream, final_chunk(seq, tracker, finish, now)))
            self._drop(seq)

    def _start(self, seq: Sequence) -> int:
        """Prepare the sequence's slot; return how many prompt positions it holds already (own slot, a copy from
        another slot, or a saved state). What the slot held before and loses now is saved in the prompt cache, unless
        `_unsaved` (a preempted batch line's is). A saved state is looked up before any copy: a copy between slots
        lands at the next decode, so a state restored after it would be overwritten (the backend refuses that)."""
        if seq.slot not in self._unsaved:
            self._save(seq.slot, seq.evicts, seq.num_cached)
        self._idle_saved.discard(seq.slot)
        self._unsaved.discard(seq.slot)
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
        key = self._key(self.scheduler.slot_adapters[slot])
        if self.cache.covers(key, tokens, can_cut):
            return
        state = self.backend.save_state(slot)
        if state is not None:
            self.cache.put(key, tokens, state, can_cut=can_cut, persist=persist)

    def _key(self, adapters: tuple[Adapter, ...]) -> str:
        """This model's name in the prompt cache for states computed under an adapter set (a prefix computed under
        one set never serves another)."""
        return f"{self.cache_key}+lora:{adapters_identity(adapters)}" if adapters else self.cache_key

    def _restore_cached(self, seq: Sequence, floor: int) -> tuple[int, Tier]:
        """Restore into the slot the saved state of the longest prefix of the prompt when it holds at least
        `min_share` more than `floor` positions: (the positions held now, where they came from), or (0, "slot")."""
        tokens = seq.prefill_tokens
        limit = len(tokens) - 1
        hit = self.cache.lookup(self._key(seq.adapters), tokens, limit, self.info.can_cut_memory) \
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

    def _drop(self, seq: Sequence) -> None:
        if self.scheduler.remove(seq):
            self.backend.release(seq.slot)
            if seq.sampling.score_tokens or seq.priority > 0:
                self._unsaved.add(seq.slot)
            else:
                self._unsaved.discard(seq.slot)
        self._trackers.pop(seq, None)

    def _fail_all(self, message: str) -> None:
        outbox: Outbox = []
        for seq, tracker in self._bridge.take_all():
            outbox.append((tracker.stream, Chunk(finish_reason="error", error=message)))
            self._drop(seq)
            if seq.slot >= 0:
                self.scheduler.forget(seq.slot)
        deliver(outbox)

    def _die(self, reason: str) -> None:
        """Mark the engine failed and end every request with an error, touching neither backend nor scheduler."""
        trackers, jobs = self._bridge.die(reason)
        message = f"the engine stopped: {reason}"
        deliver([(tracker.stream, Chunk(finish_reason="error", error=message)) for tracker in trackers])
        for job in jobs:
            settle(job, None, EngineStopped(message))
