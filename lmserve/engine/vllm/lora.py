"""LoRA adapters per request on vLLM (issue 44): vLLM's multi-LoRA path, where requests with different adapters — and
none — share one batch.

vLLM is readied for adapters when the model loads (`enable_lora`, `max_loras` adapters in one batch, `max_lora_rank`),
which lmserve does when the server was started with --enable-lora, --lora or --runtime-lora; a request naming an
adapter of a model loaded otherwise is a 400 naming the flag. An adapter is a PEFT directory, checked against the
repository by lmserve/store/lora.py before vLLM sees it. vLLM runs one adapter per request, as trained (no scale):
two adapters, or a scale other than 1, are a 400 naming why.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from pathlib import Path
from typing import Any

from lmserve.errors import InvalidRequest
from lmserve.store.lora import check_lora
from lmserve.types import Adapter

VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM's max_lora_rank takes: lmserve's --max-lora-rank goes up to the next (lmserve checks its own)."""


def lora_args(enabled: bool, max_loras: int, max_rank: int) -> dict[str, Any]:
    """vLLM's engine keywords for LoRA: none unless `enabled`."""
    if not enabled:
        return {}
    rank = next((value for value in VLLM_RANKS if value >= max_rank), VLLM_RANKS[-1])
    return {"enable_lora": True, "max_loras": max_loras, "max_lora_rank": rank}


class VllmLoras:
    """The adapters requests to one vLLM model name: each checked, given a stable id, made vLLM's LoRARequest."""

    def __init__(self, base: Path, *, enabled: bool, max_loras: int, max_rank: int) -> None:
        self._base = base
        self.enabled = enabled
        self.max_loras = max_loras if enabled else 0
        self._max_rank = max_rank
        self._ids: dict[str, tuple[int, str]] = {}
        """Path → the id and name vLLM knows it by (the name it was first asked for under: vLLM tells adapters apart
        by name)."""
        self._next = itertools.count(1)
        self._sizes: OrderedDict[str, int] = OrderedDict()
        """The last `max_loras` adapters used, with their weights' sizes: what vLLM holds loaded, near enough."""

    @property
    def num_bytes(self) -> int:
        return sum(self._sizes.values())

    def request(self, adapters: tuple[Adapter, ...]) -> Any:
        """vLLM's LoRARequest for a request's adapters (None for none); InvalidRequest naming what vLLM cannot do."""
        if not adapters:
            return None
        if not self.enabled:
            raise InvalidRequest("this vLLM model was loaded without LoRA support: start the server with "
                                 "--enable-lora (or --lora NAME=PATH) to run adapters on vLLM", param="lora")
        if len(adapters) > 1:
            raise InvalidRequest(f"vLLM runs one LoRA adapter per request, and this one names {len(adapters)}",
                                 param="lora")
        adapter = adapters[0]
        if adapter.scale != 1.0:
            raise InvalidRequest(f"vLLM applies a LoRA adapter as trained (scale 1), not at scale {adapter.scale}",
                                 param="lora")
        facts = check_lora(Path(adapter.path), self._base, max_rank=self._max_rank)
        from vllm.lora.request import LoRARequest

        path = str(Path(adapter.path).resolve())
        if path not in self._ids:
            self._ids[path] = (next(self._next), adapter.name or Path(path).name)
        lora_id, name = self._ids[path]
        self._sizes[path] = facts.size
        self._sizes.move_to_end(path)
        while len(self._sizes) > self.max_loras:
            self._sizes.popitem(last=False)
        return LoRARequest(name, lora_id, path)
