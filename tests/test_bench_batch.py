"""bench/batch.py --quick: `lmserve batch`, the HTTP clients, the Batch API and the TTFT probe all run on the default
model (llama.cpp; the vLLM part is off in a quick run), and the table has a numeric ratio and a verdict per goal.

Timings are never asserted (the goals are the full benchmark's business, on a quiet machine).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300
ROW = re.compile(r"^\| (?P<part>1|2a|2b) \| [^|]+ \| [^|]+ \| [^|]+ \| (?P<ratio>\d+\.\d+)x \| [^|]+ \| "
                 r"(?P<verdict>PASS|MISS) \|$", re.MULTILINE)


def run_quick(model: Path) -> tuple[int, str]:
    """Run the quick benchmark; on a timeout, SIGTERM it first so it stops the server it started."""
    proc = subprocess.Popen([sys.executable, "bench/batch.py", "--quick", "--model", str(model)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        pytest.fail(f"bench/batch.py --quick ran past {TIMEOUT_S} s:\n{out[-3000:]}")
    return proc.returncode, out


def test_quick_prints_every_llama_cpp_goal_with_a_ratio(model_path: Path) -> None:
    code, out = run_quick(model_path)
    assert code == 0, out[-3000:]
    for peer in ("[lmserve batch] 12 lines", "[16 HTTP clients] 12 lines", "[Batch API] 12 lines", "[TTFT] idle"):
        assert peer in out, out[-3000:]
    assert "vllm" not in out.lower().split("| part |")[-1], out[-3000:]  # no vLLM row in a quick run
    rows = {m["part"]: float(m["ratio"]) for m in ROW.finditer(out)}
    assert sorted(rows) == ["1", "2a", "2b"], out[-3000:]
    assert all(value > 0 for value in rows.values()), rows
