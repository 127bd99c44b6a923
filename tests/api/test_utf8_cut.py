"""A reply cut by `max_tokens` in the middle of a multi-byte character ends before it, never in U+FFFD.

With the real embedded model, greedy: asked for emojis, SmolLM2 writes each 🌟 as three tokens (b"\\xf0\\x9f",
b"\\x8c", b"\\x9f"), so most small `max_tokens` cut one. Both dialects, streamed and not, through the real service.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from itertools import pairwise
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from api_wire import sse_json

from lmserve.chat.template import ChatTemplate
from lmserve.config import ServerConfig
from lmserve.engine.llamacpp.backend import LlamaCppBackend
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.http.app import create_app
from lmserve.service import static_service
from lmserve.service.residency import LoadedModel
from lmserve.types import LoadOptions

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = "Reply with three emojis."
MAX_TOKENS = range(1, 7)
Reply = Callable[[httpx.AsyncClient, int, bool], Awaitable[tuple[str, int]]]


@pytest.fixture(scope="module")
def engine(model_path: Path) -> Iterator[BatchingEngine]:
    eng = BatchingEngine(LlamaCppBackend(model_path, LoadOptions(num_ctx=512, num_parallel=2, num_batch=256)))
    yield eng
    eng.close()


@pytest_asyncio.fixture(loop_scope="module")
async def client(engine: BatchingEngine) -> AsyncIterator[httpx.AsyncClient]:
    info = engine.info
    template = ChatTemplate(info.chat_template, bos_token=info.bos_token, eos_token=info.eos_token)
    app = create_app(static_service([LoadedModel(name="smol", engine=engine, template=template)]), ServerConfig())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as http:
        yield http


async def openai_reply(http: httpx.AsyncClient, max_tokens: int, stream: bool) -> tuple[str, int]:
    """The reply's text and its completion token count."""
    body = {"model": "smol", "messages": [{"role": "user", "content": PROMPT}], "temperature": 0,
            "max_tokens": max_tokens, "stream": stream, "stream_options": {"include_usage": True}}
    if not stream:
        del body["stream_options"]
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    if not stream:
        reply = response.json()
        return reply["choices"][0]["message"]["content"], reply["usage"]["completion_tokens"]
    chunks, is_done = sse_json(response.text)
    assert is_done
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return text, chunks[-1]["usage"]["completion_tokens"]


async def native_reply(http: httpx.AsyncClient, max_tokens: int, stream: bool) -> tuple[str, int]:
    body = {"model": "smol", "messages": [{"role": "user", "content": PROMPT}], "stream": stream,
            "options": {"temperature": 0, "num_predict": max_tokens}}
    response = await http.post("/api/chat", json=body)
    assert response.status_code == 200, response.text
    lines = [json.loads(line) for line in response.text.splitlines()] if stream else [response.json()]
    return "".join(line["message"]["content"] for line in lines), lines[-1]["eval_count"]


@pytest.mark.parametrize("dialect", [openai_reply, native_reply], ids=["openai", "native"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_cut_character_is_dropped(client: httpx.AsyncClient, dialect: Reply, stream: bool) -> None:
    replies = [await dialect(client, n, stream) for n in MAX_TOKENS]
    texts = [text for text, _ in replies]
    assert [num_tokens for _, num_tokens in replies] == list(MAX_TOKENS)
    assert all("\ufffd" not in text for text in texts), texts
    assert texts[0] == ""  # the first token is half an emoji: nothing of it shows
    assert any(len(text) > 0 for text in texts)  # later ones complete characters
    assert all(later.startswith(earlier) for earlier, later in pairwise(texts))
