"""The Responses API (/v1/responses) in-process over the fake engine, read by the official `openai` client in strict
mode: create, stream, retrieve, delete, input items, chained calls, function calls, formats, the store, errors."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
from api_wire import assert_openai_error
from fastapi import FastAPI
from openai.types.responses import Response as OpenAIResponse
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from lmserve.chat.template import ChatTemplate
from lmserve.config import ServerConfig
from lmserve.dialects.responses.routes import Framer, OutputBuilder, stream_events
from lmserve.dialects.responses.schemas import ResponseRequest
from lmserve.dialects.responses.translate import parse_items, to_messages, to_sampling
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.fake import FakeBackend
from lmserve.http.app import create_app
from lmserve.service import static_service
from lmserve.service.residency import LoadedModel
from lmserve.types import Chunk, TokenLogprob, ToolCall

REPLY_TOKENS = 12
"""The fake model ends every reply after this many tokens."""
HERMES_TEMPLATE = "{# hermes-style: <tool_call> #}" + (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
WEATHER: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TIME: dict[str, Any] = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}
EVENTS: TypeAdapter[ResponseStreamEvent] = TypeAdapter(ResponseStreamEvent)


def serve(tmp_path: Path, backend: FakeBackend, template: str | None = None) -> tuple[FastAPI, BatchingEngine]:
    engine = BatchingEngine(backend)
    model = LoadedModel(name="fake", engine=engine, template=ChatTemplate(template), template_source=template)
    return create_app(static_service([model]), ServerConfig(models_dir=str(tmp_path))), engine


@pytest_asyncio.fixture
async def http(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    app, engine = serve(tmp_path, FakeBackend(eog_after=REPLY_TOKENS))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
        yield client
    engine.close()


@pytest_asyncio.fixture
async def tools_http(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    app, engine = serve(tmp_path, FakeBackend(script=CALL), HERMES_TEMPLATE)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
        yield client
    engine.close()


def client_of(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0,
                              _strict_response_validation=True)


def events_of(text: str) -> list[dict[str, Any]]:
    """A Responses SSE body as its events, each checked: `event:` names the data's type, one data line."""
    assert text.endswith("\n\n")
    events = []
    for block in text[:-2].split("\n\n"):
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        EVENTS.validate_python(event)
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


async def chat_prompt_tokens(http: httpx.AsyncClient, messages: list[dict[str, Any]], **fields: Any) -> int:
    """How many tokens the same conversation takes as a chat completion (the fake's tokens are the prompt's bytes)."""
    body = {"model": "fake", "messages": messages, "max_tokens": 1, **fields}
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["prompt_tokens"])


# ---- create -------------------------------------------------------------------------------------------------


async def test_a_string_input_gets_a_completed_response(http: httpx.AsyncClient) -> None:
    response = await client_of(http).responses.create(model="fake", input="Say something.")
    assert response.id.startswith("resp_") and response.object == "response" and response.model == "fake"
    assert response.status == "completed" and response.incomplete_details is None and response.error is None
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.id.startswith("msg_")
    [part] = message.content
    assert part.type == "output_text" and part.annotations == []
    usage = response.usage
    assert usage is not None and usage.output_tokens == REPLY_TOKENS
    assert usage.total_tokens == usage.input_tokens + REPLY_TOKENS
    assert usage.input_tokens_details.cached_tokens == 0 and usage.output_tokens_details.reasoning_tokens == 0
    assert response.output_text == FakeBackend.expected(usage.input_tokens, REPLY_TOKENS)
    assert usage.input_tokens == await chat_prompt_tokens(http, [{"role": "user", "content": "Say something."}])


async def test_max_output_tokens_makes_it_incomplete(http: httpx.AsyncClient) -> None:
    response = await client_of(http).responses.create(model="fake", input="Hi", max_output_tokens=5)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 5
    assert response.output[0].status == "incomplete"  # type: ignore[union-attr]
    assert response.max_output_tokens == 5


async def test_instructions_and_items_become_the_chat(http: httpx.AsyncClient) -> None:
    items: Any = [
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"role": "assistant", "content": "c"},
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "d"}]},
        {"type": "message", "role": "user", "content": "e"},
    ]
    response = await client_of(http).responses.create(model="fake", input=items, instructions="Be brief.")
    assert response.instructions == "Be brief."
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a\nb"},
            {"role": "assistant", "content": "c"}, {"role": "system", "content": "d"}, {"role": "user", "content": "e"}]
    assert response.usage is not None and response.usage.input_tokens == await chat_prompt_tokens(http, chat)


async def test_sampling_fields_are_echoed_and_used(http: httpx.AsyncClient) -> None:
    client = client_of(http)
    one = await client.responses.create(model="fake", input="Hi", temperature=0.5, top_p=0.9,
                                        extra_body={"seed": 7})
    assert (one.temperature, one.top_p) == (0.5, 0.9)
    assert one.usage is not None
    assert one.output_text == FakeBackend.expected(one.usage.input_tokens, REPLY_TOKENS, seed=7)


# ---- streaming ----------------------------------------------------------------------------------------------


async def test_a_stream_has_the_typed_event_sequence(http: httpx.AsyncClient) -> None:
    body = {"model": "fake", "input": "Say something.", "stream": True}
    reply = await http.post("/v1/responses", json=body)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
    events = events_of(reply.text)
    kinds = [e["type"] for e in events]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    final = OpenAIResponse.model_validate(events[-1]["response"])
    assert final.id == events[0]["response"]["id"] and final.status == "completed"
    text = "".join(e["delta"] for e in deltas)
    assert text == final.output_text == events[-4]["text"]
    assert final.usage is not None and text == FakeBackend.expected(final.usage.input_tokens, REPLY_TOKENS)
    item_id = events[2]["item"]["id"]
    assert all(e["item_id"] == item_id and e["output_index"] == 0 for e in events[3:-2])


async def test_the_stream_helper_gives_what_create_gives(http: httpx.AsyncClient) -> None:
    client = client_of(http)
    whole = await client.responses.create(model="fake", input="Hi")
    async with client.responses.stream(model="fake", input="Hi") as stream:
        seen = [event.type async for event in stream]
        streamed = await stream.get_final_response()
    assert streamed.output_text == whole.output_text and streamed.status == "completed"
    assert seen[0] == "response.created" and seen[-1] == "response.completed"
    assert (await client.responses.retrieve(streamed.id)).output_text == whole.output_text  # stored when done


async def test_a_cut_stream_ends_incomplete(http: httpx.AsyncClient) -> None:
    body = {"model": "fake", "input": "Hi", "stream": True, "max_output_tokens": 3}
    events = events_of((await http.post("/v1/responses", json=body)).text)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-2]["item"]["status"] == "incomplete"


# ---- the store ----------------------------------------------------------------------------------------------


async def test_retrieve_input_items_and_delete(http: httpx.AsyncClient) -> None:
    client = client_of(http)
    items: Any = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
                  {"role": "user", "content": "three"}]
    created = await client.responses.create(model="fake", input=items, metadata={"k": "v"})
    got = await client.responses.retrieve(created.id)
    assert got.model_dump() == created.model_dump() and got.metadata == {"k": "v"}
    listed = await client.responses.input_items.list(created.id)
    texts = [item.content[0].text for item in listed.data]  # type: ignore[union-attr]
    assert texts == ["three", "two", "one"]  # newest first by default
    assert [item.type for item in listed.data] == ["message"] * 3
    assert all(item.id.startswith("msg_") for item in listed.data)  # type: ignore[union-attr]
    ascending = await client.responses.input_items.list(created.id, order="asc", limit=2)
    assert [i.content[0].text for i in ascending.data] == ["one", "two"] and ascending.has_more  # type: ignore[union-attr]
    rest = await client.responses.input_items.list(created.id, order="asc", after=ascending.data[-1].id)  # type: ignore[union-attr]
    assert [i.content[0].text for i in rest.data] == ["three"] and not rest.has_more  # type: ignore[union-attr]
    await client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.delete(created.id)


async def test_unknown_ids_are_404_in_the_openai_shape(http: httpx.AsyncClient) -> None:
    for method, path in [("GET", "/v1/responses/resp_nope"), ("DELETE", "/v1/responses/resp_nope"),
                         ("GET", "/v1/responses/resp_nope/input_items")]:
        reply = await http.request(method, path)
        assert reply.status_code == 404
        assert "resp_nope" in assert_openai_error(reply.json())["message"]
    reply = await http.post("/v1/responses", json={"model": "fake", "input": "x", "previous_response_id": "resp_x"})
    assert reply.status_code == 404 and assert_openai_error(reply.json())["param"] == "previous_response_id"


async def test_store_false_is_not_kept(http: httpx.AsyncClient) -> None:
    client = client_of(http)
    response = await client.responses.create(model="fake", input="Hi", store=False)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(response.id)


async def test_previous_response_id_continues_the_conversation(http: httpx.AsyncClient) -> None:
    client = client_of(http)
    first = await client.responses.create(model="fake", input="Hello", instructions="Be brief.")
    second = await client.responses.create(model="fake", input="And again?", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    chat = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And again?"}]  # the first one's instructions are not carried over
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens == await chat_prompt_tokens(http, chat) > first.usage.input_tokens
    third = await client.responses.create(model="fake", input="Once more.", previous_response_id=second.id)
    chat += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "Once more."}]
    assert third.usage is not None and third.usage.input_tokens == await chat_prompt_tokens(http, chat)
    await client.responses.delete(first.id)  # a chain does not need its first record any more
    assert (await client.responses.create(model="fake", input="x", previous_response_id=third.id)).status


async def test_a_restarted_server_keeps_stored_responses(tmp_path: Path) -> None:
    app, engine = serve(tmp_path, FakeBackend(eog_after=REPLY_TOKENS))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as http:
        first = await client_of(http).responses.create(model="fake", input="Remember me.")
    engine.close()
    app, engine = serve(tmp_path, FakeBackend(eog_after=REPLY_TOKENS))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as http:
        client = client_of(http)
        assert (await client.responses.retrieve(first.id)).output_text == first.output_text
        second = await client.responses.create(model="fake", input="Who?", previous_response_id=first.id)
        chat = [{"role": "user", "content": "Remember me."}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "Who?"}]
        assert second.usage is not None and second.usage.input_tokens == await chat_prompt_tokens(http, chat)
    engine.close()
    assert (tmp_path / "responses" / f"{first.id}.json").is_file()


# ---- function calls -----------------------------------------------------------------------------------------


async def test_a_function_call_round_trip(tools_http: httpx.AsyncClient) -> None:
    client = client_of(tools_http)
    named: Any = {"type": "function", "name": "get_weather"}
    asked = await client.responses.create(model="fake", input="Weather in Paris?", tools=[WEATHER, TIME],
                                          tool_choice=named)
    assert asked.tool_choice.name == "get_weather"  # type: ignore[union-attr]
    [call] = asked.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id and call.id.startswith("fc_")
    assert json.loads(call.arguments) == {"city": "Paris"}
    answer: Any = [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    followed = await client.responses.create(model="fake", input=answer, tools=[WEATHER, TIME],
                                             previous_response_id=asked.id)
    chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                  for t in (WEATHER, TIME)]
    function = {"name": call.name, "arguments": call.arguments}
    chat = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": call.call_id, "type": "function", "function": function}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]
    assert followed.usage is not None
    assert followed.usage.input_tokens == await chat_prompt_tokens(tools_http, chat, tools=chat_tools)
    [listed] = (await client.responses.input_items.list(followed.id)).data
    assert listed.type == "function_call_output" and listed.call_id == call.call_id  # type: ignore[union-attr]


async def test_a_streamed_function_call(tools_http: httpx.AsyncClient) -> None:
    body = {"model": "fake", "input": "Weather?", "tools": [WEATHER], "tool_choice": "required", "stream": True}
    events = events_of((await tools_http.post("/v1/responses", json=body)).text)
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert events[2]["item"]["arguments"] == "" and events[2]["item"]["name"] == "get_weather"
    assert json.loads(events[4]["arguments"]) == {"city": "Paris"} == json.loads(events[3]["delta"])
    assert events[-1]["response"]["output"] == [events[5]["item"]]
    async with client_of(tools_http).responses.stream(model="fake", input="Weather?", tools=[WEATHER],  # type: ignore[list-item]
                                                      tool_choice="required") as stream:
        final = await stream.get_final_response()
    assert [item.type for item in final.output] == ["function_call"]


# ---- formats, reasoning, errors -----------------------------------------------------------------------------


async def test_a_json_schema_format_is_taken_and_echoed(http: httpx.AsyncClient) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
              "additionalProperties": False}
    text: Any = {"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}}
    response = await client_of(http).responses.create(model="fake", input="Who?", text=text)
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema" and response.text.format.schema_ == schema  # type: ignore[union-attr]
    bad = {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "patternProperties": {}}}}
    reply = await http.post("/v1/responses", json={"model": "fake", "input": "x", "text": bad})
    assert reply.status_code == 400 and assert_openai_error(reply.json())["param"] == "text.format"


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input", "not supported"),
    ({"input": "x", "tools": [{"type": "function", "parameters": {}}]}, "tools", "tools[0].name"),
    ({"input": "x", "tools": [{"name": "f"}]}, "tools", "tools[0].type"),
    ({"input": "x", "prompt": {"id": "pmpt_1", "variables": {"a": "b"}}}, "prompt", "instructions"),
    ({"input": "x", "moderation": {"model": "omni-moderation-latest"}}, "moderation", "moderation"),
    ({"input": "x", "conversation": "conv_1", "previous_response_id": "resp_1"}, "conversation", "one of"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "nope"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice", "requires tools"),
    ({}, "input", "input"),
    ({"input": 3}, "input", "input"),
    ({"input": "x", "background": True}, "background", "background"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, "input", "file_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]},
     "input", "vision"),
])
async def test_bad_requests_are_400s_naming_the_field(http: httpx.AsyncClient, body: dict[str, Any], param: str,
                                                      words: str) -> None:
    reply = await http.post("/v1/responses", json={"model": "fake", **body})
    assert reply.status_code == 400, reply.text
    error = assert_openai_error(reply.json(), error_type="invalid_request_error")
    assert error["param"] == param and words in error["message"]


async def test_bad_list_queries_are_400s(http: httpx.AsyncClient) -> None:
    created = (await http.post("/v1/responses", json={"model": "fake", "input": "x"})).json()
    for query in ["limit=0", "limit=101", "order=sideways", "after=msg_unknown", "limit=ten"]:
        reply = await http.get(f"/v1/responses/{created['id']}/input_items?{query}")
        assert reply.status_code == 400, query
        assert_openai_error(reply.json())


OPENS_THINKING = (  # a generation prompt that opens the thinking unless enable_thinking is false
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}"
)


async def test_a_thinking_model_gives_a_reasoning_item_then_the_message(tmp_path: Path) -> None:
    app, engine = serve(tmp_path, FakeBackend(script="Two and two.</think>Four."), OPENS_THINKING)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as http:
        client = client_of(http)
        whole = await client.responses.create(model="fake", input="2+2?", reasoning={"effort": "high"})
        reasoning, message = whole.output
        assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
        assert [part.text for part in reasoning.content or []] == ["Two and two."]
        assert whole.output_text == "Four." and message.type == "message"
        assert whole.reasoning is not None and whole.reasoning.effort == "high"
        assert whole.usage is not None and whole.usage.output_tokens_details.reasoning_tokens > 0
        body = {"model": "fake", "input": "2+2?", "stream": True}
        events = events_of((await http.post("/v1/responses", json=body)).text)
        thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
        done = [e for e in events if e["type"] == "response.reasoning_text.done"]
        assert thought == "Two and two." and done[0]["text"] == thought and done[0]["output_index"] == 0
        assert [item["type"] for item in events[-1]["response"]["output"]] == ["reasoning", "message"]
        off = await client.responses.create(model="fake", input="2+2?", reasoning={"effort": "none"})
        assert [item.type for item in off.output] == ["message"]  # thinking off: all of it is the answer
        again = await client.responses.create(model="fake", input="And 3+3?", previous_response_id=whole.id)
        assert again.status == "completed"  # the earlier reasoning item is read back and left out of the prompt
    engine.close()


def test_reasoning_comes_first_as_its_own_item() -> None:
    builder = OutputBuilder()
    events = [*builder.push(Chunk(reasoning="Let me")), *builder.push(Chunk(reasoning=" think.")),
              *builder.push(Chunk(text="\n\n")), *builder.push(Chunk(text="Yes.")),
              *builder.push(Chunk(tool_calls=[ToolCall("f", "{}", "call_1")])), *builder.finish("completed")]
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
    ]
    for number, event in enumerate(events):
        EVENTS.validate_python({**event, "sequence_number": number})
    reasoning, message, call = builder.items
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [{"type": "reasoning_text",
                                                                          "text": "Let me think."}]
    assert message["content"][0]["text"] == "\n\nYes."
    assert call["call_id"] == "call_1" and [e["output_index"] for e in events[-4:]] == [2, 2, 2, 2]
    OpenAIResponse.model_validate({"id": "resp_1", "object": "response", "created_at": 0, "model": "m",
                                   "output": builder.items, "parallel_tool_calls": True, "tool_choice": "auto",
                                   "tools": []})


def test_whitespace_beside_calls_makes_no_message_and_an_empty_reply_makes_one() -> None:
    builder = OutputBuilder()
    builder.push(Chunk(text=" \n"))
    builder.push(Chunk(tool_calls=[ToolCall("f", "{}", "call_1")]))
    builder.push(Chunk(text="\n"))
    builder.finish("completed")
    assert [item["type"] for item in builder.items] == ["function_call"]
    empty = OutputBuilder()
    empty.push(Chunk(reasoning="hmm"))
    empty.finish("completed")
    assert [item["type"] for item in empty.items] == ["reasoning", "message"]
    assert empty.items[1]["content"][0]["text"] == ""


def entry(text: str, logprob: float) -> TokenLogprob:
    return TokenLogprob(0, text, text.encode(), logprob, top=[TokenLogprob(1, text, text.encode(), logprob)])


def test_the_output_texts_logprobs_go_with_its_deltas_and_its_part() -> None:
    builder = OutputBuilder()
    events = [*builder.push(Chunk(text="\n", logprobs=[entry("\n", -0.1)])),
              *builder.push(Chunk(text="Yes", logprobs=[entry("Yes", -0.2)])),
              *builder.push(Chunk(text=".", logprobs=[entry(".", -0.3)])), *builder.finish("completed")]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [(d["delta"], [lp["token"] for lp in d["logprobs"]]) for d in deltas] == [
        ("\nYes", ["\n", "Yes"]), (".", ["."])]  # the leading newline waited for text, its entry with it
    [done] = [e for e in events if e["type"] == "response.output_text.done"]
    part = builder.items[0]["content"][0]
    assert [lp["logprob"] for lp in part["logprobs"]] == [-0.1, -0.2, -0.3] and done["logprobs"] == part["logprobs"]
    assert part["logprobs"][0]["top_logprobs"] == [{"token": "\n", "logprob": -0.1, "bytes": [10]}]
    for number, event in enumerate(events):
        EVENTS.validate_python({**event, "sequence_number": number})
    OpenAIResponse.model_validate({"id": "resp_1", "object": "response", "created_at": 0, "model": "m",
                                   "output": builder.items, "parallel_tool_calls": True, "tool_choice": "auto",
                                   "tools": []})


@pytest.mark.parametrize(("fields", "asked"), [
    ({}, None), ({"include": ["message.output_text.logprobs"]}, 0),
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 3}, 3), ({"top_logprobs": 2}, 2),
    ({"include": ["reasoning.encrypted_content"]}, None),
])
def test_include_and_top_logprobs_ask_for_logprobs(fields: dict[str, Any], asked: int | None) -> None:
    assert to_sampling(ResponseRequest(model="m", input="hi", **fields)).logprobs == asked


def test_a_reasoning_item_is_the_thinking_of_the_assistant_turn_after_it() -> None:
    items = parse_items([
        {"type": "message", "role": "user", "content": "2+2?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Add."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "4"}]},
        {"type": "reasoning", "id": "rs_2", "summary": [], "content": [{"type": "reasoning_text", "text": "Look."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
    ])
    messages, _ = to_messages(None, items)
    assert [(m.role, m.content, m.thinking, len(m.tool_calls)) for m in messages] == [
        ("user", "2+2?", "", 0), ("assistant", "4", "Add.", 0), ("assistant", "", "Look.", 1)]


class FailingGeneration:
    """A generation whose engine fails after some text (what `stream_events` reads of a Generation)."""

    model = "m"
    num_prompt_tokens = 3

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        yield Chunk(text="Half an ")
        yield Chunk(finish_reason="error", error="the engine stopped")


async def test_an_engine_failure_ends_the_stream_with_response_failed() -> None:
    saved: list[dict[str, Any]] = []

    async def save(response: dict[str, Any]) -> None:
        saved.append(response)

    head = {"id": "resp_1", "object": "response", "created_at": 0, "model": "m", "output": [],
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "status": "in_progress"}
    frames = stream_events(FailingGeneration(), head, Framer(), save)  # type: ignore[arg-type]
    events = events_of(b"".join([frame async for frame in frames]).decode())
    for event in events:
        EVENTS.validate_python(event)
    last = events[-1]
    assert [e["type"] for e in events][:2] == ["response.created", "response.in_progress"]
    assert last["type"] == "response.failed" and last["response"]["status"] == "failed"
    assert last["response"]["error"]["message"] == "the engine stopped" and not saved
