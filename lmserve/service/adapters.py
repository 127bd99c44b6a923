"""LoRA adapters the server was given by name (issue 44): `serve --lora NAME=PATH`, vLLM's runtime
`/v1/load_lora_adapter`, and llama-server's numbered list (`GET/POST /lora-adapters`, a request's `lora` field).

An adapter is a model: registering NAME creates the stored model NAME as `FROM <served model>` + `ADAPTER <path>`
(so `/v1/models`, `/api/tags` and `show` list it with its parent, and every dialect, the CLI and `lmserve.LLM` take
`model: NAME`). On an engine that applies adapters per request (llama.cpp) such a model shares its base's loaded
weights and engine: the adapter rides on each request (SamplingParams.adapters), never loading the base twice.

The list is numbered in the order adapters were registered (ids, as llama-server numbers its `--lora` files). A
request's `lora: [{"id"|"name", "scale"}]` picks from it; `POST /lora-adapters` sets each adapter's global scale,
which applies to requests to the served model that name no adapters (0, off, until set: llama-server's
`--lora-init-without-apply`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from lmserve.errors import InvalidRequest, ModelNotFound
from lmserve.service.catalog import Catalog
from lmserve.store.modelfile import Modelfile
from lmserve.types import Adapter, LoraRef


@dataclass(slots=True)
class LoraEntry:
    """One registered adapter: its id in the list, its model name, its file, its global scale."""

    id: int
    name: str
    path: str
    scale: float = 0.0


class LoraRegistry:
    """The adapters registered over the served model `base`; `runtime` allows loading and unloading while serving."""

    def __init__(self, catalog: Catalog, base: str = "", *, runtime: bool = False) -> None:
        self._catalog = catalog
        self.base = base
        self.runtime = runtime
        self._entries: list[LoraEntry] = []
        self._lock = threading.Lock()
        self._registering = threading.Lock()

    def entries(self) -> list[LoraEntry]:
        with self._lock:
            return list(self._entries)

    def register(self, name: str, path: str) -> LoraEntry:
        """Create the model `name` as the served model with the adapter at `path` (checked against it: a 400 naming
        what is wrong) and list it."""
        if not self.base:
            raise InvalidRequest("this server has no base model to put LoRA adapters over", param="lora_name")
        with self._registering:  # one at a time: the name is checked and taken together
            if any(entry.name == name for entry in self.entries()):
                raise InvalidRequest(f"a LoRA adapter named '{name}' is loaded already", param="lora_name")
            given = str(Path(path).expanduser().resolve())
            self._catalog.create(name, Modelfile(from_=self.base, adapters=[given]))
            stored = self._catalog.settings(name).adapters  # the store's copy, which the model runs with
            with self._lock:
                entry = LoraEntry(max((e.id for e in self._entries), default=-1) + 1, name,
                                  stored[0].path if stored else given)
                self._entries.append(entry)
        return entry

    def unregister(self, name: str) -> None:
        """Remove a registered adapter (its model is deleted; ids of the others stay)."""
        with self._lock:
            entry = next((entry for entry in self._entries if entry.name == name), None)
            if entry is None:
                raise ModelNotFound(name, available=[entry.name for entry in self._entries])
            self._entries = [other for other in self._entries if other is not entry]
        self._catalog.delete(name)

    def set_scales(self, scales: dict[int, float]) -> None:
        """Set the global scale of the adapters named by id (POST /lora-adapters); the others go to 0."""
        known = {entry.id for entry in self.entries()}
        unknown = sorted(set(scales) - known)
        if unknown:
            raise InvalidRequest(f"no LoRA adapter has id {unknown[0]} (ids: {sorted(known)})", param="id")
        with self._lock:
            for entry in self._entries:
                entry.scale = scales.get(entry.id, 0.0)

    def applied(self, model: str) -> tuple[Adapter, ...]:
        """The adapters at their global scales for a request to `model` that names none: the served model's only."""
        if model != self.base:
            return ()
        return tuple(Adapter(entry.path, entry.scale, entry.name) for entry in self.entries() if entry.scale != 0.0)

    def resolve(self, refs: tuple[LoraRef, ...]) -> tuple[Adapter, ...]:
        """The adapters a request's `lora` names, each at its scale; a 400 naming an unknown id or name."""
        entries = self.entries()
        adapters: list[Adapter] = []
        for ref in refs:
            if ref.id is not None:
                entry = next((entry for entry in entries if entry.id == ref.id), None)
                if entry is None:
                    raise InvalidRequest(f"no LoRA adapter has id {ref.id} (GET /lora-adapters lists them)",
                                         param="lora")
                adapters.append(Adapter(entry.path, ref.scale, entry.name))
            elif ref.name is not None:
                named = self._model_adapters(ref.name)
                adapters += [Adapter(adapter.path, ref.scale, adapter.name) for adapter in named]
            else:
                raise InvalidRequest("each item of lora needs an id or a name", param="lora")
        return tuple(adapters)

    def _model_adapters(self, name: str) -> tuple[Adapter, ...]:
        try:
            adapters = self._catalog.settings(name).adapters
        except ModelNotFound:
            adapters = ()
        if not adapters:
            raise InvalidRequest(f"'{name}' is no LoRA adapter of this server (GET /lora-adapters lists them)",
                                 param="lora")
        return adapters
