"""Context sizing through a real server (llama.cpp, the embedded SmolLM2, trained for 8,192 tokens), read by the
official clients: `-c` above the trained length is capped there, the log says so with both numbers, `ps` and
`show` report the context in force, and a prompt longer than the context is a 400 whose message gives its size,
the context, the trained length and what can work, in the OpenAI, native and Anthropic shapes."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.test_server import MODEL, Server

TRAINED = 8192
ASKED = 32768
LONG: Any = [{"role": "user", "content": "hello " * 9000}]
"""About 9,000 tokens: past what SmolLM2 was trained for, so no context can take it."""
CANNOT = f"This model was trained for at most {TRAINED} tokens, so it cannot take this prompt"
CLAUDE_CODE_PATTERN = re.compile(r"prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)")
"""How Claude Code reads a prompt that is too long (it then compacts the conversation)."""


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server("-c", str(ASKED), "-np", "1")
    yield srv
    srv.stop()


def ps(server: Server) -> dict[str, int]:
    return {m["name"]: m["context_length"] for m in httpx.get(server.base_url + "/api/ps").json()["models"]}


def test_a_context_above_the_trained_length_is_capped_and_reported(server: Server) -> None:
    assert ps(server) == {MODEL: TRAINED}
    shown = httpx.post(server.base_url + "/api/show", json={"model": MODEL}).json()
    assert shown["model_info"]["llama.context_length"] == TRAINED


def test_a_modelfile_num_ctx_is_shown_as_in_force(server: Server) -> None:
    with ollama.Client(host=server.base_url) as client:
        client.create(model="long-context", from_=MODEL, parameters={"num_ctx": ASKED})

        def num_ctx() -> str:
            rows = dict(line.split(None, 1) for line in (client.show("long-context").parameters or "").splitlines())
            return rows["num_ctx"]

        assert num_ctx() == str(TRAINED)  # not loaded: capped at the trained length
        client.generate(model="long-context", prompt="")  # loads it
        assert num_ctx() == str(TRAINED)  # loaded: the engine's
        assert ps(server)["long-context:latest"] == TRAINED


def test_a_prompt_past_the_trained_length_is_a_400_in_the_openai_shape(server: Server) -> None:
    with server.client() as client, pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=LONG, max_tokens=8)
    error = info.value.body
    assert isinstance(error, dict) and error["code"] == "context_length_exceeded"
    assert f"this model's context is {TRAINED} tokens per sequence" in error["message"]
    assert CANNOT in error["message"]


def test_a_prompt_past_the_trained_length_is_a_400_in_the_native_shape(server: Server) -> None:
    with ollama.Client(host=server.base_url) as client, pytest.raises(ollama.ResponseError) as info:
        client.chat(model=MODEL, messages=LONG)
    assert info.value.status_code == 400 and CANNOT in info.value.error


def test_a_prompt_past_the_trained_length_is_a_400_in_anthropic_wording(server: Server) -> None:
    client = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0,
                                 _strict_response_validation=True)
    with pytest.raises(anthropic.BadRequestError) as info, \
            client.messages.stream(model=MODEL, max_tokens=32000, messages=LONG) as stream:  # as Claude Code asks
        stream.get_final_message()
    message = info.value.body["error"]["message"]  # type: ignore[index]
    found = CLAUDE_CODE_PATTERN.match(message)
    assert found is not None and int(found.group(1)) > TRAINED and found.group(2) == str(TRAINED), message
    assert CANNOT in message


def test_a_prompt_over_a_smaller_context_is_told_the_context_that_fits(server: Server) -> None:
    with ollama.Client(host=server.base_url) as client, pytest.raises(ollama.ResponseError) as info:
        client.chat(model=MODEL, messages=[{"role": "user", "content": "hello " * 1500}], options={"num_ctx": 1024})
    assert info.value.status_code == 400
    assert f"trained for up to {TRAINED} tokens: start the server with -c 2048" in info.value.error
    assert "set num_ctx 2048" in info.value.error


def test_max_tokens_beyond_the_context_is_not_refused(server: Server) -> None:
    """Claude Code asks for 32,000 tokens whatever the model: the reply may take what the context leaves."""
    client = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0,
                                 _strict_response_validation=True)
    with client.messages.stream(model=MODEL, max_tokens=32000, messages=[{"role": "user", "content": "Say hi."}],
                                extra_body={"temperature": 0}) as stream:
        reply = stream.get_final_message()
    assert reply.stop_reason in ("end_turn", "max_tokens", "model_context_window_exceeded")


def loads(base_url: str, model: str, headers: dict[str, str] | None = None) -> float:
    """How many times the server loaded `model` (its /metrics counter)."""
    text = httpx.get(base_url + "/metrics", headers=headers, timeout=5).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "lmserve_model_loads_total" and sample.labels.get("model") == model)


def check_num_ctx_reloads_nothing(base_url: str, model: str, contexts: tuple[int, ...],
                                  headers: dict[str, str] | None = None) -> None:
    """Chats with a new `num_ctx` each (aider sends 1.25 x the prompt + 8192 with every request) and Open WebUI's
    `num_keep`, through the official ollama client: none within the loaded context loads the model again."""
    before = loads(base_url, model, headers)
    assert before >= 1
    with ollama.Client(host=base_url, headers=headers) as client:
        for num_ctx in contexts:
            reply = client.chat(model=model, messages=[{"role": "user", "content": "Say hi."}],
                                options={"num_ctx": num_ctx, "num_keep": 24, "num_predict": 4, "temperature": 0})
            assert reply.done and reply.eval_count, reply
    assert loads(base_url, model, headers) == before


def test_a_num_ctx_within_the_loaded_context_reloads_nothing(server: Server) -> None:
    check_num_ctx_reloads_nothing(server.base_url, MODEL, (9000, 9001, TRAINED, 1024))  # capped at the trained


def test_the_log_names_both_numbers(server: Server) -> None:
    out = server.stop()
    assert f"context  {ASKED} tokens per sequence asked, at most the model's trained length" in out
    assert re.search(rf"^{MODEL}: a context of {ASKED} tokens per sequence was asked for .* but the model was trained "
                     rf"for {TRAINED}: its context is {TRAINED} tokens per sequence$", out, re.MULTILINE), out
    assert f"loaded {MODEL}: context {TRAINED} tokens per sequence x 1 slot (asked, trained for {TRAINED})" in out
