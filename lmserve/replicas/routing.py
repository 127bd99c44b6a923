"""How Ray Serve picks the replica for a call: the routers `--replica-routing` names, on Ray's request-router API.

- prefix (`PrefixRouter`): a prompt goes to the replica that was sent the longest start of it, so a conversation's
  next turn, or an agent's next step under the same long system prompt, finds its KV state in that replica's
  prompt cache. Prompt text is cut into blocks of BLOCK_CHARS characters, each block named by a hash chained over
  the blocks before it (equal names: equal text up to there); the router remembers which replica was last sent
  each block (the newest MAX_BLOCKS). A prompt whose blocks no replica was sent, and calls without a prompt (model
  listing, stored records, pulls), go to the least loaded replica; so does a prompt whose replica has more than
  `imbalance` requests in flight beyond the least loaded one (Ray keeps the counts).
- least-loaded: Ray's default, the power of two choices on requests in flight.
- round-robin (`RoundRobinRouter`): each replica in turn, whatever it holds (the baseline of bench/replicas.py).

Ray's own prefix router (`PrefixCacheAffinityRouter`) was tried first: its prefix tree lives in a detached actor
called with blocking `ray.get`s from the routing loop, a burst of new conversations all went to one replica (equal
queue lengths resolve to the first candidate), and its public import path needs vLLM's configuration and pyarrow.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from lmserve.replicas.calls import HttpCall

BLOCK_CHARS = 64
MAX_BLOCKS = 500_000
"""Blocks remembered, the least recently sent forgotten first (about 32 MB of prompt text's worth)."""


def prompt_of(request: PendingRequest | None) -> str:
    """The prompt text of a pending call ("" without one)."""
    if request is None:
        return ""
    return next((arg.prompt for arg in request.args if isinstance(arg, HttpCall)), "")


def block_names(text: str) -> list[int]:
    """The chained names of `text`'s whole blocks: name i stands for text[:BLOCK_CHARS * (i + 1)]."""
    names, name = [], 0
    for end in range(BLOCK_CHARS, len(text) + 1, BLOCK_CHARS):
        name = hash((name, text[end - BLOCK_CHARS:end]))
        names.append(name)
    return names


class PrefixRouter(RequestRouter):
    """Each prompt to the replica that was sent its longest start; otherwise the least loaded."""

    def initialize_state(self, imbalance: int = 4, **kwargs: Any) -> None:
        self._imbalance = imbalance
        self._sent: OrderedDict[int, ReplicaID] = OrderedDict()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        load = {r.replica_id: self._in_flight(r.replica_id) for r in candidate_replicas}
        by_load = sorted(candidate_replicas, key=lambda r: (load[r.replica_id], random.random()))
        holder = self._holder(prompt_of(pending_request), {r.replica_id: r for r in candidate_replicas})
        if holder is None or load[holder.replica_id] > load[by_load[0].replica_id] + self._imbalance:
            return [by_load]
        return [[holder], [r for r in by_load if r is not holder]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        for name in block_names(prompt_of(pending_request)):
            self._sent[name] = replica_id
            self._sent.move_to_end(name)
        while len(self._sent) > MAX_BLOCKS:
            self._sent.popitem(last=False)

    def _holder(self, text: str, candidates: dict[ReplicaID, RunningReplica]) -> RunningReplica | None:
        """The candidate that was sent the longest start of `text`, if any was."""
        holder = None
        for name in block_names(text):
            replica_id = self._sent.get(name)
            if replica_id in candidates:
                holder = candidates[replica_id]
        return holder

    def _in_flight(self, replica_id: ReplicaID) -> int:
        count = self.replica_queue_len_cache.get(replica_id)
        return int(count) if count is not None else 0


class RoundRobinRouter(RequestRouter):
    """Each replica in turn (in the order of their ids), whatever it holds or how busy it is."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._turn = 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda replica: replica.replica_id.unique_id)
        chosen = ordered[self._turn % len(ordered)]
        self._turn += 1
        return [[chosen]]


def router_config(routing: str, parallel: int) -> dict[str, Any] | None:
    """Ray's `request_router_config` for `--replica-routing ROUTING` (None: Ray's default router)."""
    if routing == "prefix":
        return {"request_router_class": PrefixRouter, "request_router_kwargs": {"imbalance": parallel}}
    if routing == "round-robin":
        return {"request_router_class": RoundRobinRouter}
    return None
