"""bench/mlx.py --quick: both peers start, serve every level, and the side-by-side table has numeric ratios.

Timings are never asserted (the goals are the full benchmark's business, on a quiet machine).
"""

from __future__ import annotations

import importlib.util
import re

import pytest

from tests.bench_quick import run_quick

TIMEOUT_S = 600
ROW = re.compile(r"^\s*(?P<streams>\d+)\s+\d+\s+[\d.]+\s+[\d.]+\s+(?P<tps>\d+\.\d+)x\s+(PASS|FAIL)\s+\d+/\d+\s+"
                 r"\d+/\d+\s+(?P<ttft>\d+\.\d+)x\s+(PASS|FAIL)\s*$", re.MULTILINE)


@pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None, reason="mlx-lm is not installed")
def test_quick_prints_both_peers_side_by_side() -> None:
    # the tests' tiny float32 Llama: the SmolLM2 repository is bf16 and the peer would need a float32 copy of it (the
    # benchmark's default is the real model)
    from tests.hf_repos import tiny_llama_repo

    code, out = run_quick("mlx.py", "--model", str(tiny_llama_repo()), timeout_s=TIMEOUT_S)
    assert code == 0, out[-3000:]
    assert "default device" in out, out[-3000:]
    for peer in ("mlx_lm.server", "lmserve"):
        assert f"[{peer}] $ " in out and f"[{peer}] healthy after" in out, out[-3000:]
    assert "mlx_lm tok/s" in out and "lmserve tok/s" in out, out[-3000:]
    rows = {int(m["streams"]): (float(m["tps"]), float(m["ttft"])) for m in ROW.finditer(out)}
    assert sorted(rows) == [1, 2], out[-3000:]
    assert all(tps > 0 and ttft > 0 for tps, ttft in rows.values()), rows
