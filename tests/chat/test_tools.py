"""Spec for lmserve.chat.tools: tool calls in model output, whole and streamed, one parser per format."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest

from lmserve.chat.tools import (
    PARSERS,
    ParsedCall,
    StreamingToolParser,
    ToolCallParser,
    detect_parser,
    get_parser,
)
from lmserve.errors import InvalidRequest

S, E = "<|tool_call_start|>", "<|tool_call_end|>"
Calls = list[tuple[str, dict[str, Any]]]

# (parser, model output, expected content, expected calls as (name, arguments object))
CASES: list[tuple[str, str, str, Calls]] = [
    # ---- lfm2: the outputs of shared/reference/lfm2.md, and variations ----
    (
        "lfm2",
        f'{S}[get_weather(city="Paris"), get_time(tz="CET")]{E}',
        "",
        [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})],
    ),
    (
        "lfm2",
        f'{S}[{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}]{E}',
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "lfm2",
        f'{S}[{{"name": "a", "arguments": {{"x": [1, 2.5, true, null]}}}}, {{"name": "b", "arguments": "{{}}"}}]{E}',
        "",
        [("a", {"x": [1, 2.5, True, None]}), ("b", {})],
    ),
    ("lfm2", f"{S}[get_time()]{E}", "", [("get_time", {})]),
    ("lfm2", f"{S}[{{'name': 'f', 'arguments': {{'a': True}}}}]{E}", "", [("f", {"a": True})]),  # Python-style dicts
    ("lfm2", f"{S}get_time(tz='UTC'){E}", "", [("get_time", {"tz": "UTC"})]),  # a bare call, no list
    ("lfm2", f"{S}[no_such_tool(x=1)]{E}", "", [("no_such_tool", {"x": 1})]),  # names are not checked against tools
    # nested quotes, escapes, non-ASCII
    (
        "lfm2",
        f'{S}[search(q="say \\"hi\\" to \'bob\'", path=\'C:\\\\tmp\\\\x\', note="a\\nb", city="Zürich")]{E}',
        "",
        [("search", {"q": "say \"hi\" to 'bob'", "path": "C:\\tmp\\x", "note": "a\nb", "city": "Zürich"})],
    ),
    # the end marker ends the block, even inside a string: malformed
    ("lfm2", f"{S}[f(s='<|tool_call_end|> inside')]{E}", f"{S}[f(s='<|tool_call_end|> inside')]{E}", []),
    # several calls, nested literals, JSON spellings, tuples, negative numbers
    (
        "lfm2",
        f"{S}[book(room=101, guests=['Ann', 'Bo'], opts={{'late': True, 'note': None}}, span=(1, 2), t=-3.5), "
        f"notify(ok=true, why=null)]{E}",
        "",
        [
            (
                "book",
                {"room": 101, "guests": ["Ann", "Bo"], "opts": {"late": True, "note": None}, "span": [1, 2], "t": -3.5},
            ),
            ("notify", {"ok": True, "why": None}),
        ],
    ),
    # echo of the call body after the end marker: whole, with whitespace, partial at the end, without brackets
    ("lfm2", f'{S}[get_weather(city="Paris")]{E}[get_weather(city="Paris")]', "", [("get_weather", {"city": "Paris"})]),
    (
        "lfm2",
        f'{S}[get_weather(city="Paris")]{E}\n[get_weather(city = "Paris")]\nIt is sunny.',
        "\nIt is sunny.",
        [("get_weather", {"city": "Paris"})],
    ),
    ("lfm2", f'{S}[get_weather(city="Paris")]{E}[get_weather(ci', "", [("get_weather", {"city": "Paris"})]),
    (
        "lfm2",
        f'{S}[get_weather(city="Paris")]{E} get_weather(city="Paris") Done.',
        " Done.",
        [("get_weather", {"city": "Paris"})],
    ),
    ("lfm2", f"{S}[f(a=1)]{E}\n\n", "", [("f", {"a": 1})]),
    # text before and after, two blocks
    (
        "lfm2",
        f'Let me check. {S}[get_weather(city="Paris")]{E} Checking now.',
        "Let me check.  Checking now.",
        [("get_weather", {"city": "Paris"})],
    ),
    ("lfm2", f"A{S}[f(a=1)]{E}B{S}[g(b=2)]{E}C", "ABC", [("f", {"a": 1}), ("g", {"b": 2})]),
    ("lfm2", "1 < 2 and <|tool_list_start|> is not a call", "1 < 2 and <|tool_list_start|> is not a call", []),
    # malformed → content, as written
    ("lfm2", f'{S}[get_weather(city="Paris"]{E}', f'{S}[get_weather(city="Paris"]{E}', []),
    ("lfm2", f'Hi {S}[get_weather(city="Paris")]', f'Hi {S}[get_weather(city="Paris")]', []),  # unterminated
    ("lfm2", f"{S}[]{E}", f"{S}[]{E}", []),
    ("lfm2", f"{S}hello{E} there", f"{S}hello{E} there", []),
    ("lfm2", f'{S}[{{"name": "f", "arguments": [1]}}]{E}', f'{S}[{{"name": "f", "arguments": [1]}}]{E}', []),
    ("lfm2", f'{S}[{{"arguments": {{}}}}]{E}', f'{S}[{{"arguments": {{}}}}]{E}', []),
    ("lfm2", f"{S}[f(a=1)]{E} and {S}[g(]{E}", f" and {S}[g(]{E}", [("f", {"a": 1})]),
    # ---- lfm2: LFM2.5's quirks ----
    ("lfm2", f'{S}[weather.get(city="x")]{E}', "", [("weather.get", {"city": "x"})]),  # dotted names
    ("lfm2", f"{S}[a.b.c(x=1), d(y=2)]{E}", "", [("a.b.c", {"x": 1}), ("d", {"y": 2})]),
    ("lfm2", f"{S}[f(a=True, b=False, c=None, s='it')]{E}", "", [("f", {"a": True, "b": False, "c": None, "s": "it"})]),
    # a bare call list as the whole output (no start marker), maybe with a stray end marker
    ("lfm2", '[get_weather(city="Paris")]', "", [("get_weather", {"city": "Paris"})]),
    ("lfm2", "\n [ tools.search (q='x', n=None) ]\n", "", [("tools.search", {"q": "x", "n": None})]),
    ("lfm2", f"[f(a=1), g.h(b='x')]{E}", "", [("f", {"a": 1}), ("g.h", {"b": "x"})]),
    ("lfm2", "[f(a=1)] and text", "[f(a=1)] and text", []),  # bare only as the whole output
    ("lfm2", "[Paris](https://example.com) is nice", "[Paris](https://example.com) is nice", []),
    ("lfm2", "[1, 2, 3]", "[1, 2, 3]", []),
    ("lfm2", "[]", "[]", []),
    ("lfm2", "[f(1)]", "[f(1)]", []),
    # unknown function-name forms → content
    ("lfm2", f'{S}[get-weather(city="x")]{E}', f'{S}[get-weather(city="x")]{E}', []),
    ("lfm2", f'{S}["get_weather"(city="x")]{E}', f'{S}["get_weather"(city="x")]{E}', []),
    ("lfm2", f"{S}[make()(x=1)]{E}", f"{S}[make()(x=1)]{E}", []),
    ("lfm2", f"{S}[tools[0](x=1)]{E}", f"{S}[tools[0](x=1)]{E}", []),
    ("lfm2", f"{S}[lambda: 1]{E}", f"{S}[lambda: 1]{E}", []),
    # positional or non-literal arguments → content (and nothing is ever evaluated)
    ("lfm2", f'{S}[get_weather("Paris")]{E}', f'{S}[get_weather("Paris")]{E}', []),
    ("lfm2", f"{S}[f(**opts)]{E}", f"{S}[f(**opts)]{E}", []),
    ("lfm2", f"{S}[f(a=1, a=2)]{E}", f"{S}[f(a=1, a=2)]{E}", []),
    ("lfm2", f"{S}[f(city=where)]{E}", f"{S}[f(city=where)]{E}", []),
    ("lfm2", f'{S}[f(x=__import__("os").system("false"))]{E}', f'{S}[f(x=__import__("os").system("false"))]{E}', []),
    ("lfm2", f'{S}[f(s=f"{{x}}")]{E}', f'{S}[f(s=f"{{x}}")]{E}', []),
    ("lfm2", f"{S}[f(s={{1, 2}})]{E}", f"{S}[f(s={{1, 2}})]{E}", []),  # a set has no JSON form
    ("lfm2", f"{S}[f(x=float('nan'))]{E}", f"{S}[f(x=float('nan'))]{E}", []),
    ("lfm2", f"{S}[f(x=1e999)]{E}", f"{S}[f(x=1e999)]{E}", []),  # inf has no JSON form
    # ---- hermes (Qwen2.5 / Hermes templates) ----
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "hermes",
        'Sure.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": "{\\"y\\": \\"é\\"}"}\n</tool_call>',
        "Sure.\n\n",
        [("a", {"x": 1}), ("b", {"y": "é"})],
    ),
    (
        "hermes",
        '<tool_call>{"type": "function", "function": {"name": "f", "arguments": {}}}</tool_call>',
        "",
        [("f", {})],
    ),
    ("hermes", "<tool_call>{'name': 'f'}</tool_call>", "<tool_call>{'name': 'f'}</tool_call>", []),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call> ok', '<tool_call>{"arguments": {}}</tool_call> ok', []),
    (
        "hermes",
        '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>',
        '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>',
        [],
    ),
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}', '<tool_call>{"name": "f", "arguments": {}}', []),
    ("hermes", "Use <tool to call things", "Use <tool to call things", []),
    # ---- llama3_json ----
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "llama3_json",
        '\n<|python_tag|>{"name": "a", "arguments": {"x": 1}}; {"name": "b", "parameters": {}}',
        "",
        [("a", {"x": 1}), ("b", {})],
    ),
    ("llama3_json", '  {"name": "f", "parameters": {"q": "a } b"}}\n', "", [("f", {"q": "a } b"})]),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", '{"name": "f", "parameters": {}} and more', '{"name": "f", "parameters": {}} and more', []),
    ("llama3_json", 'Calling {"name": "f", "parameters": {}}', 'Calling {"name": "f", "parameters": {}}', []),
    ("llama3_json", '{"name": "f", "parameters": {', '{"name": "f", "parameters": {', []),
    ("llama3_json", "<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    ("llama3_json", "<|python_tag|>", "<|python_tag|>", []),
    ("llama3_json", "The weather is fine.", "The weather is fine.", []),
    ("llama3_json", '{"name": "say", "parameters": {"text": "' + "x" * 300 + '"}}', "", [("say", {"text": "x" * 300})]),
    ("llama3_json", '{"text": "' + "x" * 300 + '"} tail', '{"text": "' + "x" * 300 + '"} tail', []),
    # ---- pythonic ----
    (
        "pythonic",
        '[get_weather(city="Paris"), get_time(tz="CET")]',
        "",
        [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})],
    ),
    ("pythonic", '\n [ get_weather (city="Paris") ]\n', "", [("get_weather", {"city": "Paris"})]),
    ("pythonic", "[Paris](https://example.com) is nice", "[Paris](https://example.com) is nice", []),
    ("pythonic", "[f(a=1)] and text", "[f(a=1)] and text", []),
    ("pythonic", "[]", "[]", []),
    ("pythonic", '[{"name": "f", "arguments": {}}]', '[{"name": "f", "arguments": {}}]', []),  # calls only, no dicts
    ("pythonic", '["a", "b"]', '["a", "b"]', []),
    ("pythonic", "[f(1)]", "[f(1)]", []),
    ("pythonic", "No calls [f(a=1)]", "No calls [f(a=1)]", []),
    ("pythonic", "  ", "  ", []),
    ("pythonic", '[weather.get(city="x")]', '[weather.get(city="x")]', []),  # dotted names are LFM2.5's
    # ---- json (lmserve's own, for any model) ----
    ("json", '[{"name": "get_weather", "arguments": {"city": "Paris"}}]', "", [("get_weather", {"city": "Paris"})]),
    (
        "json",
        ' [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "parameters": {}}]\n',
        "",
        [("a", {"x": 1}), ("b", {})],
    ),
    ("json", '{"name": "f", "arguments": {"q": "a } b"}}', "", [("f", {"q": "a } b"})]),  # one object, no list
    ("json", '{"name": "f", "arguments": "{\\"x\\": 2}"}', "", [("f", {"x": 2})]),  # arguments as JSON text
    ("json", '```json\n[{"name": "f", "arguments": {}}]\n```', "", [("f", {})]),  # a fenced block
    ("json", '```\n{"name": "f", "arguments": {}}\n```\n', "", [("f", {})]),
    ("json", '```json\n[{"name": "f", "arguments": {}}]', "", [("f", {})]),  # the closing fence never came
    # ordinary JSON and text stay content
    ("json", '{"answer": 42}', '{"answer": 42}', []),
    ("json", '["a", "b"]', '["a", "b"]', []),
    ("json", "[]", "[]", []),
    ("json", '{"name": "Bob"}', '{"name": "Bob"}', []),  # no arguments: not a call
    ("json", '{"name": "f", "arguments": {}, "id": 3}', '{"name": "f", "arguments": {}, "id": 3}', []),
    ("json", '{"name": "f", "arguments": [1]}', '{"name": "f", "arguments": [1]}', []),
    ("json", '{"name": "f", "arguments": {}, "parameters": {}}', '{"name": "f", "arguments": {}, "parameters": {}}',
     []),
    ("json", '[{"name": "f", "arguments": {}}] and more', '[{"name": "f", "arguments": {}}] and more', []),
    ("json", 'Calling [{"name": "f", "arguments": {}}]', 'Calling [{"name": "f", "arguments": {}}]', []),
    ("json", '[{"name": "f", "arguments": {', '[{"name": "f", "arguments": {', []),
    ("json", '```python\nprint(1)\n```', '```python\nprint(1)\n```', []),
    ("json", "```json[1]", "```json[1]", []),
    ("json", "The weather is fine.", "The weather is fine.", []),
    ("json", "  ", "  ", []),
    ("json", '{"name": "say", "arguments": {"text": "' + "x" * 300 + '"}}', "", [("say", {"text": "x" * 300})]),
    ("json", '{"text": "' + "x" * 300 + '"} tail', '{"text": "' + "x" * 300 + '"} tail', []),
]

IDS = [f"{name}-{i}" for i, (name, *_rest) in enumerate(CASES)]


def _simple(calls: list[ParsedCall]) -> Calls:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _stream(parser: ToolCallParser, pieces: list[str]) -> tuple[list[str], list[ParsedCall]]:
    stream = StreamingToolParser(parser)
    contents: list[str] = []
    calls: list[ParsedCall] = []
    for piece in pieces:
        content, got = stream.push(piece)
        contents.append(content)
        calls.extend(got)
    content, got = stream.finish()
    contents.append(content)
    calls.extend(got)
    return contents, calls


def _random_split(text: str, rng: random.Random) -> list[str]:
    pieces, i = [], 0
    while i < len(text):
        n = rng.randint(1, 12)
        pieces.append(text[i : i + n])
        i += n
    return pieces


@pytest.mark.parametrize(("name", "output", "content", "calls"), CASES, ids=IDS)
def test_parse(name: str, output: str, content: str, calls: Calls) -> None:
    got_content, got_calls = get_parser(name).parse(output)
    assert (got_content, _simple(got_calls)) == (content, calls)
    for call in got_calls:
        assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
        assert json.dumps(json.loads(call.arguments), ensure_ascii=False, separators=(",", ":")) == call.arguments


@pytest.mark.parametrize(("name", "output", "content", "calls"), CASES, ids=IDS)
def test_streaming_matches_parse(name: str, output: str, content: str, calls: Calls) -> None:
    parser = get_parser(name)
    splits = [list(output), [output]] + [_random_split(output, random.Random(seed)) for seed in range(20)]
    for pieces in splits:
        contents, got = _stream(parser, pieces)
        assert ("".join(contents), _simple(got)) == (content, calls), pieces
        # nothing of a marker that became a call was ever shown (only malformed blocks come back as content)
        assert "".join(contents).count(parser.start_marker) == content.count(parser.start_marker)
        if calls and parser.start_marker not in content:
            assert not any(parser.start_marker in piece for piece in contents)


def test_streaming_holds_back_a_possible_marker_and_streams_text_before_it() -> None:
    stream = StreamingToolParser(get_parser("lfm2"))
    assert stream.push("Let me check <|tool") == ("Let me check ", [])
    assert stream.push("_call_start|>[get_weather(") == ("", [])
    content, calls = stream.push('city="Paris")]<|tool_call_end|>[get_wea')
    assert content == "" and _simple(calls) == [("get_weather", {"city": "Paris"})]
    assert stream.push('ther(city="Paris")] Done') == (" Done", [])
    assert stream.finish() == ("", [])

    stream = StreamingToolParser(get_parser("hermes"))
    assert stream.push("a <") == ("a ", [])
    assert stream.push("b") == ("<b", [])  # decided: not a marker
    assert stream.finish() == ("", [])


def test_streaming_releases_a_malformed_block_as_content() -> None:
    stream = StreamingToolParser(get_parser("lfm2"))
    assert stream.push(f"{S}[f(1)]") == ("", [])
    assert stream.push(f"{E} ok") == (f"{S}[f(1)]{E} ok", [])
    assert stream.finish() == ("", [])


@pytest.mark.parametrize(
    ("name", "output", "released"),
    [
        ("pythonic", "[Paris](x) is nice", "[Paris]"),
        ("pythonic", "Hello", "H"),
        ("llama3_json", '{"answer": 1} ok', '{"answer": 1}'),
        ("llama3_json", "Hello", "H"),
        ("json", "Hello", "H"),
        ("json", '{"answer": 1} ok', '{"an'),  # the first key is no call key: decided at once
        ("json", '["a", "b"]', '["'),
        ("json", "```python\nx", "```p"),
        ("lfm2", "Hello", "H"),  # not a bare call list: streams as text
        ("lfm2", "[Paris](x) is nice", "[Paris]"),
    ],
)
def test_whole_output_formats_stream_content_once_it_cannot_be_a_call(name: str, output: str, released: str) -> None:
    stream = StreamingToolParser(get_parser(name))
    shown = [stream.push(ch)[0] for ch in output]
    first = next(i for i, piece in enumerate(shown) if piece)
    assert first == len(released) - 1  # held exactly until it was decided
    assert "".join(shown) == output  # all of it before finish()
    assert stream.finish() == ("", [])


def test_whole_output_call_comes_at_finish() -> None:
    stream = StreamingToolParser(get_parser("llama3_json"))
    assert stream.push('{"name": "f", "parameters": {"a": 1}}') == ("", [])
    content, calls = stream.finish()
    assert content == "" and _simple(calls) == [("f", {"a": 1})]


_FUZZ_ATOMS = [
    *[S, E, "<tool_call>", "</tool_call>", "<|python_tag|>", "<|tool", '"name": "f"', '"arguments": {}'],
    *["<", "[", "]", "(", ")", "{", "}", '"', "'", "f(a=1)", "g(", "x=", ";", "text", "=", ":", "[f(a=1)]"],
    *['{"name": "f", "parameters": {}}', '[{"name": "f", "arguments": {}}]', ", ", " ", "  ", "\n"],
    *["```", "```json\n", "a.b(", "True", "None", "'s'", '{"answer": 1}'],
]


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_fuzz_never_raises_and_streaming_always_matches(name: str) -> None:
    parser = get_parser(name)
    rng = random.Random(1234)
    for _ in range(1500):
        output = "".join(rng.choice(_FUZZ_ATOMS) for _ in range(rng.randint(0, 14)))
        content, calls = parser.parse(output)
        for pieces in (list(output), _random_split(output, rng)):
            contents, got = _stream(parser, pieces)
            assert ("".join(contents), _simple(got)) == (content, _simple(calls)), output


def test_call_ids_are_fresh() -> None:
    _, calls = get_parser("lfm2").parse(f"{S}[f(), f()]{E}")
    assert len({c.id for c in calls}) == 2


def test_get_parser() -> None:
    assert set(PARSERS) == {"lfm2", "hermes", "llama3_json", "pythonic", "json"}
    for name in PARSERS:
        assert get_parser(name).name == name
    with pytest.raises(InvalidRequest) as err:
        get_parser("mistral")
    assert err.value.status == 400
    for name in PARSERS:
        assert name in err.value.message


LFM2_TEMPLATE = (
    "{{- bos_token -}}{%- if tools -%}{{ 'List of tools: <|tool_list_start|>[' }}...{{ ']<|tool_list_end|>' }}"
    "{%- endif -%}{%- for message in messages -%}{{ '<|im_start|>' + message['role'] }}...{%- endfor -%}"
)
LFM25_TEMPLATE = "{%- if tools -%}{{ '\\nList of tools: [' }}{{ tools | tojson }}]{%- endif -%}"
QWEN_TEMPLATE = (
    "{%- if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>\n\nFor each function call, "
    "return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>{%- endif %}'
)
LLAMA31_TEMPLATE = (
    '{%- if builtin_tools is defined or tool_calls %}{{- "<|python_tag|>" }}{%- endif %}'
    '{%- elif message.role == "tool" or message.role == "ipython" %}'
    '{{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}'
)
LLAMA32_NO_TAG = '{{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}{{- message.content | tojson }}'
LLAMA_PYTHONIC = (
    "If you decide to invoke any of the function(s), you MUST put it in the format of "
    "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]"
    '{{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}'
)
CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (LFM2_TEMPLATE, "lfm2"),
        (LFM25_TEMPLATE, "lfm2"),
        ("... <|tool_call_start|> ...", "lfm2"),
        (QWEN_TEMPLATE, "hermes"),
        (LLAMA31_TEMPLATE, "llama3_json"),
        (LLAMA32_NO_TAG, "llama3_json"),
        (LLAMA_PYTHONIC, "pythonic"),
        (CHATML, None),
        ("", None),
        (None, None),
    ],
)
def test_detect_parser(template: str | None, expected: str | None) -> None:
    assert detect_parser(template) == expected
