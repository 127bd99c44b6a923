"""The Conversations API (/v1/conversations) in-process over the fake engine, read by the official `openai` client in
strict mode: a conversation and its items created, listed, read, changed and deleted; `POST /v1/responses` with
`conversation` reading its items before the input and adding the input and output after it; the errors."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from api_wire import assert_openai_error
from fastapi import FastAPI

from lmserve.chat.template import ChatTemplate
from lmserve.config import ServerConfig
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.fake import FakeBackend
from lmserve.http.app import create_app
from lmserve.service import static_service
from lmserve.service.residency import LoadedModel

REPLY_TOKENS = 12


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text}


def serve(tmp_path: Path) -> tuple[FastAPI, BatchingEngine]:
    engine = BatchingEngine(FakeBackend(eog_after=REPLY_TOKENS))
    model = LoadedModel(name="fake", engine=engine, template=ChatTemplate(None))
    return create_app(static_service([model]), ServerConfig(models_dir=str(tmp_path))), engine


@pytest.fixture
async def http(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    app, engine = serve(tmp_path)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
        yield client
    engine.close()


@pytest.fixture
def client(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0,
                              _strict_response_validation=True)


async def chat_prompt_tokens(http: httpx.AsyncClient, messages: list[dict[str, Any]]) -> int:
    """The prompt size of the same conversation as a chat completion (the fake's tokens are the prompt's bytes)."""
    reply = await http.post("/v1/chat/completions", json={"model": "fake", "messages": messages, "max_tokens": 1})
    assert reply.status_code == 200, reply.text
    return int(reply.json()["usage"]["prompt_tokens"])


# ---- conversations ------------------------------------------------------------------------------------------


async def test_create_retrieve_update_delete(client: openai.AsyncOpenAI) -> None:
    made = await client.conversations.create(items=[user("Hello")], metadata={"topic": "demo"})
    assert made.id.startswith("conv_") and made.object == "conversation" and made.metadata == {"topic": "demo"}
    assert (await client.conversations.retrieve(made.id)).model_dump() == made.model_dump()
    updated = await client.conversations.update(made.id, metadata={"topic": "other"})
    assert updated.metadata == {"topic": "other"} and updated.created_at == made.created_at
    deleted = await client.conversations.delete(made.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (made.id, "conversation.deleted", True)
    with pytest.raises(openai.NotFoundError):
        await client.conversations.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        await client.conversations.delete(made.id)


async def test_create_with_nothing(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> None:
    made = await client.conversations.create()
    assert made.metadata == {}
    assert (await client.conversations.items.list(made.id)).data == []
    bare = await http.post("/v1/conversations")  # no body at all
    assert bare.status_code == 200 and bare.json()["object"] == "conversation"


async def test_items_list_add_retrieve_delete(client: openai.AsyncOpenAI) -> None:
    made = await client.conversations.create(items=[user("one"), {"role": "assistant", "content": "two"}])
    listed = await client.conversations.items.list(made.id)
    assert [item.content[0].text for item in listed.data] == ["two", "one"]  # type: ignore[union-attr]  # newest first
    assert [item.content[0].type for item in listed.data] == ["output_text", "input_text"]  # type: ignore[union-attr]
    added = await client.conversations.items.create(made.id, items=[user("three")])
    [new] = added.data
    assert new.id.startswith("msg_") and added.first_id == added.last_id == new.id  # type: ignore[union-attr]
    page = await client.conversations.items.list(made.id, order="asc", limit=2)
    assert [item.content[0].text for item in page.data] == ["one", "two"] and page.has_more  # type: ignore[union-attr]
    rest = await client.conversations.items.list(made.id, order="asc", after=page.data[-1].id)  # type: ignore[union-attr]
    assert [item.id for item in rest.data] == [new.id]  # type: ignore[union-attr]
    got = await client.conversations.items.retrieve(new.id, conversation_id=made.id)  # type: ignore[union-attr]
    assert got.model_dump() == new.model_dump()
    after = await client.conversations.items.delete(new.id, conversation_id=made.id)  # type: ignore[union-attr]
    assert after.id == made.id and after.object == "conversation"
    with pytest.raises(openai.NotFoundError):
        await client.conversations.items.retrieve(new.id, conversation_id=made.id)  # type: ignore[union-attr]
    assert len((await client.conversations.items.list(made.id)).data) == 2


# ---- responses in a conversation ----------------------------------------------------------------------------


async def test_a_response_reads_and_extends_its_conversation(client: openai.AsyncOpenAI,
                                                             http: httpx.AsyncClient) -> None:
    made = await client.conversations.create(items=[user("Hello")])
    first = await client.responses.create(model="fake", input="And again?", conversation=made.id)
    assert first.conversation is not None and first.conversation.id == made.id
    chat = [{"role": "user", "content": "Hello"}, {"role": "user", "content": "And again?"}]
    assert first.usage is not None and first.usage.input_tokens == await chat_prompt_tokens(http, chat)
    items = (await client.conversations.items.list(made.id, order="asc")).data
    assert [item.type for item in items] == ["message"] * 3
    assert items[-1].id == first.output[0].id  # type: ignore[union-attr]  # the output, as the response gave it
    second = await client.responses.create(model="fake", input="Once more.", conversation={"id": made.id},
                                           stream=False, store=False)
    chat += [{"role": "assistant", "content": first.output_text}, {"role": "user", "content": "Once more."}]
    assert second.usage is not None and second.usage.input_tokens == await chat_prompt_tokens(http, chat)
    assert len((await client.conversations.items.list(made.id)).data) == 5  # store: false still adds to it
    [own] = (await client.responses.input_items.list(first.id)).data
    assert own.content[0].text == "And again?"  # type: ignore[union-attr]  # a response's own input only


async def test_a_streamed_response_extends_its_conversation(client: openai.AsyncOpenAI) -> None:
    made = await client.conversations.create()
    async with client.responses.stream(model="fake", input="Hi", conversation=made.id) as stream:
        final = await stream.get_final_response()
    assert final.conversation is not None and final.conversation.id == made.id
    listed = (await client.conversations.items.list(made.id, order="asc")).data
    assert [item.id for item in listed][-1] == final.output[0].id  # type: ignore[union-attr]
    assert len(listed) == 2


async def test_conversations_survive_a_restart(tmp_path: Path) -> None:
    app, engine = serve(tmp_path)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as http:
        made = (await http.post("/v1/conversations", json={"items": [user("Remember me.")]})).json()
    engine.close()
    app, engine = serve(tmp_path)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as http:
        items = (await http.get(f"/v1/conversations/{made['id']}/items")).json()["data"]
        assert items[0]["content"] == [{"type": "input_text", "text": "Remember me."}]
    engine.close()
    assert (tmp_path / "conversations" / f"{made['id']}.json").is_file()


# ---- errors -------------------------------------------------------------------------------------------------


async def test_unknown_ids_are_404s_in_the_openai_shape(http: httpx.AsyncClient) -> None:
    made = (await http.post("/v1/conversations", json={})).json()["id"]
    for method, path in [("GET", "/v1/conversations/conv_nope"), ("DELETE", "/v1/conversations/conv_nope"),
                         ("POST", "/v1/conversations/conv_nope"), ("GET", "/v1/conversations/conv_nope/items"),
                         ("GET", f"/v1/conversations/{made}/items/msg_nope"),
                         ("DELETE", f"/v1/conversations/{made}/items/msg_nope")]:
        reply = await http.request(method, path, json={"metadata": {}} if method == "POST" else None)
        assert reply.status_code == 404, (method, path)
        assert "_nope" in assert_openai_error(reply.json())["message"]
    reply = await http.post("/v1/responses", json={"model": "fake", "input": "x", "conversation": "conv_nope"})
    assert reply.status_code == 404
    assert assert_openai_error(reply.json())["param"] == "conversation"


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/conversations", {"items": [user(str(i)) for i in range(21)]}, "items"),
    ("/v1/conversations", {"items": [{"type": "web_search_call", "id": "ws_1"}]}, "items"),
    ("/v1/conversations", {"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ("/v1/conversations", {"metadata": {"k": "v" * 513}}, "metadata"),
    ("/v1/conversations/{id}", {}, "metadata"),
    ("/v1/conversations/{id}/items", {"items": []}, "items"),
    ("/v1/conversations/{id}/items", {}, "items"),
])
async def test_bad_bodies_are_400s_naming_the_field(http: httpx.AsyncClient, path: str, body: dict[str, Any],
                                                    param: str) -> None:
    made = (await http.post("/v1/conversations", json={})).json()["id"]
    reply = await http.post(path.format(id=made), json=body)
    assert reply.status_code == 400, reply.text
    assert assert_openai_error(reply.json(), error_type="invalid_request_error")["param"] == param


async def test_bad_list_queries_are_400s(http: httpx.AsyncClient) -> None:
    made = (await http.post("/v1/conversations", json={"items": [user("x")]})).json()["id"]
    for query in ["limit=0", "limit=101", "order=sideways", "after=msg_unknown", "limit=ten"]:
        reply = await http.get(f"/v1/conversations/{made}/items?{query}")
        assert reply.status_code == 400, query
        assert_openai_error(reply.json())
