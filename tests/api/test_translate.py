"""The OpenAI dialect's translators: wire request → engine-neutral records, validation errors → param."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from lmserve import options as opts
from lmserve.dialects.openai import schemas
from lmserve.dialects.openai.translate import to_chat_request, to_completion_request, to_options
from lmserve.dialects.shared.errors import invalid_from_validation, location
from lmserve.errors import InvalidRequest
from lmserve.types import SamplingParams, ToolCall

USER = [{"role": "user", "content": "hi"}]


def chat_req(**fields: Any) -> schemas.ChatCompletionRequest:
    return schemas.ChatCompletionRequest.model_validate({"model": "m", "messages": USER, **fields})


SAMPLING_CASES: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({}, {}),
    ({"temperature": 0, "top_p": 0.5, "seed": 3}, {"temperature": 0.0, "top_p": 0.5, "seed": 3}),
    ({"min_p": 0.1}, {"min_p": 0.1}),
    ({"top_k": 40}, {"top_k": 40}),
    ({"top_k": -1}, {"top_k": 0}),
    ({"repeat_penalty": 1.2}, {"repeat_penalty": 1.2}),
    ({"repetition_penalty": 1.3}, {"repeat_penalty": 1.3}),
    ({"repeat_penalty": 1.1, "repetition_penalty": 1.3}, {"repeat_penalty": 1.1}),
    ({"presence_penalty": 0.5, "frequency_penalty": -0.5}, {"presence_penalty": 0.5, "frequency_penalty": -0.5}),
    ({"max_tokens": 7}, {"max_tokens": 7}),
    ({"max_tokens": 7, "max_completion_tokens": 3}, {"max_tokens": 3}),
    ({"stop": "\n"}, {"stop": ["\n"]}),
    ({"stop": ["a", "b"]}, {"stop": ["a", "b"]}),
    ({"logit_bias": {"15": -100, "7": 2.5}}, {"logit_bias": {15: -100.0, 7: 2.5}}),
    ({"ignore_eos": True}, {"ignore_eos": True}),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "changes"), SAMPLING_CASES)
def test_to_options(fields: dict[str, Any], changes: dict[str, Any]) -> None:
    params = opts.sampling(to_options(chat_req(**fields)).values)
    default = SamplingParams()
    for name in SamplingParams.__slots__:
        assert getattr(params, name) == changes.get(name, getattr(default, name)), name


@pytest.mark.parametrize("bias", [{"x": 1}, {"1.5": 1}, {"-3": 1}, {"4": 101}])
def test_bad_logit_bias(bias: dict[str, float]) -> None:
    with pytest.raises(InvalidRequest) as info:
        to_options(chat_req(logit_bias=bias))
    assert info.value.param == "logit_bias"


def test_to_chat_request_messages() -> None:
    png = b"\x89PNG\r\n"
    data_url = "data:image/png;base64," + base64.b64encode(png).decode()
    messages = [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [
            {"type": "text", "text": "one"},
            {"type": "image_url", "image_url": {"url": data_url}},
            {"type": "text", "text": "two"},
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png", "detail": "low"}},
        ]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_9", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
        ]},
        {"role": "tool", "tool_call_id": "call_9", "content": "42", "name": "f"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
    ]  # fmt: skip
    req = chat_req(messages=messages, max_tokens=5)
    with pytest.raises(InvalidRequest):  # image parts need their images loaded first (load_images)
        to_chat_request(req)
    request = to_chat_request(req, images=[[], [png, b"fetched"], [], [], []])
    system, user, assistant, tool, refusal = request.messages
    assert (system.role, system.content) == ("system", "rules")
    assert (user.content, user.images) == ("one\ufffctwo\ufffc", [png, b"fetched"])  # images stay where they were
    assert (assistant.content, assistant.tool_calls) == ("", [ToolCall(name="f", arguments='{"x":1}', id="call_9")])
    assert (tool.role, tool.tool_call_id, tool.name, tool.content) == ("tool", "call_9", "f", "42")
    assert (refusal.role, refusal.content) == ("assistant", "no")
    assert request.options.values == {"num_predict": 5}
    assert request.model == "m"


@pytest.mark.parametrize(("tool_choice", "num_tools"), [(None, 1), ("auto", 1), ("required", 1), ("none", 0)])
def test_tools_passed_unless_tool_choice_none(tool_choice: str | None, num_tools: int) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    request = to_chat_request(chat_req(tools=tools, tool_choice=tool_choice))
    assert len(request.tools) == num_tools
    if num_tools:
        assert request.tools[0] == {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(("prompt", "expected"), [("abc", "abc"), (["abc"], "abc"), ([], "")])
def test_to_completion_request(prompt: Any, expected: str) -> None:
    req = schemas.CompletionRequest.model_validate({"model": "m", "prompt": prompt, "stop": "x"})
    request = to_completion_request(req)
    assert (request.model, request.prompt, request.options.values) == ("m", expected, {"stop": ["x"]})


@pytest.mark.parametrize(
    ("loc", "expected"),
    [
        (("messages", 0, "role"), "messages[0].role"),
        (("stop", "list[str]", 3), "stop[3]"),
        (("messages", 1, "content", "list[tagged-union[TextPart,ImagePart]]", 0, "text", "text"),
         "messages[1].content[0].text"),  # a discriminated union's tag ("text") names its payload too: said once
        (("messages", 0, "content", "list[tagged-union[TextPart,ImagePart]]", 0, "image_url", "image_url", "url"),
         "messages[0].content[0].image_url.url"),
        (("response_format", "json_schema", "json_schema", "name"), "response_format.json_schema.name"),
        (("tool_choice", "NamedToolChoice", "function"), "tool_choice.function"),
        (("temperature", "float"), "temperature"),
    ],
)  # fmt: skip
def test_location(loc: tuple[int | str, ...], expected: str) -> None:
    assert location(loc) == expected


def test_invalid_from_validation_strips_fastapi_prefix() -> None:
    err = invalid_from_validation([{"loc": ("body", "temperature"), "type": "float_parsing", "msg": "bad"}], strip=1)
    assert (err.param, err.status) == ("temperature", 400)
    assert "temperature" in err.message


def test_text_parts_join_with_newlines_and_images_keep_their_place() -> None:
    parts = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
        {"type": "text", "text": "a"},
        {"type": "text", "text": "b"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
        {"type": "text", "text": "c"},
    ]
    request = to_chat_request(chat_req(messages=[{"role": "user", "content": parts}]), images=[[b"1", b"2"]])
    assert request.messages[0].content == "\ufffca\nb\ufffcc"


def test_an_assistant_turns_reasoning_content_is_its_thinking() -> None:
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
                {"role": "user", "content": "And 3+3?"}]
    request = to_chat_request(chat_req(messages=messages))
    assert [m.thinking for m in request.messages] == ["", "Add them.", ""]
