"""End to end on the MLX engine: what llama.cpp and vLLM do, through a real `lmserve serve --engine mlx`.

One server for the module serves the embedded SmolLM2 converted to a safetensors repository (tests/hf_repos.py) on
MLX's CPU build (float32, the engine's default on a CPU), with an API key, so every test also proves that auth works
on this engine. The checks mirror tests/test_vllm_e2e.py (the openai and ollama clients, structured output, tools,
aborts, metrics) and add the Anthropic and Responses dialects, n > 1, log-probabilities, embeddings and unloading,
which the MLX engine has as llama.cpp does (it is a backend of the same slot engine). What is proven elsewhere is not
repeated: replies in a batch equal to replies alone (tests/engine/mlx/test_backend.py, tests/test_offline.py
`test_mlx_answers_a_batch_as_each_alone`); the slot engine's bounded queue (tests/engine/slots/) and its 503 on
every route (tests/api/test_native.py).
"""

from __future__ import annotations

import importlib.util
import json
import math
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import ollama
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.audio_clips import b64, tone
from tests.hf_repos import smollm2_repo
from tests.lora_adapters import smollm2_peft
from tests.test_context_e2e import check_num_ctx_reloads_nothing
from tests.test_logprobs_e2e import check_prompt_logprobs_score_the_greedy_reply
from tests.test_server import QUESTION as QUESTION_DICTS
from tests.test_server import Server
from tests.test_structured_e2e import PERSON, PERSON_FORMAT
from tests.test_tools_e2e import ASK, TIME, WEATHER, check_call

# find_spec, not an import: MLX is imported through the engine, which puts OpenBLAS under it (engine/mlx/runtime.py)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None,
                                reason="the MLX engine needs mlx and mlx-lm (pip install 'lmserve[mlx]')")

KEY = "mlx-sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_QUEUE = 2
QUESTION: Any = QUESTION_DICTS  # the clients' message types, which plain dicts satisfy at run time
STORY: Any = [{"role": "user", "content": "Tell a long story."}]
GREEDY = {"temperature": 0}


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

    def claude(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.base_url, api_key=KEY, max_retries=0,
                                   _strict_response_validation=True)


@pytest.fixture(scope="module")
def server() -> Iterator[KeyedServer]:
    # SmolLM2's template names no tool-call format: hermes, as tests/test_tools_e2e.py gives it on llama.cpp
    srv = KeyedServer("--model", str(smollm2_repo()), "--engine", "mlx", "--api-key", KEY,
                      "--tool-call-parser", "hermes", "--lora", f"sea={smollm2_peft(1)}",
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


def test_chat_completion_is_served_by_mlx(server: KeyedServer, client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=40)
    choice = reply.choices[0]
    assert "Paris" in (choice.message.content or "")
    assert choice.finish_reason == "stop"
    assert reply.usage is not None and reply.usage.prompt_tokens > 10
    shown = httpx.post(server.base_url + "/api/show", json={"model": model}, headers=AUTH).json()
    assert shown["details"]["format"] == "safetensors"
    ps = httpx.get(server.base_url + "/api/ps", headers=AUTH).json()["models"]
    assert [m["name"] for m in ps] == [model] and ps[0]["context_length"] == 1024


def test_streamed_chat_equals_the_whole_reply(client: openai.OpenAI, model: str) -> None:
    whole = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=40)
    stream = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=40,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stop_string_is_not_in_the_reply(client: openai.OpenAI, model: str) -> None:
    whole = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=40)
    text = whole.choices[0].message.content or ""
    stop = text.split()[1]
    for stream in (False, True):
        reply = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=40,
                                               stop=[stop], stream=stream)
        got = "".join(c.choices[0].delta.content or "" for c in reply if c.choices) if stream else \
            reply.choices[0].message.content  # type: ignore[union-attr]
        assert got == text[: text.index(stop)], (stream, got)


def test_max_tokens_gives_finish_reason_length(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(model=model, messages=STORY, temperature=0, max_tokens=5)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 5


def test_sampling_options_and_the_same_seed_give_the_same_reply(client: openai.OpenAI, model: str) -> None:
    def ask(seed: int) -> str:
        reply = client.chat.completions.create(
            model=model, messages=STORY, temperature=0.9, top_p=0.9, seed=seed, max_tokens=16,
            frequency_penalty=0.3, presence_penalty=0.2,
            extra_body={"top_k": 40, "min_p": 0.05, "typical_p": 0.95, "repetition_penalty": 1.1})
        return reply.choices[0].message.content or ""

    assert ask(7) == ask(7)
    assert len({ask(7), ask(8), ask(9)}) > 1


def test_mirostat_samples(server: KeyedServer, model: str) -> None:
    with server.native() as native:
        for version in (1, 2):
            reply = native.generate(model=model, prompt="Once upon a time", options={
                "mirostat": version, "mirostat_tau": 4.0, "seed": 3, "num_predict": 8})
            assert reply.eval_count == 8 and reply.response


def test_n_choices_and_logprobs(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(model=model, messages=STORY, temperature=1.0, seed=1, n=3, max_tokens=8)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.message.content for c in reply.choices}) > 1
    scored = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=6,
                                            logprobs=True, top_logprobs=3)
    content = scored.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and "".join(t.token for t in content) == scored.choices[0].message.content
    for token in content:
        assert token.logprob <= 0 and len(token.top_logprobs) == 3
        assert token.top_logprobs[0].logprob >= token.top_logprobs[-1].logprob
        assert token.token == token.top_logprobs[0].token  # greedy: the likeliest


def test_completions(server: KeyedServer, client: openai.OpenAI, model: str) -> None:
    reply = client.completions.create(model=model, prompt="The capital of France is", temperature=0, max_tokens=8)
    assert reply.choices[0].text and reply.choices[0].finish_reason == "length"
    # streamed legacy completions carry finish_reason null until the end: read plainly (see tests/test_server.py)
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0) as plain:
        stream = plain.completions.create(model=model, prompt="The capital of France is", temperature=0,
                                          max_tokens=8, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == reply.choices[0].text


def test_embeddings(client: openai.OpenAI, model: str) -> None:
    vectors = client.embeddings.create(model=model, input=["hello world", "the capital of France"],
                                       encoding_format="float").data
    assert len(vectors) == 2 and len(vectors[0].embedding) == 576
    assert abs(sum(x * x for x in vectors[0].embedding) - 1.0) < 1e-3


# ---- the other dialects -----------------------------------------------------------------------------------------


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
        with pytest.raises(ollama.ResponseError) as info:
            client.chat(model="nope", messages=QUESTION)
        assert info.value.status_code == 404


def test_anthropic_create_stream_and_forced_tool(server: KeyedServer, model: str) -> None:
    forced: Any = {"type": "tool", "name": "get_weather"}
    with server.claude() as client:
        whole = client.messages.create(model=model, max_tokens=30, extra_body=GREEDY, messages=QUESTION)
        text = "".join(block.text for block in whole.content if block.type == "text")
        assert "paris" in text.lower() and whole.stop_reason == "end_turn"
        with client.messages.stream(model=model, max_tokens=30, extra_body=GREEDY, messages=QUESTION) as stream:
            assert "".join(stream.text_stream) == text
        call = client.messages.create(model=model, max_tokens=120, extra_body=GREEDY, messages=ASK,
                                      tools=[{"name": "get_weather", "description": WEATHER["function"]["description"],
                                              "input_schema": WEATHER["function"]["parameters"]}],
                                      tool_choice=forced)
        [use] = [block for block in call.content if block.type == "tool_use"]
        assert call.stop_reason == "tool_use" and use.name == "get_weather" and isinstance(use.input, dict)


def test_responses_create_and_stream(client: openai.OpenAI, model: str) -> None:
    whole = client.responses.create(model=model, input=QUESTION, temperature=0, max_output_tokens=30)
    assert "Paris" in whole.output_text
    events = list(client.responses.create(model=model, input=QUESTION, temperature=0, max_output_tokens=30,
                                          stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text and events[-1].type == "response.completed"


# ---- structured output and tools --------------------------------------------------------------------------------


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


def test_a_streamed_forced_call_is_the_same_call(client: openai.OpenAI, model: str) -> None:
    messages: Any = ASK
    whole = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], tool_choice="required",
                                           temperature=0, max_tokens=120)
    stream = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], tool_choice="required",
                                            temperature=0, max_tokens=120, stream=True)
    arguments = "".join(tc.function.arguments or "" for c in stream if c.choices
                        for tc in c.choices[0].delta.tool_calls or [] if tc.function)
    [call] = whole.choices[0].message.tool_calls or []
    assert json.loads(arguments) == json.loads(call.function.arguments)  # type: ignore[union-attr]


# ---- usage, aborts, the queue, bad input ------------------------------------------------------------------------


def test_a_repeated_long_prompt_reports_cached_tokens(client: openai.OpenAI, model: str) -> None:
    messages: Any = [{"role": "user", "content": "Facts about rivers and lakes. " * 60 + "Which is longer?"}]
    first = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=2)
    second = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=2)
    assert first.usage is not None and second.usage is not None
    assert second.usage.prompt_tokens == first.usage.prompt_tokens > 300
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    assert second.usage.prompt_tokens - 2 <= details.cached_tokens < second.usage.prompt_tokens
    assert second.choices[0].message.content == first.choices[0].message.content


def test_a_client_that_hangs_up_mid_stream_frees_its_sequence(
    server: KeyedServer, client: openai.OpenAI, model: str
) -> None:
    """The running count drops within seconds of the socket closing; the aborted generation adds no tokens (a
    finished one would add its 600), and the server goes on answering."""
    stream = client.chat.completions.create(
        model=model, messages=STORY, temperature=0.8, max_tokens=600, stream=True, extra_body={"ignore_eos": True},
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


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": QUESTION_DICTS, "logit_bias": {"99999999": 1}}, "logit_bias"),
        ("/v1/chat/completions", {"messages": QUESTION_DICTS, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, None),
        ("/v1/chat/completions", {"messages": QUESTION_DICTS, "temperature": -1}, None),
    ],
)
def test_bad_input_is_a_400_in_the_openai_shape(server: KeyedServer, model: str, path: str, body: dict[str, Any],
                                                param: str | None) -> None:
    response = httpx.post(server.base_url + path, json={"model": model, **body}, headers=AUTH, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"] and (param is None or error["param"] == param)


def test_an_image_is_a_400_naming_why(client: openai.OpenAI, model: str) -> None:
    pixel = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAAB"
             "JRU5ErkJggg==")
    content: Any = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": pixel}}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], max_tokens=4)
    assert "image" in str(refused.value).lower()


def test_an_audio_clip_is_a_400_naming_what_is_missing(client: openai.OpenAI, model: str) -> None:
    content: Any = [{"type": "input_audio", "input_audio": {"data": b64(tone(0.5)), "format": "wav"}}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], max_tokens=4)
    assert "has no audio encoder" in str(refused.value) and "mlx-whisper" in str(refused.value)


# ---- metrics and unloading (last: it unloads the model) ----------------------------------------------------------


def test_a_num_ctx_within_the_loaded_context_reloads_nothing(server: KeyedServer, model: str) -> None:
    check_num_ctx_reloads_nothing(server.base_url, model, (1024, 1000, 512), AUTH)  # the server runs -c 1024


def test_prompt_logprobs_score_the_greedy_reply(server: KeyedServer, model: str) -> None:
    check_prompt_logprobs_score_the_greedy_reply(server.base_url, model, 2e-3, AUTH)


def test_metrics_count_the_requests_and_tokens_of_the_model(client: openai.OpenAI, model: str,
                                                            server: KeyedServer) -> None:
    reply = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=5)
    assert reply.usage is not None
    parsed = scrape(server)

    def value(name: str, **labels: str) -> float:
        return parsed.get((name, frozenset(labels.items())), 0.0)

    assert value("lmserve_requests_total", route="/v1/chat/completions", status="200") >= 1
    assert value("lmserve_prompt_tokens_total", model=model) >= reply.usage.prompt_tokens
    assert value("lmserve_generated_tokens_total", model=model) >= 5
    assert value("lmserve_model_loads_total", model=model) == 1
    assert (value("lmserve_running_sequences", model=model), value("lmserve_queue_depth", model=model)) == (0, 0)


def test_keep_alive_zero_unloads_and_the_next_request_loads_again(server: KeyedServer, model: str) -> None:
    with server.native() as native:
        native.generate(model=model, prompt="hi", raw=True, options={"num_predict": 1}, keep_alive=0)
        deadline = time.monotonic() + 30
        while native.ps().models and time.monotonic() < deadline:
            time.sleep(0.2)
        assert native.ps().models == []
        reply = native.chat(model=model, messages=QUESTION, options={"temperature": 0})
        assert "Paris" in reply.message.content
        assert [m.model for m in native.ps().models] == [model]


def test_sleep_level_1_drops_the_caches_and_a_request_wakes_the_model(
    server: KeyedServer, client: openai.OpenAI, model: str,
) -> None:
    asked = {"model": model, "messages": QUESTION, "temperature": 0, "max_tokens": 6}
    before = client.chat.completions.create(**asked).choices[0].message.content  # type: ignore[call-overload]

    def memory() -> dict[str, int]:
        ps = httpx.get(server.base_url + "/api/ps", headers=AUTH).json()["models"]
        return dict(next(entry["memory"] for entry in ps if entry["name"] == model))

    awake = memory()
    assert awake["weights"] > 100 * 2**20 and awake["kv_cache"] > 0  # SmolLM2's float arrays; the slots' caches
    slept = httpx.post(server.base_url + "/sleep", params={"model": model}, headers=AUTH, timeout=60)
    assert slept.status_code == 200 and slept.json()["sleeping"] == {model: 1}, slept.text
    assert memory()["kv_cache"] == 0
    assert client.chat.completions.create(**asked).choices[0].message.content == before  # type: ignore[call-overload]


def test_a_decision_puts_most_probability_on_paris(client: openai.OpenAI, model: str) -> None:
    """Judging on MLX (service/judging.py): 20 questions through a queue of MAX_QUEUE, exact and the same alone."""
    choices: Any = [{"value": "Berlin"}, {"value": "Paris"}, {"value": "Tokyo"}]
    questions: Any = [{"type": "choice", "instructions": "Answer the question.", "choices": choices}]
    questions += [{"type": "predicate", "instructions": f"The question mentions the number {i}."} for i in range(19)]
    decision = client.decisions.create(model=model, input="What is the capital of France?", questions=questions)
    first = decision.answers[0]
    assert first.type == "choice" and first.choice == "Paris"
    assert abs(math.fsum(p.probability for p in first.probabilities) - 1) < 1e-6
    alone = client.decisions.create(model=model, input="What is the capital of France?", questions=questions[:1])
    assert [p.probability for p in alone.answers[0].probabilities] == pytest.approx(  # type: ignore[union-attr]
        [p.probability for p in first.probabilities], abs=1e-6)


def test_a_chat_model_reranks_on_mlx(server: KeyedServer, model: str) -> None:
    body = {"model": model, "query": "What is the capital of France?",
            "documents": ["Bananas are yellow.", "Paris is the capital of France."]}
    ranked = httpx.post(server.base_url + "/v1/rerank", json=body, headers=AUTH, timeout=120).json()
    assert [r["index"] for r in ranked["results"]] == [1, 0]


def test_a_lora_adapter_is_a_model_over_the_repository_and_a_request_field(server: KeyedServer,
                                                                          client: openai.OpenAI, model: str) -> None:
    """`--lora sea=<PEFT directory>` (issue 44): the model `sea`, listed with its parent, answering otherwise than the
    base over the same loaded weights; llama-server's `lora` field picks it by id on the base's name."""
    cards = {card.id: card for card in client.models.list()}
    assert getattr(cards["sea:latest"], "parent", None) == model

    def ask(name: str, **extra: Any) -> str:
        reply = client.chat.completions.create(model=name, messages=QUESTION, max_tokens=12,
                                               extra_body={**GREEDY, **extra})
        return reply.choices[0].message.content or ""

    sea = ask("sea")
    assert sea != ask(model) and ask(model, lora=[{"id": 0, "scale": 1.0}]) == sea
    with server.native() as native:
        assert native.show("sea").modelinfo["lora.ranks"] == [8]
        greedy = {"temperature": 0, "num_predict": 12, "repeat_penalty": 1.0}  # the native defaults penalize
        assert native.chat(model="sea", messages=QUESTION, options=greedy).message.content == sea
    ps = httpx.get(server.base_url + "/api/ps", headers=AUTH).json()["models"]
    assert {entry["name"] for entry in ps} == {model, "sea:latest"}
    assert len({entry["adapter_bytes"] for entry in ps}) == 1 and ps[0]["adapter_bytes"] > 0  # names of one instance
