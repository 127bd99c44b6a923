"""End to end: derived models share one loaded copy of their weights, through a real server and the ollama client."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import ollama
import pytest

from tests.test_server import MODEL, Server


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server("-np", "2", "-c", "512", "-t", "1")
    yield srv
    srv.stop()


def loads(server: Server) -> dict[str, float]:
    """lmserve_model_loads_total by model, from /metrics."""
    text = httpx.get(server.base_url + "/metrics").text
    found = re.finditer(r'^lmserve_model_loads_total\{model="([^"]+)"\} (\S+)$', text, re.MULTILINE)
    return {match[1]: float(match[2]) for match in found}


def test_models_that_differ_only_in_prompt_settings_share_one_engine(server: Server) -> None:
    with ollama.Client(host=server.base_url) as client:
        client.create(model="pirate", from_=MODEL, system="You are a pirate.")
        client.create(model="cool", from_=MODEL, parameters={"temperature": 0.1, "stop": ["\n\n"]})
        client.create(model="parrot", from_=MODEL, messages=[{"role": "user", "content": "Say hi"},
                                                             {"role": "assistant", "content": "Hi"}])
        for name in ("pirate", "cool", "parrot", MODEL):
            reply = client.chat(model=name, messages=[{"role": "user", "content": "Hello"}], options={"num_predict": 4})
            assert reply.done
        running = {m.model for m in client.ps().models}
    assert {"pirate:latest", "cool:latest", "parrot:latest", MODEL} <= running
    assert sum(loads(server).values()) == 1  # the preloaded model's weights, and nothing more


def test_another_load_time_option_is_a_second_engine(server: Server) -> None:
    before = sum(loads(server).values())
    with ollama.Client(host=server.base_url) as client:
        client.create(model="wide", from_=MODEL, parameters={"num_ctx": 1024})
        reply = client.chat(model="wide", messages=[{"role": "user", "content": "Hello"}], options={"num_predict": 2})
    assert reply.done
    assert sum(loads(server).values()) == before + 1
