"""Does a safetensors repository's config.json describe the weights it holds? Checked before vLLM loads it.

vLLM builds each layer from config.json and its weight loaders `narrow()` a larger checkpoint tensor to the layer's
size: an LFM2 whose config.json says an FFN of 128 over weights 256 wide loads without a word and computes with the
first half of every FFN (wrong from the first token). transformers refuses such a repository (size mismatch) and
llama.cpp the GGUF converted from it (`check_tensor_dims`); lmserve refuses it too, naming the tensor and both
sizes.

Only the safetensors headers are read (8-byte little-endian length, then a JSON object of tensor dtypes and shapes);
no tensor data. What is checked is one table, `RULES`: per model type, the tensors whose sizes follow from config.json.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmserve.errors import InvalidRequest
from lmserve.store.safetensors_header import safetensors_shapes


@dataclass(frozen=True, slots=True)
class Expect:
    """Tensors whose name matches `pattern` have `size` along dimension `dim`, as config.json's `source` says."""

    pattern: str
    dim: int
    size: int
    source: str

    def applies(self, name: str) -> bool:
        return re.search(self.pattern, name) is not None


def lfm2_ffn_width(config: dict[str, Any]) -> int:
    """The FFN width of an LFM2 text config, derived as transformers, vLLM and llama.cpp's converter all do:
    block_ff_dim (else intermediate_size); with block_auto_adjust_ff_dim, two thirds of it, times
    block_ffn_dim_multiplier, rounded up to a multiple of block_multiple_of."""
    width = int(config.get("block_ff_dim") or config.get("intermediate_size") or 0)
    if config.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        multiplier = config.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            width = int(float(multiplier) * width)
        multiple = int(config.get("block_multiple_of") or 256)
        width = multiple * math.ceil(width / multiple)
    return width


def _ffn(prefix: str, width: int, source: str) -> list[Expect]:
    """A gated FFN (w1, w3: width x hidden; w2: hidden x width) under `prefix` (a pattern)."""
    return [Expect(prefix + r"w[13]\.weight$", 0, width, source), Expect(prefix + r"w2\.weight$", 1, width, source)]


def _lfm2(config: dict[str, Any]) -> list[Expect]:
    keys = ("block_ff_dim", "intermediate_size", "block_auto_adjust_ff_dim", "block_ffn_dim_multiplier",
            "block_multiple_of")
    source = ", ".join(f"{key} {json.dumps(config[key])}" for key in keys if key in config)
    return _ffn(r"layers\.\d+\.feed_forward\.", lfm2_ffn_width(config), source)


def _lfm2_moe(config: dict[str, Any]) -> list[Expect]:
    dense = int(config.get("num_dense_layers") or 0)
    width, expert = int(config.get("intermediate_size") or 0), int(config.get("moe_intermediate_size") or 0)
    layers = "|".join(str(i) for i in range(dense)) or "-"  # "-" matches no layer number
    return (_ffn(rf"layers\.(?:{layers})\.feed_forward\.", width, f"intermediate_size {width}")
            + _ffn(r"layers\.\d+\.feed_forward\.experts\.\d+\.", expert, f"moe_intermediate_size {expert}"))


RULES: dict[str, Callable[[dict[str, Any]], list[Expect]]] = {"lfm2": _lfm2, "lfm2_moe": _lfm2_moe}
"""Per model type (config.json's, or its text_config's), the tensor sizes config.json implies."""


def check_weights(directory: Path, config: dict[str, Any]) -> None:
    """InvalidRequest when a tensor of the repository at `directory` contradicts `config` (its config.json)."""
    text = config.get("text_config") or config
    rule = RULES.get(str(text.get("model_type") or config.get("model_type") or ""))
    if rule is None:
        return
    expectations = rule(text)
    for path in sorted(directory.glob("*.safetensors")):
        for name, shape in safetensors_shapes(path).items():
            for expect in expectations:
                if expect.applies(name) and len(shape) > expect.dim and shape[expect.dim] != expect.size:
                    raise InvalidRequest(
                        f"{directory.name}'s config.json does not describe its weights: it means a width of "
                        f"{expect.size} ({expect.source}) but {name} in {path.name} has {shape[expect.dim]} along "
                        f"dimension {expect.dim} (shape {shape}); vLLM would silently cut the tensor to fit",
                        param="model")
