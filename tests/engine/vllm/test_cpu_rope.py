"""vLLM's CPU rotary kernel is turned off for every model in `CPU_ROPE_KERNEL_WRONG` (the LFM2 family), recognized
by model type, text model type or architecture, hybrid or not, and for nothing else (engine/vllm/args.py
`engine_args`).
tests/test_lfm2_reference.py shows the numbers this buys: each member within 1e-4 of transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lmserve.engine.vllm.args import CPU_ROPE_KERNEL_WRONG, VllmOptions, cpu_rope_kernel_wrong, engine_args

EXACT_ROPE = {"custom_ops": ["-rotary_embedding"]}


@pytest.mark.parametrize("config", [
    {"model_type": "lfm2", "layer_types": ["conv", "full_attention"]},  # the hybrid
    {"model_type": "lfm2", "layer_types": ["full_attention"] * 4},  # all attention: not hybrid, just as wrong
    {"model_type": "lfm2_moe", "layer_types": ["conv", "full_attention"]},
    {"model_type": "lfm2_vl", "text_config": {"model_type": "lfm2"}},
    {"model_type": "some_wrapper", "text_config": {"model_type": "lfm2"}},
    {"architectures": ["Lfm2ForCausalLM"]},  # no model_type at all
    {"architectures": ["Lfm2MoeForCausalLM"]},
], ids=["hybrid", "all-attention", "moe", "vl", "text-config", "architecture", "moe-architecture"])
def test_the_lfm2_family_on_the_cpu_takes_pytorchs_rope(config: dict[str, Any]) -> None:
    assert cpu_rope_kernel_wrong(config)
    assert engine_args(Path("/m"), VllmOptions(), config=config)["compilation_config"] == EXACT_ROPE
    assert "compilation_config" not in engine_args(Path("/m"), VllmOptions(is_cpu=False), config=config)


@pytest.mark.parametrize("config", [
    {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
    {"model_type": "qwen3", "layer_types": ["full_attention"]},
    {"model_type": "granitemoehybrid", "layer_types": ["mamba", "attention"]},  # a hybrid of another family
    {},
])
def test_other_models_keep_vllms_kernel(config: dict[str, Any]) -> None:
    assert not cpu_rope_kernel_wrong(config)
    assert "compilation_config" not in engine_args(Path("/m"), VllmOptions(), config=config)


def test_every_family_in_the_table_says_why() -> None:
    assert CPU_ROPE_KERNEL_WRONG and all(family.islower() and len(reason) > 20
                                         for family, reason in CPU_ROPE_KERNEL_WRONG.items())
