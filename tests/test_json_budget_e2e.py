"""End to end (llama.cpp): structured output closed within `max_tokens`, through the official clients.

SmolLM2 asked for a list under a schema with an unbounded array loops inside the array until the limit: every
reply must still parse and validate, finish "length" (the limit forced the close), count no more tokens than the
limit, and read the same streamed and whole. A limit below the shortest valid document is a 400 naming it. The
limits are swept in-process (tests/service/test_json_budget.py); here one limit, and the minimum, end to end.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import ollama
import openai
import pytest

from tests.test_server import MODEL, Server

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"countries": {"type": "array", "items": {"type": "string"}}},
    "required": ["countries"],
    "additionalProperties": False,
}
FORMAT: Any = {"type": "json_schema", "json_schema": {"name": "countries", "schema": SCHEMA, "strict": True}}
MESSAGES: Any = [{"role": "user", "content": "List every country in the world."}]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def minimum(client: openai.OpenAI) -> int:
    """The fewest tokens a reply may have, as the 400 for max_tokens 1 names it."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=1,
                                       response_format=FORMAT)
    assert caught.value.status_code == 400
    found = re.search(r"at least (\d+)", str(caught.value))
    assert found is not None, str(caught.value)
    return int(found.group(1))


def test_below_the_minimum_is_a_400_naming_it(client: openai.OpenAI, minimum: int) -> None:
    assert 2 <= minimum <= 16
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=minimum - 1,
                                       response_format=FORMAT)
    assert caught.value.body is not None
    error: Any = caught.value.body
    assert error["param"] == "max_tokens"
    assert f"at least {minimum}" in error["message"]


def test_a_limit_gives_a_valid_document_streamed_and_whole(client: openai.OpenAI) -> None:
    """One representative limit end to end; the closing logic is swept over limits in-process
    (tests/service/test_json_budget.py), the shortest document here at the minimum."""
    for limit in (25,):
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=limit,
                                               response_format=FORMAT)
        choice = reply.choices[0]
        content = choice.message.content or ""
        jsonschema.validate(json.loads(content), SCHEMA)
        assert choice.finish_reason == "length", (limit, content)  # the model loops: the limit forced the close
        countries = json.loads(content)["countries"]  # the model's own items, closed: those of a longer reply
        longer = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=limit * 3,
                                                response_format=FORMAT).choices[0].message.content or ""
        assert len(countries) >= 3 and json.loads(longer)["countries"][:len(countries) - 1] == countries[:-1]
        assert reply.usage is not None and reply.usage.completion_tokens <= limit
        stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=limit,
                                                response_format=FORMAT, stream=True,
                                                stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == content, limit
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finishes == ["length"]
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == reply.usage.completion_tokens


def test_the_minimum_limit_gives_the_shortest_document(client: openai.OpenAI, minimum: int) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=minimum,
                                           response_format=FORMAT)
    value = json.loads(reply.choices[0].message.content or "")
    assert value == {"countries": []}
    assert reply.usage is not None and reply.usage.completion_tokens <= minimum


def test_json_object_closes_too(client: openai.OpenAI) -> None:
    for limit in (3, 12, 40):
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=limit,
                                               response_format={"type": "json_object"})
        assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)
        assert reply.usage is not None and reply.usage.completion_tokens <= limit


def test_native_format_closes_streamed_and_whole(server: Server, minimum: int) -> None:
    with ollama.Client(host=server.base_url) as native:
        for limit in (minimum, 25):
            options = {"temperature": 0, "num_predict": limit}
            reply = native.chat(model=MODEL, messages=MESSAGES, format=SCHEMA, options=options)
            jsonschema.validate(json.loads(reply.message.content or ""), SCHEMA)
            assert reply.done_reason == "length"
            assert reply.eval_count is not None and reply.eval_count <= limit
            parts = list(native.chat(model=MODEL, messages=MESSAGES, format=SCHEMA, options=options, stream=True))
            assert "".join(p.message.content or "" for p in parts) == reply.message.content
            assert parts[-1].done_reason == "length"
            generated = native.generate(model=MODEL, prompt="List every country in the world.", format=SCHEMA,
                                        options=options)
            jsonschema.validate(json.loads(generated.response), SCHEMA)


def test_native_below_the_minimum_is_a_400(server: Server, minimum: int) -> None:
    with ollama.Client(host=server.base_url) as native, pytest.raises(ollama.ResponseError) as caught:
        native.chat(model=MODEL, messages=MESSAGES, format=SCHEMA, options={"num_predict": minimum - 1})
    assert caught.value.status_code == 400
    assert "num_predict" in caught.value.error and f"at least {minimum}" in caught.value.error
