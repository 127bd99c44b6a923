"""Property tests: the parsers and template engines never raise anything but their own error type.

Text strategies mix random unicode with fragments of each syntax, so that generated inputs reach the interesting
paths (delimiters, keywords, quotes, markers) rather than being rejected at the first character.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmserve.chat.gotemplate import GoTemplate, TemplateError
from lmserve.chat.template import ChatTemplate
from lmserve.chat.tools import PARSERS, StreamingToolParser, get_parser
from lmserve.chat.tools.base import ParsedCall
from lmserve.errors import InvalidRequest
from lmserve.store.modelfile import Modelfile, ModelfileError, parse
from lmserve.store.names import parse_name
from lmserve.types import Message, ToolCall

FUZZ = settings(max_examples=200, deadline=None, derandomize=True)

COMMON = ['"', "'", "`", "\\", "\n", "\r\n", "\t", " ", "é", "\u2028", "😀", "\x00", "0", "1.5", "-", ":", ",", "#"]

GO_FRAGMENTS = [
    *[
        "{{",
        "}}",
        "{{-",
        "-}}",
        "range",
        "end",
        "if",
        "else",
        "with",
        "define",
        "template",
        "block",
        "break",
        "continue",
        ".Messages",
        ".Role",
        ".Content",
    ],
    *[
        ".",
        "$",
        "$x",
        ":=",
        "=",
        "|",
        "(",
        ")",
        "len",
        "index",
        "slice",
        "printf",
        "print",
        "println",
        "json",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "and",
        "or",
        "not",
        "call",
    ],
    *[
        "html",
        "js",
        "urlquery",
        "nil",
        "true",
        "false",
        "/*",
        "*/",
        "$.Messages",
        "1e3",
        "0x1F",
        "'a'",
        ".System",
        ".Tools",
    ],
    "{{ ",
    " }}",
    "else if",
    '"%s"',
    '"%d"',
    '"%v"',
    "$i, $m :=",
    "range $i, $m := .Messages",
    "{{ end }}",
]
MODELFILE_LINES = [
    "FROM llama3",
    "FROM ./model.gguf",
    "FROM mmproj-x.gguf",
    "ADAPTER ./lora.gguf",
    "PARAMETER stop <|im_end|>",
    'PARAMETER stop "a b"',
    "PARAMETER temperature 0.5",
    "PARAMETER num_ctx 4096",
    "PARAMETER seed -1",
    'TEMPLATE """{{ .Prompt }}"""',
    'SYSTEM """be\nbrief"""',
    "SYSTEM hi",
    "MESSAGE user hello",
    'MESSAGE assistant "hi there"',
    'LICENSE """MIT"""',
    "REQUIRES 0.5.0",
    "# comment",
    "",
]
MODELFILE_FRAGMENTS = [
    "FROM ",
    "ADAPTER ",
    "PARAMETER ",
    "PARAMETER stop ",
    "PARAMETER temperature ",
    "PARAMETER num_ctx ",
    "PARAMETER bogus ",
    "TEMPLATE ",
    "SYSTEM ",
    "MESSAGE user ",
    "MESSAGE ",
    "LICENSE ",
    "REQUIRES ",
    '"""',
    "from ",
    "0.5",
    "true",
    "4096",
    "-1",
    "<|im_end|>",
    "{{ .Prompt }}",
]
TOOL_FRAGMENTS = [
    *[
        "<|tool_call_start|>",
        "<|tool_call_end|>",
        "<|tool_call_start",
        "|>",
        "[f(a=1)]",
        "[",
        "]",
        "(",
        ")",
        "f(",
        "a=",
        "=",
        "None",
        "True",
    ],
    *[
        "<tool_call>",
        "</tool_call>",
        "<tool_",
        "<|python_tag|>",
        '{"name":',
        '"f"',
        '"arguments":',
        '"parameters":',
        "{",
        "}",
        "{}",
        ";",
    ],
    '[f(a=1), g(b="x")]',
    "[1, 2]",
    '{"a": 1}',
    '{"name": "f", "arguments": {"a": 1}}',
    '{"name": "f", "parameters": {}}',
    "null",
    "1e309",
]
JINJA_FRAGMENTS = [
    *[
        "{{",
        "}}",
        "{%",
        "%}",
        "{%-",
        "-%}",
        "{#",
        "#}",
        "for",
        "endfor",
        "if",
        "endif",
        "else",
        "in",
        "messages",
        "message",
        "message.role",
        "tools",
        "tojson",
        "|",
    ],
    *[
        "loop.index",
        "generation",
        "endgeneration",
        "break",
        "continue",
        "add_generation_prompt",
        "bos_token",
        "range(3)",
    ],
    *["__class__", "namespace()", "~", "+", "none"],
    "message['content']",
    "raise_exception('x')",
    "strftime_now('%Y')",
    "set x = ",
    "1 / 0",
]
NAME_FRAGMENTS = ["llama3", ":", "latest", "/", "hf.co", "user", "repo", ".gguf", "Q4_K_M", "..", "-", "_", "@"]


def fragmented(fragments: list[str], max_size: int = 30) -> st.SearchStrategy[str]:
    """Text built from syntax fragments, common special characters and random unicode."""
    piece = st.one_of(st.sampled_from(fragments + COMMON), st.text(max_size=6))
    return st.lists(piece, max_size=max_size).map("".join)


# --- Modelfile ---------------------------------------------------------------------------------------------------


def modelfile_text() -> st.SearchStrategy[str]:
    line = st.one_of(
        st.sampled_from(MODELFILE_LINES),
        st.sampled_from(MODELFILE_LINES),
        fragmented(MODELFILE_FRAGMENTS, max_size=8),
        st.sampled_from(MODELFILE_FRAGMENTS),
    )
    valid = st.lists(st.sampled_from(MODELFILE_LINES), max_size=8).map(lambda lines: "\n".join(["FROM base", *lines]))
    return st.one_of(valid, st.lists(line, max_size=10).map("\n".join))


def _parse_or_none(text: str) -> Modelfile | None:
    try:
        return parse(text)
    except ModelfileError:
        return None


@FUZZ
@given(modelfile_text())
def test_modelfile_parse_raises_only_modelfile_error(text: str) -> None:
    _parse_or_none(text)


@FUZZ
@given(modelfile_text())
def test_modelfile_round_trip(text: str) -> None:
    parsed = _parse_or_none(text)
    if parsed is not None:
        assert parse(parsed.to_text()) == parsed


@FUZZ
@given(
    st.text(),
    st.text(),
    st.lists(st.tuples(st.sampled_from(["user", "assistant", "system"]), st.text())),
)
def test_modelfile_round_trip_from_values(template: str, system: str, messages: list[tuple[str, str]]) -> None:
    """Printed from arbitrary values: whatever of it parses prints back to itself."""
    text = Modelfile(from_="base", template=template, system=system, messages=messages).to_text()
    parsed = _parse_or_none(text)
    if parsed is not None:
        assert parse(parsed.to_text()) == parsed


# --- Go templates ------------------------------------------------------------------------------------------------

GO_DATA: dict[str, Any] = {
    "System": "sys",
    "Prompt": "hi",
    "Response": "",
    "Messages": [
        {"Role": "user", "Content": "hi", "ToolCalls": []},
        {"Role": "assistant", "Content": "", "ToolCalls": [{"Function": {"Name": "f", "Arguments": {"a": 1}}}]},
    ],
    "Tools": [{"Type": "function", "Function": {"Name": "f", "Description": "d", "Parameters": {"a": [1, 2.5]}}}],
}


@FUZZ
@given(fragmented(GO_FRAGMENTS, max_size=40))
def test_gotemplate_raises_only_template_error(source: str) -> None:
    try:
        template = GoTemplate(source)
    except TemplateError:
        return
    with contextlib.suppress(TemplateError):
        template.execute(GO_DATA)


# --- Chat templates (Jinja2) -------------------------------------------------------------------------------------


@FUZZ
@given(fragmented(JINJA_FRAGMENTS, max_size=30), st.text(max_size=20))
def test_chat_template_raises_only_invalid_request(source: str, content: str) -> None:
    messages = [
        Message(role="system", content=content),
        Message(role="user", content="hi"),
        Message(role="assistant", content="", tool_calls=[ToolCall(name="f", arguments='{"a": 1}', id="c1")]),
        Message(role="tool", content="1", tool_call_id="c1"),
    ]
    with contextlib.suppress(InvalidRequest):
        ChatTemplate(source).render(messages, tools=[{"type": "function", "function": {"name": "f"}}])


# --- Model names -------------------------------------------------------------------------------------------------


@FUZZ
@given(fragmented(NAME_FRAGMENTS, max_size=12))
def test_parse_name_raises_only_invalid_request(text: str) -> None:
    with contextlib.suppress(InvalidRequest):
        parse_name(text)


# --- Tool-call parsers -------------------------------------------------------------------------------------------


def _calls(calls: list[ParsedCall]) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in calls]


IDENT = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,5}", fullmatch=True)
JSON_ARGS = st.dictionaries(IDENT, st.one_of(st.integers(), st.text(max_size=5), st.booleans(), st.none()), max_size=3)


@st.composite
def well_formed_calls(draw: st.DrawFn) -> str:
    """A call in one of the formats, so that the parsers' success paths are exercised, not only their fallbacks."""
    name = draw(IDENT)
    args = draw(JSON_ARGS)
    pythonic = "[" + f"{name}(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")]"
    obj = json.dumps({"name": name, "arguments": args})
    return draw(
        st.sampled_from(
            [
                pythonic,
                f"<|tool_call_start|>{pythonic}<|tool_call_end|>",
                f"<|tool_call_start|>[{obj}]<|tool_call_end|>",
                f"<tool_call>{obj}</tool_call>",
                obj,
                "<|python_tag|>" + json.dumps({"name": name, "parameters": args}),
                json.dumps({"name": name, "parameters": args}) + "; " + obj,
            ]
        )
    )


@st.composite
def text_and_cuts(draw: st.DrawFn) -> tuple[str, list[str]]:
    piece = st.one_of(well_formed_calls(), fragmented(TOOL_FRAGMENTS, max_size=6))
    text = draw(st.one_of(well_formed_calls(), st.lists(piece, max_size=4).map("".join)))
    cuts = sorted(draw(st.sets(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("name", sorted(PARSERS))
@FUZZ
@given(case=text_and_cuts())
def test_tool_parser_streaming_equals_whole(name: str, case: tuple[str, list[str]]) -> None:
    text, chunks = case
    content, calls = get_parser(name).parse(text)
    stream = StreamingToolParser(get_parser(name))
    streamed_content: list[str] = []
    streamed_calls: list[ParsedCall] = []
    for chunk in chunks:
        out, new = stream.push(chunk)
        streamed_content.append(out)
        streamed_calls += new
    out, new = stream.finish()
    streamed_content.append(out)
    streamed_calls += new
    assert "".join(streamed_content) == content
    assert _calls(streamed_calls) == _calls(calls)
