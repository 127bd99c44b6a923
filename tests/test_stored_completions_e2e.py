"""End to end: stored chat completions and the `models` resource from a real `lmserve serve`, through the official
`openai` client, on llama.cpp (the embedded SmolLM2) and on vLLM (the same model as a safetensors repository).

The llama.cpp server has an API key, so every call also proves the routes are behind it. Replies are greedy, so a
stored reply is checked against the one returned.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.test_server import MODEL, Server

KEY = "stored-sekret"
QUESTION: Any = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 10 times 3?"}]
LIMIT = 16


class KeyedServer(Server):
    """A server whose clients send the API key."""

    def client(self, api_key: str = KEY) -> openai.OpenAI:
        return super().client(api_key)


@pytest.fixture(scope="module")
def server() -> Iterator[KeyedServer]:
    srv = KeyedServer("-np", "2", "-c", "512", "--api-key", KEY)
    yield srv
    srv.stop()


@pytest.fixture
def client(server: KeyedServer) -> Iterator[openai.OpenAI]:
    with server.client() as c:
        yield c


def lenient(client: openai.OpenAI) -> openai.OpenAI:
    """The same client without strict validation (the schema types each stored message as the assistant's)."""
    return openai.OpenAI(base_url=str(client.base_url), api_key=client.api_key, max_retries=0)


def ask(client: openai.OpenAI, **fields: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=LIMIT, **fields)


# ---- llama.cpp ----------------------------------------------------------------------------------------------


def test_create_with_store_then_retrieve_update_messages_and_delete(client: openai.OpenAI) -> None:
    reply = ask(client, store=True, metadata={"suite": "crud"})
    kept = client.chat.completions.retrieve(reply.id)
    assert kept.choices == reply.choices and kept.usage == reply.usage and kept.model == reply.model
    assert kept.to_dict()["metadata"] == {"suite": "crud"}
    updated = client.chat.completions.update(reply.id, metadata={"suite": "crud", "seen": "yes"})
    assert updated.to_dict()["metadata"] == {"suite": "crud", "seen": "yes"}
    with lenient(client) as loose:
        messages = loose.chat.completions.messages.list(reply.id)
    assert [(m.id, m.role, m.content) for m in messages.data] == [
        (f"{reply.id}-0", "system", "Answer briefly."), (f"{reply.id}-1", "user", "What is 10 times 3?")]
    deleted = client.chat.completions.delete(reply.id)
    assert deleted.deleted and deleted.object == "chat.completion.deleted" and deleted.id == reply.id
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.retrieve(reply.id)


def test_a_streamed_completion_is_stored_whole(client: openai.OpenAI) -> None:
    whole = ask(client)
    chunks = list(ask(client, store=True, stream=True))
    assert all(chunk.usage is None for chunk in chunks)  # the client asked for no usage
    kept = client.chat.completions.retrieve(chunks[0].id)
    assert kept.choices[0].message.content == whole.choices[0].message.content
    assert kept.choices[0].message.content == "".join(c.choices[0].delta.content or "" for c in chunks)
    assert kept.choices[0].finish_reason == whole.choices[0].finish_reason
    assert kept.usage is not None and whole.usage is not None
    assert kept.usage.completion_tokens == whole.usage.completion_tokens
    assert kept.usage.prompt_tokens == whole.usage.prompt_tokens


def test_nothing_is_stored_without_store(client: openai.OpenAI) -> None:
    reply = ask(client, metadata={"suite": "unstored"})
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.retrieve(reply.id)
    assert client.chat.completions.list(metadata={"suite": "unstored"}).data == []


def test_list_with_filters_pages_and_order(client: openai.OpenAI) -> None:
    ids = [ask(client, store=True, metadata={"suite": "list", "i": str(i)}).id for i in range(3)]
    page = client.chat.completions.list(metadata={"suite": "list"}, limit=2)
    assert [c.id for c in page.data] == ids[:2] and page.has_more
    assert [c.id for c in client.chat.completions.list(metadata={"suite": "list"}, limit=2)] == ids  # every page
    newest = client.chat.completions.list(metadata={"suite": "list"}, order="desc", limit=1)
    assert [c.id for c in newest.data] == [ids[2]]
    assert [c.id for c in client.chat.completions.list(metadata={"suite": "list", "i": "1"}).data] == [ids[1]]
    assert [c.id for c in client.chat.completions.list(model=MODEL, metadata={"suite": "list"}).data] == ids
    assert client.chat.completions.list(model="other", metadata={"suite": "list"}).data == []
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.list(limit=101)


def test_metadata_beyond_the_limits_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, store=True, metadata={f"k{i}": "v" for i in range(17)})
    assert caught.value.status_code == 400


def test_the_routes_are_behind_the_api_key(server: KeyedServer, client: openai.OpenAI) -> None:
    reply = ask(client, store=True)
    assert httpx.get(f"{server.base_url}/v1/chat/completions/{reply.id}").status_code == 401
    assert httpx.get(f"{server.base_url}/v1/chat/completions").status_code == 401
    with server.client(api_key="wrong") as stranger, pytest.raises(openai.AuthenticationError):
        stranger.chat.completions.list()


def test_models_list_retrieve_and_delete(server: KeyedServer, client: openai.OpenAI) -> None:
    assert MODEL in [m.id for m in client.models.list().data]
    assert client.models.retrieve(MODEL).id == MODEL
    copied = httpx.post(f"{server.base_url}/api/copy", json={"source": MODEL, "destination": "smol-copy"},
                        headers={"Authorization": f"Bearer {KEY}"})
    assert copied.status_code == 200
    deleted = client.models.delete("smol-copy:latest")
    assert (deleted.id, deleted.object, deleted.deleted) == ("smol-copy:latest", "model", True)
    assert "smol-copy:latest" not in [m.id for m in client.models.list().data]
    with pytest.raises(openai.NotFoundError):
        client.models.delete("smol-copy:latest")


@contextlib.contextmanager
def serving(models_dir: str) -> Iterator[openai.OpenAI]:
    """A client of a server over the model store `models_dir`, stopped afterwards."""
    srv = Server("-np", "1", "-c", "512", env={"LMSERVE_MODELS": models_dir})
    try:
        with srv.client() as client:
            yield client
    finally:
        srv.stop()


def test_stored_completions_survive_a_restart(tmp_path: Path) -> None:
    with serving(str(tmp_path)) as client:
        reply = ask(client, store=True, metadata={"suite": "restart"})
    with serving(str(tmp_path)) as client:
        assert client.chat.completions.retrieve(reply.id).choices == reply.choices
        assert [c.id for c in client.chat.completions.list(metadata={"suite": "restart"}).data] == [reply.id]
    assert [p.name for p in (tmp_path / "chat-completions").iterdir()] == [f"{reply.id}.json"]


# ---- vLLM ---------------------------------------------------------------------------------------------------


def test_vllm_stored_completion_whole_and_streamed(vllm_client: openai.OpenAI, vllm_model: str) -> None:
    """On the run's shared vLLM server (tests/conftest.py)."""
    fields: Any = {"model": vllm_model, "messages": QUESTION, "temperature": 0, "max_tokens": LIMIT, "store": True,
                   "metadata": {"engine": "vllm"}}
    whole = vllm_client.chat.completions.create(**fields)
    kept = vllm_client.chat.completions.retrieve(whole.id)
    assert kept.choices == whole.choices and kept.model == vllm_model
    chunks = list(vllm_client.chat.completions.create(stream=True, **fields))
    streamed = vllm_client.chat.completions.retrieve(chunks[0].id)
    assert streamed.choices[0].message.content == whole.choices[0].message.content
    listed = vllm_client.chat.completions.list(metadata={"engine": "vllm"}).data
    assert [c.id for c in listed] == [whole.id, streamed.id]
    assert vllm_client.chat.completions.delete(whole.id).deleted
