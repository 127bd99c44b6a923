"""lmserve's vLLM plugin (lmserve/engine/vllm/plugin.py): vLLM's own CPU LoRA shrink, masked, leaves a token of no
adapter (index -1) at zero where vLLM alone gives it the last adapter slot's product; a request's prompt rows (prompt
log-probabilities) get their adapter's logits where vLLM's CPU wrapper has one index per request."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace
from typing import Any

import pytest

from lmserve.engine.vllm.plugin import masked_shrink, prompt_rows

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


def logits_case(per_request: list[int], tokens: list[int]) -> tuple[Any, Any, Any]:
    """A stand-in for vLLM's CPU punica wrapper (`sampler_indices` one per request, `token_lora_indices` one per token
    of the step), two adapters of rank 2 over 4 hidden units and 3 logits."""
    import torch

    wrapper = SimpleNamespace(sampler_indices=torch.tensor(per_request), token_lora_indices=torch.tensor(tokens))
    lora_a = torch.stack([torch.full((1, 2, 4), 1.0), torch.full((1, 2, 4), 2.0)])
    lora_b = torch.stack([torch.full((1, 3, 2), 1.0), torch.full((1, 3, 2), 10.0)])
    return wrapper, lora_a, lora_b


@pytest.fixture
def cpu_kernels(monkeypatch: pytest.MonkeyPatch) -> Any:
    """vLLM's CPU LoRA wrapper's kernels as lmserve's plugin leaves them (the shrink masked)."""
    from vllm.lora.ops.torch_ops.lora_ops import bgmv_shrink
    from vllm.lora.punica_wrapper import punica_cpu

    monkeypatch.setattr(punica_cpu, "bgmv_shrink", masked_shrink(bgmv_shrink))
    return punica_cpu.PunicaWrapperCPU.add_lora_logits


def test_a_prompts_rows_under_requests_of_one_adapter_take_it(cpu_kernels: Any) -> None:
    import torch

    wrapper, lora_a, lora_b = logits_case([1, 1], [1] * 12)
    prompt = torch.ones(10, 4)  # one request's prompt rows, where vLLM gives one index per request (2)
    logits = torch.zeros(10, 3)
    prompt_rows(cpu_kernels)(wrapper, logits, prompt, lora_a, lora_b, 1.0)
    assert logits.tolist() == [[160.0] * 3] * 10  # x A: 2 x 4 = 8 per rank unit; x B: 10 x (8 + 8)


def test_a_prompts_rows_of_no_adapter_are_left_alone(cpu_kernels: Any) -> None:
    import torch

    wrapper, lora_a, lora_b = logits_case([-1, -1], [-1] * 12)
    logits = torch.zeros(10, 3)
    prompt_rows(cpu_kernels)(wrapper, logits, torch.ones(10, 4), lora_a, lora_b, 1.0)
    assert logits.abs().sum().item() == 0.0


def test_a_prompts_rows_among_requests_of_other_adapters_take_their_tokens_adapter(cpu_kernels: Any) -> None:
    import torch

    wrapper, lora_a, lora_b = logits_case([0, 1], [0, 0, 0, 1, 1, 1, 1])
    hidden = torch.ones(7, 4)  # the step's hidden states: request 0's 3 tokens, then request 1's 4
    logits = torch.zeros(4, 3)
    prompt_rows(cpu_kernels)(wrapper, logits, hidden[3:7], lora_a, lora_b, 1.0)
    assert logits.tolist() == [[160.0] * 3] * 4  # adapter 1's, not adapter 0's (8 x 1 x 2 = 8)


def test_one_row_per_request_is_vllms_own_path(cpu_kernels: Any) -> None:
    import torch

    wrapper, lora_a, lora_b = logits_case([0, 1], [0, 1])
    logits = torch.zeros(2, 3)
    prompt_rows(cpu_kernels)(wrapper, logits, torch.ones(2, 4), lora_a, lora_b, 1.0)
    assert logits.tolist() == [[8.0] * 3, [160.0] * 3]
