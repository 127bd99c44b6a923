"""Keeping apart the requests that vLLM's sampler cannot serve in one step.

vLLM 0.32's V1 sampler (the CPU build's and the V1 GPU runner's, vllm/v1/sample/sampler.py `Sampler.forward`) has
one logprobs result per step for the whole batch: when any request of the step names `logprob_token_ids`
(lmserve's `SamplingParams.score_tokens`), every request of the step gets that gather, so a request that asked
for its `logprobs` likeliest alternatives (1 or more) gets only its sampled token's, silently. A request with
`logprobs=0` (the sampled token's only) or none is unaffected, and a scoring request is right in any company.
The V2 model runner merges per request; vLLM's fix for V1 is pull request #51789 (open when this was written).

`KindGate` admits requests of one kind into the engine only while none of another kind is in it: scoring
requests (short: one token each) and top-logprobs requests take turns, first come, first served.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

SCORES = "scores"
"""A request that scores named tokens (vLLM's `logprob_token_ids`)."""
TOP_LOGPROBS = "top_logprobs"
"""A request that asks for its likeliest alternatives at each token (vLLM's `logprobs` of 1 or more)."""


def gate_kind(params: Any) -> str | None:
    """The kind of the vLLM `SamplingParams` `params` for `KindGate`, or None when it may share a step with any."""
    if params.logprob_token_ids:
        return SCORES
    if params.logprobs is not None and params.logprobs != 0:
        return TOP_LOGPROBS
    return None


class KindGate:
    """Admits requests of several kinds so that two kinds are never in the engine together.

    A request enters at once when no other kind is in and nobody waits; otherwise it queues, and the queue is
    served in order: its head enters once the kinds before it have left, with every waiter behind it of the same
    kind up to the first of another. Used from one event loop.
    """

    def __init__(self) -> None:
        self._inside: dict[str, int] = {}
        self._queue: deque[tuple[str, asyncio.Future[None]]] = deque()

    def inside(self, kind: str) -> int:
        """How many requests of `kind` are in."""
        return self._inside.get(kind, 0)

    @property
    def waiting(self) -> int:
        """How many requests wait to enter."""
        return sum(1 for _, future in self._queue if not future.done())

    async def enter(self, kind: str) -> None:
        """Wait until a request of `kind` may be in the engine, and count it in (`leave` counts it out)."""
        if not self._queue and self._admits(kind):
            self._inside[kind] = self.inside(kind) + 1
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((kind, future))
        try:
            await future
        except BaseException:
            if future.done() and not future.cancelled():  # let in, then cancelled before it ran
                self.leave(kind)
            else:
                future.cancel()
                self._admit()
            raise

    def leave(self, kind: str) -> None:
        """Count a request of `kind` out, letting in those waiting that may enter now."""
        self._inside[kind] = self.inside(kind) - 1
        self._admit()

    def _admits(self, kind: str) -> bool:
        return all(count == 0 for other, count in self._inside.items() if other != kind)

    def _admit(self) -> None:
        while self._queue:
            kind, future = self._queue[0]
            if future.done():  # cancelled while it waited
                self._queue.popleft()
                continue
            if not self._admits(kind):
                return
            self._queue.popleft()
            self._inside[kind] = self.inside(kind) + 1
            future.set_result(None)
