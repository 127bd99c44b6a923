"""How many threads llama.cpp should compute with, given how busy the machine's CPUs are besides lmserve.

llama.cpp's CPU threads meet at a barrier after each operation of a step and spin while they wait. When other
programs keep the cores busy, one of its threads is often descheduled and the others spin for it, so a step takes
many times longer (measured on 2 cores under a load of about 2: a 9-token reply took 0.27 to 3.4 s with 2 threads,
0.17 to 0.19 s with 1). `ThreadGovernor` watches the CPU time the whole machine spends (/proc/stat, steal included:
another virtual machine's use of our cores) less what this process spends, and gives llama.cpp the cores the
others leave free: all of them on an idle machine (no loss of single-stream speed), fewer as outside load rises,
never fewer than one. The reading is averaged over about half a second, so one short burst does not flip it.

Where /proc/stat cannot be read (not Linux), the governor keeps the configured count.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

WINDOW_S = 0.25
"""Seconds between two readings of the machine's CPU time."""
SMOOTHING_S = 0.5
"""Time constant of the running estimate of the outside load: a window of this length weighs 1 - 1/e; a window
that spans an idle spell of seconds (no steps, no readings) replaces the estimate almost whole."""
MARGIN = 0.25
"""Cores of outside load tolerated before a thread is given up (background noise, our own HTTP threads' peaks)."""


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """Seconds of CPU time: `busy` over all the machine's cores, `own` of this process, at `wall` (monotonic)."""

    busy: float
    own: float
    wall: float


def read_cpu_times() -> CpuTimes | None:
    """The machine's busy CPU time (user, nice, system, irq, softirq, steal) and this process's, now; None where
    /proc/stat cannot be read."""
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(value) for value in fields[1:9])
    ticks = os.sysconf("SC_CLK_TCK")
    own = os.times()
    return CpuTimes(busy=(user + nice + system + irq + softirq + steal) / ticks, own=own.user + own.system,
                    wall=time.monotonic())


class ThreadGovernor:
    """Chooses the thread count of each llama.cpp step: `most` on a quiet machine, one fewer per core the outside
    load keeps busy, at least one. `threads()` is cheap: it reads the CPU times at most once per WINDOW_S."""

    def __init__(self, most: int, cores: int | None = None, read: Callable[[], CpuTimes | None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.most = most
        self._cores = cores or os.cpu_count() or 1
        self._read = read or read_cpu_times
        self._clock = clock
        self._last = self._read()
        self._outside = 0.0
        """Cores the rest of the machine keeps busy (a running average)."""
        self._threads = most

    @property
    def outside_load(self) -> float:
        """The current estimate of the cores the rest of the machine keeps busy."""
        return self._outside

    def threads(self) -> int:
        """The thread count for the next step."""
        if self._last is None:
            return self.most
        if self._clock() - self._last.wall < WINDOW_S:
            return self._threads
        current = self._read()
        if current is None:
            return self.most
        elapsed = current.wall - self._last.wall
        if elapsed <= 0:
            return self._threads
        outside = max(0.0, (current.busy - self._last.busy) - (current.own - self._last.own)) / elapsed
        self._last = current
        weight = 1 - math.exp(-elapsed / SMOOTHING_S)
        self._outside = weight * min(outside, self._cores) + (1 - weight) * self._outside
        free = self._cores - max(0.0, self._outside - MARGIN)
        self._threads = max(1, min(self.most, math.floor(free + 0.5)))
        return self._threads


CPU_SYSFS = Path("/sys/devices/system/cpu")
"""Where Linux describes each CPU's place: `cpuN/topology/core_cpus_list` names the CPUs sharing its core."""


def default_threads(sysfs: Path = CPU_SYSFS) -> int:
    """One thread per physical core this process may run on (its affinity: a container's or `taskset`'s cores, not
    every core of the machine), as llama.cpp's own default: a core's second hardware thread shares its arithmetic
    units, so a thread there adds little to a step and takes the core the server's Python needs. Where the topology
    cannot be read, one per CPU the process may use; the machine's count where the platform cannot say."""
    if not hasattr(os, "sched_getaffinity"):
        return max(1, os.cpu_count() or 1)
    cpus = sorted(os.sched_getaffinity(0))
    cores = {core_of(sysfs, cpu) for cpu in cpus}
    if None in cores:
        return max(1, len(cpus))
    return max(1, len(cores))


def core_of(sysfs: Path, cpu: int) -> str | None:
    """The physical core CPU `cpu` is a hardware thread of, as the list of the CPUs sharing it ("0,8"; CPU numbers
    are the machine's, so the list names one core), or None where sysfs does not say."""
    topology = sysfs / f"cpu{cpu}" / "topology"
    for name in ("core_cpus_list", "thread_siblings_list"):  # the second on kernels before 5.7
        try:
            return (topology / name).read_text(encoding="ascii").strip()
        except OSError:
            continue
    return None
