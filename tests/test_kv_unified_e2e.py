"""`lmserve serve --kv-unified`: 8 slots share one KV pool of 1024 tokens; 8 streamed chats that together need more
all finish whole through the OpenAI client (sequences paused for room resume and their streams go on). That one
sequence may fill the whole pool is proven in-process (tests/engine/test_kv_unified.py)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.test_server import MODEL, Server
from tests.test_speculative_e2e import metric

TOPICS = ["a dragon", "a robot", "the sea", "a lighthouse", "a cat", "the moon", "a forest", "a city"]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server("--kv-unified", "-np", "8", "-c", "1024")
    yield srv
    srv.stop()


def chat(server: Server, topic: str) -> tuple[str, str | None, int, int]:
    """Stream one chat: its text, finish reason, prompt and completion tokens."""
    with server.client() as client:
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Write a long story about {topic}."}],
            temperature=0, max_tokens=200, stream=True, stream_options={"include_usage": True})
        text, finish, prompt_tokens, completion_tokens = "", None, 0, 0
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                prompt_tokens, completion_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
    return text, finish, prompt_tokens, completion_tokens


def test_chats_outgrowing_the_shared_pool_all_finish(server: Server) -> None:
    with ThreadPoolExecutor(len(TOPICS)) as pool:
        replies = list(pool.map(lambda topic: chat(server, topic), TOPICS))
    assert sum(prompt + completion for _, _, prompt, completion in replies) > 1024  # more than the pool holds
    assert metric(server, "lmserve_preemptions_total") > 0  # paused for room, recomputed, and finished
    for text, finish, _, completion in replies:
        assert finish in ("length", "stop")
        assert completion > 40 and len(text) > 100
