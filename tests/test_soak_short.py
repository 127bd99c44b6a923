"""Short versions of bench/soak.py, bench/overload.py and bench/replicas.py: real servers, the default model."""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.cores import all_cores

BENCH = Path(__file__).resolve().parent.parent / "bench"
REPLICAS_TIMEOUT_S = 600


def load(name: str) -> ModuleType:
    """bench/ is not a package: load bench/<name>.py by path (registered so dataclasses resolve)."""
    module_name = f"lmserve_bench_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    path = list(sys.path)
    try:
        spec.loader.exec_module(module)
    finally:  # the scripts put bench/ on sys.path to share code: its names (bench/mlx.py) must not shadow packages
        sys.path[:] = path
    return module


def test_soak_short() -> None:
    result = load("soak").run_soak(seconds=10, clients=4, max_tokens=16, python=sys.executable, warmup=4)
    assert result.errors == 0, result.summary()
    assert result.requests > 0, result.summary()
    # RSS growth over 15 s is noise; only check that it was measured.
    assert result.rss_start_kib > 0 and result.rss_end_kib > 0, result.summary()


def test_overload_short() -> None:
    result = load("overload").run_overload(requests=16, max_queue=2, parallel=2, max_tokens=32,
                                           python=sys.executable)
    assert result.rejected > 0, result.summary()
    assert result.other == 0, result.summary()
    assert result.completed + result.rejected == result.requests, result.summary()


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray Serve is not installed")
def test_replicas_short_prints_both_tables() -> None:
    """Tiny sizes: every setup starts, answers and is stopped, and both tables come out with a row per setup."""
    argv = [sys.executable, str(BENCH / "replicas.py"), "--python", sys.executable, "--conversations", "2",
            "--turns", "2", "--users", "2", "--system-tokens", "100", "--max-tokens", "4", "--concurrency", "1",
            "--max-tokens-overhead", "8", "--requests-per-stream", "1", "--min-requests", "1", "--rounds", "1"]
    with all_cores():  # Ray's processes on one core start several times slower (tests/cores.py)
        proc = subprocess.Popen(argv, cwd=BENCH.parent, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = proc.communicate(timeout=REPLICAS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the script stops the servers it started
        out, _ = proc.communicate(timeout=120)
        pytest.fail(f"bench/replicas.py ran past {REPLICAS_TIMEOUT_S} s:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ")]
    assert {"ray-prefix", "ray-round-robin", "plain", "1"} <= set(rows), out[-3000:]
    assert "ray-prefix / ray-round-robin returning TTFT: mean" in out, out[-3000:]
    assert "ray / plain" in out, out[-3000:]
