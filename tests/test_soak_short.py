"""Short versions of bench/soak.py and bench/overload.py: a real server, the default model."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load(name: str) -> ModuleType:
    """bench/ is not a package: load bench/<name>.py by path (registered so dataclasses resolve)."""
    module_name = f"lmserve_bench_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def test_soak_short() -> None:
    result = load("soak").run_soak(seconds=10, clients=4, max_tokens=16, python=sys.executable, warmup=4)
    assert result.errors == 0, result.summary()
    assert result.requests > 0, result.summary()
    # RSS growth over 15 s is noise; only check that it was measured.
    assert result.rss_start_kib > 0 and result.rss_end_kib > 0, result.summary()


def test_overload_short() -> None:
    result = load("overload").run_overload(requests=12, max_queue=2, parallel=2, max_tokens=8,
                                           python=sys.executable)
    assert result.rejected > 0, result.summary()
    assert result.other == 0, result.summary()
    assert result.completed + result.rejected == result.requests, result.summary()
