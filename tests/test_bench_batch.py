"""bench/batch.py --quick: `lmserve batch`, the HTTP clients, the Batch API and the TTFT probe all run on the default
model (llama.cpp; the vLLM part is off in a quick run), and the table has a numeric ratio and a verdict per goal.

Timings are never asserted (the goals are the full benchmark's business, on a quiet machine).
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.bench_quick import run_quick

TIMEOUT_S = 300
ROW = re.compile(r"^\| (?P<part>1|2a|2b) \| [^|]+ \| [^|]+ \| [^|]+ \| (?P<ratio>-?\d+\.\d+)x \| [^|]+ \| "
                 r"(?P<verdict>PASS|MISS) \|$", re.MULTILINE)


def test_quick_prints_every_llama_cpp_goal_with_a_ratio(model_path: Path) -> None:
    code, out = run_quick("batch.py", "--model", str(model_path), timeout_s=TIMEOUT_S)
    assert code == 0, out[-3000:]
    for peer in ("[lmserve batch] 12 lines", "[16 HTTP clients] 12 lines", "[Batch API] 12 lines", "[TTFT] idle"):
        assert peer in out, out[-3000:]
    assert "vllm" not in out.lower().split("| part |")[-1], out[-3000:]  # no vLLM row in a quick run
    rows = {m["part"]: float(m["ratio"]) for m in ROW.finditer(out)}
    assert sorted(rows) == ["1", "2a", "2b"], out[-3000:]
    # Part 1 is a difference of two short runs (the file's less the one-line file's): on a busy machine a quick
    # run's 12 lines can be within the load's noise and come out negative, which the table then calls a MISS.
    assert rows["2a"] > 0 and rows["2b"] > 0, rows
