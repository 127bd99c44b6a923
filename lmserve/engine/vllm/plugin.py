"""lmserve's vLLM plugin: loaded by vLLM in each of its processes (its `vllm.general_plugins` entry point), where the
engine core and the workers run the model.

It mends one thing, on vLLM's CPU build only, and only in the processes lmserve starts for a model with LoRA: the
CPU LoRA kernels (vllm/lora/ops/torch_ops) pick each token's adapter as `weights[index]`, and a token without an
adapter has index -1, which Python reads as the last adapter slot. A batch mixing requests with and without adapters
then ran the plain ones under whichever adapter held the last slot (seen on vLLM 0.32.0: a base request answered as
the fourth adapter; GPU kernels skip -1). The shrink (x A) of such tokens is set to zero here, so the expand (B)
adds nothing to them.
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


def masked_shrink(shrink: Callable[..., None]) -> Callable[..., None]:
    """`shrink` (x A into `output`), then zero for the tokens of no adapter (index -1)."""

    def run(inputs: Any, weights: Any, output: Any, indices: Any, *args: Any, **kwargs: Any) -> None:
        shrink(inputs, weights, output, indices, *args, **kwargs)
        none = indices < 0
        if bool(none.any()):
            output[: none.shape[0]][none] = 0

    run.lmserve_masked = True  # type: ignore[attr-defined]
    return run
