"""OpenTelemetry traces of requests, exported over OTLP (`--otlp-traces-endpoint`, vLLM's flag, or the standard
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT`); off, and nothing installed, when none is set.

Each HTTP request is a server span named for its route (`POST /v1/chat/completions`), continuing the caller's W3C
`traceparent`. A request that generated carries vLLM's attribute names (`gen_ai.request.model`, `gen_ai.usage.*`,
`gen_ai.latency.*`) and lmserve's (`lmserve.engine`, the finish reasons, cached tokens, tool calls) and has a child
span for each part of its generation: `queue` (waiting for a slot), `prefill` (the prompt, to the first token) and
`decode`, placed from the engine's own timings. As the access log does, the middleware keeps a record per request in
a context variable, and the service's finish observer fills it in from the final chunk.

Spans go out in batches from a thread of the SDK (`OTEL_BSP_*` tune it); the exporter speaks OTLP's protobuf over
HTTP, or gRPC with `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc`.
"""

from __future__ import annotations

import contextvars
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lmserve.errors import LmserveError
from lmserve.service.observers import Observers
from lmserve.types import Chunk

if TYPE_CHECKING:  # OpenTelemetry is imported only when tracing is on (its SDK and exporter take 0.2 s to import)
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

TRACES_PATH = "/v1/traces"
EngineOf = Callable[[str], str | None]
"""A model name → the engine serving it (`llamacpp`, `vllm`, `mlx`), None when not loaded."""


def traces_endpoint(flag: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """Where to export traces: the flag (its URL's /v1/traces added when it has no path), else OTel's variables
    (the traces endpoint as it is, the general one with /v1/traces); None: tracing is off."""
    if flag:
        url = flag if "://" in flag else f"http://{flag}"
        if urlsplit(url).scheme not in ("http", "https"):
            raise LmserveError(f"--otlp-traces-endpoint {flag}: give an http(s) URL of an OTLP collector")
        return url if urlsplit(url).path.strip("/") else url.rstrip("/") + TRACES_PATH
    if environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    if environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return environ["OTEL_EXPORTER_OTLP_ENDPOINT"].rstrip("/") + TRACES_PATH
    return None


def exporter(endpoint: str, environ: Mapping[str, str] = os.environ) -> SpanExporter:
    """OTLP's exporter for `endpoint`: protobuf over HTTP, or gRPC when OTel's protocol variable says so."""
    protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
        except ImportError:
            raise LmserveError("traces over gRPC (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc) need the package "
                               "opentelemetry-exporter-otlp-proto-grpc; or use http/protobuf") from None
        return GrpcExporter(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=endpoint)


@dataclass(slots=True)
class TraceRecord:
    """What a request's span learns while it runs: the model it generated with and its generations' final chunks,
    each with the wall-clock time (ns since the epoch) it was seen."""

    arrived_ns: int
    model: str | None = None
    finals: list[tuple[int, Chunk]] = field(default_factory=list)


_current: contextvars.ContextVar[TraceRecord | None] = contextvars.ContextVar("lmserve_trace", default=None)


def record_finish(model: str, chunk: Chunk) -> None:
    """A finish observer: note the model and final chunk on the current request's trace record."""
    record = _current.get()
    if record is not None and all(seen is not chunk for _, seen in record.finals):
        record.model = model
        record.finals.append((time.time_ns(), chunk))


class TracingMiddleware:
    """A server span per HTTP request, ended once its response body has been sent (pure ASGI: streams pass on)."""

    def __init__(self, app: ASGIApp, tracer: Tracer, engine_of: EngineOf) -> None:
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.app, self.tracer, self.engine_of = app, tracer, engine_of
        self.propagator, self.kind = TraceContextTextMapPropagator(), SpanKind.SERVER

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = str(scope.get("method", "")), str(scope.get("path", ""))
        carrier = {key.decode("latin-1"): value.decode("latin-1") for key, value in scope.get("headers", ())}
        record = TraceRecord(time.time_ns())
        span = self.tracer.start_span(f"{method} {path}", context=self.propagator.extract(carrier), kind=self.kind,
                                      attributes={"http.request.method": method, "url.path": path},
                                      start_time=record.arrived_ns)

        async def noting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                span.set_attribute("http.response.status_code", int(message["status"]))
            await send(message)

        token = _current.set(record)
        try:
            await self.app(scope, receive, noting_send)
        finally:
            _current.reset(token)
            route = getattr(scope.get("route"), "path", None)
            if route:
                span.update_name(f"{method} {route}")
                span.set_attribute("http.route", route)
            self._generation(span, record)
            span.end()

    def _generation(self, span: Span, record: TraceRecord) -> None:
        """The generation's attributes on `span`, and its queue, prefill and decode as child spans."""
        if record.model is None or not record.finals:
            return
        span.set_attributes(attributes(record, self.engine_of(record.model)))
        ended, first = record.finals[0]
        timings = first.timings
        if timings is None:
            return
        decoding = ended - timings.eval_ns
        prefilling = decoding - timings.prompt_eval_ns
        queued = min(prefilling, ended - timings.total_ns) if timings.total_ns else prefilling
        from opentelemetry.trace import set_span_in_context

        parent = set_span_in_context(span)
        for name, start, end in (("queue", queued, prefilling), ("prefill", prefilling, decoding),
                                 ("decode", decoding, ended)):
            if end > start:
                self.tracer.start_span(name, context=parent, start_time=start).end(end_time=end)


def attributes(record: TraceRecord, engine: str | None) -> dict[str, Any]:
    """A generating request's span attributes (vLLM's names where it has them) from its final chunks."""
    chunks = [chunk for _, chunk in record.finals]
    usages = [chunk.usage for chunk in chunks if chunk.usage is not None]
    found: dict[str, Any] = {
        "gen_ai.request.model": record.model or "",
        "gen_ai.response.model": record.model or "",
        "gen_ai.usage.prompt_tokens": max((usage.prompt_tokens for usage in usages), default=0),
        "gen_ai.usage.completion_tokens": sum(usage.completion_tokens for usage in usages),
        "lmserve.usage.cached_tokens": max((usage.cached_tokens for usage in usages), default=0),
        "gen_ai.response.finish_reasons": [str(chunk.finish_reason) for chunk in chunks],
        "lmserve.tool_calls": sum(len(chunk.tool_calls) for chunk in chunks),
    }
    if engine is not None:
        found["lmserve.engine"] = engine
    ended, first = record.finals[0]
    if first.timings is not None:
        timings, ns = first.timings, 1e-9
        found["gen_ai.latency.time_to_first_token"] = max(0, ended - timings.eval_ns - record.arrived_ns) * ns
        found["gen_ai.latency.time_in_queue"] = max(0, timings.total_ns - timings.prompt_eval_ns - timings.eval_ns) * ns
        found["gen_ai.latency.time_in_model_prefill"] = timings.prompt_eval_ns * ns
        found["gen_ai.latency.time_in_model_decode"] = timings.eval_ns * ns
        found["gen_ai.latency.e2e"] = max(0, ended - record.arrived_ns) * ns
    return found


def tracer_provider(endpoint: str) -> TracerProvider:
    """A tracer provider whose spans go to the OTLP collector at `endpoint` in batches (service `lmserve`, unless
    OTEL_SERVICE_NAME names it)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": "lmserve"})
    found = TracerProvider(resource=resource)
    found.add_span_processor(BatchSpanProcessor(exporter(endpoint)))
    return found


def forwarding(tracer: Tracer, method: str, path: str,
               headers: tuple[tuple[bytes, bytes], ...]) -> tuple[Span, tuple[tuple[bytes, bytes], ...]]:
    """A span for handing a request on (the replicas' ingress), continuing its caller's `traceparent`, and the
    request's headers with `traceparent` now naming that span, so the server that answers continues it."""
    from opentelemetry.trace import SpanKind, set_span_in_context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    propagator = TraceContextTextMapPropagator()
    carrier = {key.decode("latin-1"): value.decode("latin-1") for key, value in headers}
    span = tracer.start_span(f"{method} {path}", context=propagator.extract(carrier), kind=SpanKind.SERVER,
                             attributes={"http.request.method": method, "url.path": path, "lmserve.role": "ingress"})
    onward: dict[str, str] = {}
    propagator.inject(onward, context=set_span_in_context(span))
    kept = tuple((key, value) for key, value in headers if key.lower() not in (b"traceparent", b"tracestate"))
    return span, kept + tuple((key.encode("latin-1"), value.encode("latin-1")) for key, value in onward.items())


def install(app: FastAPI, observers: Observers, endpoint: str | None, engine_of: EngineOf) -> TracerProvider | None:
    """Trace every request of `app` to the OTLP collector at `endpoint` (None: install nothing); the provider, to
    shut down (flushing what is left) when the server stops."""
    if endpoint is None:
        return None
    provider = tracer_provider(endpoint)
    observers.on_finish(record_finish)
    app.add_middleware(TracingMiddleware, tracer=provider.get_tracer("lmserve"), engine_of=engine_of)
    return provider
