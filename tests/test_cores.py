"""One share of the cores per xdist worker (tests/cores.py)."""

from __future__ import annotations

import os

from tests.cores import THREAD_VARIABLES, all_cores, worker_share


def test_workers_split_the_cores_evenly() -> None:
    assert [worker_share([0, 1], i, 2) for i in range(2)] == [[0], [1]]
    assert [worker_share([0, 1, 2, 3], i, 2) for i in range(2)] == [[0, 1], [2, 3]]
    assert [worker_share([4, 5, 6], i, 2) for i in range(2)] == [[4], [5]]  # the odd core is left to the system
    assert [worker_share([0], i, 2) for i in range(2)] == [[0], [0]]  # fewer cores than workers: they share one


def test_all_cores_gives_the_run_every_core_for_the_block_and_this_workers_share_after() -> None:
    mine = os.sched_getaffinity(0)
    threads = {name: os.environ.get(name) for name in THREAD_VARIABLES}
    with all_cores():
        cores = os.sched_getaffinity(0)
        assert cores >= mine
        assert all(os.environ[name] == str(len(cores)) for name in THREAD_VARIABLES)
    assert os.sched_getaffinity(0) == mine
    assert {name: os.environ.get(name) for name in THREAD_VARIABLES} == threads
