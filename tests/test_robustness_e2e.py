"""End to end: crafted or broken models give clear errors and the server keeps serving the default model."""

from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import pytest

from tests.test_server import MODEL, Server
from tests.tiny_gguf import CHATML_TEMPLATE, write_tiny_llama

INJECTION = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
QUESTION = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server("-np", "2", "-c", "512")
    yield srv
    srv.stop()


@pytest.fixture
def client(server: Server) -> Iterator[ollama.Client]:
    with ollama.Client(host=server.base_url) as c:
        yield c


def chat(server: Server, model: str) -> httpx.Response:
    body = {"model": model, "messages": QUESTION, "max_tokens": 4, "temperature": 0}
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)


def assert_default_model_answers(server: Server) -> None:
    response = chat(server, MODEL)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] is not None


def test_a_crafted_gguf_blob_is_rejected_at_create(server: Server, client: ollama.Client, tmp_path: Path) -> None:
    data = bytearray(write_tiny_llama(tmp_path / "tiny.gguf", seed=11).read_bytes())
    data[16:24] = struct.pack("<Q", 2**62)  # kv_count far beyond what the file holds
    crafted = tmp_path / "crafted.gguf"
    crafted.write_bytes(bytes(data))
    digest = client.create_blob(crafted)
    response = httpx.post(server.base_url + "/api/create", timeout=60,
                          json={"model": "crafted", "files": {"crafted.gguf": digest}, "stream": False})
    assert response.status_code == 400, response.text
    assert "kv_count" in response.text
    assert "crafted:latest" not in [m.model for m in client.list().models]
    assert_default_model_answers(server)


def test_an_injected_gguf_chat_template_renders_sandboxed(server: Server, client: ollama.Client,
                                                          tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "evil.gguf", seed=12, chat_template=INJECTION)
    digest = client.create_blob(path)
    assert client.create(model="evil", files={"evil.gguf": digest}).status == "success"
    response = chat(server, "evil")
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "unsafe" in error["message"]
    assert "subclasses" not in response.text.replace(INJECTION, "")  # nothing of the class tree leaked
    assert_default_model_answers(server)


def test_a_model_whose_blob_vanished_fails_clearly(server: Server, client: ollama.Client, tmp_path: Path) -> None:
    digest = client.create_blob(write_tiny_llama(tmp_path / "gone.gguf", seed=13, chat_template=CHATML_TEMPLATE))
    assert client.create(model="gone", files={"gone.gguf": digest}).status == "success"
    (Path(server.models_dir) / "blobs" / ("sha256-" + digest.removeprefix("sha256:"))).unlink()
    response = chat(server, "gone")
    assert response.status_code == 500, response.text
    message = response.json()["error"]["message"]
    assert "gone" in message and "missing" in message
    assert_default_model_answers(server)


def test_a_model_truncated_after_create_fails_clearly(server: Server, client: ollama.Client, tmp_path: Path) -> None:
    digest = client.create_blob(write_tiny_llama(tmp_path / "cut.gguf", seed=14, chat_template=CHATML_TEMPLATE))
    assert client.create(model="cut", files={"cut.gguf": digest}).status == "success"
    blob = Path(server.models_dir) / "blobs" / ("sha256-" + digest.removeprefix("sha256:"))
    blob.chmod(0o644)
    data = blob.read_bytes()
    blob.write_bytes(data[: len(data) // 2])
    response = chat(server, "cut")
    assert response.status_code == 500, response.text
    message = response.json()["error"]["message"]
    assert "cut" in message and "failed to load" in message and "past the end" in message
    assert_default_model_answers(server)
    running = httpx.get(server.base_url + "/api/ps", timeout=30).json()["models"]
    assert all(not m["name"].startswith(("cut", "gone")) for m in running)


def metric(server: Server, name: str) -> float:
    for line in httpx.get(server.base_url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def running_sequences(server: Server) -> float:
    return metric(server, "lmserve_running_sequences")


LONG = {"temperature": 0.8, "ignore_eos": True, "max_tokens": 400}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell a long story."}], "stream": True,
                                  **LONG}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell a long story."}], **LONG}),
        ("/api/generate", {"prompt": "Tell a long story.", "options": {"num_predict": 400}}),
        ("/api/chat", {"messages": [{"role": "user", "content": "Tell a long story."}], "stream": False,
                       "options": {"num_predict": 400}}),
    ],
)
def test_a_client_that_hangs_up_frees_its_sequence_at_once(server: Server, path: str, body: dict[str, object]) -> None:
    """The engine's running count drops when the socket closes, and the answer is never finished (an aborted
    generation adds nothing to the generated-token count; a finished one would add its 400 tokens)."""
    generated = metric(server, "lmserve_generated_tokens_total")
    payload = json.dumps({"model": MODEL, **body}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        deadline = time.monotonic() + 10
        while running_sequences(server) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert running_sequences(server) == 1
    # the socket is closed mid-generation (streamed or not)
    closed = time.monotonic()
    while running_sequences(server) > 0 and time.monotonic() - closed < 60:
        time.sleep(0.01)
    assert running_sequences(server) == 0
    assert metric(server, "lmserve_generated_tokens_total") == generated
