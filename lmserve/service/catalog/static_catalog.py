"""`StaticCatalog`: models already loaded, served as they are (tests, fixed deployments)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from lmserve import options as opts
from lmserve.errors import InvalidRequest, ModelNotFound
from lmserve.options import Layer
from lmserve.service.catalog.protocol import ModelDescription, ModelListing, ModelSettings, model_capabilities
from lmserve.service.residency import LoadedModel, LoadPlan, WeightsKey
from lmserve.store import repository
from lmserve.store.modelfile import Modelfile
from lmserve.store.store import Store
from lmserve.types import LoadOptions


class StaticCatalog:
    """A fixed set of already-loaded models (tests, and `serve` of a single file)."""

    def __init__(self, models: list[LoadedModel]) -> None:
        self._models = {m.name: m for m in models}
        self._aliases = {alias: m.name for m in models for alias in m.aliases}
        self._settings: dict[str, ModelSettings] = {}

    def listing(self) -> list[ModelListing]:
        return [
            ModelListing(m.name, m.created, m.owned_by, size=m.engine.info.size_bytes, details=_details(m))
            for m in self._models.values()
        ]

    def resolve(self, name: str) -> str:
        for candidate in (name, name + ":latest"):
            if candidate in self._models:
                return candidate
            if candidate in self._aliases:
                return self._aliases[candidate]
        raise ModelNotFound(name, available=list(self._models))

    def settings(self, name: str) -> ModelSettings:
        canonical = self.resolve(name)
        if canonical not in self._settings:  # the models never change
            self._settings[canonical] = ModelSettings(
                name=canonical, parameters=self.parameters(canonical), recommended=self.model_defaults(canonical),
                has_vision=self.has_vision(canonical), plan=partial(self.plan, canonical))
        return self._settings[canonical]

    def describe(self, name: str) -> ModelDescription:
        model = self._models[name]
        listing = next(item for item in self.listing() if item.name == name)
        info = model.engine.info
        return ModelDescription(
            listing=listing,
            modelfile=f"FROM {info.path}\n",
            template=info.chat_template or "",
            system=model.system or "",
            model_info=dict(info.metadata),
            capabilities=model_capabilities(model.template_source or info.chat_template or "", vision=info.has_vision,
                                            audio=info.audio_marker is not None,
                                            reranker=info.can_rank),
        )

    def has_vision(self, name: str) -> bool:
        return self._models[name].engine.info.has_vision

    def parameters(self, name: str) -> Layer:
        """What the model's `sampling` changes from SamplingParams' defaults (it has no Modelfile)."""
        return opts.layer_of(self._models[name].sampling)

    def model_defaults(self, name: str) -> Layer:
        return opts.model_defaults(self._models[name].engine.info.metadata)

    @property
    def store(self) -> Store | None:
        return None

    def create(self, name: str, modelfile: Modelfile, *, base_dir: Path | None = None,
               quantize: Callable[[Path], Path] | None = None) -> None:
        raise InvalidRequest("this server serves a fixed model; start it with a model store to create models")

    def copy(self, source: str, destination: str) -> None:
        raise InvalidRequest("this server serves a fixed model; start it with a model store to copy models")

    def delete(self, name: str) -> None:
        raise InvalidRequest("this server serves a fixed model; start it with a model store to delete models")

    def plan(self, name: str, options: LoadOptions) -> LoadPlan:
        """The model as it was loaded, whatever the options (its engine is fixed)."""
        model = self._models[name]
        return LoadPlan(WeightsKey(f"static:{name}", LoadOptions()), lambda: model.engine, lambda engine: model)


def _details(model: LoadedModel) -> dict[str, Any]:
    info = model.engine.info
    return {
        "parent_model": "",
        "format": "gguf",
        "family": info.architecture,
        "families": [info.architecture] if info.architecture else None,
        "parameter_size": _parameter_size(info.num_params),
        "quantization_level": info.description.split()[-1] if info.description else "",
    }


def _parameter_size(num_params: int) -> str:
    return repository.parameter_size(num_params)
