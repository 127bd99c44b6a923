"""The guard middleware: Host header check (DNS rebinding), request-body limit, CORS; streams still stream."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from api_wire import API_KEY, assert_openai_error, sse_json

from lmserve.config import DEFAULT_ORIGINS, ServerConfig, resolve
from lmserve.http.app import create_app
from lmserve.http.guards import is_loopback_host, origin_pattern, split_host_header
from lmserve.service import Service

CHAT = "/v1/chat/completions"
NATIVE_CHAT = "/api/chat"
USER = [{"role": "user", "content": "hi"}]
LOOPBACK_URL = "http://127.0.0.1:11434"
JSON = {"content-type": "application/json"}


def client_for(service: Service, config: ServerConfig, base_url: str = LOOPBACK_URL) -> httpx.AsyncClient:
    """A client whose scope["server"] is an IP, as under a real server, so the Host check applies."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(create_app(service, config)), base_url=base_url)


# ---- Host header ----------------------------------------------------------------------------------

HOSTS = [
    ("localhost:11434", 200),
    ("localhost", 200),
    ("127.0.0.1", 200),
    ("127.0.0.1:11434", 200),
    ("127.1.2.3:80", 200),
    ("[::1]:11434", 200),
    ("[::1]", 200),
    ("app.localhost:11434", 200),
    ("evil.com", 403),
    ("evil.com:11434", 403),
    ("attacker.localhost.evil.com", 403),
    ("localhost.evil.com:11434", 403),
    ("192.168.1.10:11434", 403),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(("host", "status"), HOSTS)
async def test_host_header_on_loopback_bind(service: Service, host: str, status: int) -> None:
    async with client_for(service, ServerConfig(host="127.0.0.1")) as client:
        response = await client.get("/v1/models", headers={"Host": host})
        assert response.status_code == status, response.text
        if status == 403:
            assert_openai_error(response.json(), error_type="permission_error")
        native = await client.get("/api/tags", headers={"Host": host})
        assert native.status_code == status
        if status == 403:
            assert set(native.json()) == {"error"} and isinstance(native.json()["error"], str)


@pytest.mark.asyncio
@pytest.mark.parametrize("bind", ["localhost", "::1", "127.0.0.2"])
async def test_every_loopback_bind_checks_host(service: Service, bind: str) -> None:
    async with client_for(service, ServerConfig(host=bind)) as client:
        assert (await client.get("/v1/models", headers={"Host": "evil.com"})).status_code == 403
        assert (await client.get("/v1/models")).status_code == 200


@pytest.mark.asyncio
@pytest.mark.parametrize("host", ["evil.com", "attacker.localhost.evil.com", "localhost:11434", "10.0.0.5:11434"])
async def test_any_host_on_non_loopback_bind(service: Service, host: str) -> None:
    async with client_for(service, ServerConfig(host="0.0.0.0")) as client:
        response = await client.get("/v1/models", headers={"Host": host})
        assert response.status_code == 200, response.text


@pytest.mark.asyncio
async def test_host_check_runs_before_auth(service: Service) -> None:
    async with client_for(service, ServerConfig(api_key=API_KEY)) as client:
        response = await client.get("/v1/models", headers={"Host": "evil.com", "Authorization": f"Bearer {API_KEY}"})
        assert response.status_code == 403
        ok = await client.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200


def test_host_helpers() -> None:
    assert split_host_header("localhost:11434") == "localhost"
    assert split_host_header("[::1]:11434") == "[::1]"
    assert split_host_header("::1") == "::1"
    assert is_loopback_host("[::1]") and is_loopback_host("::1") and is_loopback_host("LOCALHOST.")
    assert not is_loopback_host("0.0.0.0") and not is_loopback_host("localhost.evil.com")


# ---- body size ------------------------------------------------------------------------------------

LIMIT = 2048


def big_chat(size: int) -> bytes:
    body = json.dumps({"model": "fake", "messages": [{"role": "user", "content": "x" * size}], "max_tokens": 2})
    return body.encode()


async def chunks(body: bytes, size: int = 256) -> AsyncIterator[bytes]:
    for i in range(0, len(body), size):
        yield body[i : i + size]


@pytest.mark.asyncio
async def test_content_length_over_limit_is_413(service: Service) -> None:
    async with client_for(service, ServerConfig(max_body_bytes=LIMIT)) as client:
        response = await client.post(CHAT, content=big_chat(LIMIT), headers=JSON)
        assert response.status_code == 413
        error = assert_openai_error(response.json(), error_type="invalid_request_error")
        assert error["code"] == "request_too_large"
        native = await client.post(NATIVE_CHAT, content=big_chat(LIMIT), headers=JSON)
        assert native.status_code == 413
        assert set(native.json()) == {"error"} and "limit" in native.json()["error"]


@pytest.mark.asyncio
@pytest.mark.parametrize("path", [CHAT, NATIVE_CHAT, "/v1/embeddings"])
async def test_chunked_body_over_limit_is_413(service: Service, path: str) -> None:
    async with client_for(service, ServerConfig(max_body_bytes=LIMIT)) as client:
        response = await client.post(path, content=chunks(big_chat(LIMIT)), headers=JSON)
        assert "content-length" not in response.request.headers
        assert response.status_code == 413, response.text
        body = response.json()
        if path.startswith("/api/"):
            assert set(body) == {"error"} and isinstance(body["error"], str)
        else:
            assert assert_openai_error(body)["code"] == "request_too_large"


@pytest.mark.asyncio
async def test_body_under_limit_passes(service: Service) -> None:
    async with client_for(service, ServerConfig(max_body_bytes=LIMIT)) as client:
        plain = await client.post(CHAT, content=big_chat(100), headers=JSON)
        assert plain.status_code == 200, plain.text
        chunked = await client.post(CHAT, content=chunks(big_chat(100), 16), headers=JSON)
        assert chunked.status_code == 200, chunked.text
        assert chunked.json()["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.asyncio
async def test_blob_upload_is_exempt_from_the_limit(service: Service) -> None:
    digest = "sha256:" + "0" * 64  # wrong digest for the data: the route's answer, not 413, proves it got through
    async with client_for(service, ServerConfig(max_body_bytes=16)) as client:
        response = await client.post(f"/api/blobs/{digest}", content=b"y" * 4096)
        assert response.status_code != 413


# ---- CORS -----------------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "origin",
    [
        "http://localhost",
        "http://localhost:3000",
        "https://127.0.0.1:8443",
        "http://0.0.0.0:5173",
        "app://obsidian.md",
        "tauri://localhost",
    ],
)
async def test_allowed_origin_gets_cors_headers(service: Service, origin: str) -> None:
    async with client_for(service, ServerConfig()) as client:
        response = await client.get("/v1/models", headers={"Origin": origin})
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == origin
        assert "Origin" in response.headers["vary"]
        posted = await client.post(
            CHAT, json={"model": "fake", "messages": USER, "max_tokens": 2}, headers={"Origin": origin}
        )
        assert posted.status_code == 200
        assert posted.headers["access-control-allow-origin"] == origin


@pytest.mark.asyncio
async def test_preflight_is_answered_before_auth(service: Service) -> None:
    async with client_for(service, ServerConfig(api_key=API_KEY)) as client:
        response = await client.options(
            CHAT,
            headers={
                "Origin": "http://localhost:3000",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
            },
        )
        assert response.status_code == 204
        assert response.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "POST" in response.headers["access-control-allow-methods"]
        allowed = {h.strip().lower() for h in response.headers["access-control-allow-headers"].split(",")}
        assert {"authorization", "content-type", "x-stainless-os"} <= allowed
        # the actual request still needs the key, and its 401 is readable by the page
        unauthorized = await client.get("/v1/models", headers={"Origin": "http://localhost:3000"})
        assert unauthorized.status_code == 401
        assert unauthorized.headers["access-control-allow-origin"] == "http://localhost:3000"


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "origin", ["https://evil.com", "http://localhost.evil.com", "http://localhost:80.evil.com", "null"]
)
async def test_disallowed_origin(service: Service, origin: str) -> None:
    async with client_for(service, ServerConfig()) as client:
        get = await client.get("/v1/models", headers={"Origin": origin})
        assert get.status_code == 200
        assert "access-control-allow-origin" not in get.headers
        post = await client.post(CHAT, json={"model": "fake", "messages": USER}, headers={"Origin": origin})
        assert post.status_code == 403
        assert_openai_error(post.json(), error_type="permission_error")
        native = await client.post(NATIVE_CHAT, json={"model": "fake", "messages": USER}, headers={"Origin": origin})
        assert native.status_code == 403 and set(native.json()) == {"error"}
        preflight = await client.options(CHAT, headers={"Origin": origin, "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in preflight.headers


@pytest.mark.asyncio
async def test_configured_origin_is_allowed(service: Service) -> None:
    config = resolve({}, {"LMSERVE_ORIGINS": "https://chat.example.com, https://*.example.org"})
    async with client_for(service, config) as client:
        for origin in ("https://chat.example.com", "https://x.example.org", "http://localhost:3000"):
            response = await client.post(
                CHAT, json={"model": "fake", "messages": USER, "max_tokens": 2}, headers={"Origin": origin}
            )
            assert response.status_code == 200, origin
            assert response.headers["access-control-allow-origin"] == origin
        denied = await client.post(
            CHAT, json={"model": "fake", "messages": USER}, headers={"Origin": "https://evil.com"}
        )
        assert denied.status_code == 403


@pytest.mark.asyncio
async def test_star_allows_every_origin(service: Service) -> None:
    async with client_for(service, ServerConfig(origins=("*",))) as client:
        response = await client.post(
            CHAT,
            json={"model": "fake", "messages": USER, "max_tokens": 2},
            headers={"Origin": "https://anything.example"},
        )
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == "https://anything.example"


def test_origin_patterns() -> None:
    port = origin_pattern("http://localhost:*")
    assert port.fullmatch("http://localhost:8080")
    assert not port.fullmatch("http://localhost:80.evil.com")
    assert not port.fullmatch("http://localhost")
    assert origin_pattern("app://*").fullmatch("app://anything")
    assert "http://localhost" in DEFAULT_ORIGINS and "https://0.0.0.0:*" in DEFAULT_ORIGINS


def test_env_parsing() -> None:
    config = resolve(
        {},
        {
            "LMSERVE_ORIGINS": " https://a.example ,,http://b:* ",
            "LMSERVE_MAX_BODY": "1000",
            "LMSERVE_MAX_MESSAGES": "8",
        },
    )
    assert config.origins == ("https://a.example", "http://b:*")
    assert config.max_body_bytes == 1000
    assert config.max_messages == 8
    defaults = resolve({}, {})
    assert defaults.origins == ()
    assert defaults.max_body_bytes == 64 * 1024 * 1024
    assert defaults.max_messages == 1024


# ---- streams pass through the middleware ----------------------------------------------------------


@pytest.mark.asyncio
async def test_sse_still_streams(service: Service) -> None:
    config = ServerConfig(max_body_bytes=LIMIT, api_key=API_KEY)
    body: dict[str, Any] = {"model": "fake", "messages": USER, "max_tokens": 8, "stream": True}
    headers = {"Origin": "http://localhost:3000", "Authorization": f"Bearer {API_KEY}"}
    async with client_for(service, config) as client, client.stream("POST", CHAT, json=body, headers=headers) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.headers["access-control-allow-origin"] == "http://localhost:3000"
        parts = [part async for part in resp.aiter_text()]
        events, is_done = sse_json("".join(parts))
    assert is_done
    assert len(events) >= 3


@pytest.mark.asyncio
async def test_ndjson_still_streams(service: Service) -> None:
    body: dict[str, Any] = {"model": "fake", "messages": USER, "options": {"num_predict": 8}}
    async with (
        client_for(service, ServerConfig(max_body_bytes=LIMIT)) as client,
        client.stream("POST", NATIVE_CHAT, json=body) as resp,
    ):
        assert resp.status_code == 200
        lines = [json.loads(line) async for line in resp.aiter_lines() if line]
    assert len(lines) >= 3
    assert lines[-1]["done"] is True
