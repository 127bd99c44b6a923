"""The LoRA adapters of one MLX model, applied per step (issue 44).

An adapter is a PEFT directory (adapter_config.json + adapter_model.safetensors), checked against the repository by
lmserve/store/lora.py before it is read. Each weight it changes, `W` (a linear layer of the model, named as in the
repository: mlx-lm keeps Hugging Face's names), gets `lora_A` [rank, n_in] and `lora_B` [n_out, rank]; the layer then
computes `W x + s (B (A x))` with `s` = the request's scale x lora_alpha / rank (PEFT's scaling; / sqrt(rank) for
rsLoRA).

As on llama.cpp, one step runs one adapter set (the slot engine's scheduler groups sequences by set): before a step
the backend makes its set the active one (`AdapterPool.apply`). A layer an adapter changes is wrapped once, on first
use, in a `LoraLayer` that adds the active set's products to the wrapped layer's output; with no set active it
returns the wrapped layer's output untouched, so the base model's replies do not change.

Adapters load on first use and stay loaded, at most `max_loaded` at once: beyond it the least recently used ones
outside the active set are dropped.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from lmserve.errors import InvalidRequest
from lmserve.store.lora import PEFT_CONFIG, PEFT_PREFIX, PEFT_WEIGHTS, check_lora
from lmserve.store.safetensors_header import safetensors_shapes
from lmserve.types import Adapter

DEFAULT_MAX_LOADED = 8
"""Adapters kept loaded per model when the server says nothing (--max-loras)."""

Delta = tuple[mx.array, mx.array, float]
"""A layer's change under one adapter: A transposed [n_in, rank], B transposed [rank, n_out], its scaling."""


class Active:
    """The deltas of the active set, by layer name (a plain object: MLX does not count it among the parameters)."""

    def __init__(self) -> None:
        self.deltas: dict[str, list[Delta]] = {}


class LoraLayer(nn.Module):  # type: ignore[misc]  # mlx has no type information
    """A linear layer of the model plus the active adapters' low-rank products for it."""

    def __init__(self, base: nn.Module, name: str, active: Active) -> None:
        super().__init__()
        self.base = base
        self.layer_name = name
        self.active = active

    def __call__(self, x: mx.array) -> mx.array:
        y: mx.array = self.base(x)
        for a_t, b_t, scaling in self.active.deltas.get(self.layer_name, ()):
            y = y + (scaling * ((x @ a_t.astype(x.dtype)) @ b_t.astype(x.dtype))).astype(y.dtype)
        return y


class AdapterPool:
    """The adapters loaded for one model and the set its steps run with. Engine thread only, except `check`."""

    def __init__(self, model: nn.Module, base: Path, dtype: Any, *, max_loaded: int = DEFAULT_MAX_LOADED,
                 max_rank: int = 0) -> None:
        self._model = model
        self._base = base
        self._dtype = dtype
        self.max_loaded = max(1, max_loaded)
        self.max_rank = max_rank
        self._loaded: OrderedDict[str, dict[str, Delta]] = OrderedDict()
        """Path → its deltas at scale 1, least recently used first."""
        self._active = Active()
        self._applied: tuple[Adapter, ...] = ()
        self._wrapped: set[str] = set()
        self._fitting: set[str] = set()
        """Adapters whose layers were found in the model (`check`)."""
        self.num_bytes = 0
        """The loaded adapters' weights, in bytes (read from any thread)."""

    def check(self, adapters: tuple[Adapter, ...]) -> None:
        """InvalidRequest unless every adapter of the set is a LoRA for this model within the rank limit, changing
        linear layers mlx-lm's model has."""
        for adapter in adapters:
            check_lora(Path(adapter.path), self._base, max_rank=self.max_rank)
            if adapter.path not in self._fitting:
                for tensor in safetensors_shapes(Path(adapter.path) / PEFT_WEIGHTS):
                    name = tensor.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)[0]
                    if not isinstance(self._layer(name), nn.Linear | nn.QuantizedLinear | LoraLayer):
                        raise InvalidRequest(f"LoRA adapter {Path(adapter.path).name} changes {name}, which is no "
                                             "linear layer of this model on MLX", param="lora")
                self._fitting.add(adapter.path)

    def apply(self, adapters: tuple[Adapter, ...]) -> None:
        """Make `adapters` the set the next step runs with, loading any not loaded yet."""
        if adapters == self._applied:
            return
        deltas: dict[str, list[Delta]] = {}
        for adapter in adapters:
            for name, (a_t, b_t, scaling) in self._deltas(adapter.path, keep=adapters).items():
                deltas.setdefault(name, []).append((a_t, b_t, scaling * adapter.scale))
        for name in deltas.keys() - self._wrapped:
            self._wrap(name)
        self._active.deltas = deltas
        self._applied = adapters

    @property
    def loaded(self) -> list[str]:
        return list(self._loaded)

    def _deltas(self, path: str, *, keep: tuple[Adapter, ...]) -> dict[str, Delta]:
        deltas = self._loaded.get(path)
        if deltas is not None:
            self._loaded.move_to_end(path)
            return deltas
        deltas = self._read(Path(path))
        self._loaded[path] = deltas
        self.num_bytes += _bytes(deltas)
        busy = {adapter.path for adapter in (*keep, *self._applied)}
        for old in [old for old in self._loaded if old not in busy]:
            if len(self._loaded) <= self.max_loaded:
                break
            self.num_bytes -= _bytes(self._loaded.pop(old))
        return deltas

    def _read(self, folder: Path) -> dict[str, Delta]:
        """A PEFT directory's deltas at scale 1, by the name of the layer each changes."""
        config = json.loads((folder / PEFT_CONFIG).read_text())
        rank = int(config["r"])
        alpha = float(config.get("lora_alpha") or rank)
        scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        tensors = mx.load(str(folder / PEFT_WEIGHTS))
        assert isinstance(tensors, dict)
        deltas: dict[str, Delta] = {}
        for tensor, value in tensors.items():
            if tensor.endswith(".lora_A.weight"):
                name = tensor.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
                b = tensors[tensor.replace(".lora_A.", ".lora_B.")]
                deltas[name] = (value.T.astype(self._dtype), b.T.astype(self._dtype), scaling)
        mx.eval([delta[:2] for delta in deltas.values()])
        return deltas

    def _layer(self, name: str) -> Any:
        """The model's module at `name` (a dotted path; numbers index lists), or None."""
        owner: Any = self._model
        for part in name.split("."):
            try:
                owner = owner[int(part)] if part.isdigit() else getattr(owner, part)
            except (AttributeError, IndexError, KeyError, TypeError):
                return None
        return owner

    def _wrap(self, name: str) -> None:
        """Put a LoraLayer around the model's layer `name`."""
        owner, _, last = name.rpartition(".")
        setattr(self._layer(owner), last, LoraLayer(self._layer(name), name, self._active))
        self._wrapped.add(name)


def _bytes(deltas: dict[str, Delta]) -> int:
    return sum(a_t.nbytes + b_t.nbytes for a_t, b_t, _ in deltas.values())
