"""How Ray Serve picks the replica for a call: the routers `--replica-routing` names, on Ray's request-router API.

- prefix (`PrefixRouter`): a prompt goes to the replica that was sent the longest start of it, so a conversation's
  next turn, or an agent's next step under the same long system prompt, finds its KV state in that replica's
  prompt cache. Prompt text is cut into blocks of BLOCK_CHARS characters, each block named by a hash chained over
  the blocks before it (equal names: equal text up to there); the router remembers which replica was last sent
  each block (the newest MAX_BLOCKS). A prompt whose blocks no replica was sent, and calls without a prompt (model
  listing, stored records, pulls), go to the least loaded replica; so does a prompt whose replica has more than
  `imbalance` requests in flight beyond the least loaded one. Requests in flight are the larger of Ray's count
  (which forgets a replica not sent anything for 10 s and then reads 0) and the router's own count of the requests
  it routed that have not completed; equal loads are broken in turn, so a burst of new conversations is spread
  evenly rather than by chance.
- least-loaded: Ray's default, the power of two choices on requests in flight.
- round-robin (`RoundRobinRouter`): each replica in turn, whatever it holds (the baseline of bench/replicas.py).

Ray's own prefix router (`PrefixCacheAffinityRouter`) was tried first: its prefix tree lives in a detached actor
called with blocking `ray.get`s from the routing loop, a burst of new conversations all went to one replica (equal
queue lengths resolve to the first candidate), and its public import path needs vLLM's configuration and pyarrow.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from lmserve.replicas.calls import HttpCall

BLOCK_CHARS = 64
MAX_BLOCKS = 500_000
"""Blocks remembered, the least recently sent forgotten first (about 32 MB of prompt text's worth)."""
ENDED_KEPT = 4096
"""Ended requests not (yet) known as routed that the router remembers: rejected ones, and any that ends first."""


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
        self._routed: dict[str, ReplicaID] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._turn = 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_load = self._by_load(candidate_replicas)
        holder = self._holder(prompt_of(pending_request), {r.replica_id: r for r in candidate_replicas})
        if holder is None or self._load(holder.replica_id) > self._load(by_load[0].replica_id) + self._imbalance:
            self._turn += 1
            return [by_load]
        return [[holder], [r for r in by_load if r is not holder]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        for name in block_names(prompt_of(pending_request)):
            self._sent[name] = replica_id
            self._sent.move_to_end(name)
        while len(self._sent) > MAX_BLOCKS:
            self._sent.popitem(last=False)
        metadata = getattr(pending_request, "metadata", None)
        if metadata is None:
            return
        if metadata.internal_request_id in self._ended:
            del self._ended[metadata.internal_request_id]
        else:
            self._routed[metadata.internal_request_id] = replica_id

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """A request ended (or was rejected, never routed): it counts no more. One that ends before Ray says it was
        routed is remembered (the newest ENDED_KEPT), so that it is never counted."""
        if self._routed.pop(internal_request_id, None) is None:
            self._ended[internal_request_id] = None
            while len(self._ended) > ENDED_KEPT:
                self._ended.popitem(last=False)

    def _by_load(self, candidates: list[RunningReplica]) -> list[RunningReplica]:
        """The candidates, least loaded first; equal loads in an order that turns with each call."""
        ordered = sorted(candidates, key=lambda r: r.replica_id.unique_id)
        rank = {r.replica_id: (i - self._turn) % len(ordered) for i, r in enumerate(ordered)}
        return sorted(ordered, key=lambda r: (self._load(r.replica_id), rank[r.replica_id]))

    def _holder(self, text: str, candidates: dict[ReplicaID, RunningReplica]) -> RunningReplica | None:
        """The candidate that was sent the longest start of `text`, if any was."""
        holder = None
        for name in block_names(text):
            replica_id = self._sent.get(name)
            if replica_id in candidates:
                holder = candidates[replica_id]
        return holder

    def _load(self, replica_id: ReplicaID) -> int:
        """Requests in flight on a replica: Ray's count, or the router's own where Ray's is missing or lower."""
        count = self.replica_queue_len_cache.get(replica_id)
        own = sum(1 for routed in self._routed.values() if routed == replica_id)
        return max(int(count) if count is not None else 0, own)


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
