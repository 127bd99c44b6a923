"""End to end: structured output from a real `lmserve serve`, read by the official `openai` and `ollama` clients.

Every answer under a schema must parse and validate against it; what cannot be enforced is a 400.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import ollama
import openai
import pytest
from pydantic import BaseModel

from tests.test_server import MODEL, Server

PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
PERSON_FORMAT: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
PROMPTS = [
    "Tell me about Ada Lovelace.",
    "Make up a person who is 42 years old.",
    "Who was the first person on the moon?",
    "Write a haiku about autumn.",
    "Invent a character for a fantasy novel.",
]


class City(BaseModel):
    name: str
    country: str
    population: int
    coastal: bool


def ask(text: str) -> Any:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with server.client() as c:
        yield c


@pytest.mark.parametrize("prompt", PROMPTS)
def test_openai_json_schema_answers_validate(client: openai.OpenAI, prompt: str) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=ask(prompt), temperature=0, max_tokens=200, response_format=PERSON_FORMAT
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content or ""), PERSON)


def test_openai_streamed_json_schema_answer_validates(client: openai.OpenAI) -> None:
    chunks = client.chat.completions.create(
        model=MODEL, messages=ask(PROMPTS[1]), temperature=0, max_tokens=200, response_format=PERSON_FORMAT,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), PERSON)


def test_openai_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=MODEL, messages=ask("Describe Lisbon."), temperature=0, max_tokens=200, response_format=City
    )
    city = completion.choices[0].message.parsed
    assert isinstance(city, City)


def test_openai_sampled_answers_validate_too(client: openai.OpenAI) -> None:
    for seed in range(3):
        reply = client.chat.completions.create(
            model=MODEL, messages=ask(PROMPTS[0]), temperature=1.0, seed=seed, max_tokens=200,
            response_format=PERSON_FORMAT,
        )
        jsonschema.validate(json.loads(reply.choices[0].message.content or ""), PERSON)


def test_openai_json_object_mode_gives_an_object(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=ask("Reply in JSON: what is the capital of France?"), temperature=0, max_tokens=200,
        response_format={"type": "json_object"},
    )
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)


def test_openai_unenforceable_schema_is_a_bad_request(client: openai.OpenAI) -> None:
    schema = {**PERSON, "properties": {**PERSON["properties"], "email": {"type": "string", "format": "email"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=ask(PROMPTS[0]), max_tokens=50,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}},
        )
    assert info.value.status_code == 400
    assert "'format'" in info.value.message and "#/properties/email" in info.value.message
    with pytest.raises(openai.BadRequestError, match="'not'"):
        client.chat.completions.create(
            model=MODEL, messages=ask(PROMPTS[0]), max_tokens=50,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": {"not": {}}}},
        )


def test_ollama_chat_with_a_schema_and_generate_with_json(server: Server) -> None:
    with ollama.Client(host=server.base_url) as native:
        for prompt in PROMPTS[:3]:
            reply = native.chat(model=MODEL, messages=ask(prompt), format=PERSON,
                                options={"temperature": 0, "num_predict": 200})
            assert reply.done_reason == "stop"
            jsonschema.validate(json.loads(reply.message.content or ""), PERSON)
        city = native.chat(model=MODEL, messages=ask("Describe Lisbon."), format=City.model_json_schema(),
                           options={"temperature": 0, "num_predict": 200})
        City.model_validate_json(city.message.content or "")
        generated = native.generate(model=MODEL, prompt="List three colors as JSON.", format="json",
                                    options={"temperature": 0, "num_predict": 200})
        assert generated.done_reason == "stop"
        assert isinstance(json.loads(generated.response), dict)
        streamed = native.generate(model=MODEL, prompt="List three colors as JSON.", format="json", stream=True,
                                   options={"temperature": 0, "num_predict": 200})
        assert "".join(part.response for part in streamed) == generated.response


def test_ollama_unenforceable_format_is_a_400(server: Server) -> None:
    with ollama.Client(host=server.base_url) as native:
        with pytest.raises(ollama.ResponseError) as info:
            native.chat(model=MODEL, messages=ask("hi"), format={"type": "array", "uniqueItems": True})
        assert info.value.status_code == 400 and "'uniqueItems'" in info.value.error
    # the client itself refuses format strings other than "json"; the server does too
    reply = httpx.post(server.base_url + "/api/generate", json={"model": MODEL, "prompt": "hi", "format": "yaml"})
    assert reply.status_code == 400 and "'yaml'" in reply.json()["error"]
