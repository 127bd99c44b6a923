"""The replica routers: a prompt goes where its longest start was sent; otherwise, or when that replica is
overloaded, to the least loaded; round robin takes each replica in turn."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from ray.serve._private.common import DeploymentID, ReplicaID

from lmserve.replicas.calls import HttpCall
from lmserve.replicas.routing import BLOCK_CHARS, PrefixRouter, RoundRobinRouter, block_names, router_config

DEPLOYMENT = DeploymentID(name="Replica", app_name="lmserve")


@dataclass
class FakeReplica:
    replica_id: ReplicaID


@dataclass
class Metadata:
    internal_request_id: str


@dataclass
class FakeRequest:
    args: list[Any]
    metadata: Metadata | None = None


class Loads(dict[ReplicaID, int]):
    """Requests in flight per replica, as Ray's queue-length cache gives them."""


def replicas(*names: str) -> list[FakeReplica]:
    return [FakeReplica(ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)) for name in names]


def request(prompt: str, request_id: str | None = None) -> FakeRequest:
    return FakeRequest([HttpCall("POST", "/v1/chat/completions", b"", (), b"{}", prompt)],
                       Metadata(request_id) if request_id else None)


def prefix_router(loads: Loads, imbalance: int = 2) -> PrefixRouter:
    router = PrefixRouter.__new__(PrefixRouter)
    router._replica_queue_len_cache = loads
    router.initialize_state(imbalance=imbalance)
    return router


def choose(router: Any, candidates: list[FakeReplica], prompt: str) -> list[list[FakeReplica]]:
    return asyncio.run(router.choose_replicas(candidates, request(prompt)))  # type: ignore[no-any-return]


SYSTEM = "You are a careful assistant who answers in one sentence. " * 4


def test_block_names_are_chained_over_whole_blocks() -> None:
    text = "a" * BLOCK_CHARS + "b" * BLOCK_CHARS + "c" * (BLOCK_CHARS - 1)
    names = block_names(text)
    assert len(names) == 2
    assert block_names("x" + text[1:])[1] != names[1]  # a different start renames every later block
    assert block_names(text + "more text")[:2] == names


def test_a_returning_conversation_goes_to_the_replica_that_was_sent_its_start() -> None:
    a, b = replicas("a", "b")
    router = prefix_router(Loads())
    first = SYSTEM + "User: what is two plus two?"
    router.on_request_routed(request(first), b.replica_id, None)
    groups = choose(router, [a, b], first + "Assistant: four. User: and three plus three?")
    assert groups[0] == [b] and groups[1] == [a]


def test_the_longest_matching_start_wins_and_a_shared_start_belongs_to_the_last_replica_sent_it() -> None:
    a, b = replicas("a", "b")
    router = prefix_router(Loads())
    longer = SYSTEM + "User: tell me about the sea, its tides and its fish. " * 3
    router.on_request_routed(request(longer), a.replica_id, None)
    router.on_request_routed(request(SYSTEM + "User: a short one."), b.replica_id, None)
    assert choose(router, [a, b], longer + "More?")[0] == [a]
    assert choose(router, [a, b], SYSTEM + "User: something else entirely, please.")[0] == [b]


def test_a_new_prompt_goes_to_the_least_loaded() -> None:
    a, b, c = replicas("a", "b", "c")
    loads = Loads({a.replica_id: 3, b.replica_id: 0, c.replica_id: 1})
    [ordered] = choose(prefix_router(loads), [a, b, c], SYSTEM)
    assert ordered == [b, c, a]


def test_calls_without_a_prompt_go_to_the_least_loaded() -> None:
    a, b = replicas("a", "b")
    [ordered] = choose(prefix_router(Loads({a.replica_id: 2})), [a, b], "")
    assert ordered == [b, a]


def test_an_overloaded_holder_is_passed_over() -> None:
    a, b = replicas("a", "b")
    loads = Loads({a.replica_id: 5, b.replica_id: 1})
    router = prefix_router(loads, imbalance=2)
    router.on_request_routed(request(SYSTEM), a.replica_id, None)
    assert choose(router, [a, b], SYSTEM + "again")[0] == [b, a]
    loads[a.replica_id] = 3
    assert choose(router, [a, b], SYSTEM + "again")[0] == [a]


def test_a_burst_of_new_conversations_on_equal_loads_is_spread_in_turn() -> None:
    a, b = replicas("a", "b")
    router = prefix_router(Loads())
    firsts = [choose(router, [b, a], f"{SYSTEM} conversation {n}")[0][0].replica_id.unique_id for n in range(8)]
    assert sorted(firsts) == ["a"] * 4 + ["b"] * 4


def test_requests_routed_and_not_completed_count_where_ray_has_forgotten_them() -> None:
    a, b = replicas("a", "b")
    loads = Loads()  # Ray's cache entries go stale after 10 s without a send: it reads nothing
    router = prefix_router(loads, imbalance=2)
    for n in range(3):
        router.on_request_routed(request(f"{SYSTEM} conversation {n}", f"id-{n}"), a.replica_id, None)
    assert choose(router, [a, b], "a new prompt")[0][0] == b
    assert choose(router, [a, b], f"{SYSTEM} conversation 0, again")[0] == [b, a]  # 3 > 0 + 2: passed over
    router.on_request_completed(a.replica_id, "id-1")
    router.on_request_completed(a.replica_id, "never-routed")  # a rejected request completes too
    assert choose(router, [a, b], f"{SYSTEM} conversation 0, again")[0] == [a]
    router.on_request_completed(a.replica_id, "id-quick")  # ended before Ray said it was routed: never counted
    router.on_request_routed(request(f"{SYSTEM} conversation 9", "id-quick"), a.replica_id, None)
    assert choose(router, [a, b], f"{SYSTEM} conversation 0, again")[0] == [a]


def test_a_replica_gone_from_the_candidates_holds_nothing() -> None:
    a, b = replicas("a", "b")
    router = prefix_router(Loads())
    router.on_request_routed(request(SYSTEM), a.replica_id, None)
    assert choose(router, [b], SYSTEM + "again") == [[b]]


def test_round_robin_takes_each_replica_in_turn() -> None:
    a, b, c = replicas("a", "b", "c")
    router = RoundRobinRouter.__new__(RoundRobinRouter)
    router.initialize_state()
    chosen = [choose(router, [c, a, b], SYSTEM)[0][0].replica_id.unique_id for _ in range(6)]
    assert chosen == ["a", "b", "c", "a", "b", "c"]


def test_router_config_names_the_routers() -> None:
    assert router_config("prefix", 4) == {"request_router_class": PrefixRouter,
                                          "request_router_kwargs": {"imbalance": 4}}
    assert router_config("round-robin", 4) == {"request_router_class": RoundRobinRouter}
    assert router_config("least-loaded", 4) is None  # Ray's default: the power of two choices
