"""The records the layers share."""

from __future__ import annotations

import pytest

from lmserve.types import Chunk, FinishReason


@pytest.mark.parametrize(("reason", "failed"), [
    (None, False), ("stop", False), ("length", False), ("tool_calls", False), ("error", True), ("abort", True),
])
def test_a_chunk_is_failed_when_the_engine_erred_or_aborted_the_generation(
    reason: FinishReason | None, failed: bool
) -> None:
    assert Chunk(finish_reason=reason).is_failed is failed
