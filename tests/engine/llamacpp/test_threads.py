"""The llama.cpp engine's default thread count: one per physical core this process may use."""

from __future__ import annotations

import os
from pathlib import Path

from lmserve.engine.llamacpp.cpu_load import CPU_SYSFS, core_of, default_threads


def fake_sysfs(root: Path, cores: list[str]) -> Path:
    """A /sys/devices/system/cpu where CPU i is a hardware thread of the core whose sibling list is cores[i]."""
    for cpu, siblings in enumerate(cores):
        topology = root / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "core_cpus_list").write_text(siblings + "\n")
    return root


def test_default_threads_are_the_cores_this_process_may_use_not_the_machines() -> None:
    cores = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(cores)})
        assert default_threads() == 1
    finally:
        os.sched_setaffinity(0, cores)
    physical = {core_of(CPU_SYSFS, cpu) for cpu in cores}
    assert default_threads() == (len(cores) if None in physical else len(physical))


def test_hyperthreads_of_one_core_count_once(tmp_path: Path) -> None:
    cpus = os.sched_getaffinity(0)
    # every CPU this process may use paired with a sibling: half as many cores (rounded up)
    siblings = [f"{cpu - cpu % 2},{cpu - cpu % 2 + 1}" for cpu in range(max(cpus) + 1)]
    sysfs = fake_sysfs(tmp_path, siblings)
    assert default_threads(sysfs) == len({cpu // 2 for cpu in cpus})


def test_each_cpu_its_own_core_gives_a_thread_each(tmp_path: Path) -> None:
    cpus = os.sched_getaffinity(0)
    sysfs = fake_sysfs(tmp_path, [str(cpu) for cpu in range(max(cpus) + 1)])
    assert default_threads(sysfs) == len(cpus)


def test_an_unreadable_topology_counts_every_cpu(tmp_path: Path) -> None:
    assert default_threads(tmp_path / "missing") == len(os.sched_getaffinity(0))


def test_older_kernels_name_the_siblings_thread_siblings_list(tmp_path: Path) -> None:
    topology = tmp_path / "cpu3" / "topology"
    topology.mkdir(parents=True)
    (topology / "thread_siblings_list").write_text("3,7\n")
    assert core_of(tmp_path, 3) == "3,7"
    assert core_of(tmp_path, 4) is None
