"""Tool calls through both dialects, over a fake engine that answers a scripted reply."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio

from lmserve.chat.template import ChatTemplate
from lmserve.config import ServerConfig
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.fake import FakeBackend
from lmserve.http.app import create_app
from lmserve.service import static_service
from lmserve.service.residency import LoadedModel

HERMES_TEMPLATE = "{# hermes-style: <tool_call> #}" + (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>'
TOOLS: list[dict[str, Any]] = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]},
    },
}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest_asyncio.fixture
async def http(request: pytest.FixtureRequest) -> AsyncIterator[httpx.AsyncClient]:
    script: str = request.param
    engine = BatchingEngine(FakeBackend(script=script))
    model = LoadedModel(name="fake", engine=engine, template=ChatTemplate(HERMES_TEMPLATE),
                        template_source=HERMES_TEMPLATE)
    app = create_app(static_service([model]), ServerConfig())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
        yield client
    engine.close()


def openai_client(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0,
                              _strict_response_validation=True)


@pytest.mark.parametrize("http", ["Let me check. " + CALL], indirect=True)
async def test_openai_reply_carries_the_call_and_the_text_outside_it(http: httpx.AsyncClient) -> None:
    reply = await openai_client(http).chat.completions.create(model="fake", messages=ASK, tools=TOOLS)  # type: ignore[arg-type]
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}  # type: ignore[union-attr]


@pytest.mark.parametrize("http", [CALL + CALL.replace("Paris", "Lyon")], indirect=True)
async def test_the_stream_helper_reassembles_the_same_calls(http: httpx.AsyncClient) -> None:
    client = openai_client(http)
    whole = await client.chat.completions.create(model="fake", messages=ASK, tools=TOOLS)  # type: ignore[arg-type]
    async with client.chat.completions.stream(model="fake", messages=ASK, tools=TOOLS) as stream:  # type: ignore[arg-type]
        streamed = await stream.get_final_completion()
    expected = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls or []]  # type: ignore[union-attr]
    got = [(c.function.name, c.function.arguments) for c in streamed.choices[0].message.tool_calls or []]  # type: ignore[union-attr]
    assert got == expected and len(got) == 2
    assert streamed.choices[0].finish_reason == "tool_calls"
    assert not streamed.choices[0].message.content


@pytest.mark.parametrize("http", [CALL], indirect=True)
async def test_stream_deltas_follow_the_contract(http: httpx.AsyncClient) -> None:
    body = {"model": "fake", "messages": ASK, "tools": TOOLS, "stream": True}
    text = (await http.post("/v1/chat/completions", json=body)).text
    events = [json.loads(e[6:]) for e in text.strip().split("\n\n") if e != "data: [DONE]"]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["index"] == 0 and calls[0]["type"] == "function" and calls[0]["function"]["arguments"] == ""
    assert calls[0]["id"].startswith("call_") and calls[0]["function"]["name"] == "get_weather"
    assert all("index" in c for c in calls)
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Paris", "days": 2}
    assert not any(d.get("content") for d in deltas)
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("http", [CALL], indirect=True)
async def test_tool_choice_none_means_plain_text(http: httpx.AsyncClient) -> None:
    body = {"model": "fake", "messages": ASK, "tools": TOOLS, "tool_choice": "none"}
    message = (await http.post("/v1/chat/completions", json=body)).json()["choices"][0]
    assert message["finish_reason"] == "stop" and "tool_calls" not in message["message"]


@pytest.mark.parametrize("http", ['<tool_call>{"name": oops</tool_call> done'], indirect=True)
async def test_a_malformed_call_is_plain_content(http: httpx.AsyncClient) -> None:
    body = {"model": "fake", "messages": ASK, "tools": TOOLS}
    choice = (await http.post("/v1/chat/completions", json=body)).json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == '<tool_call>{"name": oops</tool_call> done'


@pytest.mark.parametrize("http", [CALL], indirect=True)
async def test_native_chat_gives_arguments_as_an_object(http: httpx.AsyncClient) -> None:
    body = {"model": "fake", "messages": ASK, "tools": TOOLS, "stream": False}
    message = (await http.post("/api/chat", json=body)).json()["message"]
    assert message["tool_calls"] == [{"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]
    lines = [json.loads(x) for x in (await http.post("/api/chat", json={**body, "stream": True})).text.splitlines()]
    calls = [x["message"]["tool_calls"] for x in lines if x["message"].get("tool_calls")]
    assert calls == [message["tool_calls"]]
    assert lines[-1]["done"] is True


@pytest.mark.parametrize("http", [CALL + CALL.replace("Paris", "Lyon")], indirect=True)
async def test_parallel_tool_calls_false_keeps_the_first_call(http: httpx.AsyncClient) -> None:
    body = {"model": "fake", "messages": ASK, "tools": TOOLS, "parallel_tool_calls": False}
    calls = (await http.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris"]
    streamed = (await http.post("/v1/chat/completions", json={**body, "stream": True})).text
    assert streamed.count('"name":"get_weather"') == 1
