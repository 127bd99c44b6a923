"""The thread governor: llama.cpp gets the cores the rest of the machine leaves free, on a scripted machine."""

from __future__ import annotations

import time

import pytest

from lmserve.engine.llamacpp.cpu_load import CpuTimes, ThreadGovernor, read_cpu_times


class Machine:
    """A scripted machine: each `run` advances the clock with `outside` cores busy elsewhere and `own` here."""

    def __init__(self) -> None:
        self.now = 0.0
        self.busy = 0.0
        self.own = 0.0

    def read(self) -> CpuTimes:
        return CpuTimes(busy=self.busy, own=self.own, wall=self.now)

    def clock(self) -> float:
        return self.now

    def run(self, seconds: float, outside: float, own: float = 0.0) -> None:
        self.now += seconds
        self.busy += (outside + own) * seconds
        self.own += own * seconds


def governor(machine: Machine, most: int = 2, cores: int = 2) -> ThreadGovernor:
    return ThreadGovernor(most, cores=cores, read=machine.read, clock=machine.clock)


def steps(gov: ThreadGovernor, machine: Machine, seconds: float, outside: float, own: float = 0.0) -> int:
    """Run steps of 50 ms for `seconds`; the thread count of the last."""
    threads = gov.threads()
    for _ in range(round(seconds / 0.05)):
        machine.run(0.05, outside, own)
        threads = gov.threads()
    return threads


def test_a_quiet_machine_gets_every_thread_even_while_we_compute_on_all_cores() -> None:
    machine = Machine()
    gov = governor(machine)
    assert steps(gov, machine, 2.0, outside=0.0, own=2.0) == 2  # our own busy cores are not outside load


def test_outside_load_takes_threads_away_and_gives_them_back() -> None:
    machine = Machine()
    gov = governor(machine, most=4, cores=4)
    assert steps(gov, machine, 2.0, outside=2.0) == 2
    assert steps(gov, machine, 2.0, outside=3.0) == 1
    assert steps(gov, machine, 2.0, outside=0.1) == 4


def test_never_fewer_than_one_thread_nor_more_than_asked() -> None:
    machine = Machine()
    gov = governor(machine, most=1, cores=2)
    assert steps(gov, machine, 2.0, outside=0.0) == 1
    busy = governor(machine, most=2, cores=2)
    assert steps(busy, machine, 2.0, outside=6.0) == 1  # a load of 8 on 2 cores


def test_a_short_burst_does_not_flip_it() -> None:
    machine = Machine()
    gov = governor(machine)
    steps(gov, machine, 2.0, outside=0.0)
    assert steps(gov, machine, 0.25, outside=2.0) == 2


def test_after_an_idle_spell_the_first_step_already_sees_the_load() -> None:
    machine = Machine()
    gov = governor(machine)
    steps(gov, machine, 1.0, outside=0.0)
    machine.run(5.0, outside=1.5)  # a burner started while no request ran (no steps, no readings)
    assert gov.threads() == 1


def test_without_proc_stat_the_count_stays_as_configured() -> None:
    gov = ThreadGovernor(3, cores=2, read=lambda: None)
    assert gov.threads() == 3


def test_this_machine_can_be_read() -> None:
    first = read_cpu_times()
    if first is None:
        pytest.skip("no /proc/stat here")
    second = first
    deadline = time.monotonic() + 2.0
    while second.own <= first.own and time.monotonic() < deadline:  # CPU time ticks in 10 ms steps
        sum(i * i for i in range(20_000))
        reading = read_cpu_times()
        assert reading is not None
        second = reading
    assert second.own > first.own and second.busy >= first.busy and second.wall > first.wall
