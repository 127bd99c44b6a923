"""The HTTP application's wiring: the app's state (what the routes take, lmserve/dialects/shared/state.py), the
routers of every dialect and endpoint, the error handlers (errors.py), and the middleware around them: tracing
(tracing.py, when asked for), the access log, metrics, the catch-all, the guards (guards.py) and authentication
(auth.py), outermost first."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

from fastapi import APIRouter, FastAPI
from fastapi.responses import Response

from lmserve.chat.media import MediaPolicy
from lmserve.config import ServerConfig
from lmserve.dialects.openai.stored import completions_store
from lmserve.dialects.responses.conversations import conversations_store
from lmserve.dialects.responses.routes import responses_store
from lmserve.dialects.table import DIALECTS, batch_endpoints
from lmserve.endpoints import audio, batches, decisions, files, gateway, infill, lora, rerank, tokens
from lmserve.endpoints.files import files_store
from lmserve.http import health, sleeping
from lmserve.http.access_log import install as install_access_log
from lmserve.http.auth import AuthMiddleware
from lmserve.http.errors import CatchAllMiddleware
from lmserve.http.errors import install as install_error_handlers
from lmserve.http.guards import GuardMiddleware
from lmserve.http.metrics import METRICS_PATH, Metrics, MetricsMiddleware
from lmserve.http.openapi import install as install_openapi
from lmserve.http.tracing import install as install_tracing
from lmserve.http.tracing import traces_endpoint
from lmserve.http.web import web_router
from lmserve.service import Service
from lmserve.service.batch_lines import asgi_send
from lmserve.service.batch_runner import BatchService, batch_store


def add_routes(app: FastAPI, router: APIRouter) -> None:
    """Add a router's routes to the app as they are. FastAPI's include_router builds each route again (its body model
    and dependencies: half the time of create_app); with no prefix, tags or dependencies to add, they would be the
    same routes. lmserve's routers hold plain routes only (no mounts, lifespans or router-wide dependencies)."""
    app.router.routes.extend(router.routes)


ROUTERS = (gateway.router, files.router, batches.router, tokens.router, infill.router, decisions.router, audio.router,
           rerank.router, lora.router, *(router for dialect in DIALECTS for router in dialect.routers))
"""The module-level routers, in the order their routes are matched (and listed by /openapi.json): the endpoints' fixed
paths first (POST /v1/chat/completions/render before a stored completion's id), then every dialect's."""


def _set_state(app: FastAPI, service: Service, config: ServerConfig, served: str | None) -> None:
    """What the routes take from the app (lmserve/dialects/shared/state.py)."""
    state = app.state
    state.service, state.config, state.served = service, config, served
    state.media = MediaPolicy(allowed_hosts=frozenset(config.image_allow_hosts),
                                  max_bytes=config.image_max_bytes, max_audio_seconds=config.audio_max_seconds)
    state.completions = completions_store(config)
    state.responses = responses_store(config)
    state.conversations = conversations_store(config)
    state.files = files_store(config)  # shared with the batch routes
    # stopped first when the server shuts down (server.py), before the grace runs out
    state.batches = BatchService(batch_store(config), state.files, endpoints=batch_endpoints(),
                                 concurrency=config.batch_concurrency)


def create_app(service: Service, config: ServerConfig, *, preload: Sequence[str] = (),
               served: str | None = None, resume_batches: bool = True) -> FastAPI:
    """The lmserve application over `service`; `preload` names models loaded at startup and kept loaded; `served`
    is the model the server was started with (listed first by GET /v1/models, so the web page starts on it).
    `resume_batches`: run the unfinished batches of the store at startup (not for `lmserve batch`, which runs its
    own file in process)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        for name in preload:
            await service.models.load(name, keep_alive=-1)
        expiry = asyncio.create_task(service.residency.run_expiry())
        send, close_send = asgi_send(app, config.api_key)  # batch lines go through the app's own routes
        await app.state.batches.start(send, resume=resume_batches)
        try:
            yield
        finally:
            await app.state.batches.stop()
            await close_send()
            expiry.cancel()
            if app.state.tracing is not None:
                app.state.tracing.shutdown()  # sends the spans still waiting

    app = FastAPI(title="lmserve", docs_url=None, redoc_url=None, lifespan=lifespan)
    _set_state(app, service, config, served)
    for router in ROUTERS:
        add_routes(app, router)
    add_routes(app, web_router())  # GET /: the chat page for a browser, plain text for other clients
    install_openapi(app)  # /openapi.json: one operationId per method

    add_routes(app, health.router)
    add_routes(app, sleeping.router)
    metrics = Metrics(service)
    metrics.attach(service)
    app.state.metrics = metrics

    @app.get(METRICS_PATH, include_in_schema=False)
    async def metrics_endpoint() -> Response:
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    install_error_handlers(app)
    if config.api_key:
        app.add_middleware(AuthMiddleware, api_key=config.api_key)
    app.add_middleware(GuardMiddleware, config=config)  # outside auth: preflights carry no Authorization
    app.add_middleware(CatchAllMiddleware)  # outside auth and guards, so it also covers them
    app.add_middleware(MetricsMiddleware, metrics=metrics, routes=app.router.routes)  # outermost: sees every status
    install_access_log(app, service.observers)  # one line per request on the console, outside even the metrics
    app.state.tracing = install_tracing(app, service.observers, traces_endpoint(config.otlp_traces_endpoint),
                                        lambda model: _engine_of(service, model))  # outermost, when asked for
    return app


def _engine_of(service: Service, model: str) -> str | None:
    """The engine serving the loaded `model` (for its trace), None when it is not loaded."""
    for resident in service.residency.running():
        if resident.model.name == model:
            return resident.model.engine.info.engine
    return None
