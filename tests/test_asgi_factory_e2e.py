"""End to end: lmserve's ASGI factory for platforms (`uvicorn --factory lmserve.server:asgi_app`, what the serverless
deployments run) on a real socket, configured by LMSERVE_* variables alone, on the llama.cpp engine with the embedded
model; `Authorization: Key <key>` (the fal header) is the key's form when LMSERVE_API_KEY is set, and is ignored
when it is not."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests import scratch
from tests.test_server import MODEL, QUESTION, free_port, wait_healthy


class FactoryServer:
    """uvicorn serving lmserve.server:asgi_app in a subprocess, configured by `env`."""

    def __init__(self, env: dict[str, str]) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        environ = {k: v for k, v in os.environ.items() if not k.startswith("LMSERVE_")}
        environ.update(LMSERVE_MODELS=scratch.store(), LMSERVE_CTX_SIZE="512",
                       LMSERVE_PARALLEL="2", **env)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--factory", "lmserve.server:asgi_app", "--port", str(self.port)],
            env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )

    def wait_healthy(self) -> None:
        wait_healthy(self.process, self.base_url)

    def stop(self) -> str:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            out, _ = self.process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            out, _ = self.process.communicate()
        return out or ""


@pytest.fixture(scope="module")
def keyed() -> Iterator[FactoryServer]:
    server = FactoryServer({"LMSERVE_API_KEY": "sekret"})
    server.wait_healthy()
    yield server
    server.stop()


def test_key_header_lists_models_and_chats(keyed: FactoryServer) -> None:
    headers = {"Authorization": "Key sekret"}
    listed = httpx.get(keyed.base_url + "/v1/models", headers=headers)
    assert listed.status_code == 200
    assert [m["id"] for m in listed.json()["data"]] == [MODEL]
    reply = httpx.post(keyed.base_url + "/v1/chat/completions", headers=headers, timeout=60,
                       json={"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 8})
    assert reply.status_code == 200
    assert "Paris" in reply.json()["choices"][0]["message"]["content"]


def test_the_openai_client_with_the_key_chats(keyed: FactoryServer) -> None:
    with openai.OpenAI(base_url=keyed.base_url + "/v1", api_key="sekret", max_retries=0) as client:
        reply = client.chat.completions.create(model=MODEL, messages=QUESTION,  # type: ignore[arg-type]
                                               temperature=0, max_tokens=8)
    assert reply.choices[0].message.content and "Paris" in reply.choices[0].message.content


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Key nope"}], ids=["no key", "wrong key"])
def test_without_the_key_is_401_in_the_openai_error_shape(keyed: FactoryServer, headers: dict[str, str]) -> None:
    refused = httpx.get(keyed.base_url + "/v1/models", headers=headers)
    assert refused.status_code == 401
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key")
    assert isinstance(error["message"], str) and error["message"]
    assert httpx.get(keyed.base_url + "/health").status_code == 200  # the platform's health check needs no key


def test_the_model_is_loaded_at_startup(keyed: FactoryServer) -> None:
    loaded = httpx.get(keyed.base_url + "/api/ps", headers={"Authorization": "Key sekret"}).json()["models"]
    assert [m["name"] for m in loaded] == [MODEL]


def test_without_a_configured_key_the_platforms_key_header_is_ignored() -> None:
    server = FactoryServer({})
    try:
        server.wait_healthy()
        listed = httpx.get(server.base_url + "/v1/models", headers={"Authorization": "Key the-platforms-key"})
        assert listed.status_code == 200
        assert [m["id"] for m in listed.json()["data"]] == [MODEL]
    finally:
        output = server.stop()
    assert server.process.returncode == -signal.SIGTERM, output  # uvicorn re-raises the signal it stopped on
    assert "Application shutdown complete" in output  # the lifespan's end, which closes the service


def test_a_model_that_cannot_be_served_ends_the_server_with_one_line() -> None:
    server = FactoryServer({"LMSERVE_MODEL": "no-such-model"})
    server.process.wait(timeout=60)
    output = server.stop()
    assert server.process.returncode == 1
    assert output.strip().splitlines()[-1].startswith("lmserve: ")
    assert "no-such-model" in output.strip().splitlines()[-1]
