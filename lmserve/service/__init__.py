"""The service: one object the HTTP dialects call, made of parts split by concern.

    generation  chat, completion, native generate, embeddings (service/generation.py)
    judging     decisions, reranking, classifying: exact probabilities of answers (service/judging.py)
    models      list, show, create, copy, delete, pull; load, unload, ps (service/models.py)
    residency   which engine instance serves each model name; shared weights; keep-alive (service/residency/)
    loras       LoRA adapters registered by name, and a request's picks among them (service/adapters.py)
    precedence  the options a request runs with: its own over the model's over the server's (service/precedence.py)
    observers   registered listeners of finished generations and loads, e.g. metrics (service/observers.py)

The parts share one Catalog (service/catalog/), the one place that knows where models come from, and the
Residency given to the Service (whose observers they share).
"""

from __future__ import annotations

from lmserve.engine.factory import PromptCache
from lmserve.service.adapters import LoraRegistry
from lmserve.service.catalog import Catalog, ModelDescription, ModelListing, StaticCatalog
from lmserve.service.generation import GenerationService
from lmserve.service.generation_stream import Generation
from lmserve.service.judging import JudgingService
from lmserve.service.models import ModelService
from lmserve.service.observers import Observers
from lmserve.service.precedence import Precedence
from lmserve.service.residency import LoadedModel, Residency
from lmserve.types import LoadOptions

__all__ = ["Generation", "ModelDescription", "ModelListing", "Service", "static_service"]

class Service:
    """Generation, models and residency over one catalog."""

    def __init__(
        self,
        catalog: Catalog,
        residency: Residency,
        *,
        load_options: LoadOptions | None = None,
        hf_endpoint: str | None = None,
        tool_call_parser: str | None = None,
        max_messages: int = 1024,
        max_images: int = 16,
        n_predict: int = -1,
        reasoning_parser: str | None = None,
        reasoning_budget: int | None = None,
        prompt_cache: PromptCache | None = None,
    ) -> None:
        self.catalog = catalog
        self.residency = residency
        self.prompt_cache = prompt_cache
        """The llama.cpp models' prompt cache beyond the slots (closed last: engines save their slots into it)."""
        self.observers: Observers = residency.observers
        self.loras = LoraRegistry(catalog)
        """The LoRA adapters registered by name (`serve --lora`, /v1/load_lora_adapter); its `base` is set by the
        server to the model it serves."""
        self.precedence = Precedence(load_options, n_predict, self.loras)
        self.generation = GenerationService(catalog, residency, self.precedence, self.observers,
                                            tool_call_parser=tool_call_parser, max_messages=max_messages,
                                            max_images=max_images, reasoning_parser=reasoning_parser,
                                            reasoning_budget=reasoning_budget)
        self.judging = JudgingService(self.generation)
        self.models = ModelService(catalog, residency, self.precedence, hf_endpoint=hf_endpoint)

    def fail_all(self, message: str) -> None:
        """End every request in flight, on every loaded model, with an error carrying `message`."""
        for engine in self.residency.engines():
            engine.fail_all(message)

    def close(self) -> None:
        self.residency.close()
        if self.prompt_cache is not None:
            self.prompt_cache.close()


def static_service(models: list[LoadedModel]) -> Service:
    """A service over models that are already loaded; unloading forgets them, it never closes their engines."""
    catalog = StaticCatalog(models)
    residency = Residency(catalog.plan, max_loaded=len(models) or 1, keep_alive=None,
                          close_engine=lambda engine: None)
    return Service(catalog, residency)
