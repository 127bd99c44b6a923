"""Fixtures of the chat tests: `server`, a real HTTP server on 127.0.0.1 whose routes a test sets (image and audio
URLs are fetched from it)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

Handler = Callable[[asyncio.StreamWriter], Awaitable[None]]


@dataclass
class Server:
    port: int
    routes: dict[str, Handler] = field(default_factory=dict)
    hosts: list[str] = field(default_factory=list)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def reply(status: str, headers: dict[str, str], body: bytes = b"") -> Handler:
    async def send(w: asyncio.StreamWriter) -> None:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        w.write(f"HTTP/1.1 {status}\r\n{head}Connection: close\r\n\r\n".encode() + body)
        await w.drain()

    return send


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    srv = Server(port=0)

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            head = (await r.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            path = head[0].split(" ")[1]
            srv.hosts += [h.split(":", 1)[1].strip() for h in head[1:] if h.lower().startswith("host:")]
            await srv.routes.get(path, reply("404 Not Found", {"Content-Length": "0"}))(w)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()
            with contextlib.suppress(ConnectionError):
                await w.wait_closed()

    tcp = await asyncio.start_server(handle, "127.0.0.1", 0)
    srv.port = tcp.sockets[0].getsockname()[1]
    try:
        yield srv
    finally:
        tcp.close()
        await tcp.wait_closed()
