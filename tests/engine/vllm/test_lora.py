"""LoRA adapters per request on a real vLLM engine (lmserve/engine/vllm/lora.py): four PEFT adapters made by `peft`
over the embedded SmolLM2's repository (tests/lora_adapters.py) and the base, mixed in one batch, each reply the one it
gets alone (float32); what vLLM cannot do is a 400 naming why. The run's shared engine (tests/conftest.py
`vllm_engine`, up to 4 adapters in a batch)."""

from __future__ import annotations

import asyncio

import pytest

from lmserve.engine.vllm.engine import VllmEngine
from lmserve.engine.vllm.lora import VllmLoras
from lmserve.errors import InvalidRequest
from lmserve.types import Adapter, SamplingParams
from tests.hf_repos import smollm2_repo
from tests.lora_adapters import smollm2_peft

pytestmark = pytest.mark.asyncio(loop_scope="session")  # vLLM's output handler lives on the loop that first used it

PROMPT = "<|im_start|>user\nWrite one sentence about the sea.<|im_end|>\n<|im_start|>assistant\n"


async def reply(engine: VllmEngine, adapters: tuple[Adapter, ...]) -> str:
    sampling = SamplingParams(temperature=0, max_tokens=12, adapters=adapters)
    return "".join([chunk.text async for chunk in engine.submit(engine.tokenize(PROMPT), sampling)])


async def test_four_adapters_and_the_base_mixed_in_eight_requests_each_answer_as_alone(vllm_engine: VllmEngine) -> None:
    sets = [(), *((Adapter(str(smollm2_peft(seed)), name=f"a{seed}"),) for seed in (1, 2, 3, 4))]
    alone = [await reply(vllm_engine, adapters) for adapters in sets]
    assert len(set(alone)) == len(sets)  # every adapter changes the answer
    jobs = [sets[i % len(sets)] for i in range(8)]
    mixed = await asyncio.gather(*(reply(vllm_engine, adapters) for adapters in jobs))
    assert mixed == [alone[i % len(sets)] for i in range(8)]  # the base's too (engine/vllm/plugin.py)
    assert vllm_engine.stats.max_adapters == 4 and vllm_engine.stats.adapter_bytes > 0


@pytest.mark.parametrize(("adapters", "reason"), [
    (lambda: (Adapter(str(smollm2_peft(1)), 0.5),), "as trained \\(scale 1\\), not at scale 0.5"),
    (lambda: (Adapter(str(smollm2_peft(1))), Adapter(str(smollm2_peft(2)))), "one LoRA adapter per request"),
    (lambda: (Adapter("/nowhere/adapter"),), "LoRA adapter not found"),
])
async def test_what_vllm_cannot_run_is_a_400_naming_why(vllm_engine: VllmEngine, adapters, reason: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidRequest, match=reason):
        vllm_engine.submit(vllm_engine.tokenize(PROMPT), SamplingParams(max_tokens=2, adapters=adapters()))


async def test_a_model_loaded_without_lora_names_the_flag() -> None:
    loras = VllmLoras(smollm2_repo(), enabled=False, max_loras=4, max_rank=64)
    assert loras.request(()) is None and loras.max_loras == 0
    with pytest.raises(InvalidRequest, match="--enable-lora"):
        loras.request((Adapter(str(smollm2_peft(1))),))
