"""End to end on the vLLM engine: the same behaviour as on llama.cpp, through a real `lmserve serve`.

One server for the module serves the embedded SmolLM2 converted to a safetensors repository (tests/hf_repos.py),
so the vLLM engine serves it; float32, because on CPU bf16 matmuls are not batch invariant. The server has an
API key, so every test also proves that auth works on this engine. The checks mirror tests/test_server.py,
tests/test_structured_e2e.py, tests/test_tools_e2e.py and tests/api/test_metrics.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import jsonschema
import ollama
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.hf_repos import smollm2_repo
from tests.test_server import QUESTION as QUESTION_DICTS
from tests.test_server import Server, alone_and_together
from tests.test_structured_e2e import PERSON, PERSON_FORMAT
from tests.test_tools_e2e import ASK, TIME, WEATHER, check_call

KEY = "vllm-sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_QUEUE = 2
QUESTION: Any = QUESTION_DICTS  # the clients' message types, which plain dicts satisfy at run time
STORY: Any = [{"role": "user", "content": "Tell a long story."}]


class KeyedServer(Server):
    """A server whose clients send the API key."""

    def client(self, api_key: str = KEY) -> openai.OpenAI:
        return super().client(api_key)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.base_url + "/v1", api_key=KEY, max_retries=0, _strict_response_validation=True
        )

    def native(self) -> ollama.Client:
        return ollama.Client(host=self.base_url, headers=AUTH)


@pytest.fixture(scope="module")
def server() -> Iterator[KeyedServer]:
    # SmolLM2's template names no tool-call format: hermes, as tests/test_tools_e2e.py gives it on llama.cpp
    srv = KeyedServer(str(smollm2_repo()), "--dtype", "float32", "--api-key", KEY, "--tool-call-parser", "hermes",
                      env={"LMSERVE_MAX_QUEUE": str(MAX_QUEUE)})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: KeyedServer) -> Iterator[openai.OpenAI]:
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def model(server: KeyedServer) -> str:
    name = server.repository_model(AUTH)
    assert name == f"{smollm2_repo().name}:latest"
    return name


def scrape(server: KeyedServer) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of /metrics, keyed by (sample name, labels)."""
    text = httpx.get(server.base_url + "/metrics", headers=AUTH, timeout=5).text
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def gauge(server: KeyedServer, name: str, model: str) -> float:
    return scrape(server).get((name, frozenset({("model", model)})), 0.0)


def running(server: KeyedServer, model: str) -> float:
    return gauge(server, "lmserve_running_sequences", model)


# ---- the openai client ------------------------------------------------------------------------------------------


def test_chat_completion(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=40)
    choice = reply.choices[0]
    assert "Paris" in (choice.message.content or "")
    assert choice.finish_reason == "stop"
    assert reply.model == model
    assert reply.usage is not None
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.usage.prompt_tokens > 10


def test_streamed_chat_equals_the_whole_reply(client: openai.OpenAI, model: str) -> None:
    whole = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=40)
    chunks = list(client.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=40, stream=True,
        stream_options={"include_usage": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stop_string_is_not_in_the_reply(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=40, stop=["Paris"]
    )
    content = reply.choices[0].message.content or ""
    assert "Paris" not in content and content
    assert reply.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=40, stop=["Paris"], stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == content


def test_max_tokens_gives_finish_reason_length(client: openai.OpenAI, model: str) -> None:
    messages: Any = [{"role": "user", "content": "Write a long story about a dragon."}]
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=7, temperature=0)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 7
    reply = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=5, temperature=0)
    assert reply.usage is not None and reply.usage.completion_tokens == 5


def test_same_seed_gives_the_same_sampled_reply(client: openai.OpenAI, model: str) -> None:
    messages: Any = [{"role": "user", "content": "Invent a name for a cat."}]

    def ask(seed: int) -> str:
        reply = client.chat.completions.create(model=model, messages=messages, temperature=1.0, seed=seed,
                                               max_tokens=20)
        return reply.choices[0].message.content or ""

    assert ask(42) == ask(42)


def test_completions(server: KeyedServer, client: openai.OpenAI, model: str) -> None:
    reply = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert reply.object == "text_completion"
    assert reply.choices[0].text
    assert reply.choices[0].finish_reason == "length"
    # streamed legacy completions carry finish_reason null until the end: read plainly (see tests/test_server.py)
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0) as plain:
        stream = plain.completions.create(
            model=model, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in stream if c.choices) == reply.choices[0].text


def test_models(client: openai.OpenAI, model: str) -> None:
    listed = {m.id: m for m in client.models.list()}
    assert listed[model].owned_by == "lmserve"
    assert client.models.retrieve(model).id == model


def test_temperature_zero_alone_equals_eight_concurrent(server: KeyedServer, model: str) -> None:
    prompts = [
        "What is the capital of France?", "Write a haiku about rain.", "Count from 1 to 10.",
        "Explain gravity in one sentence.", "Name five fruits.", "What is 12 times 7?",
        "Tell me a joke.", "Describe the ocean.",
    ]
    alone, together = alone_and_together(server, model, prompts, max_tokens=24)
    assert together == alone
    assert len(set(alone)) == len(prompts)


# ---- the ollama client ------------------------------------------------------------------------------------------


def test_the_ollama_client_chats_generates_and_manages(server: KeyedServer, model: str) -> None:
    with server.native() as client:
        assert model in [m.model for m in client.list().models]
        reply = client.chat(model=model, messages=QUESTION, options={"temperature": 0})
        assert "Paris" in reply.message.content
        assert reply.done_reason == "stop" and reply.eval_count and reply.prompt_eval_count
        parts = list(client.chat(model=model, messages=QUESTION, options={"temperature": 0}, stream=True))
        assert "".join(p.message.content for p in parts) == reply.message.content
        generated = client.generate(model=model, prompt="The capital of France is", raw=True,
                                    options={"temperature": 0, "num_predict": 6})
        assert generated.done_reason == "length" and generated.eval_count == 6 and generated.context
        streamed = list(client.generate(model=model, prompt="The capital of France is", raw=True, stream=True,
                                        options={"temperature": 0, "num_predict": 6}))
        assert "".join(p.response for p in streamed) == generated.response
        shown = client.show(model)
        assert shown.details is not None
        assert (shown.details.format, shown.details.family) == ("safetensors", "llama")
        assert [m.model for m in client.ps().models] == [model]
        assert httpx.get(server.base_url + "/api/ps", headers=AUTH).json()["models"][0]["context_length"] == 1024
        with pytest.raises(ollama.ResponseError) as info:
            client.chat(model="nope", messages=QUESTION)
        assert info.value.status_code == 404


# ---- structured output ------------------------------------------------------------------------------------------


def test_openai_json_schema_answer_validates(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Tell me about Ada Lovelace."}], temperature=0,
        max_tokens=200, response_format=PERSON_FORMAT,
    )
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), PERSON)


def test_native_format_schema_answer_validates(server: KeyedServer, model: str) -> None:
    with server.native() as native:
        reply = native.chat(model=model, messages=[{"role": "user", "content": "Make up a person who is 42."}],
                            format=PERSON, options={"temperature": 0, "num_predict": 200})
    assert reply.done_reason == "stop"
    jsonschema.validate(json.loads(reply.message.content or ""), PERSON)


# ---- tools ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tools", "tool_choice", "called"),
    [
        ([WEATHER], "required", WEATHER),
        ([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, TIME),
    ],
)
def test_a_forced_tool_choice_gives_a_valid_call(
    client: openai.OpenAI, model: str, tools: list[Any], tool_choice: Any, called: dict[str, Any]
) -> None:
    messages: Any = ASK
    reply = client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice=tool_choice,
                                           temperature=0, max_tokens=120)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls or []
    check_call(call, called)


def test_native_chat_with_tools_and_a_tool_result_in_the_history(server: KeyedServer, model: str) -> None:
    """The native dialect has no tool_choice, and SmolLM2-135M calls no tool unforced (on llama.cpp neither): the
    native request with tools, a call and its result in the history is served, as in tests/test_tools_e2e.py."""
    messages: Any = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                          "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18 degrees and sunny", "tool_name": "get_weather"},
    ]
    with server.native() as native:
        reply = native.chat(model=model, messages=messages, tools=[WEATHER],
                            options={"temperature": 0, "num_predict": 30})
    assert reply.done and reply.done_reason in ("stop", "length")
    for call in reply.message.tool_calls or []:
        assert isinstance(call.function.arguments, dict)


# ---- usage, aborts, the queue -----------------------------------------------------------------------------------


def test_a_repeated_long_prompt_reports_cached_tokens(client: openai.OpenAI, model: str) -> None:
    messages: Any = [{"role": "user", "content": "Facts about rivers and lakes. " * 60 + "Which is longer?"}]
    first = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=2)
    second = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=2)
    assert first.usage is not None and second.usage is not None
    assert second.usage.prompt_tokens == first.usage.prompt_tokens > 300
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    assert 0 < details.cached_tokens <= second.usage.prompt_tokens


def test_a_client_that_hangs_up_mid_stream_frees_its_sequence(
    server: KeyedServer, client: openai.OpenAI, model: str
) -> None:
    """The running count drops within seconds of the socket closing; the aborted generation adds no tokens (a
    finished one would add its 600), and the server goes on answering."""
    stream = client.chat.completions.create(
        model=model, messages=STORY, temperature=0.8, max_tokens=600,
        stream=True, extra_body={"ignore_eos": True},
    )
    generated = gauge(server, "lmserve_generated_tokens_total", model)
    for count, _ in enumerate(stream, start=1):
        if count == 3:
            break
    assert running(server, model) == 1
    stream.close()
    closed = time.monotonic()
    while running(server, model) > 0 and time.monotonic() - closed < 60:  # a loaded server notices late
        time.sleep(0.05)
    assert running(server, model) == 0
    assert gauge(server, "lmserve_generated_tokens_total", model) == generated  # aborted, never finished
    reply = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=20)
    assert "Paris" in (reply.choices[0].message.content or "")


def test_a_full_queue_is_503_with_retry_after(server: KeyedServer, model: str) -> None:
    body = {"model": model, "messages": STORY, "max_tokens": 120,
            "ignore_eos": True}

    async def fire() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=300) as http:
            return await asyncio.gather(*(http.post("/v1/chat/completions", json=body) for _ in range(16)))

    replies = asyncio.run(fire())
    refused = [r for r in replies if r.status_code == 503]
    served = [r for r in replies if r.status_code == 200]
    assert len(refused) + len(served) == 16 and refused and served
    assert len(served) <= 8 + MAX_QUEUE
    for r in refused:
        assert r.headers["retry-after"]
        assert openai_error(r.json()) and r.json()["error"]["type"] == "overloaded_error"
    assert all(r.json()["usage"]["completion_tokens"] == 120 for r in served)


# ---- what this engine cannot do, auth, metrics ------------------------------------------------------------------


def openai_error(body: Any) -> str:
    """The message of an error in OpenAI's shape ({"error": {"message", "type", "param", "code"}})."""
    assert set(body) == {"error"} and set(body["error"]) >= {"message", "type", "param", "code"}
    return str(body["error"]["message"])


def native_error(body: Any) -> str:
    """The message of an error in Ollama's shape ({"error": "..."})."""
    assert set(body) == {"error"} and isinstance(body["error"], str)
    return body["error"]


@pytest.mark.parametrize(
    ("path", "body", "message_of"),
    [
        ("/v1/embeddings", {"input": "hello"}, openai_error),
        ("/api/embed", {"input": "hello"}, native_error),
        ("/api/embeddings", {"prompt": "hello"}, native_error),
    ],
)
def test_embeddings_are_a_400_in_each_dialect(
    server: KeyedServer, model: str, path: str, body: dict[str, Any], message_of: Callable[[Any], str]
) -> None:
    response = httpx.post(server.base_url + path, json={"model": model, **body}, headers=AUTH, timeout=30)
    assert response.status_code == 400
    assert "embeddings" in message_of(response.json())


def test_a_missing_or_wrong_api_key_is_401(server: KeyedServer, model: str) -> None:
    body = {"model": model, "messages": QUESTION}
    assert httpx.post(server.base_url + "/v1/chat/completions", json=body).status_code == 401
    wrong = httpx.post(server.base_url + "/api/chat", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    with server.client(api_key="nope") as bad, pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_metrics_count_the_requests_and_tokens_of_the_model(client: openai.OpenAI, model: str,
                                                            server: KeyedServer) -> None:
    reply = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=5)
    assert reply.usage is not None
    httpx.get(server.base_url + "/v1/models")  # no key: counted as a 401
    parsed = scrape(server)

    def value(name: str, **labels: str) -> float:
        return parsed.get((name, frozenset(labels.items())), 0.0)

    assert value("lmserve_requests_total", route="/v1/chat/completions", status="200") >= 1
    assert value("lmserve_requests_total", route="/v1/models", status="401") >= 1
    assert value("lmserve_prompt_tokens_total", model=model) >= reply.usage.prompt_tokens
    assert value("lmserve_generated_tokens_total", model=model) >= 5
    assert value("lmserve_time_to_first_token_seconds_count", model=model) >= 1
    assert value("lmserve_model_loads_total", model=model) == 1
    assert (value("lmserve_running_sequences", model=model), value("lmserve_queue_depth", model=model)) == (0, 0)
