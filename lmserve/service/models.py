"""Models: list, show, create, copy, delete and pull stored models; load, unload and list the resident ones."""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Any

from lmserve.engine.factory import check_quantization, quantize_weights
from lmserve.engine.protocol import EngineStats
from lmserve.errors import InvalidRequest, ModelNotFound
from lmserve.service.catalog import Catalog, ModelDescription, ModelListing
from lmserve.service.precedence import Precedence
from lmserve.service.pulling import Pull, Report
from lmserve.service.residency import Residency, Resident
from lmserve.store.modelfile import Modelfile
from lmserve.store.store import Store
from lmserve.types import RequestOptions


class ModelService:
    """The model-management half of the API (the local runner's /api/tags, show, create, copy, delete, pull, ps)."""

    def __init__(self, catalog: Catalog, residency: Residency, precedence: Precedence, *,
                 hf_endpoint: str | None = None) -> None:
        self.catalog = catalog
        self.residency = residency
        self.precedence = precedence
        self.hf_endpoint = hf_endpoint

    def listing(self) -> list[ModelListing]:
        return self.catalog.listing()

    def get(self, name: str) -> ModelListing:
        canonical = self.catalog.resolve(name)
        for listing in self.catalog.listing():
            if listing.name == canonical:
                return listing
        raise ModelNotFound(name)

    def describe(self, name: str) -> ModelDescription:
        """What `show` tells: the catalog's description, with a Modelfile's `num_ctx` as the context in force (the
        loaded model's, else capped at the trained length): never a number the engine would not use."""
        canonical = self.catalog.resolve(name)
        description = self.catalog.describe(canonical)
        asked = description.parameters.get("num_ctx")
        if isinstance(asked, int):
            description.parameters["num_ctx"] = self._context_in_force(canonical, asked, description.model_info)
        return description

    def _context_in_force(self, name: str, asked: int, model_info: dict[str, Any]) -> int:
        for resident in self.residency.running():
            if resident.model.name == name:
                return resident.model.engine.info.num_ctx
        trained = model_info.get(f"{model_info.get('general.architecture', '')}.context_length")
        return min(asked, trained) if isinstance(trained, int) and trained > 0 else asked

    def copy(self, source: str, destination: str) -> None:
        self.catalog.copy(self.catalog.resolve(source), destination)

    async def delete(self, name: str) -> None:
        canonical = self.catalog.resolve(name)
        await self.residency.unload(canonical)
        self.catalog.delete(canonical)

    def create(
        self, name: str, modelfile: Modelfile, *, base_dir: Path | None = None, quantize: str | None = None
    ) -> None:
        """Create (or replace) a stored model from a Modelfile, quantizing its weights when asked."""
        quantizer = None
        if quantize is not None:
            level = quantize
            check_quantization(level)

            def quantizer(source: Path) -> Path:
                destination = source.with_name(f".quantized-{level}-{source.name}")
                quantize_weights(source, destination, level, label=modelfile.from_)
                return destination

        self.catalog.create(name, modelfile, base_dir=base_dir, quantize=quantizer)

    @property
    def store(self) -> Store:
        store = self.catalog.store
        if store is None:
            raise InvalidRequest("this server serves a fixed model and has no model store")
        return store

    # ---- residency ------------------------------------------------------------------------------

    async def load(self, name: str, options: RequestOptions | None = None, keep_alive: float | None = None) -> str:
        """Load a model without generating (with the load-time `options` a request set); returns its canonical
        name."""
        model = self.catalog.settings(name)
        load = self.residency.serving(model.name, self.precedence.load(model, options or RequestOptions()))
        resident = await self.residency.acquire(model.name, load, keep_alive, plan=model.plan(load))
        self.residency.release(resident)
        return resident.model.name

    async def unload(self, name: str) -> bool:
        return await self.residency.unload(self.catalog.resolve(name))

    def running(self) -> list[Resident]:
        return self.residency.running()

    # ---- pull -----------------------------------------------------------------------------------

    def pull(self, name: str) -> Pull:
        """Start pulling `name` (see `pull_blocking`) in a worker thread: its progress records as an async iterator,
        which raises the pull's error after its last record; `abort()` stops it. Call it on the event loop."""
        return Pull(partial(self.pull_blocking, name), name)

    def pull_blocking(self, name: str, report: Report) -> None:
        """Download `[hf.co/]<org>/<repo>[:QUANT]` and register it under that name: the repo's GGUF for the quant
        (and its mmproj projector), or, for a repo without GGUFs, its safetensors repository (config.json, weights,
        tokenizer: served by the vLLM engine).

        Blocking (`serve` pulls its model with it before the server runs). Files go to `<store>/hf-cache` (so a
        second pull downloads nothing and an interrupted one resumes) and are hard-linked into the store. `report`
        gets each step: "pulling manifest", each file's download ({digest, total, completed}), "verifying sha256
        digest", then "writing manifest" and "success"; an exception it raises stops the download. The hub is
        `hf_endpoint`, else HF_ENDPOINT, else huggingface.co; the token is HF_TOKEN, else the stored huggingface
        token. The embedded model's name (`smollm2:135m`) registers it again from its installed package, so `rm` of
        it can be undone.
        """
        from lmserve.store.embedded import is_embedded
        from lmserve.store.embedded import restore as restore_embedded
        from lmserve.store.names import parse_name
        from lmserve.store.pull import PulledRepository, PullProgress
        from lmserve.store.pull import pull as pull_files

        parsed = parse_name(name)
        if is_embedded(name):  # restored from the installed package, no network
            from lmserve.service.catalog import gguf_details
            from lmserve.store.gguf_check import gguf_metadata

            restore_embedded(self.store, lambda path: gguf_details(gguf_metadata(path)), report)
            report(PullProgress("writing manifest"))
            report(PullProgress("success"))
            return
        if parsed.namespace is None:
            raise InvalidRequest(
                f"cannot pull '{name}': only Hugging Face names, <org>/<repo> or hf.co/<org>/<repo>[:QUANT], can be "
                "pulled (there is no other registry); create local models with `create`",
                param="model",
            )
        files = pull_files(
            parsed,
            endpoint=self.hf_endpoint or os.environ.get("HF_ENDPOINT") or None,
            token=os.environ.get("HF_TOKEN") or None,
            cache_dir=self.store.root / "hf-cache",
            progress=report,
        )
        report(PullProgress("writing manifest"))
        if isinstance(files, PulledRepository):
            self.create(str(parsed), Modelfile(from_=str(files.directory.resolve())))
        else:
            # the snapshot's paths, not their blobs': a signature lies beside the file under the file's own name
            projector = str(files.projector.absolute()) if files.projector is not None else None
            self.create(str(parsed), Modelfile(from_=str(files.model.absolute()), projector=projector))
        report(PullProgress("success"))


def model_memory(stats: EngineStats) -> dict[str, int]:
    """What a loaded model holds, by part, in bytes, as its engine measures it (/api/ps, /metrics)."""
    return {"weights": stats.weights_bytes, "kv_cache": stats.kv_bytes, "prompt_cache": stats.cache_bytes,
            "adapters": stats.adapter_bytes}
