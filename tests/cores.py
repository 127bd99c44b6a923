"""One share of the cores per xdist worker, so two workers never fight over two cores.

Each worker process is pinned to its own cores (`sched_setaffinity`), and the thread counts of OpenMP, OpenBLAS and
MKL follow; every server, engine process and thread pool it starts inherits both. lmserve's llama.cpp engine counts
the cores it may use, so a server in a pinned worker runs one thread a core it was given, never one a core of the
machine: with ggml's spinning thread pool, four busy threads on two cores are several times slower than two. A test
that needs more cores (tensor parallel over two CPU workers) takes them back with `all_cores()`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
MACHINE = frozenset(os.sched_getaffinity(0))
"""The cores the test run was given."""


def worker_share(cpus: list[int], index: int, workers: int) -> list[int]:
    """Worker `index`'s cores among `workers`: an even split, the remainder to none (one core at least)."""
    share = max(1, len(cpus) // workers)
    start = (index * share) % len(cpus)
    return cpus[start:start + share]


def _set(cpus: frozenset[int] | list[int]) -> None:
    os.sched_setaffinity(0, cpus)
    for name in THREAD_VARIABLES:
        os.environ[name] = str(len(cpus))


def pin_worker(config: pytest.Config) -> None:
    """In an xdist worker of a run with several: keep to this worker's share of the cores."""
    workerinput = getattr(config, "workerinput", None)
    if not workerinput or int(workerinput.get("workercount", 1)) < 2:
        return
    index = int(str(workerinput["workerid"]).removeprefix("gw"))
    _set(worker_share(sorted(MACHINE), index, int(workerinput["workercount"])))


@contextmanager
def all_cores() -> Iterator[None]:
    """Every core of the run for what starts in the block (its processes keep them); this worker's share after."""
    mine = frozenset(os.sched_getaffinity(0))
    saved = {name: os.environ.get(name) for name in THREAD_VARIABLES}
    _set(MACHINE)
    try:
        yield
    finally:
        os.sched_setaffinity(0, mine)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
