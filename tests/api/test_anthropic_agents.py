"""What agents send to the Anthropic Messages API (Claude Code's requests, captured from its npm release 2.1.197),
over the fake engine: every field and block is honoured or, where Anthropic calls it advisory, accepted; refusals
use Anthropic's wording, which Claude Code's fallbacks match.

Context editing (`context_management`, lmserve/dialects/anthropic/context.py) is checked through count_tokens (what
the rendered prompt holds) and the response's `applied_edits`."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anthropic
import httpx
import httpx2
import pytest
import pytest_asyncio
from fastapi import FastAPI

from lmserve.chat.template import ChatTemplate
from lmserve.config import ServerConfig
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.fake import FakeBackend
from lmserve.http.app import create_app
from lmserve.service import static_service
from lmserve.service.residency import LoadedModel

MESSAGES = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
BETAS = ("claude-code-20250219,interleaved-thinking-2025-05-14,thinking-token-count-2026-05-13,"
         "context-management-2025-06-27,prompt-caching-scope-2026-01-05,mid-conversation-system-2026-04-07,"
         "effort-2025-11-24")
CLAUDE_CODE_HEADERS = {"anthropic-beta": BETAS, "anthropic-version": "2023-06-01", "x-app": "cli",
                       "anthropic-dangerous-direct-browser-access": "true", "x-api-key": "x",
                       "X-Claude-Code-Session-Id": "970b2a33-7166-447d-bcef-358e05bab2bc"}
TOOL = {"name": "Read", "description": "Read a file.",
        "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}},
                         "required": ["file_path"], "additionalProperties": False,
                         "$schema": "https://json-schema.org/draft/2020-12/schema"}}
WITH_THINKING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
    "</think>{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A template that keeps earlier thinking (as some thinking models' do): clearing it shortens the prompt."""
ONLY_FIRST_SYSTEM = (
    "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('System role only supported at the start') }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def claude_code_body(**fields: Any) -> dict[str, Any]:
    """The shape of Claude Code's first request (texts shortened)."""
    return {
        "model": "fake",
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.0df;"},
                   {"type": "text", "text": "You are a Claude agent.", "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "You are an interactive agent.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>\nToday's date is 2026-11-26.\n</system-reminder>\n\n"},
                {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "Available agent types for the Agent tool: claude, Explore."},
        ],
        "tools": [TOOL],
        "metadata": {"user_id": '{"device_id":"50c2","account_uuid":"","session_id":"970b"}'},
        "max_tokens": 32000,
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "stream": True,
        **fields,
    }


def fake_app(template: str | None = None, **backend: Any) -> tuple[FastAPI, BatchingEngine]:
    engine = BatchingEngine(FakeBackend(**backend))
    model = LoadedModel(name="fake", engine=engine, template=ChatTemplate(template), template_source=template)
    return create_app(static_service([model]), ServerConfig()), engine


@pytest.fixture
def app() -> Iterator[FastAPI]:
    app, engine = fake_app(WITH_THINKING, num_ctx=4096, eog_after=4)
    yield app
    engine.close()


@pytest_asyncio.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
        yield client


def error_message(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    payload = response.json()
    assert payload["type"] == "error" and payload["error"]["type"] == kind, payload
    return str(payload["error"]["message"])


async def count(client: httpx.AsyncClient, messages: list[dict[str, Any]], **fields: Any) -> int:
    response = await client.post(COUNT, json={"model": "fake", "messages": messages, **fields})
    assert response.status_code == 200, response.text
    return int(response.json()["input_tokens"])


# ---- Claude Code's request ------------------------------------------------------------------------------------


async def test_claude_codes_first_request_streams_a_reply(client: httpx.AsyncClient) -> None:
    response = await client.post(MESSAGES + "?beta=true", json=claude_code_body(), headers=CLAUDE_CODE_HEADERS)
    assert response.status_code == 200, response.text
    events = [line.removeprefix("event: ") for line in response.text.splitlines() if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"], events
    assert "error" not in events


async def test_claude_codes_request_through_the_official_beta_client(app: FastAPI) -> None:
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app), base_url="http://test") as http:
        client = anthropic.AsyncAnthropic(base_url="http://test", api_key="x", http_client=http, max_retries=0,
                                          _strict_response_validation=True)
        fields = claude_code_body(stream=False, max_tokens=8000)  # the client wants a stream for more
        message = await client.beta.messages.create(betas=BETAS.split(","), **fields)
    assert message.stop_reason == "end_turn" and message.content[0].type == "text"
    assert message.context_management is not None and message.context_management.applied_edits == []


# ---- system messages in the conversation ----------------------------------------------------------------------


async def test_a_system_message_in_the_conversation_is_in_the_prompt(client: httpx.AsyncClient) -> None:
    user = {"role": "user", "content": "hi"}
    bare = await count(client, [user])
    as_text = await count(client, [user, {"role": "system", "content": "Be brief."}])
    as_blocks = await count(client, [user, {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}])
    assert as_text == as_blocks > bare


async def test_system_messages_alone_are_not_a_conversation(client: httpx.AsyncClient) -> None:
    messages = [{"role": "system", "content": "Be brief."}]
    response = await client.post(MESSAGES, json={"model": "fake", "max_tokens": 4, "messages": messages})
    assert "at least one user or assistant message" in error_message(response, 400, "invalid_request_error")


async def test_a_system_message_takes_text_blocks_only(client: httpx.AsyncClient) -> None:
    call = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {}}
    messages = [{"role": "user", "content": "hi"}, {"role": "system", "content": [call]}]
    response = await client.post(MESSAGES, json={"model": "fake", "max_tokens": 4, "messages": messages})
    assert "a system message takes text blocks only" in error_message(response, 400, "invalid_request_error")


async def test_a_template_that_refuses_it_says_so_in_the_words_claude_code_falls_back_on() -> None:
    app, engine = fake_app(ONLY_FIRST_SYSTEM)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
            response = await client.post(MESSAGES, json=claude_code_body(stream=False))
            message = error_message(response, 400, "invalid_request_error")
            # Claude Code 2.1.197 resends the system messages as user text on this (its check, verbatim)
            assert "not supported" in message and re.search(r"role .{0,2}system", message, re.IGNORECASE)
            without = claude_code_body(stream=False)
            without["messages"] = without["messages"][:1]
            assert (await client.post(MESSAGES, json=without)).status_code == 200
    finally:
        engine.close()


# ---- refusals in Anthropic's words ----------------------------------------------------------------------------


async def test_an_unknown_model_is_not_found_naming_the_model(client: httpx.AsyncClient) -> None:
    response = await client.post(MESSAGES, json=claude_code_body(model="claude-sonnet-4-5"))
    assert error_message(response, 404, "not_found_error").startswith("model: claude-sonnet-4-5")


async def test_a_prompt_over_the_context_is_too_long_in_anthropics_words(client: httpx.AsyncClient) -> None:
    long = [{"role": "user", "content": "word " * 5000}]
    response = await client.post(MESSAGES, json={"model": "fake", "max_tokens": 10, "messages": long})
    message = error_message(response, 400, "invalid_request_error")
    # Claude Code 2.1.197 reads the numbers with this pattern (verbatim) to compact the conversation
    found = re.search(r"prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)", message, re.IGNORECASE)
    assert found and int(found[1]) > int(found[2]) == 4096, message


# ---- context editing --------------------------------------------------------------------------------------------


def thinking_turns(n: int) -> list[dict[str, Any]]:
    """n exchanges whose assistant turns have thinking, then a user turn."""
    messages: list[dict[str, Any]] = []
    for i in range(n):
        messages += [{"role": "user", "content": f"question {i}"},
                     {"role": "assistant", "content": [{"type": "thinking", "thinking": f"long thought {i} " * 20,
                                                        "signature": ""},
                                                       {"type": "text", "text": f"answer {i}"}]}]
    return [*messages, {"role": "user", "content": "last question"}]


def tool_turns(n: int) -> list[dict[str, Any]]:
    """n tool uses of Read, each with a long result, then a user turn."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "read them"}]
    for i in range(n):
        messages += [{"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_{i}", "name": "Read",
                                                        "input": {"file_path": f"/f{i}"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}",
                                                   "content": f"contents of file {i} " * 30}]}]
    return [*messages, {"role": "user", "content": "done?"}]


def edits(*edit: dict[str, Any]) -> dict[str, Any]:
    return {"context_management": {"edits": list(edit)}}


@pytest.mark.parametrize(("keep", "cleared"), [("all", 0), ({"type": "thinking_turns", "value": 1}, 2),
                                               (None, 2), ({"type": "thinking_turns", "value": 3}, 0)])
async def test_clear_thinking_keeps_the_last_turns(client: httpx.AsyncClient, keep: Any, cleared: int) -> None:
    edit: dict[str, Any] = {"type": "clear_thinking_20251015", **({} if keep is None else {"keep": keep})}
    body = {"model": "fake", "max_tokens": 4, "messages": thinking_turns(3), "thinking": {"type": "adaptive"}}
    response = await client.post(MESSAGES, json={**body, **edits(edit)})
    assert response.status_code == 200, response.text
    applied = response.json()["context_management"]["applied_edits"]
    if not cleared:
        assert applied == []
        return
    [report] = applied
    assert report["type"] == "clear_thinking_20251015" and report["cleared_thinking_turns"] == cleared
    assert report["cleared_input_tokens"] > 0


@pytest.mark.parametrize(("edit", "cleared"), [
    ({"trigger": {"type": "tool_uses", "value": 2}, "keep": {"type": "tool_uses", "value": 1}}, 3),
    ({"trigger": {"type": "tool_uses", "value": 5}}, 0),  # 4 tool uses: not triggered
    ({"trigger": {"type": "input_tokens", "value": 100}}, 1),  # default keep: the last 3
    ({}, 0),  # default trigger: 100,000 input tokens
    ({"trigger": {"type": "tool_uses", "value": 1}, "exclude_tools": ["Read"]}, 0),
    ({"trigger": {"type": "tool_uses", "value": 1}, "clear_at_least": {"type": "input_tokens", "value": 10**6}}, 0),
])
async def test_clear_tool_uses(client: httpx.AsyncClient, edit: dict[str, Any], cleared: int) -> None:
    messages = tool_turns(4)
    full = await count(client, messages)
    body = {"model": "fake", "max_tokens": 4, "messages": messages, "tools": [TOOL]}
    response = await client.post(MESSAGES, json={**body, **edits({"type": "clear_tool_uses_20250919", **edit})})
    assert response.status_code == 200, response.text
    applied = response.json()["context_management"]["applied_edits"]
    assert [a.get("cleared_tool_uses") for a in applied] == ([cleared] if cleared else [])
    counted = await count(client, messages, tools=[TOOL], **edits({"type": "clear_tool_uses_20250919", **edit}))
    assert (counted < await count(client, messages, tools=[TOOL])) == bool(cleared), (counted, full)


async def test_a_stream_reports_the_edits_in_its_message_delta(client: httpx.AsyncClient) -> None:
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 1},
            "keep": {"type": "tool_uses", "value": 0}, "clear_tool_inputs": True}
    body = {"model": "fake", "max_tokens": 4, "messages": tool_turns(2), "stream": True, **edits(edit)}
    response = await client.post(MESSAGES, json=body)
    assert response.status_code == 200, response.text
    [delta] = [line for line in response.text.splitlines() if line.startswith('data: {"type":"message_delta"')
               or line.startswith('data: {"type": "message_delta"')]
    assert '"cleared_tool_uses":2' in delta.replace(" ", ""), delta


@pytest.mark.parametrize("edit", [
    {"type": "clear_tool_uses_20250919", "keep": {"type": "input_tokens", "value": 3}},
    {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": -1}},
    {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": "two"}},
    {"type": "compact_20260112"},
])
async def test_a_malformed_edit_is_a_400(client: httpx.AsyncClient, edit: dict[str, Any]) -> None:
    body = {"model": "fake", "max_tokens": 4, "messages": thinking_turns(1), **edits(edit)}
    assert "context_management" in error_message(await client.post(MESSAGES, json=body), 400,
                                                 "invalid_request_error")
