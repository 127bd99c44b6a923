"""Draft tokens for speculative decoding from a second, smaller model with the target's vocabulary (`--model-draft`).

`DraftModel` holds a small GGUF in its own llama.cpp context with one sequence (its own KV) per slot of the target.
Each step, for every sequence that may draft, it brings its memory of that slot up to the sequence's tokens (only
what changed since the last step: the common prefix stays, a rejected tail is cut), then extends all of them
greedily together, one batch per drafted position, while its top token's probability is at least `p_min`. The
target verifies the drafts in its own step, beside the other sequences' tokens (engine/llamacpp/backend.py
`_verify`), so
drafts never change the output: a sequence keeps the drafted tokens the target itself samples. A draft model with
recurrent memory (LFM2) is rewound to the context after each draft (engine/llamacpp/recurrent_state.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

import llama_cpp as lc
import numpy as np

from lmserve.engine.llamacpp import batch_rows, recurrent_state
from lmserve.engine.llamacpp.options import DRAFT_P_MIN
from lmserve.errors import EngineFailure

log = logging.getLogger(__name__)

VOCAB_SLACK = 128
"""How many tokens two vocabularies may differ by at the end (padding) and still count as the same."""


class DraftModel:
    """A small model proposing greedy drafts for the target's slots; one llama.cpp sequence per slot."""

    def __init__(self, path: str | Path, *, num_slots: int, num_ctx: int, num_batch: int, threads: int,
                 num_gpu_layers: int = 0, p_min: float = DRAFT_P_MIN) -> None:
        path = Path(path)
        if not path.is_file():
            raise EngineFailure(f"draft model file not found: {path}")
        mparams = lc.llama_model_default_params()
        mparams.n_gpu_layers = num_gpu_layers
        model = lc.llama_model_load_from_file(str(path).encode(), mparams)
        if not model:
            raise EngineFailure(f"llama.cpp could not load the draft model {path.name}: not a valid GGUF model")
        self.name = path.name
        self.p_min = p_min
        self._model = model
        self._recurrent = bool(lc.llama_model_is_hybrid(model) or lc.llama_model_is_recurrent(model))
        """Its memory cannot be cut (LFM2): each draft is rewound after it is made
        (engine/llamacpp/recurrent_state.py)."""
        self.vocab = lc.llama_model_get_vocab(model)
        self.num_vocab = lc.llama_vocab_n_tokens(self.vocab)
        cparams = lc.llama_context_default_params()
        cparams.n_seq_max = num_slots
        cparams.n_ctx = num_ctx * num_slots
        cparams.n_batch = num_batch
        cparams.n_ubatch = num_batch
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.kv_unified = False
        cparams.no_perf = True
        ctx = lc.llama_init_from_model(model, cparams)
        if not ctx:
            lc.llama_model_free(model)
            raise EngineFailure(f"llama.cpp could not create a context of {cparams.n_ctx} tokens for the draft model "
                                f"{path.name}")
        self._ctx = ctx
        self._memory = lc.llama_get_memory(ctx)
        self.num_ctx = lc.llama_n_ctx_seq(ctx)
        self._capacity = num_batch
        self._batch = lc.llama_batch_init(num_batch, 0, 1)
        self._threads = threads
        self._token_limit = self.num_vocab
        """Drafted ids must be below it: the smaller of the two vocabularies (`pair`)."""
        self._held: dict[int, list[int]] = {}
        """slot → the tokens the draft model's memory of that slot holds, from position 0."""

    @classmethod
    def for_target(cls, path: str | Path, vocab: lc.llama_vocab_p, target: str, *, num_slots: int, num_ctx: int,
                   num_batch: int, threads: int, num_gpu_layers: int, p_min: float) -> DraftModel:
        """Load the draft model at `path` to draft for the model `target` with `vocab` (EngineFailure unless they
        share the vocabulary: see `pair`)."""
        draft = cls(path, num_slots=num_slots, num_ctx=num_ctx, num_batch=num_batch, threads=threads,
                    num_gpu_layers=num_gpu_layers, p_min=p_min)
        try:
            draft.pair(vocab, target)
        except EngineFailure:
            draft.close()
            raise
        return draft

    def pair(self, vocab: lc.llama_vocab_p, target: str) -> None:
        """Draft for the model `target` with `vocab`; EngineFailure unless its token ids mean the same texts."""
        why = self._vocab_mismatch(vocab)
        if why is not None:
            raise EngineFailure(f"the draft model {self.name} does not share {target}'s vocabulary ({why}): a draft "
                                "model must come from the same family")
        self._token_limit = min(self.num_vocab, lc.llama_vocab_n_tokens(vocab))

    def _vocab_mismatch(self, vocab: lc.llama_vocab_p) -> str | None:
        """Why the target's `vocab` is not the draft model's (token ids would mean other texts), or None."""
        other = lc.llama_vocab_n_tokens(vocab)
        if lc.llama_vocab_type(vocab) != lc.llama_vocab_type(self.vocab):
            return "its tokenizer is of another kind"
        if abs(other - self.num_vocab) > VOCAB_SLACK:
            return f"it has {self.num_vocab} tokens and the model {other}"
        for name in ("bos", "eos"):
            ours, theirs = getattr(lc, f"llama_vocab_{name}")(self.vocab), getattr(lc, f"llama_vocab_{name}")(vocab)
            if ours != theirs:
                return f"its {name.upper()} token is {ours} and the model's {theirs}"
        for token in range(min(other, self.num_vocab)):
            if lc.llama_vocab_get_text(self.vocab, token) != lc.llama_vocab_get_text(vocab, token):
                return f"token {token} differs"
        return None

    def set_threads(self, threads: int) -> None:
        if threads != self._threads:
            lc.llama_set_n_threads(self._ctx, threads, threads)
            self._threads = threads

    def draft(self, requests: dict[int, tuple[list[int], int]]) -> dict[int, list[int]]:
        """For each slot → (its sequence's tokens, the last one not yet decoded by the target; most tokens to
        draft): the greedy continuation, up to that many tokens, stopping before a token below `p_min`."""
        limits = {slot: min(most, self.num_ctx - len(tokens)) for slot, (tokens, most) in requests.items()}
        contexts = {slot: tokens for slot, (tokens, _) in requests.items() if limits[slot] > 0}
        rows = self._sync(contexts)
        saved = {slot: recurrent_state.save(self._ctx, slot) for slot in rows} if self._recurrent else {}
        drafts: dict[int, list[int]] = {slot: [] for slot in requests}
        while rows:
            step: list[tuple[int, int]] = []
            for slot, row in rows.items():
                token = self._confident_token(row)
                if token is None or token >= self._token_limit:
                    continue
                drafts[slot].append(token)
                if len(drafts[slot]) < limits[slot]:
                    step.append((slot, token))
            batch = [(slot, len(self._held[slot]), token, True) for slot, token in step]
            for slot, token in step:
                self._held[slot].append(token)
            rows = self._decode(batch)
        for slot, state in saved.items():  # back to the context alone: a drafted tail could not be cut later
            if len(self._held[slot]) > len(contexts[slot]):
                self._forget(slot, state, len(contexts[slot]))
        return drafts

    def _forget(self, slot: int, state: bytes, pos: int) -> None:
        """Rewind a recurrent slot to its first `pos` positions, whose recurrent state is `state`."""
        if recurrent_state.rewind(self._ctx, slot, state, pos):
            del self._held[slot][pos:]
        else:
            lc.llama_memory_seq_rm(self._memory, slot, -1, -1)
            self._held[slot] = []

    def _sync(self, contexts: dict[int, list[int]]) -> dict[int, int]:
        """Make each slot's memory hold its context (cutting what differs, decoding what is new, at least the last
        token); return slot → the row of the final batch holding the logits after its last token."""
        pending: list[tuple[int, int, int, bool]] = []
        last: list[tuple[int, int, int, bool]] = []
        for slot, tokens in contexts.items():
            held = self._held.setdefault(slot, [])
            common = common_prefix(held, tokens, min(len(held), len(tokens) - 1))
            if common < len(held):
                if not lc.llama_memory_seq_rm(self._memory, slot, common, -1):  # recurrent memory: start over
                    lc.llama_memory_seq_rm(self._memory, slot, -1, -1)
                    common = 0
                del held[common:]
            pending += [(slot, pos, tokens[pos], False) for pos in range(common, len(tokens) - 1)]
            last.append((slot, len(tokens) - 1, tokens[-1], True))
            held.extend(tokens[common:])
        if len(pending) + len(last) <= self._capacity:
            return self._decode(pending + last)
        for start in range(0, len(pending), self._capacity):
            self._decode(pending[start:start + self._capacity])
        return self._decode(last)

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> dict[int, int]:
        """Decode (slot, position, token, wants logits) rows as one batch; slot → its logits row."""
        if not rows:
            return {}
        batch_rows.fill(self._batch, rows)
        rc = lc.llama_decode(self._ctx, self._batch)
        if rc != 0:
            for slot in {row[0] for row in rows}:  # forget what this batch was to add: the next sync redoes it
                lc.llama_memory_seq_rm(self._memory, slot, -1, -1)
                self._held[slot] = []
            log.warning("the draft model's decode failed (code %d); drafting resumes next step", rc)
            return {}
        return {slot: i for i, (slot, _, _, logits) in enumerate(rows) if logits}

    def _confident_token(self, row: int) -> int | None:
        """The draft model's most likely token after batch row `row`, or None when its probability is below p_min."""
        logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(self._ctx, row), shape=(self.num_vocab,))
        token = int(np.argmax(logits))
        if self.p_min <= 0:  # no floor: the softmax over the vocabulary is not needed
            return token
        top = float(logits[token])
        probability = 1.0 / float(np.sum(np.exp(logits - top)))
        return token if probability >= self.p_min else None

    def close(self) -> None:
        if self._ctx:
            lc.llama_batch_free(self._batch)
            lc.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            lc.llama_model_free(self._model)
            self._model = None


def common_prefix(a: list[int], b: list[int], most: int) -> int:
    """How many leading tokens `a` and `b` share, at most `most`: slices compared in C, halving the range (each
    step's catch-up compares whole contexts, which a token-by-token Python loop made cost milliseconds)."""
    if a[:most] == b[:most]:
        return most
    low, high = 0, most  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low
