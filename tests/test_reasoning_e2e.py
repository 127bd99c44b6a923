"""Reasoning end to end through a real server, read by the official clients: the thinking in
`message.reasoning_content` / `delta.reasoning_content` (OpenAI) and `message.thinking` / `thinking` (native), never
in the answer; `reasoning_effort` / `think` switch it; a budget closes it; a grammar constrains only the answer.

The models produce gibberish, so the thinking is made deterministic by the template: its generation prompt opens
`<think>` (as Qwen3-Thinking's and DeepSeek-R1's do), so a reply cut by `max_tokens` is all thinking. On llama.cpp a
tiny LFM2 with `<think>` and `</think>` as special tokens; on vLLM the embedded SmolLM2 repository with the same
template as its chat_template.jinja (the tags as plain text).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import ollama
import openai
import pytest

from tests.hf_repos import smollm2_repo
from tests.test_server import Server
from tests.tiny_lfm2 import write_tiny_lfm2

THINKING_TEMPLATE = (  # Qwen3-style: thinking on unless enable_thinking is false; earlier thinking dropped
    "{{ bos_token }}{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{% if m.role == 'assistant' %}{{ m.content.split('</think>')[-1].lstrip('\\n') }}"
    "{% else %}{{ m.content }}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}"
)
ASK: Any = [{"role": "user", "content": "Is 7 prime?"}]
VERDICT = {"type": "object", "properties": {"prime": {"enum": ["yes", "no"]}}, "required": ["prime"],
           "additionalProperties": False}
VERDICT_FORMAT: Any = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT}}


def reasoning_of(message: Any) -> str | None:
    extra = message.model_extra or {}
    value = extra.get("reasoning_content")
    return value if isinstance(value, str) else None


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = write_tiny_lfm2(tmp_path_factory.mktemp("thinking") / "tiny-thinker.gguf", chat_template=THINKING_TEMPLATE,
                           extra_specials=["<think>", "</think>"])
    srv = Server("-m", str(path), "-np", "2", "-c", "512")
    yield srv
    srv.stop()


@pytest.fixture
def client(server: Server) -> Iterator[openai.OpenAI]:
    with server.client() as c:
        yield c


@pytest.fixture
def native(server: Server) -> Iterator[ollama.Client]:
    with ollama.Client(host=server.base_url) as c:
        yield c


def model_of(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


# ---- OpenAI dialect ------------------------------------------------------------------------------------------


def test_thinking_goes_to_reasoning_content_not_content(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=model_of(client), messages=ASK, temperature=0, max_tokens=8)
    message = reply.choices[0].message
    assert reasoning_of(message) and not message.content
    assert "<think>" not in (reasoning_of(message) or "") and reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens_details is not None
    assert 0 < (reply.usage.completion_tokens_details.reasoning_tokens or 0) <= reply.usage.completion_tokens


def test_thinking_streams_as_reasoning_content_deltas(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=model_of(client), messages=ASK, temperature=0, max_tokens=8,
                                            stream=True)
    thoughts, content = [], []
    for chunk in stream:
        for choice in chunk.choices:
            thoughts.append((choice.delta.model_extra or {}).get("reasoning_content") or "")
            content.append(choice.delta.content or "")
    whole = client.chat.completions.create(model=model_of(client), messages=ASK, temperature=0, max_tokens=8)
    assert sum(1 for t in thoughts if t) >= 2  # incrementally, not in one piece at the end
    assert "".join(thoughts) == reasoning_of(whole.choices[0].message) and "".join(content) == ""


def test_reasoning_effort_none_renders_thinking_off(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=model_of(client), messages=ASK, temperature=0, max_tokens=8,
                                           reasoning_effort="none")
    assert reasoning_of(reply.choices[0].message) is None


def test_a_budget_closes_the_thinking_and_the_grammar_shapes_only_the_answer(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=model_of(client), messages=ASK, temperature=0, max_tokens=40,
                                           response_format=VERDICT_FORMAT, extra_body={"reasoning_budget": 4})
    message = reply.choices[0].message
    assert reasoning_of(message)
    assert json.loads(message.content or "")["prime"] in ("yes", "no")
    assert reply.usage is not None and reply.usage.completion_tokens <= 40


def test_a_bad_reasoning_effort_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_of(client), messages=ASK, reasoning_effort="lots")  # type: ignore[call-overload]


# ---- Anthropic Messages and OpenAI Responses ----------------------------------------------------------------


def test_anthropic_thinking_is_a_thinking_block_and_streams_as_thinking_deltas(server: Server,
                                                                              client: openai.OpenAI) -> None:
    model = model_of(client)
    with anthropic.Anthropic(base_url=server.base_url, api_key="k", max_retries=0,
                             _strict_response_validation=True) as claude:
        thinking: Any = {"type": "enabled", "budget_tokens": 1024}
        greedy: Any = {"temperature": 0}  # this client version no longer sends temperature itself
        message = claude.messages.create(model=model, messages=ASK, max_tokens=8, thinking=thinking, extra_body=greedy)
        assert [block.type for block in message.content] == ["thinking"] and message.stop_reason == "max_tokens"
        with claude.messages.stream(model=model, messages=ASK, max_tokens=8, thinking=thinking,
                                    extra_body=greedy) as stream:
            deltas = [e.delta.thinking for e in stream if e.type == "content_block_delta"
                      and e.delta.type == "thinking_delta"]
            streamed = stream.get_final_message()
    first = message.content[0]
    assert first.type == "thinking" and "".join(deltas) == first.thinking and streamed.content == message.content


def test_responses_thinking_is_a_reasoning_item_and_streams_as_reasoning_deltas(client: openai.OpenAI) -> None:
    model = model_of(client)
    whole = client.responses.create(model=model, input="Is 7 prime?", reasoning={"effort": "high"}, temperature=0,
                                    max_output_tokens=8)
    assert whole.output[0].type == "reasoning" and whole.output_text == "" and whole.status == "incomplete"
    assert whole.usage is not None and whole.usage.output_tokens_details.reasoning_tokens > 0
    with client.responses.stream(model=model, input="Is 7 prime?", reasoning={"effort": "high"}, temperature=0,
                                 max_output_tokens=8) as stream:
        deltas = [e.delta for e in stream if e.type == "response.reasoning_text.delta"]
    reasoning = whole.output[0]
    assert reasoning.type == "reasoning" and "".join(deltas) == "".join(p.text for p in reasoning.content or [])


# ---- native dialect ------------------------------------------------------------------------------------------


def test_native_chat_think_gives_message_thinking(native: ollama.Client, client: openai.OpenAI) -> None:
    model = model_of(client)
    reply = native.chat(model=model, messages=ASK, think=True, options={"temperature": 0, "num_predict": 8})
    assert reply.message.thinking and not reply.message.content
    streamed = list(native.chat(model=model, messages=ASK, think=True, stream=True,
                                options={"temperature": 0, "num_predict": 8}))
    assert "".join(part.message.thinking or "" for part in streamed) == reply.message.thinking
    assert "thinking" in (native.show(model).capabilities or [])


def test_native_think_false_and_a_budget_option(native: ollama.Client, client: openai.OpenAI) -> None:
    model = model_of(client)
    off = native.chat(model=model, messages=ASK, think=False, options={"temperature": 0, "num_predict": 8})
    assert not off.message.thinking
    budgeted = native.chat(model=model, messages=ASK, think="high", format=VERDICT,
                           options={"temperature": 0, "num_predict": 40, "reasoning_budget": 3})
    assert budgeted.message.thinking
    assert json.loads(budgeted.message.content or "")["prime"] in ("yes", "no")


def test_native_generate_gives_thinking(native: ollama.Client, client: openai.OpenAI) -> None:
    reply = native.generate(model=model_of(client), prompt="Is 7 prime?", think=True,
                            options={"temperature": 0, "num_predict": 8})
    assert reply.thinking and not reply.response


def test_a_bad_think_or_budget_is_a_400(native: ollama.Client, client: openai.OpenAI) -> None:
    with pytest.raises(ollama.ResponseError) as caught:
        native.chat(model=model_of(client), messages=ASK, think="lots")
    assert caught.value.status_code == 400
    with pytest.raises(ollama.ResponseError) as caught:
        native.chat(model=model_of(client), messages=ASK, think=True, options={"reasoning_budget": -1})
    assert caught.value.status_code == 400


def test_a_model_that_cannot_think_answers_normally() -> None:
    srv = Server("-np", "1", "-c", "512")
    try:
        with ollama.Client(host=srv.base_url) as native:
            model = native.list().models[0].model or ""
            reply = native.chat(model=model, messages=ASK, think=True, options={"temperature": 0, "num_predict": 8})
            assert reply.message.content and not reply.message.thinking
            assert "thinking" not in (native.show(model).capabilities or [])
    finally:
        srv.stop()


# ---- the vLLM engine -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def thinking_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's repository, its weights linked, with THINKING_TEMPLATE as chat_template.jinja."""
    source = smollm2_repo()
    repo = tmp_path_factory.mktemp("smollm2-thinking") / "smollm2-thinking"
    repo.mkdir()
    for item in source.iterdir():
        if item.name == "chat_template.jinja":
            continue
        if item.is_file():
            (repo / item.name).symlink_to(item)
        else:
            shutil.copytree(item, repo / item.name)
    config_path = repo / "tokenizer_config.json"
    if config_path.is_file():  # the template is ours alone: none in the tokenizer config
        config = json.loads(config_path.read_text())
        config.pop("chat_template", None)
        config_path.unlink()
        config_path.write_text(json.dumps(config))
    (repo / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return repo


def test_vllm_engine_separates_thinking_and_closes_it_at_the_budget(thinking_repo: Path) -> None:
    srv = Server(str(thinking_repo), "--dtype", "float32", "-np", "2", "-c", "512")
    try:
        with srv.client() as client:
            model = model_of(client)
            reply = client.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=8)
            assert reasoning_of(reply.choices[0].message) and not reply.choices[0].message.content
            stream = client.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=8,
                                                    stream=True)
            deltas = [(c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in stream
                      if c.choices]
            assert "".join(deltas) == reasoning_of(reply.choices[0].message)
            budgeted = client.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=40,
                                                      response_format=VERDICT_FORMAT,
                                                      extra_body={"reasoning_budget": 4})
            assert reasoning_of(budgeted.choices[0].message)
            assert json.loads(budgeted.choices[0].message.content or "")["prime"] in ("yes", "no")
        with ollama.Client(host=srv.base_url) as native:
            thought = native.chat(model=model, messages=ASK, think=True, options={"temperature": 0, "num_predict": 8})
            assert thought.message.thinking and not thought.message.content
    finally:
        srv.stop()
