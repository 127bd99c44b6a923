"""Spec for lmserve.chat.template: messages → prompt through a sandboxed chat template."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from lmserve.chat.template import CHATML_TEMPLATE, ChatTemplate
from lmserve.errors import InvalidRequest
from lmserve.types import Message, ToolCall

# Like HuggingFaceTB/SmolLM2-*-Instruct: ChatML that injects a default system prompt when none is given.
SMOLLM2 = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"

# Like the LFM2 text template shipped in LFM2 GGUFs (see shared/reference/lfm2.md): it never reads `tool_calls`
# and prints non-string content with `tojson` (so a null content would come out as the text `null`).
LFM2 = """{{- bos_token -}}
{%- set ns = namespace(system_prompt="") -%}
{%- if messages and messages[0]["role"] == "system" -%}
    {%- set ns.system_prompt = messages[0]["content"] -%}
    {%- set messages = messages[1:] -%}
{%- endif -%}
{%- if tools -%}
    {%- set ns.system_prompt = ns.system_prompt + ("\\n" if ns.system_prompt else "") -%}
    {%- set ns.system_prompt = ns.system_prompt + "List of tools: <|tool_list_start|>[" -%}
    {%- for tool in tools -%}
        {%- if tool is not string -%}{%- set tool = tool | tojson -%}{%- endif -%}
        {%- set ns.system_prompt = ns.system_prompt + tool -%}
        {%- if not loop.last -%}{%- set ns.system_prompt = ns.system_prompt + ", " -%}{%- endif -%}
    {%- endfor -%}
    {%- set ns.system_prompt = ns.system_prompt + "]<|tool_list_end|>" -%}
{%- endif -%}
{%- if ns.system_prompt -%}
    {{- "<|im_start|>system\\n" + ns.system_prompt + "<|im_end|>\\n" -}}
{%- endif -%}
{%- for message in messages -%}
    {{- "<|im_start|>" + message["role"] + "\\n" -}}
    {%- set content = message["content"] -%}
    {%- if content is not string -%}{%- set content = content | tojson -%}{%- endif -%}
    {%- if message["role"] == "tool" -%}
        {%- set content = "<|tool_response_start|>" + content + "<|tool_response_end|>" -%}
    {%- endif -%}
    {{- content + "<|im_end|>\\n" -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- "<|im_start|>assistant\\n" -}}
{%- endif -%}
"""

WEATHER_TOOL: dict[str, Any] = {
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
WEATHER_JSON = (
    '{"name": "get_weather", "description": "Weather in a city", "parameters": {"type": "object", '
    '"properties": {"city": {"type": "string"}}, "required": ["city"]}}'
)


def user(text: str) -> Message:
    return Message(role="user", content=text)


def null_content(role: str) -> Message:
    """Build a message whose content arrived as JSON null (typed str, but the edge may let None through)."""
    message = Message(role="assistant")
    message.role = role  # type: ignore[assignment]
    message.content = None  # type: ignore[assignment]
    return message


# ── ChatML fallback ────────────────────────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("messages", "add_generation_prompt", "expected"),
    [
        ([user("hi")], True, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"),
        ([user("hi")], False, "<|im_start|>user\nhi<|im_end|>\n"),
        (
            [Message("system", "be brief"), user("hi"), Message("assistant", "hello"), user("bye")],
            True,
            "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
            "<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>user\nbye<|im_end|>\n<|im_start|>assistant\n",
        ),
        (
            [Message("developer", "rules"), user("hi")],
            False,
            "<|im_start|>system\nrules<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",
        ),
        ([null_content("assistant")], False, "<|im_start|>assistant\n<|im_end|>\n"),
        ([user("line1\nline2  ")], False, "<|im_start|>user\nline1\nline2  <|im_end|>\n"),
        ([], True, "<|im_start|>assistant\n"),
    ],
    ids=[
        "one-turn",
        "no-generation-prompt",
        "conversation",
        "developer-is-system",
        "null-content",
        "verbatim",
        "empty",
    ],
)
def test_chatml_fallback(messages: list[Message], add_generation_prompt: bool, expected: str) -> None:
    template = ChatTemplate(None)
    assert template.is_fallback
    assert template.render(messages, add_generation_prompt=add_generation_prompt) == expected


def test_explicit_chatml_source_is_not_fallback() -> None:
    template = ChatTemplate(CHATML_TEMPLATE)
    assert not template.is_fallback
    assert template.render([user("hi")]) == ChatTemplate(None).render([user("hi")])


# ── HF-style templates ─────────────────────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        ([user("hi")], SMOL_SYSTEM + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"),
        (
            [Message("system", "be brief"), user("hi")],
            "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
        ),
        (
            [Message("developer", "be brief"), user("hi")],
            "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
        ),
        (
            [user("hi"), null_content("assistant"), user("again")],
            SMOL_SYSTEM + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"
            "<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n",
        ),
    ],
    ids=["default-system-injected", "own-system-kept", "developer-counts-as-system", "null-content-is-empty"],
)
def test_smollm2_template(messages: list[Message], expected: str) -> None:
    assert ChatTemplate(SMOLLM2).render(messages) == expected


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("{{ bos_token }}|{{ eos_token }}", "<s>|</s>"),
        ("{{ messages | map(attribute='role') | join(',') }}", "system,user"),
        ("{{ tools | tojson }}", "[" + WEATHER_JSON + "]"),
        ("{{ tools[0].name }}:{{ tools[0].parameters.required[0] }}", "get_weather:city"),
        ("{{ {'a': '<é>'} | tojson }}", '{"a": "<é>"}'),
        ("{{ {'a': [1]} | tojson(indent=2) }}", '{\n  "a": [\n    1\n  ]\n}'),
        ("{{ {'b': 1, 'a': 2} | tojson(sort_keys=true) }}", '{"a": 2, "b": 1}'),
        ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}", "sys"),
        ("{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}{{ m.content }}{% endfor %}", "hi"),
        ("{% generation %}{{ messages[1].content }}{% endgeneration %}", "hi"),
        ("{% if add_generation_prompt %}\n  GEN\n{% endif %}\n", "  GEN\n"),
        ("{{ messages[1].missing }}|{{ undefined_var }}|{{ messages[1].get('name', 'anon') }}", "||anon"),
    ],
    ids=[
        "special-tokens",
        "roles",
        "tools-passed-through",
        "tools-indexable",
        "tojson-no-html-escape-keeps-unicode",
        "tojson-indent",
        "tojson-sort-keys",
        "loopcontrols-break",
        "loopcontrols-continue",
        "generation-tag",
        "trim-and-lstrip-blocks",
        "lenient-undefined",
    ],
)
def test_template_environment(source: str, expected: str) -> None:
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    messages = [Message("developer", "sys"), user("hi")]
    assert template.render(messages, tools=[WEATHER_TOOL]) == expected


@pytest.mark.parametrize("tools", [None, []], ids=["none", "empty-list"])
def test_absent_tools_are_none(tools: list[dict[str, Any]] | None) -> None:
    assert ChatTemplate("{{ tools is none }}").render([user("hi")], tools=tools) == "True"


def test_strftime_now() -> None:
    year = ChatTemplate("{{ strftime_now('%Y') }}").render([])
    assert year in {str(datetime.date.today().year), str(datetime.date.today().year - 1)}


def test_tool_calls_have_openai_shape_with_parsed_arguments() -> None:
    source = (
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "{{ c.id }} {{ c.type }} {{ c.function.name }} {{ c.function.arguments is mapping }} "
        "{{ c.function.arguments.city if c.function.arguments is mapping else c.function.arguments }};"
        "{% endfor %}{% if m.tool_call_id is defined %}[{{ m.tool_call_id }} {{ m.name }}]{% endif %}"
        "{% if m.tool_calls is not defined %}-{% endif %}{% endfor %}"
    )
    messages = [
        user("weather?"),
        Message(
            "assistant",
            tool_calls=[
                ToolCall("get_weather", '{"city": "Paris"}', id="call_1"),
                ToolCall("broken", "{not json", id="call_2"),
                ToolCall("listy", "[1, 2]", id="call_3"),
            ],
        ),
        Message("tool", "18C", tool_call_id="call_1", name="get_weather"),
    ]
    assert ChatTemplate(source).render(messages) == (
        "-call_1 function get_weather True Paris;call_2 function broken False {not json;"
        "call_3 function listy False [1, 2];[call_1 get_weather]-"
    )


# ── LFM2 ───────────────────────────────────────────────────────────────────────────────────────────────────────────

LFM2_CASES: list[tuple[str, list[Message], list[dict[str, Any]] | None, str]] = [
    (
        "system-and-user",
        [Message("system", "You are helpful."), user("What is C. elegans?")],
        None,
        "<|startoftext|><|im_start|>system\nYou are helpful.<|im_end|>\n"
        "<|im_start|>user\nWhat is C. elegans?<|im_end|>\n<|im_start|>assistant\n",
    ),
    (
        "no-system-no-tools",
        [user("hi")],
        None,
        "<|startoftext|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    ),
    (
        "tools-without-system",
        [user("weather?")],
        [WEATHER_TOOL],
        "<|startoftext|><|im_start|>system\nList of tools: <|tool_list_start|>["
        + WEATHER_JSON
        + "]<|tool_list_end|><|im_end|>\n<|im_start|>user\nweather?<|im_end|>\n<|im_start|>assistant\n",
    ),
    (
        "tool-round-trip",
        [
            Message("developer", "Be brief."),
            user("Weather in Paris?"),
            Message("assistant", tool_calls=[ToolCall("get_weather", '{"city": "Paris", "days": 2, "metric": true}')]),
            Message("tool", '{"temp": 18}', tool_call_id="c1"),
            Message("assistant", "Checking both.", tool_calls=[ToolCall("a", "{}"), ToolCall("b", '{"x": [1, null]}')]),
        ],
        [WEATHER_TOOL],
        "<|startoftext|><|im_start|>system\nBe brief.\nList of tools: <|tool_list_start|>["
        + WEATHER_JSON
        + "]<|tool_list_end|><|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<|tool_call_start|>[get_weather(city="Paris", days=2, metric=True)]<|tool_call_end|>'
        "<|im_end|>\n"
        '<|im_start|>tool\n<|tool_response_start|>{"temp": 18}<|tool_response_end|><|im_end|>\n'
        "<|im_start|>assistant\n<|tool_call_start|>[a(), b(x=[1, None])]<|tool_call_end|>Checking both.<|im_end|>\n"
        "<|im_start|>assistant\n",
    ),
    (
        "null-content-is-not-null",
        [user("hi"), null_content("assistant")],
        None,
        "<|startoftext|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n<|im_start|>assistant\n",
    ),
]


@pytest.mark.parametrize(
    ("messages", "tools", "expected"), [case[1:] for case in LFM2_CASES], ids=[case[0] for case in LFM2_CASES]
)
def test_lfm2_template(messages: list[Message], tools: list[dict[str, Any]] | None, expected: str) -> None:
    template = ChatTemplate(LFM2, bos_token="<|startoftext|>", eos_token="<|im_end|>")
    assert template.render(messages, tools=tools) == expected


def test_tool_calls_are_not_folded_into_content_when_the_template_reads_them() -> None:
    source = LFM2 + "{# reads tool_calls #}{{ messages[-1].tool_calls[0].function.name }}"
    messages = [Message("assistant", "ok", tool_calls=[ToolCall("f", "{}")])]
    rendered = ChatTemplate(source).render(messages, add_generation_prompt=False)
    assert rendered == "<|im_start|>assistant\nok<|im_end|>\nf"


# ── Failures: always InvalidRequest ────────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    "source",
    ["{% for m in messages %}", "{{ unclosed", "{% endfor %}", "{% nosuchtag %}", "{{ 1 + }}", "{% if %}{% endif %}"],
    ids=["unclosed-for", "unclosed-expr", "stray-end", "unknown-tag", "bad-expr", "empty-if"],
)
def test_syntax_error_fails_at_construction(source: str) -> None:
    with pytest.raises(InvalidRequest, match="chat template is invalid"):
        ChatTemplate(source)


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ ().__class__.__base__.__subclasses__() }}",
        "{{ messages[0].__class__ }}",
        "{{ messages[0]['__class__'] }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ raise_exception.__globals__ }}",
        "{{ strftime_now.__globals__['json'] }}",
        "{{ lipsum.__globals__['os'] }}",
        "{{ '{0.__class__}'.format('') }}",
        "{{ messages.append(1) }}",
        "{% set d = {} %}{{ d.update({'a': 1}) }}",
        "{{ messages[0].pop('role') }}",
    ],
)
def test_sandbox_escapes_are_refused(source: str) -> None:
    with pytest.raises(InvalidRequest, match="unsafe"):
        ChatTemplate(source).render([user("hi")])


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages.nope() }}",
        "{{ undefined_var.attr }}",
        "{{ 1 / 0 }}",
        "{{ 'a' + 1 }}",
        "{{ messages[5] + 'x' }}",
        "{% for i in range(10 ** 7) %}{% endfor %}",
        "{{ tojson }}{{ {1: 2} | dictsort(by='nope') }}",
        "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    ],
    ids=[
        "undefined-method",
        "undefined-attr",
        "zero-division",
        "type-error",
        "undefined-concat",
        "huge-range",
        "bad-filter-arg",
        "recursion",
    ],
)
def test_render_errors_become_invalid_request(source: str) -> None:
    with pytest.raises(InvalidRequest, match="chat template failed to render"):
        ChatTemplate(source).render([user("hi")])


def test_raise_exception_becomes_invalid_request() -> None:
    source = (
        "{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{% endif %}{{ m.content }}{% endfor %}"
    )
    template = ChatTemplate(source)
    assert template.render([user("a"), Message("assistant", "b")]) == "ab"
    with pytest.raises(InvalidRequest, match="roles must alternate") as info:
        template.render([user("a"), user("b")])
    assert info.value.param == "messages"
