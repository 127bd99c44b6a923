"""Continuous-batching scheduler: pure and synchronous, no threads, no llama.cpp.

Sequences wait in FIFO order for a free slot. Each step, every sequence that has finished its prompt
decodes one token, and the rest of the token budget goes to prompt prefill in chunks, oldest first, so
running streams keep producing tokens while a long prompt is processed.

A slot's memory outlives its sequence: the scheduler remembers which tokens each slot holds, so a prefix is not
computed again (a multi-turn chat, or many requests with one system prompt). A new sequence takes the free slot
sharing the longest prefix with its prompt only when that prefix keeps enough of what the slot holds
(`slot_similarity`); otherwise an empty slot, else the least recently used one, so a short match (the chat
template's first tokens) never costs another conversation its cache. What a slot loses when it is taken is the
engine's to save first (`Sequence.evicts`: the prompt cache beyond the slots, engine/slots/prompt_cache.py).

An image in a prompt is prefilled whole, in a step of its own for that sequence: it takes its length from
the prefill budget, and may exceed the budget when it is the first prefill of the step (else it could wait
forever behind a small budget).

Where the backend can copy a prefix between slots (`can_copy`: memory that can be cut at any position), a new
sequence also looks past its own slot: it copies a longer prefix held by another slot, or, when a sequence still
prefilling will soon hold one (many users arriving with one system prompt), waits for that leader and copies
from it instead of computing the same tokens again.

A model whose memory cannot be cut (hybrid) shares through snapshots instead: a sequence may carry checkpoints
(prompt positions, e.g. the end of the system prompt) where its prefill stops so the engine can save the slot's
state; a new sequence sharing a checkpointed prefix with a prefilling leader waits for that checkpoint and
restores the snapshot.

The n choices of one request (the OpenAI `n`) prefill their prompt once: the first choice prefills it, and the
others admitted meanwhile wait for it (`fork_of`) and are forked from it when it is done (`forks`/`forked`). A
choice admitted later, when no slot was free, shares the prompt as any other request does.

When the slots share one KV pool (`--kv-unified`) and a step does not fit in it, the engine asks for room: first
the prefix caches of idle slots go (`evict_idle`, oldest first), then the newest running sequence is parked
(`park`, preemption by recompute as in vLLM): its memory is dropped but it keeps its slot and sampler, and when it
resumes it prefills its prompt and the tokens it has output so far (`num_refill`), samples the token after them
and goes on as if nothing happened. Parked sequences resume oldest first, one each time a running sequence leaves
(its memory becomes an evictable prefix cache), or when nothing else could run; no new sequence is admitted while
one is parked, so the pool is not refilled behind it.

Requests have a priority (`SamplingParams.priority`; lower runs first, as in vLLM). The waiting queue is kept in
priority order, first come first served within one priority. When a waiting sequence finds no free slot while a
running one has a lower priority (a higher value), that one is preempted (`preempt`): it leaves its slot, which
keeps its tokens as any freed slot does (so the engine saves them in the prompt cache when the slot is taken), and
it waits again ahead of its own priority, to prefill its prompt and output so far when it gets a slot, as a parked
sequence does. While a sequence prefills, the work of sequences of lower priority waits (`schedule`), so an
interactive request's first token is not slowed by a batch's decoding; and while one runs and for `RECENT_S`
seconds after, such work takes at most `BACKGROUND_ROWS` of a step's tokens (decoded or prefilled, the oldest lines'
first, so they finish one by one), so the user's tokens and next request wait little for the step in flight (a batch
alone, with no interactive request for a while, takes whole steps).

Each sequence is in one `Phase` at a time, and moves only along the edges of `MOVES` (`Sequence.move` asserts it).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

from lmserve.engine.slots.backend import BatchEntry
from lmserve.engine.slots.phases import Phase
from lmserve.engine.slots.sequence import Sequence
from lmserve.types import Adapter

BACKGROUND_ROWS = 1
"""Tokens a step gives sequences of lower than default priority (a batch's lines), decoded and prefilled together,
while an interactive request runs and for RECENT_S seconds after. A user's request that arrives during a step waits
for it, and their stream's tokens come one a step; on a CPU a step's time grows with each token in it (2 cores,
SmolLM2: 1 decode 15 ms, 4 decodes 43 ms, 8 decodes and a 16-token prompt chunk about 200 ms). A batch alone takes
whole steps (bench/README.md, part 2b)."""
GPU_BACKGROUND_ROWS = 16
"""BACKGROUND_ROWS for a model on a GPU (MLX on Apple silicon), where a step's time grows little with a few more
tokens (as vLLM, which batches every running request whatever its priority, relies on): a batch keeps more of its
speed beside a user. Not measured here (no GPU on these machines)."""
RECENT_S = 0.5
"""Seconds after the last step with a sequence of default or higher priority during which BACKGROUND_ROWS holds: the
next request of a client that answers at once (a script's loop, an agent's quick tool) finds short steps."""
SPREAD_REUSE = 128
"""While other sequences run, a free slot widening their slots' range more than the nearest free slot would is
taken for its prefix only from this many tokens. llama.cpp attends over the KV streams from a step's lowest slot to
its highest, so four sequences on slots 0, 3, 5 and 7 decode as slowly as eight (45.7 ms a step on SmolLM2, 2 cores;
24.9 on 0-3): a short prefix is cheaper to compute again (or to copy from that slot, `_plan_sharing`) than to decode
spread out (bench/README.md, plain decoding at 4 streams). Alone, a sequence reuses its slot wherever it is."""
ADAPTER_TURN = 8
"""Steps in a row one LoRA adapter set runs while others wait (llama.cpp applies one set to a whole step). Changing
the set costs llama.cpp a new graph reservation (~7 ms a change on SmolLM2, 2 cores), and its LoRA products are slow
for 2-4 tokens a step and nearly free at 8: turning every step decoded a mix of five sets at 0.31x of one set's
throughput; longer turns batch more and change less, while each set still streams within a few hundred ms."""


class Scheduler:
    """Decides which tokens of which sequences go into the next batch."""

    def __init__(
        self, num_slots: int, max_batch_tokens: int, max_prefill_tokens: int, *, can_copy: bool = False,
        can_snapshot: bool = False, min_share: int = 16, slot_similarity: float = 0.5,
        clock: Callable[[], float] = time.monotonic, background_rows: int = BACKGROUND_ROWS,
    ) -> None:
        if num_slots < 1 or max_batch_tokens < 1 or max_prefill_tokens < 1:
            raise ValueError("scheduler sizes must be positive")
        self.num_slots = num_slots
        self.max_batch_tokens = max_batch_tokens
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))
        self.slot_tokens: list[list[int]] = [[] for _ in range(num_slots)]
        """Tokens whose state each free slot's memory holds, position by position."""
        self.slot_adapters: list[tuple[Adapter, ...]] = [() for _ in range(num_slots)]
        """The adapter set each slot's memory was computed under (set when a sequence takes the slot: `reused`)."""
        self.last_adapters: tuple[Adapter, ...] = ()
        """The adapter set of the last step (`schedule` takes turns between sets)."""
        self.turn_left = 0
        """Steps the last step's set may still run before another set's turn (ADAPTER_TURN)."""
        self.can_copy = can_copy
        self.can_snapshot = can_snapshot
        """Followers may wait for a leader's checkpoint and restore its snapshot (when copies are impossible)."""
        self.min_share = min_share
        """Fewest extra tokens that make copying from another slot (or waiting for a leader) worth it."""
        self.slot_similarity = slot_similarity
        """Least fraction of a free slot's tokens a prompt must keep to take that slot for its prefix."""
        self.clock = clock
        self.background_rows = background_rows
        self.interactive_at = -math.inf
        """When a step last ran a sequence of priority <= 0 (`clock`'s seconds)."""

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence behind every waiting one of its priority or a higher one (a lower value)."""
        index = len(self.waiting)
        while index > 0 and self.waiting[index - 1].priority > seq.priority:
            index -= 1
        self.waiting.insert(index, seq)

    def num_held_tokens(self) -> int:
        """Tokens whose state the slots' memory holds: each running sequence's, and each free slot's kept prefix
        (still in its cells until another prompt takes the slot). Safe to read from another thread (an estimate
        while the engine thread moves sequences)."""
        running = sum(seq.num_held for seq in list(self.running))
        return running + sum(len(self.slot_tokens[slot]) for slot in list(self.free_slots))

    def can_admit(self) -> bool:
        """A sequence waits and a slot is free (and no parked sequence waits for room before it)."""
        return bool(self.waiting and self.free_slots) and not any(
            seq.phase is Phase.PARKED for seq in self.running)

    def admit(self) -> Sequence:
        """Move the oldest waiting sequence into a free slot (`choose_slot`).

        `num_cached` is set to the prefix of the prompt the slot holds (at most all but the last prompt token, which
        must be decoded to get the next token's logits); the backend may still refuse to reuse it. `evicts` is what
        the slot held before.
        """
        seq = self.waiting.popleft()
        tokens = seq.prefill_tokens
        index, length = self.choose_slot(tokens, seq.adapters)
        seq.slot = self.free_slots.pop(index)
        seq.evicts = self.slot_tokens[seq.slot]
        seq.num_cached = seq.reusable(length)
        source = seq.fork_of
        if source is not None and source in self.running and source.phase in (Phase.PREFILLING, Phase.FOLLOWING):
            seq.move(Phase.FORKING)
        else:
            seq.fork_of = None  # it was admitted too late to be forked: share the prompt as others do
            if self.can_copy:
                self._plan_sharing(seq)
            elif self.can_snapshot:
                self._plan_checkpoint_sharing(seq)
            seq.move(Phase.FOLLOWING if seq.leader is not None else Phase.PREFILLING)
        self.running.append(seq)
        return seq

    def preemptible(self) -> Sequence | None:
        """The running sequence to preempt for the first waiting one, or None: when no slot is free (and nothing is
        parked), the one of the lowest priority below the waiting one's, the newest of them; only a prefilling or
        decoding sequence (one that others wait for to copy or fork from stays)."""
        if not self.waiting or self.free_slots or any(seq.phase is Phase.PARKED for seq in self.running):
            return None
        first = self.waiting[0].priority
        candidates = [seq for seq in self.running if seq.priority > first and seq.phase in (
            Phase.PREFILLING, Phase.DECODING) and not self.forks(seq) and not self._followers(seq)]
        return max(reversed(candidates), key=lambda seq: seq.priority, default=None)

    def preempt(self, seq: Sequence) -> None:
        """Take `seq` out of its slot (the engine releases the slot's sampler; the slot keeps its tokens, a prefix
        cache like any freed slot's) and queue it first among its priority. When it gets a slot again it prefills
        its prompt and its output so far and goes on (`num_refill`), as a parked sequence does."""
        self.running.remove(seq)
        self.free_slots.append(seq.slot)
        self.slot_tokens[seq.slot] = seq.held
        seq.move(Phase.WAITING)
        seq.slot, seq.copy_from, seq.copy_len, seq.evicts = -1, -1, 0, []
        seq.num_refill, seq.num_prefilled, seq.num_cached, seq.draft = len(seq.output), 0, 0, []
        index = 0
        while index < len(self.waiting) and self.waiting[index].priority < seq.priority:
            index += 1
        self.waiting.insert(index, seq)

    def _followers(self, seq: Sequence) -> list[Sequence]:
        return [other for other in self.running if other.phase is Phase.FOLLOWING and other.leader is seq]

    def held_for(self, slot: int, adapters: tuple[Adapter, ...]) -> list[int]:
        """The tokens `slot` holds that a sequence running with `adapters` may reuse: all, or none when the slot was
        computed under another adapter set."""
        return self.slot_tokens[slot] if self.slot_adapters[slot] == adapters else []

    def choose_slot(self, prompt: list[int], adapters: tuple[Adapter, ...] = ()) -> tuple[int, int]:
        """The index in the free list of the slot for `prompt` (run with `adapters`), and the prefix of it that slot
        holds.

        The slot sharing the longest prefix, when that prefix is at least `slot_similarity` of the slot's tokens or
        the whole prompt (all it could reuse), and, while others run, either widening their slots' range no more than
        the nearest free slot would or at least SPREAD_REUSE long; else the slot nearest that range: an empty one,
        else the least recently freed (the free list is in the order slots were freed).
        """
        span = self._running_span()
        least = min(_widening(span, slot) for slot in self.free_slots)
        best, best_len = -1, 0
        for i, slot in enumerate(self.free_slots):
            held = self.slot_tokens[slot]
            length = common_prefix_length(self.held_for(slot, adapters), prompt)
            if length <= best_len or (length < SPREAD_REUSE and _widening(span, slot) > least):
                continue
            if length >= self.slot_similarity * len(held) or length >= len(prompt) - 1:
                best, best_len = i, length
        if best >= 0:
            return best, best_len
        index = min(range(len(self.free_slots)), key=lambda i: self._fallback_rank(i, span))
        return index, common_prefix_length(self.held_for(self.free_slots[index], adapters), prompt)

    def _running_span(self) -> tuple[int, int] | None:
        slots = [seq.slot for seq in self.running if seq.slot >= 0]
        return (min(slots), max(slots)) if slots else None

    def _fallback_rank(self, index: int, span: tuple[int, int] | None) -> tuple[int, int, int]:
        """Nearest the running range first; then empty slots (the last in the free list first), then the least
        recently freed."""
        slot = self.free_slots[index]
        empty = not self.slot_tokens[slot]
        return _widening(span, slot), 0 if empty else 1, -index if empty else index

    def _usable(self, seq: Sequence, tokens: list[int]) -> int:
        return seq.reusable(common_prefix_length(tokens, seq.prompt))

    def _plan_sharing(self, seq: Sequence) -> None:
        """Pick a slot to copy a longer prefix from now, or a prefilling leader to wait for and copy from later."""
        best = seq.num_cached
        held = [(slot, self.held_for(slot, seq.adapters)) for slot in self.free_slots]
        held += [(other.slot, other.held) for other in self.running if other.adapters == seq.adapters]
        for slot, tokens in held:
            length = self._usable(seq, tokens)
            if length >= best + self.min_share:
                seq.copy_from, seq.copy_len, best = slot, length, length
        for other in self.running:
            if other.phase is Phase.PREFILLING and other.adapters == seq.adapters:
                length = self._usable(seq, other.prompt)
                if length >= best + self.min_share:
                    seq.leader, seq.share_len, best = other, length, length

    def _plan_checkpoint_sharing(self, seq: Sequence) -> None:
        """Wait for a prefilling leader that will snapshot a checkpoint this prompt shares."""
        best = seq.num_cached
        for other in self.running:
            if other.phase is not Phase.PREFILLING or other.adapters != seq.adapters:
                continue
            shared = self._usable(seq, other.prompt)
            for checkpoint in other.checkpoints:
                if other.num_prefilled < checkpoint <= shared and checkpoint >= best + self.min_share:
                    seq.leader, seq.share_len, best = other, checkpoint, checkpoint

    def ready_shares(self) -> list[tuple[Sequence, int, int]]:
        """Waiting followers whose leader now holds their shared prefix: (follower, source slot, length).

        A follower whose leader left early copies from a free slot that still holds the prefix, or prefills alone.
        """
        ready = []
        for seq in self.running:
            leader, length = seq.leader, seq.share_len
            if seq.phase is not Phase.FOLLOWING or leader is None:
                continue
            if leader in self.running:
                if leader.num_prefilled >= length:
                    ready.append((seq, leader.slot, length))
                    seq.move(Phase.PREFILLING)
                continue
            seq.move(Phase.PREFILLING)
            for slot in self.free_slots:
                if self._usable(seq, self.held_for(slot, seq.adapters)) >= length:
                    ready.append((seq, slot, length))
                    break
        return ready

    def forks(self, seq: Sequence) -> list[Sequence]:
        """The choices waiting to be forked from `seq` (once it has prefilled its prompt)."""
        return [other for other in self.running if other.phase is Phase.FORKING and other.fork_of is seq]

    def forked(self, seq: Sequence) -> None:
        """`seq`'s slot now holds a copy of its whole prompt, and its first token was sampled."""
        seq.move(Phase.DECODING)
        seq.num_cached = seq.num_prefilled = len(seq.prompt)

    def fork_failed(self, seq: Sequence) -> None:
        """`seq` could not be forked: it prefills its prompt itself."""
        seq.move(Phase.PREFILLING)

    def prefilled(self, seq: Sequence, num_positions: int) -> bool:
        """The next `num_positions` of `seq`'s prefill are in its slot; when they were the last, it decodes (True)."""
        assert seq.phase is Phase.PREFILLING, f"a {seq.phase.name} sequence cannot prefill"
        seq.num_prefilled += num_positions
        if seq.num_prefilled < len(seq.prompt) + seq.num_refill:
            return False
        seq.move(Phase.DECODING)
        return True

    def reused(self, seq: Sequence, num_reused: int) -> None:
        """Record how much of the slot's memory the backend kept for `seq` (computed under its adapter set)."""
        seq.num_cached = seq.num_prefilled = num_reused
        self.slot_tokens[seq.slot] = seq.prefill_tokens[:num_reused]
        self.slot_adapters[seq.slot] = seq.adapters

    def forget(self, slot: int) -> None:
        """The slot's memory is no longer trusted (a failed decode): reuse nothing from it."""
        self.slot_tokens[slot] = []

    def remove(self, seq: Sequence) -> bool:
        """Take a sequence out (finished or aborted); return True when it held a slot to release."""
        if seq in self.waiting:
            self.waiting.remove(seq)
            seq.move(Phase.FINISHED)
            return False
        if seq in self.running:
            for other in self.forks(seq):
                other.move(Phase.PREFILLING)  # it left before its prompt was done: they prefill their own
            self.running.remove(seq)
            self.free_slots.append(seq.slot)
            self.slot_tokens[seq.slot] = seq.held  # its followers may still copy from it (ready_shares)
            seq.move(Phase.FINISHED)
            self._resume(1)
            return True
        return False

    def evict_idle(self) -> tuple[int, list[int]] | None:
        """Forget the prefix cache of the free slot that has held it longest; return that slot (its memory must be
        cleared) and the tokens it held, or None when no free slot holds anything."""
        for slot in self.free_slots:
            tokens = self.slot_tokens[slot]
            if tokens:
                self.slot_tokens[slot] = []
                return slot, tokens
        return None

    def park(self) -> Sequence | None:
        """Park the newest running sequence that could run (its slot's memory must be cleared) and return it; None
        when at most one could run: it does not fit alone, and parking it would free nothing lasting.

        It keeps its slot (and so its sampler's state); when it resumes it prefills its prompt and its output so
        far, and the token sampled after them is its next one. Sequences waiting to copy from it prefill alone.
        """
        active = [seq for seq in self.running if seq.phase in (Phase.PREFILLING, Phase.FOLLOWING, Phase.DECODING)]
        if len(active) <= 1:
            return None
        seq = active[-1]
        seq.move(Phase.PARKED)
        seq.num_refill = len(seq.output)
        seq.num_prefilled = 0
        seq.draft = []
        for other in self.running:
            if other.phase is Phase.FOLLOWING and other.leader is seq:
                other.move(Phase.PREFILLING)
        return seq

    def _resume(self, count: int) -> None:
        """Let the `count` oldest parked sequences prefill again."""
        for seq in self.running:
            if count <= 0:
                return
            if seq.phase is Phase.PARKED:
                seq.move(Phase.PREFILLING)
                count -= 1

    def schedule(self) -> list[tuple[Sequence, BatchEntry]]:
        """Plan one step: one token per decoding sequence (and the tokens drafted after it), then prefill chunks
        within the budget."""
        plan: list[tuple[Sequence, BatchEntry]] = []
        budget = self.max_batch_tokens
        if all(seq.phase in (Phase.PARKED, Phase.FORKING) for seq in self.running):
            self._resume(1)  # nothing else would run: room will be found (idle caches are evicted first)
        urgent = min((seq.priority for seq in self.running if seq.phase is Phase.PREFILLING), default=None)
        group = self._adapter_turn(urgent)
        ready = [seq for seq in self.running if (urgent is None or seq.priority <= urgent) and seq.adapters == group]
        now = self.clock()
        if any(seq.priority <= 0 for seq in self.running):
            self.interactive_at = now
        spare = self.background_rows if now - self.interactive_at < RECENT_S else budget  # for priority > 0
        for seq in self._decoders(ready, spare):
            rows = budget if seq.priority <= 0 else min(budget, spare)
            if rows <= 0:
                continue
            draft = seq.draft[: rows - 1]
            plan.append((seq, BatchEntry(seq.slot, [seq.output[-1], *draft], seq.num_tokens, True, draft=len(draft))))
            budget -= 1 + len(draft)
            spare -= 1 + len(draft) if seq.priority > 0 else 0
        budget = min(budget, self.max_prefill_tokens)
        has_prefill = False
        for seq in ready:
            if budget <= 0:
                break
            if seq.phase is not Phase.PREFILLING:
                continue
            start = seq.num_prefilled
            image = seq.image_at(start)
            if image is not None:
                if image.length > budget and has_prefill:
                    continue  # next step, first in line
                plan.append((seq, BatchEntry(seq.slot, [], start, False, image=image)))
                budget -= image.length
            else:
                if (take := budget if seq.priority <= 0 else min(budget, spare)) <= 0:
                    continue  # a batch's prompt: its share of this step is spent
                chunk = seq.prefill_tokens[start : min(start + take, seq.text_end(start))]
                plan.append((seq, BatchEntry(seq.slot, chunk, start, start + len(chunk) == len(seq.prefill_tokens))))
                budget -= len(chunk)
                spare -= len(chunk) if seq.priority > 0 else 0
            has_prefill = True
        return plan

    def _decoders(self, ready: list[Sequence], rows: int) -> list[Sequence]:
        """The decoding sequences of a step: every one of default or higher priority; of the others, when fewer `rows`
        than they are bound them, only those among the oldest (prefilling or decoding), so lines finish one by one."""
        decoding = [seq for seq in ready if seq.phase is Phase.DECODING]
        background = [seq for seq in ready if seq.priority > 0 and seq.phase in (Phase.PREFILLING, Phase.DECODING)]
        if len(background) <= rows:
            return decoding
        oldest = background[:rows]
        return [seq for seq in decoding if seq.priority <= 0 or seq in oldest]

    def _adapter_turn(self, urgent: int | None) -> tuple[Adapter, ...]:
        """The adapter set this step runs (llama.cpp applies one set to a whole step): among the sets of the sequences
        of the best priority ready to decode or prefill (a batch's lines wait while a user's request of another set
        runs), the last step's set for up to ADAPTER_TURN steps in a row, then the next set after it in the order of
        their oldest sequences."""
        ready = [seq for seq in self.running if seq.phase in (Phase.PREFILLING, Phase.DECODING)
                 and (urgent is None or seq.priority <= urgent)]
        best = min((seq.priority for seq in ready), default=0)
        sets: list[tuple[Adapter, ...]] = []
        for seq in ready:
            if seq.priority == best and seq.adapters not in sets:
                sets.append(seq.adapters)
        if not sets:
            return self.last_adapters
        if self.last_adapters in sets and (self.turn_left > 0 or len(sets) == 1):
            self.turn_left -= 1
            return self.last_adapters
        turn = (sets.index(self.last_adapters) + 1) % len(sets) if self.last_adapters in sets else 0
        self.last_adapters, self.turn_left = sets[turn], ADAPTER_TURN - 1
        return self.last_adapters


def common_prefix_length(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _widening(span: tuple[int, int] | None, slot: int) -> int:
    """How many slots taking `slot` adds to the range of running slots `span`."""
    return 0 if span is None else max(span[0] - slot, slot - span[1], 0)
