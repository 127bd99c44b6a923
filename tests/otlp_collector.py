"""A real OTLP/HTTP trace collector for the tests: an HTTP server that decodes every POST /v1/traces as OTLP's own
protobuf messages (opentelemetry-proto) and keeps the spans, as a Jaeger or an OpenTelemetry Collector would
receive them."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


class Collector(ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver on a free loopback port: every span of every POST, and the paths posted to."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Receive)
        self.spans: list[Any] = []
        self.paths: list[str] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def start(self) -> Collector:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()

    def wait_for(self, found: Callable[[list[Any]], bool], seconds: float = 30.0) -> list[Any]:
        """The spans received, once `found(spans)` holds (or `seconds` have passed)."""
        deadline = time.monotonic() + seconds
        while not found(list(self.spans)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return list(self.spans)


class _Receive(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        request = ExportTraceServiceRequest.FromString(body)
        collector = self.server
        assert isinstance(collector, Collector)
        collector.paths.append(self.path)
        collector.spans += [span for resource in request.resource_spans for scope in resource.scope_spans
                            for span in scope.spans]
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def attributes(span: Any) -> dict[str, Any]:
    """A span's attributes as Python values (strings, numbers, booleans, lists of them)."""

    def value(v: Any) -> Any:
        kind = v.WhichOneof("value")
        return [value(item) for item in v.array_value.values] if kind == "array_value" else getattr(v, kind)

    return {a.key: value(a.value) for a in span.attributes}
