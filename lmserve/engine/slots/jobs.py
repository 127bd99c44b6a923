"""Embedding and rerank jobs of the slot engine: checked and queued on the event loop, run on the engine thread.

Jobs share the engine thread with decoding (llama.cpp is not thread-safe): the thread runs at most one of them
between two decode steps (engine/slots/batching.py), so generations keep moving while texts are embedded. The
thread settles each job's future on the job's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lmserve.engine.protocol import ModelInfo, unit_vector
from lmserve.engine.slots.backend import Backend
from lmserve.errors import ContextOverflow, EngineFailure, InvalidRequest, LmserveError
from lmserve.types import Adapter

if TYPE_CHECKING:
    from lmserve.engine.slots.bridge import Bridge

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class EmbedJob:
    """One text to embed; the engine thread settles `future` on `loop`."""

    tokens: list[int]
    future: asyncio.Future[list[float]]
    loop: asyncio.AbstractEventLoop
    adapters: tuple[Adapter, ...] = ()


@dataclass(slots=True, eq=False)
class RankJob:
    """(query, document) pairs for a dedicated reranker to score, in the embedding jobs' queue; the engine thread
    settles `future` on `loop` with one score per pair."""

    pairs: list[list[int]]
    future: asyncio.Future[list[float]]
    loop: asyncio.AbstractEventLoop


@dataclass(slots=True, eq=False)
class MemoryJob:
    """Free the KV cache and the slots (`asleep`: sleep level 1), or make them again; the engine thread settles
    `future` on `loop`."""

    asleep: bool
    future: asyncio.Future[list[float]]
    loop: asyncio.AbstractEventLoop


Job = EmbedJob | RankJob | MemoryJob


class Jobs:
    """The embedding and rerank side of an engine over `backend`, queued through `bridge`."""

    def __init__(self, backend: Backend, bridge: Bridge) -> None:
        self.backend = backend
        self.info: ModelInfo = backend.info
        self._bridge = bridge

    # ---- called from the event loop -------------------------------------------------------------

    def embedding_tokens(self, text: str, *, truncate: bool = True) -> list[int]:
        """`text` tokenized for embedding: cut to one sequence's context when `truncate`, else ContextOverflow."""
        tokens = self.backend.tokenize(text, add_special=True, parse_special=True)
        if not tokens:
            raise InvalidRequest("the input to embed is empty", param="input")
        num_ctx = self.info.num_ctx
        if len(tokens) > num_ctx:
            if not truncate:
                raise input_overflow(len(tokens), num_ctx, self.info.num_ctx_train)
            tokens = tokens[:num_ctx]
        return tokens

    async def embed_tokens(self, prompts: list[list[int]], *, normalize: bool = True,
                           adapters: tuple[Adapter, ...] = ()) -> list[list[float]]:
        """One vector per token list, with the LoRA `adapters`; each list must be non-empty and fit in one
        sequence's context."""
        for tokens in prompts:
            if not tokens:
                raise InvalidRequest("the input to embed is empty", param="input")
            if len(tokens) > self.info.num_ctx:
                raise input_overflow(len(tokens), self.info.num_ctx, self.info.num_ctx_train)
        loop = asyncio.get_running_loop()
        jobs = [EmbedJob(list(tokens), loop.create_future(), loop, adapters) for tokens in prompts]
        self._bridge.add_jobs(jobs)
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
        job = RankJob(pairs, loop.create_future(), loop)
        self._bridge.add_jobs([job])
        try:
            return list(await job.future)
        finally:
            job.future.cancel()  # no-op once settled; the thread skips a cancelled job

    async def memory(self, *, asleep: bool) -> None:
        """Have the engine thread free its KV cache and slots (`asleep`) or make them again (`MemoryJob`)."""
        loop = asyncio.get_running_loop()
        job = MemoryJob(asleep, loop.create_future(), loop)
        self._bridge.add_jobs([job])
        await job.future

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

    # ---- the engine thread ----------------------------------------------------------------------

    def run(self, job: EmbedJob | RankJob) -> None:
        """Compute a job and settle its future (a failure fails the job, never the thread)."""
        if job.future.cancelled():  # the caller is gone (a benign race: at worst one wasted embedding)
            return
        try:
            vector = self.backend.embed(job.tokens, job.adapters) if isinstance(job, EmbedJob) \
                else self.backend.rank(job.pairs)
        except LmserveError as exc:
            settle(job, None, exc)
        except Exception as exc:  # a failed embedding fails its request, never the thread
            what = "embedding" if isinstance(job, EmbedJob) else "ranking"
            log.exception("%s failed", what)
            settle(job, None, EngineFailure(f"{what} failed: {exc}"))
        else:
            settle(job, vector, None)


def settle(job: Job, vector: list[float] | None, error: Exception | None) -> None:
    """Settle the job's future on its event loop: with `vector`, or with `error`."""
    with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
        job.loop.call_soon_threadsafe(_set_future, job.future, vector, error)


def _set_future(future: asyncio.Future[list[float]], vector: list[float] | None, error: Exception | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(vector or [])


def input_overflow(num_tokens: int, num_ctx: int, num_ctx_train: int) -> ContextOverflow:
    """A ContextOverflow of an input to embed (param "input")."""
    error = ContextOverflow(num_tokens, num_ctx, num_ctx_train)
    error.param = "input"
    return error
