"""End to end: one memory budget through a real server (LMSERVE_MEMORY_BYTES fakes a small machine). A model that
does not fit beside an idle one unloads it; a model that can never fit is a 400 naming both numbers in GiB, through
the openai client, /api/generate and the anthropic client, and unloads nothing."""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest

from lmserve.engine.factory import estimate_memory
from lmserve.engine.memory_estimate import MemoryEstimate
from lmserve.errors import gib
from lmserve.store.gguf_check import gguf_metadata
from lmserve.types import LoadOptions
from tests.test_server import MODEL, Server

SLOTS = 2
SMALL_CTX, WIDE_CTX, HUGE_CTX = 512, 2048, 8192
QUESTION = [{"role": "user", "content": "Hello"}]


def estimate(model_path: Path, num_ctx: int) -> MemoryEstimate:
    found = estimate_memory(model_path, LoadOptions(num_ctx=num_ctx, num_parallel=SLOTS),
                            partial(gguf_metadata, max_array=4096))
    assert found is not None
    return found


@pytest.fixture(scope="module")
def budget(model_path: Path) -> int:
    """Room for the wide model alone, not beside the small one; the huge one never fits."""
    small, wide, huge = (estimate(model_path, ctx).total for ctx in (SMALL_CTX, WIDE_CTX, HUGE_CTX))
    room = wide + small // 2
    assert small < room < small + wide < huge
    return room


@pytest.fixture(scope="module")
def server(budget: int) -> Iterator[Server]:
    srv = Server("-np", str(SLOTS), "-c", str(SMALL_CTX), "-t", "1", env={"LMSERVE_MEMORY_BYTES": str(budget)})
    with ollama.Client(host=srv.base_url) as client:
        client.create(model="wide", from_=MODEL, parameters={"num_ctx": WIDE_CTX})
        client.create(model="huge", from_=MODEL, parameters={"num_ctx": HUGE_CTX})
    yield srv
    srv.stop()


def running(server: Server) -> list[str]:
    with ollama.Client(host=server.base_url) as client:
        return sorted(m.model or "" for m in client.ps().models)


def test_a_model_that_does_not_fit_beside_an_idle_one_unloads_it(server: Server) -> None:
    with ollama.Client(host=server.base_url) as client:
        assert client.chat(model=MODEL, messages=QUESTION, options={"num_predict": 2}).done
        assert running(server) == [MODEL]
        assert client.chat(model="wide", messages=QUESTION, options={"num_predict": 2}).done
    assert running(server) == ["wide:latest"]


def refusal(model_path: Path, budget: int) -> re.Pattern[str]:
    needed = gib(estimate(model_path, HUGE_CTX).total)
    return re.compile(rf"^model 'huge:latest' requires more system memory \({re.escape(needed)}\) than is available "
                      rf"\({re.escape(gib(budget))}\): .* of KV cache for {SLOTS} slots x {HUGE_CTX} tokens")


def test_a_model_that_can_never_fit_is_a_400_naming_the_numbers(server: Server, model_path: Path,
                                                                 budget: int) -> None:
    before = running(server)
    with server.client() as client, pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="huge", messages=QUESTION, max_tokens=2)  # type: ignore[arg-type]
    body = refused.value.body
    assert isinstance(body, dict) and (body["type"], body["param"], body["code"]) == (
        "invalid_request_error", "model", "insufficient_memory")
    assert refusal(model_path, budget).match(body["message"])
    native = httpx.post(server.base_url + "/api/generate", json={"model": "huge", "prompt": "Hi", "stream": False},
                        timeout=30)
    assert native.status_code == 400
    assert refusal(model_path, budget).match(native.json()["error"])
    with anthropic.Anthropic(base_url=server.base_url, api_key="placeholder", max_retries=0) as claude, \
            pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(model="huge", max_tokens=2, messages=QUESTION)  # type: ignore[arg-type]
    assert refusal(model_path, budget).match(bad.value.body["error"]["message"])  # type: ignore[index]
    assert running(server) == before  # nothing unloaded for a model that cannot load
