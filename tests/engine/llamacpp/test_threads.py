"""The llama.cpp engine's default thread count: the cores this process may use."""

from __future__ import annotations

import os

from lmserve.engine.llamacpp.cpu_load import default_threads


def test_default_threads_are_the_cores_this_process_may_use_not_the_machines() -> None:
    cores = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(cores)})
        assert default_threads() == 1
    finally:
        os.sched_setaffinity(0, cores)
    assert default_threads() == len(cores)
