"""Preemption by priority on a real backend: the cases shared by the llama.cpp and MLX tests.

A low-priority greedy request on a one-slot engine gives its slot to a high-priority one after some tokens, then
resumes by recomputing its prompt and output: its reply must be exactly its reply alone, with repetition penalties
(the sampler takes its earlier output again) and with a grammar (the grammar's state is rebuilt from it)."""

from __future__ import annotations

from lmserve.engine.slots.batching import BatchingEngine
from lmserve.types import Chunk, SamplingParams

CASES = {
    "greedy": SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
    "penalties": SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, repeat_penalty=1.8,
                                presence_penalty=1.0, repeat_last_n=64),
    "grammar": SamplingParams(temperature=0, max_tokens=200, grammar="root ::= " + " ".join(["[a-z ]"] * 180)
                              + " [a-z ]*"),  # 180 characters at least: it runs past the interruption
}
PROMPT = [5, 17, 300, 42, 9, 100, 77, 12, 13, 14]


async def low_priority_reply(engine: BatchingEngine, sampling: SamplingParams, *,
                             interrupt: bool) -> tuple[list[int], str, Chunk]:
    """The low-priority request's tokens, text and last chunk; with `interrupt`, a high-priority request arrives
    after its 8th chunk."""
    low = engine.submit(PROMPT, SamplingParams(**{**_fields(sampling), "priority": 1000}))  # type: ignore[arg-type]
    chunks: list[Chunk] = []
    async for chunk in low:
        chunks.append(chunk)
        if interrupt and len(chunks) == 8:
            high = engine.submit([7, 8, 9, 10], SamplingParams(temperature=0, max_tokens=4, priority=0))
            assert [c async for c in high][-1].finish_reason == "length"
    return list(low.output_tokens), "".join(c.text for c in chunks), chunks[-1]


def _fields(sampling: SamplingParams) -> dict[str, object]:
    return {name: getattr(sampling, name) for name in SamplingParams.__dataclass_fields__}


async def check_preemption(engine: BatchingEngine, case: str) -> None:
    sampling = CASES[case]
    alone = await low_priority_reply(engine, sampling, interrupt=False)
    before = engine.stats.preemptions
    interrupted = await low_priority_reply(engine, sampling, interrupt=True)
    assert engine.stats.preemptions == before + 1, "the high-priority request did not take the slot"
    assert interrupted[0] == alone[0] and len(alone[0]) > 8
    assert interrupted[1] == alone[1]
    assert interrupted[2].finish_reason == alone[2].finish_reason
