"""Spec for lmserve.chat.media: data URIs, base64, and SSRF-safe image fetching (servers on 127.0.0.1 only)."""

from __future__ import annotations

import asyncio
import base64
import io
import socket
import struct
import zlib
from typing import Any

import httpx
import pytest
from PIL import Image as PILImage
from PIL import ImageFile

from lmserve.chat.media import MediaPolicy, check_image, decode_base64, decode_data_uri, fetch_image
from lmserve.errors import InvalidRequest
from tests.chat.conftest import Server, reply

POLICY = MediaPolicy()


def draw(fmt: str, size: tuple[int, int] = (8, 6)) -> bytes:
    buf = io.BytesIO()
    PILImage.new("RGB", size, (200, 30, 40)).save(buf, format=fmt)
    return buf.getvalue()


PNG = draw("PNG")
JPEG = draw("JPEG")


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims width x height, with a tiny (bogus) IDAT: a decompression-bomb lookalike."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def refused(match: str) -> Any:
    return pytest.raises(InvalidRequest, match=match)


# --- data URIs and base64 -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "mime", "size"),
    [
        (f"data:image/png;base64,{b64(PNG)}", "image/png", (8, 6)),
        (f"data:image/jpeg;base64,{b64(JPEG)}", "image/jpeg", (8, 6)),
        (f"data:;base64,{b64(PNG)}", "image/png", (8, 6)),  # no declared type: Pillow decides
        (f"DATA:image/png;base64,{b64(PNG)[:20]}\n{b64(PNG)[20:]}", "image/png", (8, 6)),
    ],
)
def test_data_uri_ok(text: str, mime: str, size: tuple[int, int]) -> None:
    img = decode_data_uri(text, POLICY)
    assert (img.mime, (img.width, img.height)) == (mime, size)
    assert decode_base64(text, POLICY).data == img.data


@pytest.mark.parametrize(("text", "mime"), [(b64(PNG), "image/png"), (b64(JPEG), "image/jpeg")])
def test_raw_base64_ok(text: str, mime: str) -> None:
    img = decode_base64(text, POLICY)
    assert img.mime == mime and img.data in (PNG, JPEG)


@pytest.mark.parametrize(
    ("text", "policy", "why"),
    [
        ("data:image/png;base64,!!!notbase64", POLICY, "not valid base64"),
        ("data:image/png;base64,abc", POLICY, "not valid base64"),
        ("data:image/png," + "x", POLICY, "must be base64"),
        ("data:text/html;base64," + b64(b"<html>"), POLICY, "not an image"),
        ("data:image/png;base64," + b64(b"hello, not an image"), POLICY, "not a valid image"),
        ("data:image/png;base64," + b64(PNG[:-20]), POLICY, "not a valid image"),  # truncated
        ("data:image/png;base64," + b64(PNG), MediaPolicy(max_bytes=len(PNG) - 1), "too large"),
        ("data:image/png;base64," + b64(png_header_only(100_000, 100_000)), POLICY, "too many pixels"),
        ("data:image/png;base64," + b64(draw("PNG", (64, 64))), MediaPolicy(max_pixels=1000), "too many pixels"),
        ("image/png;base64," + b64(PNG), POLICY, "not a data URI"),
    ],
)
def test_data_uri_refused(text: str, policy: MediaPolicy, why: str) -> None:
    with refused(why) as info:
        decode_data_uri(text, policy)
    assert info.value.status == 400 and info.value.param == "image_url"


@pytest.mark.parametrize(
    ("text", "policy", "why"),
    [
        ("@@@@", POLICY, "not valid base64"),
        (b64(b"GIF89a but not really"), POLICY, "not a valid image"),
        (b64(PNG), MediaPolicy(max_bytes=10), "too large"),
        (b64(png_header_only(20_000, 20_000)), MediaPolicy(max_pixels=50_000_000), "too many pixels"),
    ],
)
def test_raw_base64_refused(text: str, policy: MediaPolicy, why: str) -> None:
    with refused(why):
        decode_base64(text, policy)


def test_pixel_cap_checked_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    data = draw("PNG", (100, 100))

    def no_load(self: PILImage.Image) -> None:
        raise AssertionError("load() called on an image over the pixel cap")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_load)
    with refused("too many pixels"):
        check_image(data, MediaPolicy(max_pixels=9_999))


# --- the SSRF guard: refused before any connection --------------------------------------------------------------------


@pytest.fixture
def no_connect(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Record every outgoing connection attempt; only 127.0.0.1 (the test servers) is let through."""
    attempts: list[object] = []
    real_connect = socket.socket.connect

    def create_connection(address: Any, *args: Any, **kwargs: Any) -> Any:
        attempts.append(address)
        raise OSError("test: socket.create_connection blocked")

    def connect(self: socket.socket, address: Any) -> None:
        attempts.append(address)
        if not (isinstance(address, tuple) and address[0] == "127.0.0.1"):
            raise OSError(f"test: connection to {address!r} blocked")
        real_connect(self, address)

    monkeypatch.setattr(socket, "create_connection", create_connection)
    monkeypatch.setattr(socket.socket, "connect", connect)
    return attempts


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("file:///etc/passwd", "scheme 'file'"),
        ("ftp://example.com/a.png", "scheme 'ftp'"),
        ("gopher://example.com/a.png", "scheme 'gopher'"),
        ("http://127.0.0.1/a.png", "loopback"),
        ("http://127.1.2.3:8080/a.png", "loopback"),
        ("http://localhost/a.png", "loopback"),
        ("http://10.0.0.1/a.png", "private"),
        ("http://192.168.1.1/a.png", "private"),
        ("http://172.16.0.1/a.png", "private"),
        ("http://100.64.0.1/a.png", "CGNAT"),
        ("http://169.254.169.254/latest/meta-data/", "cloud metadata"),
        ("http://169.254.1.1/a.png", "link-local"),
        ("http://[::1]/a.png", "loopback"),
        ("http://[fd00:ec2::254]/a.png", "cloud metadata"),
        ("http://[fe80::1]/a.png", "link-local"),
        ("http://0.0.0.0/a.png", "unspecified"),
        ("http://[::ffff:127.0.0.1]/a.png", "loopback"),
        ("http://[::ffff:169.254.169.254]/a.png", "cloud metadata"),
        ("https://224.0.0.1/a.png", "multicast"),
        ("http://240.0.0.1/a.png", "reserved"),
        ("http:///a.png", "no host|invalid"),
        ("not a url at all", "scheme|invalid"),
    ],
)
async def test_ssrf_refused_without_connecting(url: str, why: str, no_connect: list[object]) -> None:
    with refused(why) as info:
        await fetch_image(url, MediaPolicy(allowed_hosts=frozenset({"example.org"})))
    assert info.value.status == 400 and info.value.param == "image_url"
    assert no_connect == []


async def test_name_resolving_to_private_address_refused(
    monkeypatch: pytest.MonkeyPatch, no_connect: list[object]
) -> None:
    """Every resolved address is checked, not just the first."""

    async def fake_getaddrinfo(self: Any, host: str, port: int, **kw: Any) -> list[Any]:
        assert host == "images.example.com"
        return [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.216.34", port)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.1.2.3", port)),
        ]

    monkeypatch.setattr(asyncio.BaseEventLoop, "getaddrinfo", fake_getaddrinfo)
    with refused("private address"):
        await fetch_image("http://images.example.com/a.png", POLICY)
    assert no_connect == []


async def test_https_goes_to_checked_ip_with_host_and_sni(
    monkeypatch: pytest.MonkeyPatch, no_connect: list[object]
) -> None:
    sent: list[httpx.Request] = []

    async def fake_getaddrinfo(self: Any, host: str, port: int, **kw: Any) -> list[Any]:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.216.34", port))]

    async def fake_send(self: httpx.AsyncClient, request: httpx.Request, **kw: Any) -> httpx.Response:
        sent.append(request)
        raise httpx.ConnectError("test: not connecting", request=request)

    monkeypatch.setattr(asyncio.BaseEventLoop, "getaddrinfo", fake_getaddrinfo)
    monkeypatch.setattr(httpx.AsyncClient, "send", fake_send)
    with refused("fetching the image failed: ConnectError"):
        await fetch_image("https://Images.Example.com/a.png?x=1", POLICY)
    [req] = sent
    assert str(req.url) == "https://93.184.216.34/a.png?x=1"
    assert req.headers["host"] == "images.example.com"
    assert req.extensions["sni_hostname"] == "images.example.com"
    assert no_connect == []


async def test_guard_sees_connections(no_connect: list[object]) -> None:
    """Sanity check of the fixture: an allowed fetch does try to connect (and the failure is a 400)."""
    with refused("fetching the image failed"):
        await fetch_image("http://127.0.0.1:9/a.png", MediaPolicy(allowed_hosts=frozenset({"127.0.0.1"})))
    assert no_connect == [("127.0.0.1", 9)]


# --- a real server on 127.0.0.1 (tests/chat/conftest.py) -----------------------------------------------------------

LOCAL = MediaPolicy(allowed_hosts=frozenset({"127.0.0.1"}))


async def test_fetch_allowlisted_png(server: Server) -> None:
    server.routes["/a.png"] = reply("200 OK", {"Content-Type": "image/png", "Content-Length": str(len(PNG))}, PNG)
    img = await fetch_image(server.base + "/a.png", LOCAL)
    assert (img.data, img.mime, img.width, img.height) == (PNG, "image/png", 8, 6)
    assert server.hosts == [f"127.0.0.1:{server.port}"]


async def test_not_allowlisted_local_server_refused(server: Server) -> None:
    server.routes["/a.png"] = reply("200 OK", {"Content-Type": "image/png"}, PNG)
    with refused("loopback"):
        await fetch_image(server.base + "/a.png", POLICY)
    assert server.hosts == []


@pytest.mark.parametrize("allow", ["images.test", "images.test:{port}"])
async def test_connects_to_checked_ip_with_original_host(
    allow: str, server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The name is resolved once; the request goes to that IP and carries the original Host header."""
    calls: list[str] = []

    async def fake_getaddrinfo(self: Any, host: str, port: int, **kw: Any) -> list[Any]:
        calls.append(host)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]

    monkeypatch.setattr(asyncio.BaseEventLoop, "getaddrinfo", fake_getaddrinfo)
    server.routes["/a.png"] = reply("200 OK", {"Content-Type": "image/png"}, PNG)
    policy = MediaPolicy(allowed_hosts=frozenset({allow.format(port=server.port)}))
    img = await fetch_image(f"http://images.test:{server.port}/a.png", policy)
    assert img.data == PNG
    assert calls == ["images.test"]
    assert server.hosts == [f"images.test:{server.port}"]


async def test_redirect_followed_and_rechecked(server: Server) -> None:
    server.routes["/r"] = reply("302 Found", {"Location": "/a.png", "Content-Length": "0"})
    server.routes["/a.png"] = reply("200 OK", {"Content-Type": "image/png"}, PNG)
    assert (await fetch_image(server.base + "/r", LOCAL)).data == PNG


@pytest.mark.parametrize(
    ("location", "why"),
    [
        ("http://169.254.169.254/latest/meta-data/", "cloud metadata"),
        ("http://10.0.0.1/", "private"),
        ("file:///etc/passwd", "scheme 'file'"),
        ("http://localhost:{port}/a.png", "loopback"),  # same server, but that name is not allow-listed
    ],
)
async def test_redirect_hop_refused(location: str, why: str, server: Server, no_connect: list[object]) -> None:
    server.routes["/r"] = reply("301 Moved", {"Location": location.format(port=server.port), "Content-Length": "0"})
    server.routes["/a.png"] = reply("200 OK", {"Content-Type": "image/png"}, PNG)
    await _fetch_expecting(server, "/r", why)
    assert server.hosts == [f"127.0.0.1:{server.port}"]
    assert no_connect and all(addr == ("127.0.0.1", server.port) for addr in no_connect)


async def _fetch_expecting(server: Server, path: str, why: str, policy: MediaPolicy = LOCAL) -> None:
    with refused(why):
        await fetch_image(server.base + path, policy)


async def test_redirect_loop(server: Server) -> None:
    server.routes["/loop"] = reply("307 Temporary Redirect", {"Location": "/loop", "Content-Length": "0"})
    await _fetch_expecting(
        server, "/loop", "more than 3", MediaPolicy(allowed_hosts=LOCAL.allowed_hosts, max_redirects=3)
    )
    assert len(server.hosts) == 4


@pytest.mark.parametrize(
    ("headers", "body", "policy", "why"),
    [
        ({"Content-Type": "text/html"}, b"<html></html>", LOCAL, "content type 'text/html'"),
        ({}, PNG, LOCAL, "content type '\\(none\\)'"),
        ({"Content-Type": "application/octet-stream"}, b"not an image", LOCAL, "not a valid image"),
        ({"Content-Type": "image/png", "Content-Length": "999999999"}, PNG, LOCAL, "too large: 999999999"),
        (
            {"Content-Type": "image/png"},
            b"x" * 5000,
            MediaPolicy(allowed_hosts=LOCAL.allowed_hosts, max_bytes=4096),
            "more than 4096",
        ),  # no Content-Length: the stream cap stops it
        (
            {"Content-Type": "image/png", "Transfer-Encoding": "chunked"},
            b"1000\r\n" + b"x" * 4096 + b"\r\n" + b"1000\r\n" + b"x" * 4096 + b"\r\n0\r\n\r\n",
            MediaPolicy(allowed_hosts=LOCAL.allowed_hosts, max_bytes=5000),
            "more than 5000",
        ),
    ],
)
async def test_bad_responses_refused(
    headers: dict[str, str], body: bytes, policy: MediaPolicy, why: str, server: Server
) -> None:
    server.routes["/x"] = reply("200 OK", headers, body)
    await _fetch_expecting(server, "/x", why, policy)


async def test_http_error_status_refused(server: Server) -> None:
    await _fetch_expecting(server, "/missing", "HTTP 404")


@pytest.mark.parametrize("drip", [False, True])
async def test_slow_server_times_out(drip: bool, server: Server) -> None:
    async def slow(w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: 100\r\n\r\n")
        await w.drain()
        for _ in range(50):  # one byte every 0.2 s beats the read timeout but not the total deadline
            if drip:
                w.write(b"x")
                await w.drain()
            await asyncio.sleep(0.2)

    server.routes["/slow"] = slow
    policy = MediaPolicy(allowed_hosts=LOCAL.allowed_hosts, connect_timeout=0.5, read_timeout=0.5)
    loop = asyncio.get_running_loop()
    start = loop.time()
    await _fetch_expecting(server, "/slow", "timed out", policy)
    assert loop.time() - start < 5.0  # the 1 s deadline cut it, not the 10 s the server would go on (slack for load)
