"""Embeddings of a llama.cpp model: the mean of its final hidden states over a text, in a context of its own.

The embedding context is created on first use (one sequence of `num_ctx` tokens) and never touches the slots. It
pools nothing itself: the text is decoded `num_batch` tokens at a time and the per-token states are summed here, so a
long text needs no batch as large as the context (mean pooling in llama.cpp needs the whole sequence in one
micro-batch).
"""

from __future__ import annotations

from typing import Any

import llama_cpp as lc
import numpy as np

from lmserve.engine.llamacpp import batch_rows
from lmserve.engine.llamacpp.loading import LlamaModel
from lmserve.errors import EngineFailure
from lmserve.types import Adapter


class Embedder:
    """The embedding context of a loaded model (the adapters it was loaded with applied), made on the first `embed`."""

    def __init__(self, loaded: LlamaModel, *, num_ctx: int, batch_capacity: int, threads: int) -> None:
        self._loaded = loaded
        self._num_ctx = num_ctx
        self._capacity = batch_capacity
        self._threads = threads
        self._ctx: lc.llama_context_p | None = None
        self._batch: Any = None  # a llama_batch (untyped in the bindings)

    def embed(self, tokens: list[int], adapters: tuple[Adapter, ...] = ()) -> list[float]:
        """Mean of the final hidden states over `tokens`, with the LoRA `adapters` (() the model's own; see the
        module's docstring)."""
        if not tokens:
            raise EngineFailure("cannot embed an empty token list")
        if len(tokens) > self._num_ctx:
            raise EngineFailure(f"cannot embed {len(tokens)} tokens in a context of {self._num_ctx}")
        ctx, batch = self._context()
        self._loaded.adapters.apply(ctx, adapters)
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        num_embd = lc.llama_model_n_embd(self._loaded.model)
        total = np.zeros(num_embd, dtype=np.float64)
        for start in range(0, len(tokens), self._capacity):
            chunk = tokens[start : start + self._capacity]
            batch_rows.fill(batch, [(0, start + i, token, True) for i, token in enumerate(chunk)])
            rc = lc.llama_decode(ctx, batch)
            if rc != 0:
                raise EngineFailure(f"llama_decode failed with code {rc} while embedding")
            states = lc.llama_get_embeddings(ctx)
            if not states:
                raise EngineFailure("llama.cpp returned no embeddings")
            total += np.ctypeslib.as_array(states, shape=(len(chunk), num_embd)).sum(axis=0, dtype=np.float64)
        return [float(x) for x in total / len(tokens)]

    def _context(self) -> tuple[lc.llama_context_p, Any]:
        if self._ctx is not None and self._batch is not None:
            return self._ctx, self._batch
        cparams = lc.llama_context_default_params()
        cparams.n_seq_max = 1
        cparams.n_ctx = self._num_ctx
        cparams.n_batch = self._capacity
        cparams.n_ubatch = self._capacity
        cparams.n_threads = self._threads
        cparams.n_threads_batch = self._threads
        cparams.embeddings = True
        cparams.pooling_type = lc.LLAMA_POOLING_TYPE_NONE
        cparams.no_perf = True
        ctx = lc.llama_init_from_model(self._loaded.model, cparams)
        if not ctx:
            raise EngineFailure(f"llama.cpp could not create an embedding context of {cparams.n_ctx} tokens")
        try:
            self._loaded.adapters.apply(ctx, ())
        except EngineFailure:
            lc.llama_free(ctx)
            raise
        self._ctx = ctx
        self._batch = lc.llama_batch_init(self._capacity, 0, 1)
        return ctx, self._batch

    def close(self) -> None:
        if self._ctx is not None:
            if self._batch is not None:
                lc.llama_batch_free(self._batch)
                self._batch = None
            self._loaded.adapters.forget(self._ctx)
            lc.llama_free(self._ctx)
            self._ctx = None
