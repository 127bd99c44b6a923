"""llama.cpp backend over llama-cpp-python's low-level API: one context, one slot per sequence.

Each slot is a llama.cpp sequence id with its own KV stream (`kv_unified = false`): a request computes the same
numbers alone or beside others (temperature 0 is deterministic under load).
With `--kv-unified` the slots share one pool of `num_ctx` cells instead (each may grow to all of it); a batch that
finds no room raises PoolFull and the engine makes room (engine/slots/scheduler.py).

The backend decodes and samples; beside it: the model and context (loading.py), samplers (sampling.py), images
(vision.py), embeddings, reranking, the draft model, saved states (states.py) and hybrid models (recurrent_state.py).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import llama_cpp as lc
import numpy as np

from lmserve.engine.llamacpp import recurrent_state, rerank
from lmserve.engine.llamacpp.adapters import DEFAULT_MAX_LOADED
from lmserve.engine.llamacpp.cpu_load import ThreadGovernor, default_threads
from lmserve.engine.llamacpp.draft_model import DraftModel
from lmserve.engine.llamacpp.embedding import Embedder
from lmserve.engine.llamacpp.loading import LlamaModel, check_kv_options, init_llama_backend
from lmserve.engine.llamacpp.options import LlamaCppLaunch
from lmserve.engine.llamacpp.sampling import Candidates, build_chain
from lmserve.engine.llamacpp.sampling import check_grammar as parse_grammar
from lmserve.engine.llamacpp.states import state_buffer
from lmserve.engine.llamacpp.vision import Vision
from lmserve.engine.logprobs import Ranked, score_tokens
from lmserve.engine.prompt_logprobs import PromptLogprobs
from lmserve.engine.protocol import PromptImage
from lmserve.engine.slots.backend import BatchEntry, PoolFull
from lmserve.engine.slots.prompt_disk import SavedState
from lmserve.errors import EngineFailure, InvalidRequest
from lmserve.types import Adapter, LoadOptions, Media, SamplingParams

log = logging.getLogger(__name__)

LAUNCH_DEFAULTS = LlamaCppLaunch()


class LlamaCppBackend:
    """A GGUF model loaded in llama.cpp, decoding up to `num_parallel` sequences per batch."""

    def __init__(self, path: str | Path, options: LoadOptions, launch: LlamaCppLaunch = LAUNCH_DEFAULTS,
                 adapter_limits: tuple[int, int] = (DEFAULT_MAX_LOADED, 0)) -> None:
        init_llama_backend()
        check_kv_options(launch)
        path = Path(path)
        threads = options.num_threads or default_threads()
        loaded = self._loaded = LlamaModel(path, options, launch, threads, adapter_limits)
        self._model, self._vocab, self._ctx = loaded.model, loaded.vocab, loaded.ctx
        self._memory, self._batch, self._batch_capacity = loaded.memory, loaded.batch, loaded.batch_capacity
        self._num_vocab, self._eog = loaded.num_vocab, loaded.eog
        self._init_slot_state()
        self._sample_ranked = Candidates(self._num_vocab).sample
        """Sampling that keeps the candidates for logprobs (sampling.py): bound once, as it runs per token."""
        self._num_threads = threads
        self._governor = ThreadGovernor(threads) if launch.thread_policy == "adaptive" else None
        self._step_threads = threads
        self._vision: Vision | None = None
        self._draft_model: DraftModel | None = None
        self._embedder: Embedder | None = None
        self._rank_format = rerank.pair_format(loaded.model, self._vocab) if loaded.is_reranker else None
        """How the reranker reads a pair; None: the model is no reranker."""
        try:
            self._load_extras(path.name, options, launch)
        except EngineFailure:
            self.close()
            raise
        self.info = loaded.model_info(
            path, options, vision=self._vision,
            draft_model=self._draft_model.name if self._draft_model is not None else None)
        self._rank_softmax = self.info.architecture in rerank.SOFTMAX_ARCHITECTURES
        self._embedder = Embedder(loaded, num_ctx=self.info.num_ctx, batch_capacity=self._batch_capacity,
                                  threads=threads)

    def _init_slot_state(self) -> None:
        """The per-slot records of the requests the slots run, empty."""
        self._samplers: dict[int, lc.llama_sampler_p] = {}
        self._last_rows: dict[int, int] = {}
        """The batch row each slot sampled from in the last step (forks sample from it too)."""
        self._piece_cache: dict[tuple[int, bool], bytes] = {}
        self._piece_buf = ctypes.create_string_buffer(256)
        self._logprob_slots: dict[int, int] = {}  # slots whose request asked for logprobs → how many alternatives
        self._ranked: dict[int, Ranked] = {}
        """The last step's sampled tokens, ranked, of the slots in `_logprob_slots`."""
        self._score_slots: dict[int, list[int]] = {}  # slots whose request named `score_tokens` → those tokens
        self._prompt_scoring: dict[int, PromptLogprobs] = {}
        """Slots prefilling a prompt whose log-probabilities were asked for: every prompt row keeps its logits."""
        self._prompt_ranked: dict[int, list[Ranked]] = {}
        """Those slots' prompt log-probabilities once the prompt is in (`take_prompt_logprobs`)."""
        self._scores: dict[int, list[float]] = {}
        """The last step's scores of the slots in `_score_slots`."""
        self._drafted: dict[int, list[int]] = {}
        """The last step's samples after the first of each slot whose entry carried a draft (`take_drafted`)."""
        self._copying: set[int] = set()
        """Slots a KV copy (done by llama.cpp at the next decode) reads or writes: not to be saved or restored yet."""
        self._redo: dict[int, tuple[int, list[int]]] = {}
        """Rewound slots of a hybrid model → (position, accepted tokens to decode again there first: `_redecode`)."""

    def _load_extras(self, name: str, options: LoadOptions, launch: LlamaCppLaunch) -> None:
        """The vision projector and the draft model, where the options name them."""
        if options.projector:
            self._vision = Vision(options.projector, self._model, use_gpu=options.num_gpu_layers != 0,
                                  threads=self._num_threads, launch=launch)
        if launch.model_draft:
            self._draft_model = DraftModel.for_target(
                launch.model_draft, self._vocab, name, num_slots=options.num_parallel, num_ctx=self._loaded.num_ctx,
                num_batch=options.num_batch, threads=self._num_threads, num_gpu_layers=options.num_gpu_layers,
                p_min=launch.draft_p_min)

    # ---- vocabulary ---------------------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        tokens = self._loaded.tokenize_raw(text, add_special, parse_special)
        bos = lc.llama_vocab_bos(self._vocab)
        if len(tokens) >= 2 and tokens[0] == bos and tokens[1] == bos:
            tokens = tokens[1:]  # the template wrote BOS and the tokenizer added another
        return tokens

    def token_bytes(self, token: int, *, special: bool) -> bytes:
        key = (token, special)
        piece = self._piece_cache.get(key)
        if piece is None:
            n = lc.llama_token_to_piece(self._vocab, token, self._piece_buf, len(self._piece_buf), 0, special)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = lc.llama_token_to_piece(self._vocab, token, buf, -n, 0, special)
                piece = buf.raw[:n]
            else:
                piece = self._piece_buf.raw[:n]
            self._piece_cache[key] = piece
        return piece

    def is_eog(self, token: int) -> bool:
        return token in self._eog

    def tokenize_media(self, text: str, media: list[Media]) -> tuple[list[int], list[PromptImage]]:
        if self._vision is None:
            raise InvalidRequest("this model has no projector; images and audio are not supported", param="images")
        return self._vision.tokenize(text, media, lc.llama_vocab_bos(self._vocab))

    # ---- slots ----------------------------------------------------------------------------------

    def start(self, slot: int, sampling: SamplingParams, prompt: list[int], num_reused: int,
              generated: list[int] | None = None) -> int:
        self._redecode()
        if num_reused <= 0 or not lc.llama_memory_seq_rm(self._memory, slot, num_reused, -1):
            lc.llama_memory_seq_rm(self._memory, slot, -1, -1)  # hybrid/recurrent memory cannot be cut
            num_reused = 0
        sampler = build_chain(sampling, prompt, vocab=self._vocab, eog=self._eog, num_ctx=self.info.num_ctx)
        for token in generated or ():
            lc.llama_sampler_accept(sampler, token)
        old = self._samplers.pop(slot, None)
        if old is not None:
            lc.llama_sampler_free(old)
        self._samplers[slot] = sampler
        self._note_asks(slot, sampling)
        return num_reused

    def _note_asks(self, slot: int, sampling: SamplingParams) -> None:
        """Record what the slot's new request asks beside its tokens: logprobs, scores, prompt logprobs."""
        if sampling.logprobs is None:
            self._logprob_slots.pop(slot, None)
        else:
            self._logprob_slots[slot] = sampling.logprobs
        self._scores.pop(slot, None)
        if sampling.score_tokens:
            self._score_slots[slot] = list(sampling.score_tokens)
        else:
            self._score_slots.pop(slot, None)
        self._prompt_ranked.pop(slot, None)
        if sampling.prompt_logprobs is None:
            self._prompt_scoring.pop(slot, None)
        else:
            self._prompt_scoring[slot] = PromptLogprobs(sampling.prompt_logprobs)

    def copy_prefix(self, source: int, slot: int, length: int) -> bool:
        """Copy `source`'s memory into `slot`, then cut it to `length` positions.

        With one KV stream per slot llama.cpp copies whole streams (the buffer copy runs at the next decode, before
        that batch is computed); the cut needs memory that can be cut, so hybrid models say no.
        """
        if not self.info.can_cut_memory:
            return False
        self._redecode()
        lc.llama_memory_seq_rm(self._memory, slot, -1, -1)
        lc.llama_memory_seq_cp(self._memory, source, slot, -1, -1)
        self._copying.update((source, slot))
        if not lc.llama_memory_seq_rm(self._memory, slot, length, -1):
            lc.llama_memory_seq_rm(self._memory, slot, -1, -1)
            return False
        return True

    def fork(self, source: int, slots: list[int]) -> list[int | None]:
        """Copy `source`'s whole memory into each slot and sample each slot's first token from `source`'s last row.

        A whole copy needs no cut, so hybrid and recurrent memory fork too (llama.cpp shares the recurrent state
        cell and copies it on the next write). The row's logits stay valid until the next decode.
        """
        row = self._last_rows.get(source)
        if row is None:
            return [None] * len(slots)
        tokens: list[int | None] = []
        for slot in slots:
            lc.llama_memory_seq_rm(self._memory, slot, -1, -1)
            lc.llama_memory_seq_cp(self._memory, source, slot, -1, -1)
            self._copying.update((source, slot))
            tokens.append(self._sample(slot, row))
        return tokens

    def save_state(self, slot: int) -> SavedState | None:
        """The slot's state, copied once: llama.cpp writes it straight into the buffer returned (tens of MiB for a
        long prompt), an anonymous mapping whose pages the kernel faults in at once (half the time of touching
        them one by one) and gives back when it is dropped; nobody writes to it afterwards."""
        self._redecode()
        if slot in self._copying:
            return None
        size = lc.llama_state_seq_get_size(self._ctx, slot)
        state = state_buffer(size)
        written = lc.llama_state_seq_get_data(self._ctx, (ctypes.c_uint8 * size).from_buffer(state), size, slot)
        return state if written == size else state[:written]

    def restore_state(self, slot: int, state: SavedState, length: int) -> bool:
        if slot in self._copying:
            return False
        self._redo.pop(slot, None)
        lc.llama_memory_seq_rm(self._memory, slot, -1, -1)
        array = ctypes.c_uint8 * len(state)  # read in place when writable (a saved state), else copied
        buf = array.from_buffer_copy(state) if isinstance(state, bytes) else array.from_buffer(state)
        if lc.llama_state_seq_set_data(self._ctx, buf, len(state), slot) == 0 or \
                not lc.llama_memory_seq_rm(self._memory, slot, length, -1):
            lc.llama_memory_seq_rm(self._memory, slot, -1, -1)
            return False
        return True

    @staticmethod
    def check_grammar(grammar: str) -> None:
        """Raise InvalidRequest unless llama.cpp parses `grammar` (GBNF, root rule `root`; engine/llamacpp/sampling.py).

        The grammar is parsed without the vocabulary: this touches no model state, so any thread may call it.
        """
        parse_grammar(grammar)

    def clear(self, slot: int) -> None:
        self._redo.pop(slot, None)
        lc.llama_memory_seq_rm(self._memory, slot, -1, -1)

    def release(self, slot: int) -> None:
        self._prompt_scoring.pop(slot, None)
        self._prompt_ranked.pop(slot, None)
        self._logprob_slots.pop(slot, None)
        self._score_slots.pop(slot, None)
        self._scores.pop(slot, None)
        sampler = self._samplers.pop(slot, None)
        if sampler is not None:
            lc.llama_sampler_free(sampler)

    def check_adapters(self, adapters: tuple[Adapter, ...]) -> None:
        self._loaded.adapters.check(adapters)

    @property
    def adapter_bytes(self) -> int:
        return self._loaded.adapters.num_bytes

    @property
    def max_adapters(self) -> int:
        return self._loaded.adapters.max_loaded

    held_bytes = property(lambda self: self._loaded.held_bytes)

    def step(self, entries: list[BatchEntry], adapters: tuple[Adapter, ...] = ()) -> list[int | None]:
        self._redecode()  # under the set of the step that rewound it
        self._loaded.adapters.apply(self._ctx, adapters)
        images = [entry for entry in entries if entry.image is not None]
        self._decode_images(images)
        rewinds = {} if self.info.can_cut_memory else \
            {entry.slot: recurrent_state.save(self._ctx, entry.slot) for entry in entries if entry.draft}
        outputs = [-1] * len(entries)
        prompt_rows: dict[int, int] = {}  # entry index → its first batch row, for prompt log-probabilities
        n = self._fill_batch(entries, outputs, prompt_rows)
        if n == 0:
            return [None] * len(entries)
        self._decode_batch(n, images)
        self._copying.clear()  # the decode made the pending copies
        self._ranked.clear()
        self._drafted.clear()
        self._last_rows = {entry.slot: output for entry, output in zip(entries, outputs, strict=True) if output >= 0}
        for index, first in prompt_rows.items():
            self._score_prompt(entries[index], first)
        return self._sample_entries(entries, outputs, rewinds)

    def _decode_images(self, images: list[BatchEntry]) -> None:
        """Decode the step's image entries first, each on its own; on PoolFull forget what they put in."""
        for i, entry in enumerate(images):
            assert self._vision is not None  # image entries come from `tokenize_media`
            try:
                self._vision.decode(self._ctx, entry, self._batch_capacity)
            except PoolFull:
                self._forget(images[: i + 1])
                raise

    def _fill_batch(self, entries: list[BatchEntry], outputs: list[int], prompt_rows: dict[int, int]) -> int:
        """Write the text entries' tokens into the batch; set `outputs` (entry index → the row it samples from) and
        `prompt_rows` (entry index → its first row, for a prompt whose log-probabilities are asked); the row count."""
        batch = self._batch
        n = 0
        # Tokens go in slot order: with one KV stream per slot, llama.cpp decodes an ordered batch without
        # regrouping it (measured: 8 streams in descending order took 70 ms a step, ascending 36 ms).
        for index in sorted(range(len(entries)), key=lambda i: entries[i].slot):
            entry = entries[index]
            if entry.image is not None:
                continue
            if n + len(entry.tokens) > self._batch_capacity:
                raise EngineFailure("batch overflow")
            scored = entry.slot in self._prompt_scoring and not entry.draft
            if scored:
                prompt_rows[index] = n
            for i, token in enumerate(entry.tokens, start=entry.pos):
                batch.token[n] = token
                batch.pos[n] = i
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = entry.slot
                batch.logits[n] = scored
                n += 1
            if entry.wants_sample:
                for row in range(n - 1 - entry.draft, n):  # a drafted entry samples after each of its tokens
                    batch.logits[row] = True
                outputs[index] = n - 1 - entry.draft
        batch.n_tokens = n
        return n

    def _decode_batch(self, n: int, images: list[BatchEntry]) -> None:
        """Decode the `n` rows the batch holds (with the threads the governor picks)."""
        if self._governor is not None:
            self._set_threads(self._governor.threads())
        rc = lc.llama_decode(self._ctx, self._batch)
        if rc == 1:  # no room in the KV pool: llama.cpp placed nothing of the batch (its prepare undoes every cell)
            self._forget(images)
            raise PoolFull(f"no room for a batch of {n} tokens in the KV pool")
        if rc != 0:
            raise EngineFailure(f"llama_decode failed with code {rc}")

    def _sample_entries(self, entries: list[BatchEntry], outputs: list[int],
                        rewinds: dict[int, bytes]) -> list[int | None]:
        """Sample each entry that wants it from its row; verify a drafted entry's draft."""
        sampled: list[int | None] = []
        for entry, output in zip(entries, outputs, strict=True):
            if output < 0:
                sampled.append(None)
                continue
            token = self._sample(entry.slot, output)
            if entry.draft:
                self._verify(entry, token, output, rewinds.get(entry.slot))
            sampled.append(token)
        return sampled

    def _forget(self, images: list[BatchEntry]) -> None:
        """Drop what image entries of a step that failed for room put in their slots (from each one's position)."""
        for entry in images:
            lc.llama_memory_seq_rm(self._memory, entry.slot, entry.pos, -1)

    def _verify(self, entry: BatchEntry, first: int, output: int, recurrent: bytes | None) -> None:
        """Sample after each drafted token of `entry` while the samples agree with the draft (the first sample,
        `first`, came from row `output`); keep the agreed tokens in the slot's memory and forget the rest: cut
        them off, or for a hybrid model put back the `recurrent` state saved before the step and decode the agreed
        tokens again (engine/llamacpp/recurrent_state.py)."""
        draft = entry.tokens[1:]
        taken: list[int] = []
        token = first
        while len(taken) < len(draft) and token == draft[len(taken)]:
            token = self._sample(entry.slot, output + len(taken) + 1)
            taken.append(token)
        self._drafted[entry.slot] = taken
        self._last_rows[entry.slot] = output + len(taken)
        agreed = entry.pos + 1 + len(taken)  # the pending token, then the drafted tokens the samples agreed with
        if agreed == entry.pos + len(entry.tokens):
            return
        if recurrent is None:
            lc.llama_memory_seq_rm(self._memory, entry.slot, agreed, -1)
        elif recurrent_state.rewind(self._ctx, entry.slot, recurrent, entry.pos):
            self._redo[entry.slot] = entry.pos, entry.tokens[: 1 + len(taken)]
        else:
            raise EngineFailure("llama.cpp could not put back a hybrid sequence's state after a rejected draft")

    def _redecode(self) -> None:
        """Decode again what rewinds after rejected drafts took back (`_redo`, engine/llamacpp/recurrent_state.py)."""
        if self._redo:
            recurrent_state.redecode(self._ctx, self._batch, self._batch_capacity, self._redo)
            self._redo.clear()

    def take_drafted(self, slot: int) -> list[int]:
        return self._drafted.pop(slot, [])

    def draft(self, requests: dict[int, tuple[list[int], int]]) -> dict[int, list[int]]:
        if self._draft_model is None:
            return {}
        if self._governor is not None:
            self._set_threads(self._governor.threads())
        return self._draft_model.draft(requests)

    def _set_threads(self, threads: int) -> None:
        """Compute the next steps with `threads` threads (ThreadGovernor's choice), the draft model's too."""
        if threads != self._step_threads:
            log.debug("computing with %d of %d threads (outside load %.2f cores)", threads, self._num_threads,
                     self._governor.outside_load if self._governor is not None else 0.0)
            lc.llama_set_n_threads(self._ctx, threads, threads)
            self._step_threads = threads
        if self._draft_model is not None:
            self._draft_model.set_threads(threads)

    @property
    def step_threads(self) -> int:
        """The threads the last step computed with."""
        return self._step_threads

    def _sample(self, slot: int, output: int) -> int:
        """Sample the slot's next token from batch row `output`; a slot that asked for logprobs gets them ranked."""
        scored = self._score_slots.get(slot)
        if scored is not None:
            logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(self._ctx, output), shape=(self._num_vocab,))
            self._scores[slot] = score_tokens(logits, scored)
        k = self._logprob_slots.get(slot)
        if k is None:
            return int(lc.llama_sampler_sample(self._samplers[slot], self._ctx, output))
        ranked = self._sample_ranked(self._samplers[slot], self._ctx, output, k)
        self._ranked[slot] = ranked
        return ranked[0]

    def _score_prompt(self, entry: BatchEntry, first: int) -> None:
        """Rank the prompt tokens of `entry` by the logits of the rows from `first` (engine/prompt_logprobs.py)."""
        scoring = self._prompt_scoring[entry.slot]
        rows = np.stack([np.ctypeslib.as_array(lc.llama_get_logits_ith(self._ctx, first + i),
                                               shape=(self._num_vocab,)) for i in range(len(entry.tokens))])
        scoring.add(rows, entry.tokens, last=entry.wants_sample)
        if entry.wants_sample:
            self._prompt_ranked[entry.slot] = scoring.take()
            del self._prompt_scoring[entry.slot]

    def take_prompt_logprobs(self, slot: int) -> list[Ranked] | None:
        """The ranked log-probability of each prompt token after the first, once the prompt is in (None: not asked
        for, or given already)."""
        return self._prompt_ranked.pop(slot, None)

    def take_logprobs(self, slot: int) -> Ranked | None:
        """The ranked log-probabilities of the token the last `step` sampled for `slot` (None: it asked for none)."""
        return self._ranked.get(slot)

    def take_scores(self, slot: int) -> list[float] | None:
        return self._scores.pop(slot, None)

    # ---- embeddings and reranking ---------------------------------------------------------------

    def embed(self, tokens: list[int], adapters: tuple[Adapter, ...] = ()) -> list[float]:
        """Mean of the final hidden states over `tokens`, decoded in a context of its own that never touches the
        slots (engine/llamacpp/embedding.py)."""
        assert self._embedder is not None
        return self._embedder.embed(tokens, adapters)

    def rank_tokens(self, query: str, document: str, limit: int | None) -> list[int]:
        """The (query, document) pair as this reranker reads it, as llama-server forms it (engine/llamacpp/rerank.py);
        its document cut so the pair holds at most `limit` tokens where it can (None: never cut). Any thread."""
        if self._rank_format is None:
            raise InvalidRequest("this model is not a dedicated reranker", param="model")
        return rerank.pair_tokens(self._rank_format, self._loaded.tokenize_raw, query, document, limit)

    def rank(self, pairs: list[list[int]]) -> list[float]:
        """Each pair's relevance logit from the reranker's head (see `rerank.score`), computed in the model's context
        (a reranker's: it holds no slots' sequences). Pairs are decoded together, in order, as many at a time as the
        context's sequences and micro-batch take."""
        if self._rank_format is None:
            raise InvalidRequest("this model is not a dedicated reranker", param="model")
        capacity = min(self._batch_capacity, lc.llama_n_ubatch(self._ctx))
        return rerank.rank_pairs(pairs, capacity, lc.llama_n_seq_max(self._ctx), self._rank_group)

    def _rank_group(self, pairs: list[list[int]]) -> list[float]:
        """Decode `pairs` in one batch, one sequence each, and read each one's pooled head output."""
        return rerank.decode_pairs(self._ctx, self._batch, pairs, self._rank_softmax)

    def free_memory(self) -> None:
        self._free_samplers()
        self._loaded.free_context()

    def restore_memory(self) -> None:
        (loaded := self._loaded).new_context()
        self._ctx, self._memory, self._batch = loaded.ctx, loaded.memory, loaded.batch
        self._step_threads = self._num_threads  # the new context's
        self._init_slot_state()

    def _free_samplers(self) -> None:
        for sampler in self._samplers.values():
            lc.llama_sampler_free(sampler)
        self._samplers.clear()

    def close(self) -> None:
        if self._draft_model is not None:
            self._draft_model.close()
            self._draft_model = None
        if self._vision is not None:
            self._vision.close()
            self._vision = None
        self._free_samplers()
        if self._embedder is not None:
            self._embedder.close()
        self._loaded.close()  # the slots' context, the adapters, then the model
        self._ctx = self._model = None
