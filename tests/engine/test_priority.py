"""Preemption by priority on real llama.cpp (tests/engine/priority_cases.py): a low-priority request that gave its
slot away resumes with exactly the reply it has alone, on a model whose memory can be cut (a tiny F32 Llama) and on
a hybrid one whose memory cannot (a tiny LFM2: its state is recomputed whole)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lmserve.engine.llamacpp.backend import LlamaCppBackend
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.types import LoadOptions
from tests.engine.priority_cases import CASES, check_preemption
from tests.tiny_gguf import write_tiny_llama
from tests.tiny_lfm2 import write_tiny_lfm2

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module", params=["llama", "lfm2"])
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BatchingEngine]:
    folder = tmp_path_factory.mktemp("priority")
    path: Path = (write_tiny_llama(folder / "tiny-llama.gguf") if request.param == "llama"
                  else write_tiny_lfm2(folder / "tiny-lfm2.gguf"))
    engine = BatchingEngine(LlamaCppBackend(path, LoadOptions(num_ctx=256, num_parallel=1, num_batch=256)))
    yield engine
    engine.close()


@pytest.mark.parametrize("case", sorted(CASES))
async def test_a_preempted_request_resumes_with_its_reply_alone(engine: BatchingEngine, case: str) -> None:
    await check_preemption(engine, case)
