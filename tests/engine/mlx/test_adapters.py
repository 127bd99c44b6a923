"""LoRA adapters per request on the MLX engine (lmserve/engine/mlx/adapters.py): PEFT directories made by `peft` over
the embedded SmolLM2's repository (tests/lora_adapters.py), each reply the one PEFT itself gives (transformers,
float32), alone and mixed with the base's and another adapter's in one continuous batch."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmserve.errors import InvalidRequest
from lmserve.types import Adapter, LoadOptions, SamplingParams
from tests.hf_repos import smollm2_repo
from tests.lora_adapters import smollm2_peft

# find_spec, not an import: MLX is imported through the engine, which puts OpenBLAS under it (engine/mlx/runtime.py)
pytestmark = [pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None, reason="the MLX engine needs mlx-lm"),
              pytest.mark.asyncio(loop_scope="module")]

PROMPT = "<|im_start|>user\nWrite one sentence about the sea.<|im_end|>\n<|im_start|>assistant\n"
TOKENS = 12


@pytest.fixture(scope="module")
def engine() -> Iterator[object]:
    from lmserve.engine.mlx.backend import MlxBackend
    from lmserve.engine.slots.batching import BatchingEngine

    engine = BatchingEngine(MlxBackend(smollm2_repo(), LoadOptions(num_ctx=256, num_parallel=4),
                                       adapter_limits=(2, 8)))
    yield engine
    engine.close()


def peft_replies(folders: list[Path]) -> list[str]:
    """The greedy reply of PEFT's own model (transformers, float32) under each adapter."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_repo())
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(smollm2_repo(), dtype=torch.float32),
                                      str(folders[0]), adapter_name="0")
    for i, folder in enumerate(folders[1:], 1):
        model.load_adapter(str(folder), adapter_name=str(i))
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    replies = []
    for i in range(len(folders)):
        model.set_adapter(str(i))
        out = model.generate(ids, max_new_tokens=TOKENS, do_sample=False)
        replies.append(str(tokenizer.decode(out[0][ids.shape[1]:], skip_special_tokens=True)))
    return replies


async def reply(engine: object, adapters: tuple[Adapter, ...], tokens: int = TOKENS) -> str:
    sampling = SamplingParams(temperature=0, max_tokens=tokens, adapters=adapters)
    return "".join([chunk.text async for chunk in engine.submit(engine.tokenize(PROMPT), sampling)])  # type: ignore[attr-defined]


async def test_each_adapter_replies_as_peft_does_alone_and_mixed_in_one_batch(engine: object) -> None:
    folders = [smollm2_peft(1), smollm2_peft(2)]
    sets = [(), *((Adapter(str(folder), name=f"a{i}"),) for i, folder in enumerate(folders))]
    alone = [await reply(engine, adapters) for adapters in sets]
    assert alone[1:] == peft_replies(folders) and len(set(alone)) == 3
    mixed = await asyncio.gather(*(reply(engine, adapters) for adapters in sets))
    assert mixed == alone  # the base's too, after adapters were applied


async def test_adapters_beyond_the_limit_are_dropped_least_recently_used_first(engine: object) -> None:
    backend = engine.backend  # type: ignore[attr-defined]
    for seed in (1, 2, 3):
        await reply(engine, (Adapter(str(smollm2_peft(seed))),), tokens=1)
    assert backend.adapters.loaded == [str(smollm2_peft(2)), str(smollm2_peft(3))]  # at most 2 (adapter_limits)
    assert backend.adapter_bytes > 0 and engine.stats.max_adapters == 2  # type: ignore[attr-defined]


def write_embedding_lora(folder: Path) -> None:
    """A PEFT directory whose pair fits SmolLM2's token embedding [49152, 576], which is no linear layer."""
    import numpy as np
    from safetensors.numpy import save_file

    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 2, "lora_alpha": 2}')
    prefix = "base_model.model.model.embed_tokens"
    save_file({f"{prefix}.lora_A.weight": np.zeros((2, 576), np.float32),
               f"{prefix}.lora_B.weight": np.zeros((49152, 2), np.float32)}, str(folder / "adapter_model.safetensors"))


@pytest.mark.parametrize(("name", "reason"), [
    ("adapter.gguf", r"adapter\.gguf is no PEFT adapter directory"),  # a GGUF LoRA is llama.cpp's
    ("missing", "LoRA adapter not found"),
    ("embedding", r"changes model\.embed_tokens, which is no linear layer of this model on MLX"),
])
async def test_a_wrong_adapter_is_a_400_before_mlx_reads_it(engine: object, tmp_path: Path, name: str,
                                                             reason: str) -> None:
    if name.endswith(".gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    elif name == "embedding":
        write_embedding_lora(tmp_path / name)
    with pytest.raises(InvalidRequest, match=reason):
        engine.submit(engine.tokenize(PROMPT),  # type: ignore[attr-defined]
                      SamplingParams(max_tokens=2, adapters=(Adapter(str(tmp_path / name)),)))
