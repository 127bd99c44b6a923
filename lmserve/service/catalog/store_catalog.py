"""`StoreCatalog`: the model store as a catalog. A stored model is planned for residency from its manifest,
Modelfile and weights; `create` writes a model from a Modelfile (FROM a name, a GGUF, a repository directory)."""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from lmserve import options as opts
from lmserve.chat.gotemplate import GoChatTemplate
from lmserve.chat.template import ChatTemplate
from lmserve.engine.factory import EngineSettings, engine_of, estimate_memory, vision_missing
from lmserve.engine.protocol import Engine
from lmserve.errors import EngineFailure, InvalidRequest, LmserveError
from lmserve.options import Layer
from lmserve.service.catalog.details import gguf_details
from lmserve.service.catalog.protocol import (
    EngineOpener,
    ModelDescription,
    ModelListing,
    ModelSettings,
    is_reranker_metadata,
    model_capabilities,
)
from lmserve.service.residency import LoadedModel, LoadPlan, Prompter, WeightsKey
from lmserve.store import repository, signatures
from lmserve.store.gguf_check import check_gguf, gguf_metadata
from lmserve.store.load_crashes import LoadCrashes
from lmserve.store.lora import PEFT_CONFIG, PEFT_WEIGHTS, check_lora
from lmserve.store.manifest import Manifest, ModelEntry
from lmserve.store.modelfile import Modelfile
from lmserve.store.names import ModelName, is_gguf_path, parse_name
from lmserve.store.signatures import Trust
from lmserve.store.store import Store
from lmserve.types import Adapter, LoadOptions, Message


class StoreCatalog:
    """Catalog over a Store; `plan` tells residency how a stored manifest is loaded."""

    def __init__(self, store: Store, open_engine: EngineOpener, engines: EngineSettings | None = None, *,
                 trust: Trust | None = None) -> None:
        self._store = store
        self._trust = trust or Trust()
        """How files coming into the store are checked against their signatures (store/signatures.py)."""
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
            vision = self._senses(manifest)[0]
        path = self.store.model_path(manifest)
        short = str(entry.name).removesuffix(":latest")
        paths = self.store.adapter_paths(manifest)
        adapters = tuple(Adapter(str(adapter), name=short if len(paths) == 1 else f"{short}#{i}")
                         for i, adapter in enumerate(paths)) if self._per_request(path) else ()
        return ModelSettings(name=str(entry.name), parameters=opts.from_parameters(manifest.parameters),
                             recommended=self._recommended(manifest), has_vision=vision,
                             plan=partial(self._plan, entry, path), adapters=adapters)

    def _per_request(self, path: Path) -> bool:
        """Whether the engine of the model at `path` applies adapters per request (else they are load options)."""
        try:
            return engine_of(path, self._engines).adapters_per_request
        except LmserveError:
            return False

    def describe(self, name: str) -> ModelDescription:
        entry = self.store.find(name)
        manifest = entry.manifest
        if manifest.files:
            directory = self.store.model_path(manifest)
            metadata = repository.model_info(directory)
            template = manifest.template or repository.chat_template(directory)
            config = repository.read_json(directory / repository.CONFIG)
            vision = repository.has_vision(config) and vision_missing(directory, config) is None
            audio = "audio_config" in config
            metadata |= self._adapter_info(manifest, directory)
        else:
            metadata = gguf_metadata(self.store.blob_path(manifest.model))
            template = manifest.template or str(metadata.get("tokenizer.chat_template", ""))
            vision, audio = self._senses(manifest)
            metadata |= self._adapter_info(manifest, self.store.blob_path(manifest.model))
        return ModelDescription(
            listing=self._listing(entry),
            modelfile=self.modelfile(entry).to_text(),
            parameters={**self._recommended(manifest), **manifest.parameters},
            template=template,
            system=manifest.system or "",
            license="\n".join(manifest.license),
            model_info=metadata,
            capabilities=model_capabilities(template, vision=vision, audio=audio,
                                            reranker=is_reranker_metadata(config if manifest.files else metadata)),
            signature=dict(manifest.signature),
        )

    def has_vision(self, name: str) -> bool:
        return self.settings(name).has_vision

    def _senses(self, manifest: Manifest) -> tuple[bool, bool]:
        """Whether a GGUF model's projector sees images and hears audio (its header's `clip.has_*_encoder`, each
        written only when true; a projector that says neither, or cannot be read, is taken for a vision one, as
        projectors were before audio ones)."""
        if manifest.projector is None:
            return False, False
        try:
            header = gguf_metadata(self.store.blob_path(manifest.projector))
        except LmserveError:
            return True, False
        vision, audio = bool(header.get("clip.has_vision_encoder")), bool(header.get("clip.has_audio_encoder"))
        return vision or not audio, audio

    def _adapter_info(self, manifest: Manifest, base: Path) -> dict[str, Any]:
        """What `show` says of a model's LoRA adapters: their count, base and ranks (as checked against it)."""
        if not manifest.adapters and not manifest.adapter_dirs:
            return {}
        facts = [check_lora(adapter, base) for adapter in self.store.adapter_paths(manifest)]
        return {"lora.count": len(facts), "lora.base_model": manifest.parent or "",
                "lora.ranks": [fact.rank for fact in facts], "lora.alphas": [fact.alpha for fact in facts]}

    def modelfile(self, entry: ModelEntry) -> Modelfile:
        m = entry.manifest
        return Modelfile(
            from_=str(self.store.model_path(m)),
            projector=str(self.store.blob_path(m.projector)) if m.projector else None,
            parameters=dict(m.parameters),
            template=m.template,
            system=m.system,
            messages=list(m.messages),
            adapters=[str(adapter) for adapter in self.store.adapter_paths(m)],
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
        adapters = () if self._per_request(path) else \
            tuple(str(self.store.blob_path(digest)) for digest in manifest.adapters)
        projector = str(self.store.blob_path(manifest.projector)) if manifest.projector else None
        full = replace(options, adapters=adapters, projector=projector)
        header = partial(gguf_metadata, max_array=4096)  # per-layer values kept, the vocabulary left out
        return LoadPlan(WeightsKey(str(path), full), partial(self._open, entry, path, full), partial(_bind, entry),
                        binding=entry.digest, estimate=partial(estimate_memory, path, full, header, self._engines))

    def _open(self, entry: ModelEntry, path: Path, options: LoadOptions) -> Engine:
        """Open the engine of a stored model (blocking); a failure is EngineFailure, or InvalidRequest when the
        engine refuses this model here."""
        manifest = entry.manifest
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
                return self._open_engine(path, options)
        except LmserveError as exc:
            if isinstance(exc, InvalidRequest) and exc.param == "model":  # the engine refuses this model here
                raise InvalidRequest(f"model '{entry.name}' cannot be served here: {exc.message}",
                                     param="model") from exc
            raise EngineFailure(f"model '{entry.name}' failed to load: {exc.message}") from exc
        except Exception as exc:
            raise EngineFailure(f"model '{entry.name}' failed to load: {type(exc).__name__}: {exc}") from exc

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
        trust = self._trust.with_mode(modelfile.verify)
        manifest = self._base_manifest(modelfile.from_, base_dir, trust)
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
            digest = self._blob(modelfile.projector, base_dir, trust)
            if gguf_metadata(self.store.blob_path(digest)).get("general.architecture") != "clip":
                raise InvalidRequest(f"{Path(modelfile.projector).name} is not a vision projector (an mmproj GGUF has "
                                     "architecture 'clip')", param="modelfile")
            manifest.projector = digest
            families = list(manifest.details.get("families") or [])
            manifest.details = {**manifest.details, "families": [*families, "clip"] if "clip" not in families
                                else families}  # as the local runner lists a model with a projector
        blobs = [adapter for adapter in modelfile.adapters if adapter.startswith(("@sha256:", "sha256:"))]
        if manifest.files and blobs:  # /api/create's `adapters` over a repository: the files of one PEFT adapter
            self._add_peft_blobs([blob.lstrip("@") for blob in blobs], manifest)
        for adapter in modelfile.adapters:
            if not (manifest.files and adapter in blobs):
                self._add_adapter(adapter, base_dir, manifest)
        if modelfile.template is not None:
            GoChatTemplate(modelfile.template)  # unknown constructs fail now, not at request time
            manifest.template = modelfile.template
        if modelfile.system is not None:
            manifest.system = modelfile.system
        manifest.parameters.update(modelfile.parameters)
        manifest.messages = list(modelfile.messages) or manifest.messages
        manifest.license = list(modelfile.license) or manifest.license
        self.store.save(target, manifest)

    def _blob(self, source: str, base_dir: Path | None, trust: Trust | None = None) -> str:
        """The digest of an uploaded blob (`@sha256:…`) or of a local file imported into the store (its signature
        checked first as `trust` says; None: not checked)."""
        if source.startswith(("@sha256:", "sha256:")):
            digest = source.lstrip("@")
            if not self.store.has_blob(digest):
                raise InvalidRequest(f"blob {digest} is not in the store; upload it first", param="files")
            if trust is not None and trust.mode == "require":
                raise InvalidRequest(f"blob {digest} is refused (--verify-signatures require): an uploaded blob "
                                     "carries no signature; create the model from its signed files", param="files")
            check_gguf(self.store.blob_path(digest))
            return digest
        path = _local_path(source, base_dir)
        check_gguf(path)
        if trust is not None:
            signatures.check(path, trust)
        return self.store.import_file(path)

    def _add_adapter(self, source: str, base_dir: Path | None, manifest: Manifest) -> None:
        """Import an ADAPTER, checked where it lies against the model it goes over (a 400 naming what is wrong): a
        GGUF LoRA over a GGUF, a PEFT directory over a repository."""
        if not manifest.files:
            path = self.store.blob_path(source.lstrip("@")) if source.startswith(("@sha256:", "sha256:")) \
                else _local_path(source, base_dir)
            check_lora(path, self.store.blob_path(manifest.model), param="modelfile")
            manifest.adapters.append(self._blob(source, base_dir))
            return
        folder = Path(source).expanduser()
        folder = folder if folder.is_absolute() or base_dir is None else base_dir / folder
        check_lora(folder, self.store.model_path(manifest), param="modelfile")
        manifest.adapter_dirs.append({name: self.store.import_file(folder / name) for name in (PEFT_CONFIG,
                                                                                                 PEFT_WEIGHTS)})

    def _add_peft_blobs(self, digests: list[str], manifest: Manifest) -> None:
        """Add the PEFT adapter whose two files were uploaded as blobs (told apart by their content: the JSON
        config and the safetensors weights), checked against the repository."""
        for digest in digests:
            if not self.store.has_blob(digest):
                raise InvalidRequest(f"blob {digest} is not in the store; upload it first", param="adapters")
        configs = [digest for digest in digests if _first_byte(self.store.blob_path(digest)) == b"{"]
        weights = [digest for digest in digests if digest not in configs]
        if len(configs) != 1 or len(weights) != 1:
            raise InvalidRequest(f"a PEFT adapter over a safetensors model is two files, {PEFT_CONFIG} and "
                                 f"{PEFT_WEIGHTS}: give both, and one adapter per model", param="adapters")
        files = {PEFT_CONFIG: configs[0], PEFT_WEIGHTS: weights[0]}
        check_lora(self.store.folder_path(files), self.store.model_path(manifest), param="adapters")
        manifest.adapter_dirs.append(files)

    def _base_manifest(self, source: str, base_dir: Path | None, trust: Trust) -> Manifest:
        """The manifest FROM gives: an uploaded blob's, a local file's or directory's (its signature checked before
        anything reads it), or a stored model's."""
        if source.startswith(("@sha256:", "sha256:")):
            digest = self._blob(source, base_dir, trust)
            return Manifest(model=digest, details=gguf_details(gguf_metadata(self.store.blob_path(digest))))
        directory = _repository_dir(source, base_dir)
        if directory is not None:
            signed = signatures.check(directory, trust)
            return replace(self._import_repository(directory), signature=signed)
        if is_gguf_path(source) or Path(source).is_absolute():
            path = _local_path(source, base_dir)
            check_gguf(path)
            signed = signatures.check(path, trust)
            digest = self.store.import_file(path)
            return Manifest(model=digest, details=gguf_details(gguf_metadata(path)), signature=signed)
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
        manifest = entry.manifest
        return ModelListing(
            name=str(entry.name), created=int(manifest.modified_at), size=entry.size, digest=entry.digest,
            details=dict(manifest.details),
            parent=(manifest.parent or None) if manifest.adapters or manifest.adapter_dirs else None,
        )


def _bind(entry: ModelEntry, engine: Engine) -> LoadedModel:
    """A stored model bound to its engine: the Modelfile's TEMPLATE (Go) or else the model's own chat template, its
    SYSTEM and MESSAGEs."""
    manifest = entry.manifest
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


def _first_byte(path: Path) -> bytes:
    with path.open("rb") as file:
        return file.read(1)
