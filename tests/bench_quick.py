"""Running a benchmark script's `--quick` mode from a smoke test (tests/test_bench_*.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_quick(script: str, *args: str, timeout_s: float) -> tuple[int, str]:
    """Run `bench/<script> --quick <args>` from the checkout: its exit status and output. Past `timeout_s` it gets a
    SIGTERM first, so it stops the servers it started, and the test fails with its output's end."""
    proc = subprocess.Popen([sys.executable, f"bench/{script}", "--quick", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        pytest.fail(f"bench/{script} --quick ran past {timeout_s} s:\n{out[-3000:]}")
    return proc.returncode, out
