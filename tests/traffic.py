"""A small recording proxy, as a user would put between a client application and a server to see what it sends:
every request is forwarded to the server unchanged (streamed answers stream through), and kept with its method,
path, headers, JSON body and the status the server gave.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                        "proxy-authorization", "proxy-authenticate", "host", "content-length"})


@dataclass
class Recorded:
    """One request a client sent, and what the server answered."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any
    status: int = 0
    answer: bytes = b""

    def describe(self) -> str:
        return f"{self.method} {self.path} -> {self.status}: {json.dumps(self.body)[:600]}"


@dataclass
class RecordingProxy:
    """A proxy in front of `target` (a base URL); `base_url` is where clients are pointed."""

    target: str
    records: list[Recorded] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._http = httpx.Client(base_url=self.target, timeout=httpx.Timeout(600, connect=10))
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="recording-proxy", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._http.close()

    def take(self) -> list[Recorded]:
        """The requests recorded since the last take."""
        with self._lock:
            taken, self.records = self.records, []
        return taken

    def forward(self, record: Recorded, raw: bytes) -> Iterator[tuple[int, list[tuple[str, str]], bytes]]:
        """Send the request on; yield the status and headers once, then the answer's chunks (status 0, no headers)."""
        headers = {k: v for k, v in record.headers.items() if k.lower() not in HOP_BY_HOP}
        with self._http.stream(record.method, record.path, headers=headers, content=raw) as response:
            record.status = response.status_code
            yield response.status_code, [(k, v) for k, v in response.headers.items()
                                         if k.lower() not in HOP_BY_HOP], b""
            for chunk in response.iter_raw():
                record.answer += chunk
                yield 0, [], chunk
        with self._lock:
            self.records.append(record)


def _handler(proxy: RecordingProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _relay(self) -> None:
            raw = self.rfile.read(int(self.headers.get("content-length") or 0))
            try:
                body: Any = json.loads(raw) if raw else None
            except ValueError:
                body = raw[:2000].decode("utf-8", "replace")
            record = Recorded(self.command, self.path, dict(self.headers.items()), body)
            try:
                self._answer(proxy.forward(record, raw))
            except httpx.TransportError as exc:  # the server is gone: the client sees a 502, as behind a real proxy
                record.status = 502
                self.send_error(502, f"the proxy could not reach {proxy.target}: {exc!r}")
                with proxy._lock:
                    proxy.records.append(record)

        def _answer(self, answer: Iterator[tuple[int, list[tuple[str, str]], bytes]]) -> None:
            bodyless = self.command == "HEAD"
            for status, headers, chunk in answer:
                if status:
                    self.send_response(status)
                    for key, value in headers:
                        self.send_header(key, value)
                    self.send_header(*(("content-length", "0") if bodyless else ("transfer-encoding", "chunked")))
                    self.end_headers()
                elif chunk and not bodyless:
                    self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                    self.wfile.flush()
            if not bodyless:
                self.wfile.write(b"0\r\n\r\n")

        do_GET = do_POST = do_DELETE = do_HEAD = do_PUT = _relay

        def log_message(self, format: str, *args: Any) -> None:  # the clients' own output stays readable
            pass

    return Handler
