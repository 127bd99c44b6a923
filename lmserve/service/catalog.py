"""Catalogs: where model names come from, what they are, and how each is loaded (a LoadPlan for residency).

`StoreCatalog` is the model store: a stored model's weights (a GGUF blob, or a safetensors repository's directory,
`Store.model_path`) are opened by `open_engine` (engine/factory.py picks the engine), bound with the Modelfile's
TEMPLATE (Go) or else the model's own chat template, and its PARAMETERs as sampling defaults. Names created FROM
the same weights with the same load-time options plan the same WeightsKey, so they share one engine instance.
`StaticCatalog` serves models already loaded (tests, fixed deployments).
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from lmserve import options as opts
from lmserve.chat.gotemplate import GoChatTemplate
from lmserve.chat.reasoning import detect_reasoning
from lmserve.chat.template import ChatTemplate
from lmserve.engine.factory import EngineSettings, engine_of, estimate_memory, vision_missing
from lmserve.engine.protocol import Engine
from lmserve.errors import EngineFailure, InvalidRequest, LmserveError, ModelNotFound
from lmserve.options import Layer
from lmserve.service.residency import LoadedModel, LoadPlan, Prompter, WeightsKey
from lmserve.store import repository
from lmserve.store.gguf_check import check_gguf, gguf_metadata
from lmserve.store.load_crashes import LoadCrashes
from lmserve.store.modelfile import Modelfile
from lmserve.store.names import ModelName, is_gguf_path, parse_name
from lmserve.store.store import Manifest, ModelEntry, Store
from lmserve.types import LoadOptions, Message

EngineOpener = Callable[[Path, LoadOptions], Engine]
"""Loads the weights at a path with load options into an engine (engine/factory.py's open_engine)."""


def model_capabilities(template: str, *, vision: bool, reranker: bool = False) -> list[str]:
    """What `show` lists: "completion"; "tools" (any model can call tools: a template that does not render them
    gets lmserve's own JSON call format in the prompt); "rerank" (any chat model reranks, judging relevance:
    service/judging.py); "vision" with a projector or a vision config; "thinking" when the template thinks. A
    dedicated reranker (a relevance head) lists "rerank" only."""
    if reranker:
        return ["rerank"]
    found = ["completion", "tools", "rerank"]
    if vision:
        found.append("vision")
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
_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
               12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
               32: "BF16"}  # fmt: skip


def gguf_details(metadata: dict[str, Any], *, parent: str = "") -> dict[str, Any]:
    """`details` of a GGUF's metadata: its architecture, its parameter count as the local runner writes it (the
    values in its tensors, gguf_metadata's `general.parameter_count`; the `general.size_label` only without it, a
    label such as "4x3.3M" for experts) and its file type."""
    arch = str(metadata.get("general.architecture", ""))
    file_type = metadata.get("general.file_type")
    count = metadata.get("general.parameter_count")
    return {
        "parent_model": parent,
        "format": "gguf",
        "family": arch,
        "families": [arch] if arch else None,
        "parameter_size": repository.parameter_size(count) if isinstance(count, int) and count > 0
        else str(metadata.get("general.size_label", "")),
        "quantization_level": _FILE_TYPES.get(file_type, str(file_type or "")) if isinstance(file_type, int) else "",
    }


class StoreCatalog:
    """Catalog over a Store; `plan` tells residency how a stored manifest is loaded."""

    def __init__(self, store: Store, open_engine: EngineOpener, engines: EngineSettings | None = None) -> None:
        self._store = store
        self._open_engine = open_engine
        self._engines = engines or EngineSettings()
        """The server's engine settings: which engine a model goes to, and what its estimates count."""
        self._load_crashes = LoadCrashes.of_store(store.root)
        self._model_defaults: dict[str, Layer] = {}
        """Each weights blob's recommended sampling, by digest."""
        self._settings: dict[ModelName, tuple[tuple[int, int, int], ModelSettings]] = {}
        """Each model's settings, with the stamp of the manifest they were read from (Store.stamp)."""

    @property
    def store(self) -> Store:
        return self._store

    def listing(self) -> list[ModelListing]:
        return [self._listing(entry) for entry in self.store.list()]

    def resolve(self, name: str) -> str:
        return self.settings(name).name

    def settings(self, name: str) -> ModelSettings:
        """The model's settings, read again when its manifest changed since (a create, copy, delete or pull here or
        in another process): one stat of the manifest, no read and no lock, while it has not."""
        parsed = parse_name(name)
        stamp = self.store.stamp(parsed)
        cached = self._settings.get(parsed)
        if stamp is not None and cached is not None and cached[0] == stamp:
            return cached[1]
        self._settings.pop(parsed, None)
        entry = self.store.find(name)  # ModelNotFound when it went
        settings = self._read_settings(entry)
        if stamp is not None:
            self._settings[parsed] = (stamp, settings)  # a change after the stat is seen at the next check
        return settings

    def _read_settings(self, entry: ModelEntry) -> ModelSettings:
        manifest = entry.manifest
        if manifest.files:  # a repository: its config.json (the `model` blob) has a vision_config
            vision = repository.has_vision(repository.read_json(self.store.blob_path(manifest.model)))
        else:
            vision = manifest.projector is not None
        return ModelSettings(name=str(entry.name), parameters=opts.from_parameters(manifest.parameters),
                             recommended=self._recommended(manifest), has_vision=vision,
                             plan=partial(self._plan, entry, self.store.model_path(manifest)))

    def describe(self, name: str) -> ModelDescription:
        entry = self.store.find(name)
        manifest = entry.manifest
        if manifest.files:
            directory = self.store.model_path(manifest)
            metadata = repository.model_info(directory)
            template = manifest.template or repository.chat_template(directory)
            config = repository.read_json(directory / repository.CONFIG)
            vision = repository.has_vision(config) and vision_missing(directory, config) is None
        else:
            metadata = gguf_metadata(self.store.blob_path(manifest.model))
            template = manifest.template or str(metadata.get("tokenizer.chat_template", ""))
            vision = bool(manifest.projector)
        return ModelDescription(
            listing=self._listing(entry),
            modelfile=self.modelfile(entry).to_text(),
            parameters={**self._recommended(manifest), **manifest.parameters},
            template=template,
            system=manifest.system or "",
            license="\n".join(manifest.license),
            model_info=metadata,
            capabilities=model_capabilities(template, vision=vision,
                                            reranker=is_reranker_metadata(config if manifest.files else metadata)),
        )

    def has_vision(self, name: str) -> bool:
        return self.settings(name).has_vision

    def modelfile(self, entry: ModelEntry) -> Modelfile:
        m = entry.manifest
        return Modelfile(
            from_=str(self.store.model_path(m)),
            projector=str(self.store.blob_path(m.projector)) if m.projector else None,
            parameters=dict(m.parameters),
            template=m.template,
            system=m.system,
            messages=list(m.messages),
            adapters=[str(self.store.blob_path(a)) for a in m.adapters],
            license=list(m.license),
        )

    def parameters(self, name: str) -> Layer:
        return self.settings(name).parameters

    def model_defaults(self, name: str) -> Layer:
        return self.settings(name).recommended

    def _recommended(self, manifest: Manifest) -> Layer:
        if manifest.files:  # a repository recommends sampling in its generation_config.json
            digest = manifest.files.get(repository.GENERATION_CONFIG)
            if digest is None:
                return {}
            if digest not in self._model_defaults:
                config = repository.read_json(self.store.blob_path(digest))
                self._model_defaults[digest] = opts.model_defaults(config, opts.GENERATION_CONFIG_KEYS)
            return self._model_defaults[digest]
        digest = manifest.model
        if digest not in self._model_defaults:  # a blob never changes: its header is read once
            try:
                metadata = gguf_metadata(self.store.blob_path(digest))
                self._model_defaults[digest] = {name: _shortest_float32(value) if isinstance(value, float) else value
                                                for name, value in opts.model_defaults(metadata).items()}
            except (OSError, LmserveError):
                return {}  # a missing or broken blob recommends nothing; loading it says what is wrong
        return self._model_defaults[digest]

    def copy(self, source: str, destination: str) -> None:
        self.store.copy(parse_name(source), parse_name(destination))

    def delete(self, name: str) -> None:
        self.store.delete(parse_name(name))

    def plan(self, name: str, options: LoadOptions) -> LoadPlan:
        return self.settings(name).plan(options)

    def _plan(self, entry: ModelEntry, path: Path, options: LoadOptions) -> LoadPlan:
        manifest = entry.manifest
        adapters = tuple(str(self.store.blob_path(digest)) for digest in manifest.adapters)
        projector = str(self.store.blob_path(manifest.projector)) if manifest.projector else None
        full = replace(options, adapters=adapters, projector=projector)

        def open_engine() -> Engine:
            try:
                self.store.model_path(manifest)  # a repository's links, laid out again if they went
                if not manifest.files:  # a GGUF
                    if not path.is_file():
                        raise EngineFailure(f"its weights file {path.name} is missing from the store")
                    check_gguf(path)  # the file may have changed since it was created; llama.cpp must not see it
                crash_guard: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
                if engine_of(path, self._engines).in_process:  # a native crash of its load ends this process
                    crash_guard = self._load_crashes.loading(str(entry.name), path)
                with crash_guard:
                    return self._open_engine(path, full)
            except LmserveError as exc:
                if isinstance(exc, InvalidRequest) and exc.param == "model":  # the engine refuses this model here
                    raise InvalidRequest(f"model '{entry.name}' cannot be served here: {exc.message}",
                                         param="model") from exc
                raise EngineFailure(f"model '{entry.name}' failed to load: {exc.message}") from exc
            except Exception as exc:
                raise EngineFailure(f"model '{entry.name}' failed to load: {type(exc).__name__}: {exc}") from exc

        def bind(engine: Engine) -> LoadedModel:
            info = engine.info
            template: Prompter
            if manifest.template:
                template = GoChatTemplate(manifest.template, system=manifest.system)
            else:
                template = ChatTemplate(info.chat_template, bos_token=info.bos_token, eos_token=info.eos_token)
            messages = [Message(role=role, content=text) for role, text in manifest.messages]  # type: ignore[arg-type]
            return LoadedModel(
                name=str(entry.name), engine=engine, template=template, system=manifest.system, messages=messages,
                template_source=manifest.template or info.chat_template,
                created=int(manifest.modified_at),
            )

        header = partial(gguf_metadata, max_array=4096)  # per-layer values kept, the vocabulary left out
        return LoadPlan(WeightsKey(str(path), full), open_engine, bind, binding=entry.digest,
                        estimate=partial(estimate_memory, path, full, header, self._engines))

    def _check_additions(self, manifest: Manifest, modelfile: Modelfile, quantize: bool) -> None:
        """InvalidRequest unless the engine of the model `manifest` holds takes what the Modelfile adds to it
        (adapters, a projector) and quantizes it if asked."""
        spec = engine_of(self.store.model_path(manifest), self._engines)
        refused = [what for what, name, asked in (("ADAPTER", "adapters", modelfile.adapters),
                                                  ("a projector (mmproj)", "projector", modelfile.projector),
                                                  ("quantize", "quantize", quantize))
                   if asked and name not in spec.takes]
        if refused:
            raise InvalidRequest(f"{' and '.join(refused)} over {spec.serves} is not supported: {spec.label} serves "
                                 "them as they are (GGUF adapters, projectors and quantization go with GGUF files)",
                                 param="modelfile")

    def create(self, name: str, modelfile: Modelfile, *, base_dir: Path | None = None,
               quantize: Callable[[Path], Path] | None = None) -> None:
        """Build and save model `name` from a parsed Modelfile (FROM a stored model, a .gguf file or a Hugging Face
        repository directory)."""
        target = parse_name(name)
        manifest = self._base_manifest(modelfile.from_, base_dir)
        self._check_additions(manifest, modelfile, quantize is not None)
        if quantize is not None:
            quantized = quantize(self.store.blob_path(manifest.model))
            try:
                manifest.model = self.store.import_file(quantized)
            finally:
                quantized.unlink(missing_ok=True)
            manifest.details = gguf_details(gguf_metadata(self.store.blob_path(manifest.model)),
                                            parent=manifest.parent)
        if modelfile.projector:
            digest = self._blob(modelfile.projector, base_dir)
            if gguf_metadata(self.store.blob_path(digest)).get("general.architecture") != "clip":
                raise InvalidRequest(f"{Path(modelfile.projector).name} is not a vision projector (an mmproj GGUF has "
                                     "architecture 'clip')", param="modelfile")
            manifest.projector = digest
            families = list(manifest.details.get("families") or [])
            manifest.details = {**manifest.details, "families": [*families, "clip"] if "clip" not in families
                                else families}  # as the local runner lists a model with a projector
        manifest.adapters += [self._blob(a, base_dir) for a in modelfile.adapters]
        if modelfile.template is not None:
            GoChatTemplate(modelfile.template)  # unknown constructs fail now, not at request time
            manifest.template = modelfile.template
        if modelfile.system is not None:
            manifest.system = modelfile.system
        manifest.parameters.update(modelfile.parameters)
        manifest.messages = list(modelfile.messages) or manifest.messages
        manifest.license = list(modelfile.license) or manifest.license
        self.store.save(target, manifest)

    def _blob(self, source: str, base_dir: Path | None) -> str:
        """The digest of an uploaded blob (`@sha256:…`) or of a local file imported into the store."""
        if source.startswith(("@sha256:", "sha256:")):
            digest = source.lstrip("@")
            if not self.store.has_blob(digest):
                raise InvalidRequest(f"blob {digest} is not in the store; upload it first", param="files")
            check_gguf(self.store.blob_path(digest))
            return digest
        path = _local_path(source, base_dir)
        check_gguf(path)
        return self.store.import_file(path)

    def _base_manifest(self, source: str, base_dir: Path | None) -> Manifest:
        if source.startswith(("@sha256:", "sha256:")):
            digest = self._blob(source, base_dir)
            return Manifest(model=digest, details=gguf_details(gguf_metadata(self.store.blob_path(digest))))
        directory = _repository_dir(source, base_dir)
        if directory is not None:
            return self._import_repository(directory)
        if is_gguf_path(source) or Path(source).is_absolute():
            path = _local_path(source, base_dir)
            check_gguf(path)
            digest = self.store.import_file(path)
            return Manifest(model=digest, details=gguf_details(gguf_metadata(path)))
        base = self.store.find(source)
        return replace(base.manifest, parameters=dict(base.manifest.parameters), parent=str(base.name),
                       details={**base.manifest.details, "parent_model": str(base.name)})

    def _import_repository(self, directory: Path) -> Manifest:
        """A manifest of the repository in `directory`, its files imported into the store (hard links if possible)."""
        try:
            files = repository.local_files(directory)
        except OSError as exc:
            raise InvalidRequest(f"cannot read {directory}: {exc.strerror}", param="from") from None
        digests = {name: self.store.import_file(path) for name, path in files.items()}
        return Manifest(model=digests[repository.CONFIG], files=digests, details=repository.details(directory))

    def _listing(self, entry: ModelEntry) -> ModelListing:
        return ModelListing(
            name=str(entry.name), created=int(entry.manifest.modified_at), size=entry.size, digest=entry.digest,
            details=dict(entry.manifest.details),
        )


def _shortest_float32(value: float) -> float:
    """A GGUF float (float32) as the shortest decimal that is the same float32: 0.30000001192092896 is 0.3."""
    for digits in range(1, 10):
        text = f"{value:.{digits}g}"
        if struct.unpack("<f", struct.pack("<f", float(text)))[0] == value:
            return float(text)
    return value


def _repository_dir(text: str, base_dir: Path | None) -> Path | None:
    """The repository directory a FROM names: an absolute path (or `~/…`), or one relative to the Modelfile's
    folder; None when `text` names no directory (a file, or a model name). A directory without config.json is
    refused."""
    path = Path(text).expanduser()
    if not path.is_absolute():
        if base_dir is None:
            return None
        path = base_dir / path
    if not path.is_dir():
        return None
    if not repository.is_repository(path):
        raise InvalidRequest(f"{text} is a directory without a config.json: FROM takes a .gguf file, a Hugging Face "
                             "repository directory (config.json and *.safetensors) or a model name", param="from")
    return path


def _local_path(text: str, base_dir: Path | None) -> Path:
    path = Path(text).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if not path.is_file():
        raise InvalidRequest(f"file not found: {text}", param="from")
    return path


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
