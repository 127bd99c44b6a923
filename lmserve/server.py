"""Composition root for `lmserve serve`: load the model, build the service and the app, run uvicorn."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from lmserve.config import ServerConfig
from lmserve.errors import LmserveError, ModelNotFound
from lmserve.loaded import LoadedModel
from lmserve.service import static_service
from lmserve.store.embedded import DEFAULT_MODEL_NAME, embedded_model_path

log = logging.getLogger("lmserve")


def resolve_model(model: str) -> tuple[str, Path]:
    """Map a model argument to (name, gguf path): a .gguf path, or the embedded default's name."""
    path = Path(model).expanduser()
    if model.endswith(".gguf") or path.is_file():
        if not path.is_file():
            raise ModelNotFound(model)
        return path.stem, path.resolve()
    if model in (DEFAULT_MODEL_NAME, DEFAULT_MODEL_NAME.split(":")[0], DEFAULT_MODEL_NAME.split(":")[0] + ":latest"):
        return DEFAULT_MODEL_NAME, embedded_model_path()
    raise ModelNotFound(model)


def load_model(config: ServerConfig) -> LoadedModel:
    """Load the configured model into a running engine."""
    from lmserve.chat.template import ChatTemplate
    from lmserve.engine.llamacpp import LlamaCppBackend
    from lmserve.engine.loop import Engine

    name, path = resolve_model(config.model)
    backend = LlamaCppBackend(path, config.load_options)
    engine = Engine(backend, max_batch_tokens=config.batch_size, max_prefill_tokens=config.prefill_chunk)
    info = backend.info
    template = ChatTemplate(info.chat_template, bos_token=info.bos_token, eos_token=info.eos_token)
    primary = config.alias or name
    aliases = tuple(dict.fromkeys(a for a in (name, config.model, str(path)) if a != primary))
    return LoadedModel(name=primary, engine=engine, template=template, aliases=aliases)


def run(config: ServerConfig) -> int:
    import uvicorn

    from lmserve.api.app import create_app
    from lmserve.engine.llamacpp import default_threads

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        model = load_model(config)
    except LmserveError as exc:
        print(f"lmserve: {exc.message}", file=sys.stderr)
        return 1
    service = static_service([model])
    app = create_app(service, config)
    info = model.engine.info
    print(
        f"lmserve listening on http://{config.host}:{config.port}\n"
        f"  model    {model.name} ({info.path})\n"
        f"  context  {info.num_ctx} tokens per sequence\n"
        f"  slots    {info.num_parallel} parallel sequences, {config.threads or default_threads()} threads",
        flush=True,
    )
    try:
        uvicorn.run(app, host=config.host, port=config.port, log_level="warning", access_log=False)
    finally:
        service.close()
        model.engine.close()
    return 0
