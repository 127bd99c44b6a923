"""lmserve's vLLM plugin (lmserve/engine/vllm/plugin.py): vLLM's own CPU LoRA shrink, masked, leaves a token of no
adapter (index -1) at zero where vLLM alone gives it the last adapter slot's product."""

from __future__ import annotations

import importlib.util

import pytest

from lmserve.engine.vllm.plugin import masked_shrink

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
              pytest.mark.model]  # it imports vLLM and torch (seconds): kept out of `make test-fast`


def test_a_token_of_no_adapter_gets_no_product() -> None:
    import torch
    from vllm.lora.ops.torch_ops.lora_ops import bgmv_shrink

    inputs = torch.ones(3, 4)
    weights = torch.stack([torch.full((1, 2, 4), 1.0), torch.full((1, 2, 4), 2.0)])  # 2 adapter slots, rank 2
    indices = torch.tensor([0, -1, 1])
    plain, masked = torch.zeros(3, 2), torch.zeros(3, 2)
    bgmv_shrink(inputs, weights, plain, indices)
    masked_shrink(bgmv_shrink)(inputs, weights, masked, indices)
    assert plain[1].tolist() == [8.0, 8.0]  # vLLM's: index -1 read as the last slot
    assert masked.tolist() == [[4.0, 4.0], [0.0, 0.0], [8.0, 8.0]]
