"""lmserve's vLLM plugin: loaded by vLLM in each of its processes (its `vllm.general_plugins` entry point), where the
engine core and the workers run the model.

It mends one thing, on vLLM's CPU build only, and only in the processes lmserve starts for a model with LoRA: the
CPU LoRA kernels (vllm/lora/ops/torch_ops) pick each token's adapter as `weights[index]`, and a token without an
adapter has index -1, which Python reads as the last adapter slot. A batch mixing requests with and without adapters
then ran the plain ones under whichever adapter held the last slot (seen on vLLM 0.32.0: a base request answered as
the fourth adapter; GPU kernels skip -1). The shrink (x A) of such tokens is set to zero here, so the expand (B)
adds nothing to them.

And one more on the same build: the CPU wrapper's `add_lora_logits` gives the logits one adapter index per request
(`sampler_indices`), which fits the rows of a step's sampled tokens but not the rows of one request's prompt when
its prompt log-probabilities are computed (`echo` with `logprobs`): with two requests in the step the shapes part and
the engine core dies (vLLM 0.32.0: "einsum(): subscript b has size 2 ... size 10"). Such rows get their tokens'
own adapter indices here (`prompt_rows`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def register() -> None:
    """Patch vLLM's CPU LoRA shrink (called by vLLM as it starts a process), in the processes lmserve started for a
    CPU model with LoRA (engine/vllm/workers.py LORA_FIX): any other vLLM run goes untouched."""
    import os

    if os.environ.get("LMSERVE_VLLM_CPU_LORA_FIX") != "1":
        return
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    if getattr(lora_ops.bgmv_shrink, "lmserve_masked", False):
        return
    masked = masked_shrink(lora_ops.bgmv_shrink)
    lora_ops.bgmv_shrink = masked  # sgmv_shrink (prefill) calls it by this name
    punica_cpu.bgmv_shrink = masked  # type: ignore[attr-defined]  # decode calls it by its own import
    wrapper = punica_cpu.PunicaWrapperCPU
    wrapper.add_lora_logits = prompt_rows(wrapper.add_lora_logits)  # type: ignore[method-assign]


def masked_shrink(shrink: Callable[..., None]) -> Callable[..., None]:
    """`shrink` (x A into `output`), then zero for the tokens of no adapter (index -1)."""

    def run(inputs: Any, weights: Any, output: Any, indices: Any, *args: Any, **kwargs: Any) -> None:
        shrink(inputs, weights, output, indices, *args, **kwargs)
        none = indices < 0
        if bool(none.any()):
            output[: none.shape[0]][none] = 0

    run.lmserve_masked = True  # type: ignore[attr-defined]
    return run


def prompt_rows(add_lora_logits: Callable[..., None]) -> Callable[..., None]:
    """vLLM's CPU `add_lora_logits`, for rows that are not one per request too: the rows of one request's prompt (a
    slice of the step's hidden states) take the adapter index of each of their tokens (`token_lora_indices` from the
    slice's first row on), or the requests' one index when they all share it."""

    def run(self: Any, y: Any, x: Any, lora_a: Any, lora_b: Any, scale: float, **kwargs: Any) -> None:
        rows = x.view(-1, x.shape[-1])
        per_request = self.sampler_indices
        if rows.shape[0] == per_request.shape[0]:
            add_lora_logits(self, y, x, lora_a, lora_b, scale, **kwargs)
            return
        from vllm.lora.punica_wrapper import punica_cpu

        first = rows.storage_offset() // max(rows.stride(0), 1)
        tokens = self.token_lora_indices
        if bool((per_request == per_request[0]).all()):
            indices = per_request[:1].expand(rows.shape[0])
        elif first + rows.shape[0] <= tokens.shape[0]:
            indices = tokens[first: first + rows.shape[0]]
        else:
            add_lora_logits(self, y, x, lora_a, lora_b, scale, **kwargs)  # vLLM's own refusal
            return
        flat = y.view(-1, y.shape[-1])
        buffer = rows.new_zeros((rows.shape[0], lora_b.size(-1))).float()  # float32, as vLLM's own buffer
        punica_cpu.bgmv_shrink(rows, lora_a, buffer, indices, scale)  # type: ignore[attr-defined]
        punica_cpu.bgmv_expand(buffer, lora_b, flat, indices, add_inputs=True)  # type: ignore[attr-defined]

    run.lmserve_prompt_rows = True  # type: ignore[attr-defined]
    return run
