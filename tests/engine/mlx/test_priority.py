"""Preemption by priority on the MLX engine (tests/engine/priority_cases.py): a low-priority request that gave its
slot away resumes with exactly the reply it has alone, on a tiny Llama and a tiny hybrid LFM2 (float32, CPU)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

from lmserve.engine.mlx.backend import MlxBackend
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.types import LoadOptions
from tests.engine.priority_cases import CASES, check_preemption
from tests.hf_repos import tiny_lfm2_repo, tiny_llama_repo

# find_spec, not an import: MLX is imported through the engine, which puts OpenBLAS under it (engine/mlx/runtime.py)
pytestmark = [pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None, reason="the MLX engine needs mlx-lm"),
              pytest.mark.asyncio(loop_scope="module")]


@pytest.fixture(scope="module", params=["llama", "lfm2"])
def engine(request: pytest.FixtureRequest) -> Iterator[BatchingEngine]:
    repo = tiny_llama_repo() if request.param == "llama" else tiny_lfm2_repo()
    engine = BatchingEngine(MlxBackend(repo, LoadOptions(num_ctx=256, num_parallel=1)))
    yield engine
    engine.close()


@pytest.mark.parametrize("case", sorted(CASES))
async def test_a_preempted_request_resumes_with_its_reply_alone(engine: BatchingEngine, case: str) -> None:
    await check_preemption(engine, case)
