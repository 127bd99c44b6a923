"""End to end: log-probabilities from a real `lmserve serve` (llama.cpp, the embedded model), read by the official
`openai` and `ollama` clients: chat (whole and streamed), legacy completions, native chat and generate."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import httpx
import ollama
import openai
import pytest

from tests.test_server import MODEL, Server

QUESTION: Any = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with server.client() as c:
        yield c


def check_entries(entries: list[Any], top: int) -> None:
    """Each token: a log-probability, its bytes, and `top` alternatives likeliest first (the greedy pick first)."""
    assert entries
    for entry in entries:
        assert entry.logprob <= 0 and bytes(entry.bytes).decode("utf-8", "replace") == entry.token
        assert len(entry.top_logprobs) == top
        values = [alt.logprob for alt in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and sum(math.exp(v) for v in values) <= 1 + 1e-6
        if top:
            assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob


def test_chat_logprobs_cover_the_reply(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=20,
                                           logprobs=True, top_logprobs=3)
    choice = reply.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    check_entries(choice.logprobs.content, 3)
    assert "".join(e.token for e in choice.logprobs.content) == choice.message.content
    assert len(choice.logprobs.content) == reply.usage.completion_tokens - (choice.finish_reason == "stop")  # type: ignore[union-attr]


def test_streamed_chat_logprobs_come_with_their_text(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=20,
                                           logprobs=True, top_logprobs=2)
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=20,
                                            logprobs=True, top_logprobs=2, stream=True)
    entries: list[Any] = []
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        if choice.logprobs is not None and choice.logprobs.content:
            assert "".join(e.token for e in choice.logprobs.content) == (choice.delta.content or "")
            entries += choice.logprobs.content
    assert whole.choices[0].logprobs is not None
    assert [(e.token, e.logprob) for e in entries] == [(e.token, e.logprob) for e in whole.choices[0].logprobs.content
                                                       or []]


def test_no_logprobs_unless_asked(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=5)
    assert reply.choices[0].logprobs is None
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=5, logprobs=True)
    assert plain.choices[0].logprobs is not None and plain.choices[0].logprobs.content
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)


def test_legacy_completion_logprobs(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=8,
                                      logprobs=2)
    choice = reply.choices[0]
    assert choice.logprobs is not None
    lp = choice.logprobs
    assert "".join(lp.tokens or []) == choice.text
    assert len(lp.token_logprobs or []) == len(lp.tokens or []) == len(lp.text_offset or [])
    assert lp.text_offset == [len("".join((lp.tokens or [])[:i])) for i in range(len(lp.tokens or []))]
    for token, value, top in zip(lp.tokens or [], lp.token_logprobs or [], lp.top_logprobs or [], strict=True):
        assert top[token] == value and max(top.values()) == value and 2 <= len(top) <= 3
    # The legacy stream's pieces have `finish_reason: null`, which the client's strict validation of `Completion`
    # (its literal lacks None) refuses: read them unvalidated.
    tokens: list[str] = []
    offsets: list[int] = []
    with openai.OpenAI(base_url=client.base_url, api_key="placeholder", max_retries=0) as lenient:
        for chunk in lenient.completions.create(model=MODEL, prompt="The capital of France is", temperature=0,
                                                max_tokens=8, logprobs=2, stream=True):
            if chunk.choices and chunk.choices[0].logprobs is not None:
                tokens += chunk.choices[0].logprobs.tokens or []
                offsets += chunk.choices[0].logprobs.text_offset or []
    assert tokens == lp.tokens and offsets == lp.text_offset


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": QUESTION, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": QUESTION, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 6}, "logprobs"),
])
def test_bad_values_are_a_400(server: Server, path: str, body: dict[str, Any], param: str) -> None:
    response = httpx.post(server.base_url + path, json={"model": MODEL, **body}, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert param in (error.get("param") or "") + error["message"]


def test_native_chat_and_generate_logprobs(server: Server) -> None:
    with ollama.Client(host=server.base_url) as native:
        check_native(native)


def check_native(native: ollama.Client) -> None:
    reply = native.chat(model=MODEL, messages=QUESTION, options={"temperature": 0, "num_predict": 12}, logprobs=True,
                        top_logprobs=2)
    assert reply.logprobs and "".join(e.token for e in reply.logprobs) == reply.message.content
    for entry in reply.logprobs:
        assert entry.logprob <= 0 and entry.top_logprobs is not None and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token
    streamed = [e for part in native.chat(model=MODEL, messages=QUESTION, options={"temperature": 0, "num_predict": 12},
                                          logprobs=True, top_logprobs=2, stream=True) for e in part.logprobs or []]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in reply.logprobs]
    generated = native.generate(model=MODEL, prompt="Name a fruit.", options={"temperature": 0, "num_predict": 8},
                                logprobs=True)
    assert generated.logprobs and "".join(e.token for e in generated.logprobs) == generated.response
    assert native.generate(model=MODEL, prompt="Hi", options={"num_predict": 2}).logprobs is None
    with pytest.raises(ollama.ResponseError):
        native.chat(model=MODEL, messages=QUESTION, top_logprobs=3)


def test_structured_output_and_forced_tool_calls_have_logprobs(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is the sky blue? Answer in JSON."}], temperature=0,
        max_tokens=30, logprobs=True, top_logprobs=1, response_format={"type": "json_object"},
    )
    content = reply.choices[0].logprobs.content if reply.choices[0].logprobs else None
    text = reply.choices[0].message.content or ""
    assert content
    spelled = "".join(e.token for e in content)
    if reply.choices[0].finish_reason == "length":  # closed in time (service/json_budget.py): the closing was not
        assert text.startswith(spelled)  # sampled, so it has no logprobs
    else:
        assert spelled == text
    called = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}], temperature=0,
        max_tokens=60, logprobs=True, tool_choice="required", tools=[{"type": "function", "function": {
            "name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
    )
    assert called.choices[0].message.tool_calls and called.choices[0].logprobs is not None
    assert called.choices[0].logprobs.content  # the call's markup tokens


def check_prompt_logprobs_score_the_greedy_reply(base_url: str, model: str, tolerance: float,
                                                 headers: dict[str, str] | None = None) -> None:
    """What lm-evaluation-harness's multiple-choice tasks rely on (its `local-completions` posts JSON; the first
    token's null log-probability is vLLM's shape, which the `openai` client's strict schema refuses): sent back as a
    prompt of token ids (with `echo`, `logprobs: 1`, `max_tokens: 1`, several prompts in one request), a greedy
    reply's tokens get the log-probabilities they had when they were generated, each the likeliest at its place.
    `tolerance`: what the engine's batch shapes may change in the last digits."""
    generated = httpx.post(base_url + "/api/generate", headers=headers, timeout=120, json={
        "model": model, "prompt": "The capital of France is", "raw": True, "stream": False, "logprobs": True,
        "options": {"temperature": 0, "num_predict": 6, "repeat_penalty": 1.0}}).json()
    context, reply = generated["context"], generated["logprobs"]
    prompt_length = len(context) - len(reply)
    assert len(reply) == 6 and prompt_length > 1, generated
    lengths = (len(context), prompt_length + 2)
    scored = httpx.post(base_url + "/v1/completions", headers=headers, timeout=120, json={
        "model": model, "prompt": [context[:length] for length in lengths], "echo": True, "logprobs": 1,
        "max_tokens": 1, "temperature": 0}).json()
    assert "choices" in scored, scored
    assert [choice["index"] for choice in scored["choices"]] == [0, 1], scored
    for choice, length in zip(scored["choices"], lengths, strict=True):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(lp["tokens"]) == length + 1  # the prompt's tokens, one generated
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        ours = lp["token_logprobs"][prompt_length:length]
        assert ours == pytest.approx([entry["logprob"] for entry in reply][:len(ours)], abs=tolerance)
        for value, top in zip(ours, lp["top_logprobs"][prompt_length:length], strict=True):
            assert max(top.values()) == pytest.approx(value, abs=tolerance)  # greedy: each was the likeliest
        assert all(value <= 0 for value in lp["token_logprobs"][1:])
    assert scored["usage"]["prompt_tokens"] == sum(lengths)
    check_an_ended_reply_keeps_its_token(base_url, model, context[:prompt_length], headers)


EOS = 2
"""SmolLM2's end of a turn, `<|im_end|>` (its GGUF and its repository share the vocabulary)."""


def check_an_ended_reply_keeps_its_token(base_url: str, model: str, prompt: list[int],
                                         headers: dict[str, str] | None) -> None:
    """A scored continuation after which the model would end its turn: lm-eval reads the entries between the context
    and the last one, so the end-of-turn token, which has no text, keeps its entry (as vLLM's own server does)."""
    ended = httpx.post(base_url + "/v1/completions", headers=headers, timeout=120, json={
        "model": model, "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0,
        "logit_bias": {str(EOS): 100}}).json()
    [choice] = ended["choices"]
    assert choice["finish_reason"] == "stop", ended
    assert len(choice["logprobs"]["token_logprobs"]) == len(prompt) + 1, ended
    assert choice["logprobs"]["token_logprobs"][-1] <= 0, ended


def test_prompt_logprobs_score_the_greedy_reply(server: Server) -> None:
    check_prompt_logprobs_score_the_greedy_reply(server.base_url, MODEL, 2e-3)


def test_the_openai_clients_completions_take_token_ids_lists_and_echo(server: Server) -> None:
    """The official client as lm-eval's users call it (its default, lenient validation: the echoed prompt's first
    token has a null log-probability, which its schema does not allow for)."""
    ids = httpx.post(server.base_url + "/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"]
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="placeholder", max_retries=0) as lenient:
        reply = lenient.completions.create(model=MODEL, prompt=[ids, ids[:3]], echo=True, logprobs=2, max_tokens=2,
                                           temperature=0, n=2)
    assert [choice.index for choice in reply.choices] == [0, 1, 2, 3]  # prompt i's choice j: i * n + j
    for choice, length in zip(reply.choices, (len(ids), len(ids), 3, 3), strict=True):
        lp = choice.logprobs
        assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
        assert len(lp.tokens) == length + 2 and lp.token_logprobs[0] is None
        assert choice.text.startswith("".join(lp.tokens[:length]))  # the prompt, echoed as the model's text
    assert reply.choices[0].logprobs == reply.choices[1].logprobs  # greedy: both choices alike
    assert reply.usage is not None and reply.usage.prompt_tokens == len(ids) + 3
