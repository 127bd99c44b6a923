"""The Ray Serve application: an ingress deployment in front of N lmserve replicas (see the package docstring).

`application(config)` builds it from a ServerConfig (`lmserve serve --replicas N` does, in run.py); `build(args)`
is the same for Ray's own tools, its `args` the options of `lmserve serve` by name (`model`, `replicas`,
`ctx_size`, `models_dir`…: the fields of config.py's ServerConfig and the engines' launch records), read as their
LMSERVE_* variables are:

    serve run lmserve.replicas.app:build model=smollm2:135m replicas=2
    # a Ray Serve config file or a KubeRay RayService: import_path: lmserve.replicas.app:build, args: {model: …}
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError, RayServeException
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from lmserve.config import OPTIONS, ConfigError, ServerConfig, resolve
from lmserve.dialects.table import dialect_of
from lmserve.errors import EngineStopped, LmserveError, Overloaded
from lmserve.http.errors import error_response
from lmserve.http.health import HEALTH_PATH
from lmserve.http.tracing import forwarding, tracer_provider, traces_endpoint
from lmserve.replicas.calls import Head, HttpCall, Whole, answer, prompt_text
from lmserve.replicas.merging import merge
from lmserve.replicas.routing import router_config
from lmserve.server import build_app

log = logging.getLogger("lmserve")
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
REPLICA_HEADER = b"lmserve-replica"
"""The response header naming the replica that answered (Ray Serve's replica id)."""
INGRESS_MAX_ONGOING = 100_000
"""Requests the ingress holds at once: it only forwards, and each replica bounds its own (--max-queue)."""


class Replica:
    """One lmserve server (its service, engine and app) in a Ray actor, answering HttpCalls."""

    async def __init__(self, config: ServerConfig) -> None:  # type: ignore[misc]  # Ray awaits a coroutine __init__
        self._service, self._name, self._app = build_app(config, preload=True)
        self._lifespan = self._app.router.lifespan_context(self._app)
        await self._lifespan.__aenter__()  # loads the model, kept loaded; its exit closes the service
        self._id = serve.get_replica_context().replica_id.unique_id
        self._interval = config.replica_stream_interval / 1000

    async def answer(self, call: HttpCall) -> AsyncIterator[Head | bytes]:
        """The response to `call`: its Head, then its body pieces (streamed as the app sends them)."""
        async for piece in answer(self._app, call, self._interval):
            yield Head(piece.status, (*piece.headers, (REPLICA_HEADER, self._id.encode()))) \
                if isinstance(piece, Head) else piece

    async def whole(self, call: HttpCall) -> Whole:
        """The whole response to `call`, and this replica's id (for the routes merged across replicas)."""
        status, headers, body = 500, tuple[tuple[bytes, bytes], ...](), bytearray()
        async for piece in answer(self._app, call):
            if isinstance(piece, Head):
                status, headers = piece.status, piece.headers
            else:
                body += piece
        return Whole(self._id, status, headers, bytes(body))

    def check_health(self) -> None:
        """Ray's health check: a replica whose model failed for good (its restarts paused) is replaced by Ray."""
        failed = [state for state in self._service.residency.health() if state.state == "failed"]
        if failed:
            raise RuntimeError("; ".join(f"{state.name}: {state.reason}" for state in failed))

    async def __del__(self) -> None:
        """Ray stops the replica: its engine and any engine processes are closed."""
        try:
            await self._lifespan.__aexit__(None, None, None)
        except Exception:
            log.exception("replica %s: closing its server failed", self._id)


async def _call(request: Request) -> HttpCall:
    body = await request.body()
    client = (request.client.host, request.client.port) if request.client else None
    return HttpCall(request.method, request.url.path, request.scope.get("query_string", b""),
                    tuple(request.scope["headers"]), body, prompt_text(request.url.path, body), client)


async def _rest(stream: DeploymentResponseGenerator[Any], path: str, head: Head,
                span: Any = None) -> AsyncIterator[bytes]:
    """The body after the head; a replica that dies mid-stream ends it with an error in the stream's dialect. The
    ingress's `span` (when traced) ends with it."""
    try:
        async for piece in stream:
            assert isinstance(piece, bytes)
            yield piece
    except (RayError, RayServeException) as exc:
        yield _stream_error(path, head, EngineStopped(f"the replica answering this request stopped: "
                                                      f"{_reason(exc)}; retry"))
    finally:
        if span is not None:
            span.end()
        stream.cancel()  # type: ignore[no-untyped-call]  # the client went away (or the stream ended): the replica's app sees a disconnect


def _stream_error(path: str, head: Head, err: LmserveError) -> bytes:
    """The frame that ends a stream in its dialect (nothing where the response is no stream)."""
    dialect = dialect_of(path)
    return dialect.stream_error(err) if dialect.stream_media in dict(head.headers).get(b"content-type", b"").decode() \
        else b""


def _reason(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__


def _headers(raw: tuple[tuple[bytes, bytes], ...]) -> dict[str, str]:
    return {key.decode("latin-1"): value.decode("latin-1") for key, value in raw if key.lower() != b"content-length"}


ingress_api = FastAPI(title="lmserve", docs_url=None, redoc_url=None, openapi_url=None)


@serve.ingress(ingress_api)  # pickled here, by value: what its methods call is defined above
class Ingress:
    """The endpoint: forwards each request to the replica the router picks; merges the deployment-wide routes."""

    def __init__(self, replicas: DeploymentHandle[Any], fewest: int, traces: str | None = None) -> None:
        self._replicas = replicas
        self._fewest = fewest
        self._tracer = tracer_provider(traces).get_tracer("lmserve.ingress") if traces else None
        """With an OTLP endpoint: a span per forwarded request, which the replica's own span continues."""

    @ingress_api.get("/metrics", include_in_schema=False)
    @ingress_api.get("/v1/loads", include_in_schema=False)
    @ingress_api.get("/api/ps", include_in_schema=False)
    @ingress_api.get("/v1/models", include_in_schema=False)
    @ingress_api.get("/health", include_in_schema=False)
    async def merged(self, request: Request) -> Response:
        """A deployment-wide route: asked of every replica, their answers merged (merging.py)."""
        call = await _call(request)
        try:
            answers = await self._replicas.broadcast("whole", call).results_async()
        except (RayError, RayServeException) as exc:
            return error_response(call.path, EngineStopped(f"a replica did not answer: {_reason(exc)}"))
        if call.path == HEALTH_PATH and len(answers) < self._fewest:
            return JSONResponse({"status": "loading", "reason": f"{len(answers)} of {self._fewest} replicas are "
                                 "running"}, status_code=503, headers={"Retry-After": "1"})
        if not answers:  # scaled to zero: ready, and the first request routed to a replica starts one
            return await self.forward(request) if call.path != HEALTH_PATH else JSONResponse({"status": "ok"})
        whole = merge(call.path, answers)
        return Response(whole.body, status_code=whole.status, headers=_headers(whole.headers))

    @ingress_api.api_route("/{path:path}", methods=METHODS, include_in_schema=False)
    async def forward(self, request: Request) -> Response:
        """Any other route: answered by one replica, streamed back as it comes."""
        call, span = await _call(request), None
        if self._tracer is not None:
            span, headers = forwarding(self._tracer, call.method, call.path, call.headers)
            call = replace(call, headers=headers)
        stream = self._replicas.options(stream=True).answer.remote(call)
        assert isinstance(stream, DeploymentResponseGenerator)
        try:
            head = await stream.__anext__()
        except (BackPressureError, RayError, RayServeException, StopAsyncIteration) as exc:
            if span is not None:
                span.end()
            if isinstance(exc, BackPressureError):
                return error_response(call.path, Overloaded("every replica's queue is full; retry later"))
            return error_response(call.path, EngineStopped(f"the replica answering this request stopped: "
                                                           f"{_reason(exc)}; retry"))
        assert isinstance(head, Head)
        if span is not None:
            span.set_attribute("http.response.status_code", head.status)
        response = StreamingResponse(_rest(stream, call.path, head, span))
        response.status_code = head.status
        response.raw_headers = list(head.headers)
        return response


def application(config: ServerConfig) -> serve.Application:
    """The Ray Serve application of `config`: its replicas (fixed, or autoscaled between --min-replicas and
    --max-replicas on requests in flight per replica, with --parallel as the target) behind the ingress."""
    if config.max_replicas is not None:
        lowest = config.min_replicas if config.min_replicas is not None else 1
        if lowest > config.max_replicas:
            raise ConfigError(f"--min-replicas {lowest} is more than --max-replicas {config.max_replicas}")
        scaling: dict[str, Any] = {
            "autoscaling_config": {"min_replicas": lowest, "initial_replicas": max(lowest, 1),
                                   "max_replicas": config.max_replicas, "target_ongoing_requests": config.parallel,
                                   "look_back_period_s": config.scale_window or 1.0,
                                   "metrics_interval_s": min(10.0, (config.scale_window or 1.0) / 3),
                                   "upscale_delay_s": config.scale_up_delay or 0.0,
                                   "downscale_delay_s": config.scale_down_delay or 0.0}}
    elif config.min_replicas is not None:
        raise ConfigError("--min-replicas autoscales up to --max-replicas, which is not given")
    else:
        scaling = {"num_replicas": config.replicas or 1}
    routing = router_config(config.replica_routing, config.parallel)
    replica = serve.deployment(Replica, name="Replica").options(  # type: ignore[attr-defined]
        **scaling,
        max_ongoing_requests=config.parallel + config.max_queue,
        ray_actor_options={"num_cpus": config.replica_cpus, "num_gpus": config.replica_gpus},
        health_check_period_s=5,
        **({"request_router_config": routing} if routing else {}),
    )
    ingress = serve.deployment(Ingress, name="Ingress").options(  # type: ignore[attr-defined]
        num_replicas=1, max_ongoing_requests=INGRESS_MAX_ONGOING, ray_actor_options={"num_cpus": 0},
    )
    fewest = (config.min_replicas if config.min_replicas is not None else 1) if config.max_replicas is not None \
        else config.replicas or 1
    traces = traces_endpoint(config.otlp_traces_endpoint)
    return ingress.bind(replica.bind(config), fewest, traces)  # type: ignore[no-any-return]


def build(args: Mapping[str, object]) -> serve.Application:
    """The application of `args` (option names → values) over the LMSERVE_* variables of the environment: Ray
    Serve's application builder (`serve run lmserve.replicas.app:build model=…`)."""
    import os

    env = dict(os.environ)
    for name, value in args.items():
        entry = OPTIONS.get(name)
        if entry is None:
            raise ConfigError(f"{name}: not an option of lmserve serve (the args are its options by name, e.g. "
                              "model, replicas, ctx_size)")
        env[entry.env_name] = value if isinstance(value, str) else ",".join(map(str, value)) \
            if isinstance(value, list) else str(value).lower() if isinstance(value, bool) else str(value)
    return application(resolve({}, env))
