"""Speculative decoding through the real server: `--draft-max` on, a request's `draft_max` over it, the same text
either way, and the drafted/accepted counts in the native final chunk and /metrics."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest

from lmserve.store.embedded import embedded_model_path
from tests.engine.test_speculative import DOCUMENT
from tests.test_server import MODEL, Server

COPY = [{"role": "user", "content": f"Copy this text exactly:\n{DOCUMENT}"}]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server("--draft-max", "8", "-np", "1")
    yield srv
    srv.stop()


def metric(server: Server, name: str) -> float:
    text = httpx.get(server.base_url + "/metrics").text
    return sum(float(value) for value in re.findall(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE))


def test_the_openai_route_drafts_by_default_and_a_request_can_turn_it_off(server: Server) -> None:
    with server.client() as client:
        drafted = client.chat.completions.create(model=MODEL, messages=COPY, temperature=0, max_tokens=80)  # type: ignore[arg-type]
        before = metric(server, "lmserve_draft_accepted_tokens_total")
        plain = client.chat.completions.create(model=MODEL, messages=COPY, temperature=0, max_tokens=80,  # type: ignore[arg-type]
                                               extra_body={"draft_max": 0})
    assert drafted.choices[0].message.content == plain.choices[0].message.content
    assert metric(server, "lmserve_draft_accepted_tokens_total") == before > 20  # the plain one drafted nothing
    assert metric(server, "lmserve_draft_tokens_total") >= before


def test_the_native_final_chunk_counts_drafted_and_accepted_tokens(server: Server) -> None:
    body = {"model": MODEL, "messages": COPY, "stream": False, "options": {"temperature": 0, "num_predict": 60}}
    done = httpx.post(server.base_url + "/api/chat", json=body, timeout=120).json()
    assert done["draft_count"] >= done["draft_accepted_count"] > 10
    off = httpx.post(server.base_url + "/api/chat", json={**body, "options": {**body["options"], "draft_max": 0}},
                     timeout=120).json()
    assert "draft_count" not in off and off["message"]["content"] == done["message"]["content"]


def test_a_bad_draft_max_is_a_400_naming_it(server: Server) -> None:
    bad = httpx.post(server.base_url + "/v1/chat/completions", timeout=30,
                     json={"model": MODEL, "messages": COPY, "draft_max": 65})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "draft_max"


def test_a_draft_model_drafts_through_the_server_and_keeps_the_text(server: Server) -> None:
    draft = Server("--model-draft", str(embedded_model_path()), "-np", "1")  # the model drafting for itself
    try:
        body = {"model": MODEL, "messages": COPY, "stream": False, "options": {"temperature": 0, "num_predict": 40}}
        done = httpx.post(draft.base_url + "/api/chat", json=body, timeout=120).json()
        assert done["draft_count"] >= done["draft_accepted_count"] > 10  # drafted without --draft-max: 16 by default
        plain = httpx.post(server.base_url + "/api/chat", timeout=120,
                           json={**body, "options": {**body["options"], "draft_max": 0}}).json()
        assert done["message"]["content"] == plain["message"]["content"]
        assert metric(draft, "lmserve_draft_accepted_tokens_total") == done["draft_accepted_count"]
    finally:
        draft.stop()
