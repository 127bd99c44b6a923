"""Stored chat completions in-process over the fake engine, through the official `openai` client: `store: true`
keeps a reply (whole or streamed) with its metadata and messages; list (filters, pages, order), retrieve, update,
delete, messages; every error a 4xx in the OpenAI shape; behind the API key. Also `models.delete`'s 404."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
from api_wire import API_KEY, assert_openai_error, sse_json

from lmserve.chat.template import ChatTemplate
from lmserve.config import ServerConfig
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.fake import FakeBackend
from lmserve.http.app import create_app
from lmserve.service import static_service
from lmserve.service.residency import LoadedModel

REPLY_TOKENS = 8
HERMES_TEMPLATE = "{# hermes-style: <tool_call> #}" + (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
WEATHER: Any = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HI: Any = [{"role": "user", "content": "Hi"}]


async def serving(tmp_path: Path, backend: FakeBackend, template: str | None = None,
                  api_key: str | None = None) -> AsyncIterator[httpx.AsyncClient]:
    engine = BatchingEngine(backend)
    model = LoadedModel(name="fake", engine=engine, template=ChatTemplate(template), template_source=template,
                        aliases=("fake-alias",))
    app = create_app(static_service([model]), ServerConfig(models_dir=str(tmp_path), api_key=api_key))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
        yield client
    engine.close()


@pytest_asyncio.fixture
async def http(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    async for client in serving(tmp_path, FakeBackend(eog_after=REPLY_TOKENS)):
        yield client


def client_of(http: httpx.AsyncClient, *, strict: bool = True, api_key: str = "x") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key=api_key, http_client=http, max_retries=0,
                              _strict_response_validation=strict)


async def stored(http: httpx.AsyncClient, count: int, **fields: Any) -> list[str]:
    ids = []
    for _ in range(count):
        reply = await client_of(http).chat.completions.create(model="fake", messages=HI, store=True, **fields)
        ids.append(reply.id)
    return ids


# ---- create -------------------------------------------------------------------------------------------------


async def test_a_stored_completion_is_retrieved_as_it_was_returned(http: httpx.AsyncClient) -> None:
    client = client_of(http)
    reply = await client.chat.completions.create(model="fake-alias", messages=HI, store=True, temperature=0,
                                                 metadata={"user": "u1"})
    again = await client.chat.completions.retrieve(reply.id)
    assert again.id == reply.id and again.id.startswith("chatcmpl-") and len(reply.id) == len("chatcmpl-") + 32
    assert again.choices == reply.choices and again.usage == reply.usage and again.created == reply.created
    assert again.model == "fake"
    extra = again.to_dict()
    assert extra["metadata"] == {"user": "u1"} and extra["temperature"] == 0 and extra["tools"] is None


async def test_without_store_nothing_is_kept(http: httpx.AsyncClient, tmp_path: Path) -> None:
    client = client_of(http)
    for store in (False, None):
        fields: Any = {} if store is None else {"store": store}
        reply = await client.chat.completions.create(model="fake", messages=HI, metadata={"k": "v"}, **fields)
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.retrieve(reply.id)
    assert (await client.chat.completions.list()).data == []
    assert not (tmp_path / "chat-completions").exists()


async def test_a_streamed_completion_is_stored_whole_and_the_client_gets_no_usage_it_did_not_ask_for(
        http: httpx.AsyncClient) -> None:
    body = {"model": "fake", "messages": HI, "stream": True, "store": True}
    response = await http.post("/v1/chat/completions", json=body)
    chunks, is_done = sse_json(response.text)
    assert is_done and all("usage" not in chunk and chunk["choices"] for chunk in chunks)
    text = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks)
    kept = (await http.get(f"/v1/chat/completions/{chunks[0]['id']}")).json()
    whole = (await http.post("/v1/chat/completions", json={**body, "stream": False})).json()
    assert kept["object"] == "chat.completion" and kept["choices"] == whole["choices"]
    assert kept["choices"][0]["message"]["content"] == text
    assert kept["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]  # (the second one is cached)
    assert kept["usage"]["completion_tokens"] == REPLY_TOKENS


async def test_a_streamed_completion_that_asked_for_usage_gets_it(http: httpx.AsyncClient) -> None:
    client = client_of(http)
    stream = await client.chat.completions.create(model="fake", messages=HI, stream=True, store=True,
                                                  stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    kept = await client.chat.completions.retrieve(chunks[0].id)
    assert kept.usage == chunks[-1].usage


async def test_streamed_tool_calls_are_stored_as_a_whole_reply_has_them(tmp_path: Path) -> None:
    async for http in serving(tmp_path, FakeBackend(script=CALL), HERMES_TEMPLATE):
        client = client_of(http)
        fields: Any = {"model": "fake", "messages": HI, "tools": [WEATHER], "store": True}
        stream = await client.chat.completions.create(stream=True, **fields)
        chunks = [chunk async for chunk in stream]
        kept = await client.chat.completions.retrieve(chunks[0].id)
        whole = await client.chat.completions.create(**fields)
        assert kept.choices[0].finish_reason == "tool_calls"
        [call] = kept.choices[0].message.tool_calls or []
        [expected] = whole.choices[0].message.tool_calls or []
        assert (call.id, call.function) == (chunks[1].choices[0].delta.tool_calls[0].id, expected.function)
        assert kept.choices[0].message.content == whole.choices[0].message.content
        assert kept.to_dict()["tools"] == [WEATHER]


async def test_several_choices_are_stored_each_at_its_index(http: httpx.AsyncClient) -> None:
    client = client_of(http)
    whole = await client.chat.completions.create(model="fake", messages=HI, store=True, n=2)
    assert (await client.chat.completions.retrieve(whole.id)).choices == whole.choices
    chunks = [chunk async for chunk in await client.chat.completions.create(model="fake", messages=HI, store=True,
                                                                             n=2, stream=True)]
    kept = await client.chat.completions.retrieve(chunks[0].id)
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i) for i in (0, 1)]
    assert [(c.index, c.message.content, c.finish_reason) for c in kept.choices] == [
        (0, texts[0], "stop"), (1, texts[1], "stop")]
    assert kept.usage is not None and kept.usage.completion_tokens == 2 * REPLY_TOKENS


@pytest.mark.parametrize(("metadata", "where"), [
    ({f"k{i}": "v" for i in range(17)}, "metadata"),
    ({"k" * 65: "v"}, "metadata"),
    ({"k": "v" * 513}, "metadata"),
    ({"k": 1}, "metadata"),
])
async def test_metadata_beyond_the_limits_is_a_400(http: httpx.AsyncClient, metadata: Any, where: str) -> None:
    response = await http.post("/v1/chat/completions",
                               json={"model": "fake", "messages": HI, "store": True, "metadata": metadata})
    assert response.status_code == 400
    assert assert_openai_error(response.json())["param"].startswith(where)
    [completion_id] = await stored(http, 1)
    response = await http.post(f"/v1/chat/completions/{completion_id}", json={"metadata": metadata})
    assert response.status_code == 400
    assert assert_openai_error(response.json())["param"].startswith(where)


async def test_sixteen_pairs_at_the_limits_are_kept(http: httpx.AsyncClient) -> None:
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    [completion_id] = await stored(http, 1, metadata=metadata)
    assert (await client_of(http).chat.completions.retrieve(completion_id)).to_dict()["metadata"] == metadata


# ---- list ---------------------------------------------------------------------------------------------------


async def test_list_pages_oldest_first_and_newest_first_when_asked(http: httpx.AsyncClient) -> None:
    client = client_of(http)
    ids = await stored(http, 5)
    first = await client.chat.completions.list(limit=2)
    assert [c.id for c in first.data] == ids[:2] and first.has_more
    assert [c.id async for c in client.chat.completions.list(limit=2)] == ids  # the client follows the pages
    newest = await client.chat.completions.list(order="desc", limit=3)
    assert [c.id for c in newest.data] == ids[::-1][:3]
    rest = await client.chat.completions.list(order="desc", after=ids[2])
    assert [c.id for c in rest.data] == [ids[1], ids[0]] and not rest.has_more
    body = (await http.get("/v1/chat/completions", params={"limit": 1})).json()
    assert body == {"object": "list", "data": body["data"], "first_id": ids[0], "last_id": ids[0], "has_more": True}
    assert (await http.get("/v1/chat/completions", params={"after": ids[4]})).json()["first_id"] is None


async def test_list_filters_by_model_and_metadata(http: httpx.AsyncClient) -> None:
    client = client_of(http)
    a = await stored(http, 1, metadata={"user": "u1", "topic": "t"})
    b = await stored(http, 1, metadata={"user": "u2"})
    assert [c.id for c in (await client.chat.completions.list(metadata={"user": "u1"})).data] == a
    assert [c.id for c in (await client.chat.completions.list(metadata={"user": "u2"})).data] == b
    assert (await client.chat.completions.list(metadata={"user": "u1", "topic": "x"})).data == []
    assert [c.id for c in (await client.chat.completions.list(model="fake")).data] == a + b
    assert [c.id for c in (await client.chat.completions.list(model="fake-alias")).data] == []  # asked as "fake"
    assert (await client.chat.completions.list(model="other")).data == []


@pytest.mark.parametrize(("query", "param"), [
    ({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"limit": "x"}, "limit"), ({"order": "up"}, "order"),
    ({"after": "nope"}, "after"), ({"metadata": "k"}, "metadata"), ({"metadata[]": "v"}, "metadata"),
])
async def test_bad_list_parameters_are_a_400(http: httpx.AsyncClient, query: dict[str, Any], param: str) -> None:
    response = await http.get("/v1/chat/completions", params=query)
    assert response.status_code == 400, response.text
    assert param in str(assert_openai_error(response.json())["param"])


# ---- update, delete, messages -------------------------------------------------------------------------------


async def test_update_replaces_the_metadata(http: httpx.AsyncClient) -> None:
    client = client_of(http)
    [completion_id] = await stored(http, 1, metadata={"a": "1"})
    updated = await client.chat.completions.update(completion_id, metadata={"b": "2"})
    assert updated.to_dict()["metadata"] == {"b": "2"}
    assert (await client.chat.completions.retrieve(completion_id)).to_dict()["metadata"] == {"b": "2"}
    assert [c.id for c in (await client.chat.completions.list(metadata={"b": "2"})).data] == [completion_id]
    cleared = await client.chat.completions.update(completion_id, metadata=None)
    assert cleared.to_dict()["metadata"] == {}
    response = await http.post(f"/v1/chat/completions/{completion_id}", json={})
    assert response.status_code == 400 and assert_openai_error(response.json())["param"] == "metadata"


async def test_delete_answers_deleted_then_404(http: httpx.AsyncClient) -> None:
    client = client_of(http)
    [completion_id] = await stored(http, 1)
    deleted = await client.chat.completions.delete(completion_id)
    assert (deleted.id, deleted.object, deleted.deleted) == (completion_id, "chat.completion.deleted", True)
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.delete(completion_id)


async def test_messages_lists_the_request_messages_with_ids(http: httpx.AsyncClient) -> None:
    client = client_of(http, strict=False)  # the schema types every stored message as the assistant's
    messages: Any = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "One"}, {"type": "text", "text": "Two"}]},
        {"role": "assistant", "content": "Ok."},
        {"role": "user", "content": "Three", "name": "bob"},
    ]
    reply = await client.chat.completions.create(model="fake", messages=messages, store=True)
    page = await client.chat.completions.messages.list(reply.id)
    assert [m.id for m in page.data] == [f"{reply.id}-{i}" for i in range(4)]
    assert [(m.role, m.content) for m in page.data] == [("system", "Be brief."), ("user", "One\nTwo"),
                                                        ("assistant", "Ok."), ("user", "Three")]
    assert page.data[0].content_parts is None
    parts = page.data[1].content_parts or []
    assert [p.model_dump(exclude_none=True) for p in parts] == [{"type": "text", "text": "One"},
                                                                 {"type": "text", "text": "Two"}]
    assert page.data[3].to_dict()["name"] == "bob"
    newest = await client.chat.completions.messages.list(reply.id, order="desc", limit=2)
    assert [m.id for m in newest.data] == [f"{reply.id}-3", f"{reply.id}-2"] and newest.has_more
    after = await client.chat.completions.messages.list(reply.id, after=f"{reply.id}-2")
    assert [m.id for m in after.data] == [f"{reply.id}-3"] and not after.has_more
    assert [m.id async for m in client.chat.completions.messages.list(reply.id, limit=1)] == [
        f"{reply.id}-{i}" for i in range(4)]
    for query, param in (({"after": "x"}, "after"), ({"limit": 0}, "limit"), ({"order": "x"}, "order")):
        response = await http.get(f"/v1/chat/completions/{reply.id}/messages", params=query)
        assert response.status_code == 400 and assert_openai_error(response.json())["param"] == param


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/v1/chat/completions/{id}"), ("POST", "/v1/chat/completions/{id}"),
    ("DELETE", "/v1/chat/completions/{id}"), ("GET", "/v1/chat/completions/{id}/messages"),
])
@pytest.mark.parametrize("completion_id", ["chatcmpl-0123456789abcdef0123456789abcdef", "chatcmpl-x", "..json"])
async def test_an_unknown_id_is_a_404(http: httpx.AsyncClient, method: str, path: str, completion_id: str) -> None:
    body = {"metadata": {}} if method == "POST" else None
    response = await http.request(method, path.format(id=completion_id), json=body)
    assert response.status_code == 404
    assert assert_openai_error(response.json(), error_type="invalid_request_error")["code"] == "not_found"


async def test_a_stored_completion_survives_a_restart(tmp_path: Path) -> None:
    async for http in serving(tmp_path, FakeBackend(eog_after=REPLY_TOKENS)):
        [completion_id] = await stored(http, 1, metadata={"k": "v"})
    async for http in serving(tmp_path, FakeBackend(eog_after=REPLY_TOKENS)):
        assert (await client_of(http).chat.completions.retrieve(completion_id)).id == completion_id
    [path] = (tmp_path / "chat-completions").iterdir()
    assert json.loads(path.read_text())["completion"]["metadata"] == {"k": "v"}


async def test_the_stored_completions_are_behind_the_api_key(tmp_path: Path) -> None:
    async for http in serving(tmp_path, FakeBackend(eog_after=REPLY_TOKENS), api_key=API_KEY):
        client = client_of(http, api_key=API_KEY)
        reply = await client.chat.completions.create(model="fake", messages=HI, store=True)
        for method, path in (("GET", "/v1/chat/completions"), ("GET", f"/v1/chat/completions/{reply.id}"),
                             ("DELETE", f"/v1/chat/completions/{reply.id}"),
                             ("GET", f"/v1/chat/completions/{reply.id}/messages")):
            response = await http.request(method, path)
            assert response.status_code == 401, path
        assert [c.id for c in (await client.chat.completions.list()).data] == [reply.id]
        with pytest.raises(openai.AuthenticationError):
            await client_of(http, api_key="wrong").chat.completions.retrieve(reply.id)


# ---- models -------------------------------------------------------------------------------------------------


async def test_deleting_an_unknown_model_is_a_404(http: httpx.AsyncClient) -> None:
    with pytest.raises(openai.NotFoundError):
        await client_of(http).models.delete("no-such-model")
    response = await http.delete("/v1/models/no-such-model")
    assert response.status_code == 404 and assert_openai_error(response.json())


async def test_a_fixed_model_cannot_be_deleted(http: httpx.AsyncClient) -> None:
    response = await http.delete("/v1/models/fake")
    assert response.status_code == 400 and assert_openai_error(response.json())
    assert (await client_of(http).models.retrieve("fake")).id == "fake"
