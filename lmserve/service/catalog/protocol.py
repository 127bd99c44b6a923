"""What a catalog is (`Catalog`) and what it answers: a model's listing, description and settings; and what a
model can do (`show`'s capabilities)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from lmserve.chat.reasoning import detect_reasoning
from lmserve.engine.protocol import Engine
from lmserve.options import Layer
from lmserve.service.residency import LoadPlan
from lmserve.store.modelfile import Modelfile
from lmserve.store.store import Store
from lmserve.types import Adapter, LoadOptions

EngineOpener = Callable[[Path, LoadOptions], Engine]
"""Loads the weights at a path with load options into an engine (engine/factory.py's open_engine)."""


def model_capabilities(template: str, *, vision: bool, reranker: bool = False, audio: bool = False) -> list[str]:
    """What `show` lists: "completion"; "tools" (any model can call tools: a template that does not render them
    gets lmserve's own JSON call format in the prompt); "rerank" (any chat model reranks, judging relevance:
    service/judging.py); "vision" with a projector or a vision config that sees images; "audio" with one that hears;
    "thinking" when the template thinks. A dedicated reranker (a relevance head) lists "rerank" only."""
    if reranker:
        return ["rerank"]
    found = ["completion", "tools", "rerank"]
    if vision:
        found.append("vision")
    if audio:
        found.append("audio")
    if detect_reasoning(template):
        found.append("thinking")
    return found


def is_reranker_metadata(metadata: Mapping[str, object]) -> bool:
    """Whether GGUF metadata describes a dedicated reranker (llama.cpp's rank pooling, `<arch>.pooling_type` 4), or
    a repository's config a sequence classifier with one label (vLLM's score task)."""
    architecture = metadata.get("general.architecture")
    if isinstance(architecture, str) and metadata.get(f"{architecture}.pooling_type") == 4:
        return True
    architectures = metadata.get("architectures")
    return (isinstance(architectures, list) and any(str(a).endswith("ForSequenceClassification") for a in architectures)
            and metadata.get("num_labels", 1) in (1, None))


@dataclass(slots=True)
class ModelListing:
    """A model the server can serve, loaded or not."""

    name: str
    created: int
    owned_by: str = "lmserve"
    size: int = 0
    digest: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    parent: str | None = None
    """The model a LoRA adapter model runs over (its FROM); None for any other model."""


@dataclass(slots=True)
class ModelDescription:
    """What `show` tells about a model."""

    listing: ModelListing
    modelfile: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    template: str = ""
    system: str = ""
    license: str = ""
    model_info: dict[str, Any] = field(default_factory=dict)
    capabilities: list[str] = field(default_factory=lambda: ["completion"])
    signature: dict[str, str] = field(default_factory=dict)
    """Its weights' verified signature: signed_by, verified_at, signature ({} when none was verified)."""


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """What every request to one model starts from, read once per version of its manifest."""

    name: str
    """The canonical name."""
    parameters: Layer
    """The Modelfile's PARAMETERs, sampling and load-time (see lmserve/options.py)."""
    recommended: Layer
    """The sampling its weights recommend (GGUF `general.sampling.*`, a repository's generation_config.json)."""
    has_vision: bool
    """Whether it can see images (a vision projector, or a vision config)."""
    plan: Callable[[LoadOptions], LoadPlan]
    """How it is loaded with given load options (cheap: nothing is loaded yet)."""
    adapters: tuple[Adapter, ...] = ()
    """The LoRA adapters (its Modelfile's ADAPTERs) its requests run with, on an engine that applies them per request
    over the base's loaded weights (EngineSpec.adapters_per_request); elsewhere they are load options."""


class Catalog(Protocol):
    """Where model names come from (the store, or a fixed list), and how each is loaded."""

    def listing(self) -> list[ModelListing]: ...

    def resolve(self, name: str) -> str:
        """The canonical name of `name`; ModelNotFound when there is none."""
        ...

    def settings(self, name: str) -> ModelSettings:
        """What requests to `name` start from (ModelNotFound when there is none): kept while the model is
        unchanged, so that a request costs one cheap check, not a read of the model."""
        ...

    def describe(self, name: str) -> ModelDescription: ...

    def has_vision(self, name: str) -> bool:
        """Whether the model has a vision projector (cheaper than `describe`)."""
        ...

    def parameters(self, name: str) -> Layer:
        """The model's Modelfile PARAMETERs as an option layer, sampling and load-time (see lmserve/options.py)."""
        ...

    def model_defaults(self, name: str) -> Layer:
        """The sampling its weights recommend (GGUF `general.sampling.*`), as an option layer."""
        ...

    def plan(self, name: str, options: LoadOptions) -> LoadPlan:
        """How canonical `name` is loaded with `options` (cheap: nothing is loaded yet)."""
        ...

    @property
    def store(self) -> Store | None:
        """The model store behind the catalog; None for a fixed set of models."""
        ...

    def create(self, name: str, modelfile: Modelfile, *, base_dir: Path | None = None,
               quantize: Callable[[Path], Path] | None = None) -> None:
        """Build and save model `name` from a parsed Modelfile, its weights passed through `quantize` if given."""
        ...

    def copy(self, source: str, destination: str) -> None: ...

    def delete(self, name: str) -> None: ...
