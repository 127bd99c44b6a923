"""bench/vs_vllm.py --quick: both peers start, serve every level, and the side-by-side table has numeric ratios.

Timings are never asserted (the goals are the full benchmark's business, on a quiet machine).
"""

from __future__ import annotations

import importlib.util
import re

import pytest

from tests.bench_quick import run_quick

TIMEOUT_S = 400
ROW = re.compile(r"^\s*(?P<streams>\d+)\s+\d+\s+[\d.]+\s+[\d.]+\s+(?P<tps>\d+\.\d+)x\s+(PASS|FAIL)\s+\d+/\d+\s+"
                 r"\d+/\d+\s+(?P<ttft>\d+\.\d+)x\s+(PASS|FAIL)\s*$", re.MULTILINE)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_quick_prints_both_peers_side_by_side() -> None:
    code, out = run_quick("vs_vllm.py", timeout_s=TIMEOUT_S)
    assert code == 0, out[-3000:]
    assert "[vLLM] $ " in out and "[lmserve] $ " in out, out[-3000:]
    assert "vLLM tok/s" in out and "lmserve tok/s" in out, out[-3000:]
    rows = {int(m["streams"]): (float(m["tps"]), float(m["ttft"])) for m in ROW.finditer(out)}
    assert sorted(rows) == [1, 2], out[-3000:]
    assert all(tps > 0 and ttft > 0 for tps, ttft in rows.values()), rows
