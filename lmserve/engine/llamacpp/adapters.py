"""The LoRA adapters of one llama.cpp model, applied per request (issue 44).

llama.cpp applies a set of adapters to a whole context: every sequence a decode step computes runs under it. So the
scheduler gives each step the sequences of one adapter set (engine/slots/scheduler.py), and before the step the
backend makes that set the context's (`AdapterPool.apply`; llama.cpp changes nothing when the set is the same).

Adapters load on first use (`llama_adapter_lora_init`, after lmserve/store/lora.py checked the file against the base)
and stay loaded, at most `max_loaded` at once: beyond it the least recently used ones that no context has applied are
freed. The adapters a model was loaded with (LoadOptions.adapters) are loaded at once and are the set of the requests
that name none.
"""

from __future__ import annotations

import ctypes
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import llama_cpp as lc

from lmserve.errors import EngineFailure, LmserveError
from lmserve.store.lora import check_lora
from lmserve.types import Adapter

DEFAULT_MAX_LOADED = 8
"""Adapters kept loaded per model when the server says nothing (--max-loras)."""


class AdapterPool:
    """The adapters loaded for one model and the set each of its contexts has applied. Engine thread only, except
    `check`."""

    def __init__(self, model: Any, base: Path, *, max_loaded: int = DEFAULT_MAX_LOADED, max_rank: int = 0) -> None:
        self._model = model
        self._base = base
        self.max_loaded = max(1, max_loaded)
        self.max_rank = max_rank
        self._loaded: OrderedDict[str, Any] = OrderedDict()
        """Path → llama_adapter_lora pointer, least recently used first."""
        self._applied: dict[int, tuple[Adapter, ...]] = {}
        self.num_bytes = 0
        """The loaded adapters' files' sizes: what they hold in memory, near enough (read from any thread)."""
        """Context address → the set applied to it."""
        self.defaults: tuple[Adapter, ...] = ()
        """The set of requests that name none: the adapters the model was loaded with."""

    def load_defaults(self, paths: tuple[str, ...]) -> None:
        """Load the model's own adapters now (a bad one is an EngineFailure naming it: the load fails)."""
        adapters = tuple(Adapter(path) for path in paths)
        for adapter in adapters:
            try:
                check_lora(Path(adapter.path), self._base, max_rank=self.max_rank)
            except LmserveError as exc:
                raise EngineFailure(exc.message) from None
            self._pointer(adapter.path, keep=adapters)
        self.defaults = adapters

    def check(self, adapters: tuple[Adapter, ...]) -> None:
        """InvalidRequest unless every adapter of the set is a LoRA for this model within the rank limit (any
        thread)."""
        for adapter in adapters:
            check_lora(Path(adapter.path), self._base, max_rank=self.max_rank)

    def apply(self, ctx: Any, adapters: tuple[Adapter, ...]) -> None:
        """Make `adapters` (or the model's own, for ()) the set `ctx` decodes with, loading any not loaded yet."""
        adapters = adapters or self.defaults
        key = ctypes.cast(ctx, ctypes.c_void_p).value or 0
        if self._applied.get(key, ()) == adapters:
            return
        scaled: dict[str, float] = {}  # one adapter named twice is applied once at the sum of its scales
        for adapter in adapters:
            scaled[adapter.path] = scaled.get(adapter.path, 0.0) + adapter.scale
        pointers = [self._pointer(path, keep=adapters) for path in scaled]
        count = len(pointers)
        array = (lc.llama_adapter_lora_p_ctypes * count)(*pointers) if count else None
        scales = (ctypes.c_float * count)(*scaled.values()) if count else None
        rc = lc.llama_set_adapters_lora(ctx, array, count, scales)
        if rc != 0:
            raise EngineFailure(f"llama.cpp could not apply {count} LoRA adapter(s): code {rc}")
        self._applied[key] = adapters

    def forget(self, ctx: Any) -> None:
        """`ctx` is about to be freed: its set no longer holds adapters loaded."""
        self._applied.pop(ctypes.cast(ctx, ctypes.c_void_p).value or 0, None)

    @property
    def loaded(self) -> list[str]:
        return list(self._loaded)

    def _pointer(self, path: str, *, keep: tuple[Adapter, ...]) -> Any:
        pointer = self._loaded.get(path)
        if pointer is not None:
            self._loaded.move_to_end(path)
            return pointer
        pointer = lc.llama_adapter_lora_init(self._model, os.fsencode(path))
        if not pointer:
            raise EngineFailure(f"llama.cpp could not load the LoRA adapter {Path(path).name}")
        self._loaded[path] = pointer
        self.num_bytes += _size(path)
        self._evict({adapter.path for adapter in keep})
        return pointer

    def _evict(self, keep: set[str]) -> None:
        """Free the least recently used adapters beyond `max_loaded` that no context has applied and `keep` lacks."""
        busy = keep | {adapter.path for adapters in self._applied.values() for adapter in adapters}
        for path in [path for path in self._loaded if path not in busy]:
            if len(self._loaded) <= self.max_loaded:
                return
            lc.llama_adapter_lora_free(self._loaded.pop(path))
            self.num_bytes -= _size(path)

    def close(self) -> None:
        """Free every adapter (after every context that used them, before the model)."""
        for pointer in self._loaded.values():
            lc.llama_adapter_lora_free(pointer)
        self._loaded.clear()
        self._applied.clear()
        self.num_bytes = 0


def _size(path: str) -> int:
    try:
        return Path(path).stat().st_size
    except OSError:
        return 0
