"""Spec for lmserve.chat.gotemplate: Ollama Modelfile TEMPLATEs (the Go text/template subset) → prompt text."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import pytest

from lmserve.chat.gotemplate import GoTemplate, TemplateError, render_chat
from lmserve.errors import InvalidRequest
from lmserve.types import Message, ToolCall

# The seed's deployment guide (an LFM2 GGUF): TEMPLATE """…<|im_start|>assistant\n""".
LFM2 = """<|startoftext|><|im_start|>system
{{ .System }}<|im_end|>
<|im_start|>user
{{ .Prompt }}<|im_end|>
<|im_start|>assistant
"""

# A legacy (no .Messages) template that reads .Response, as many Ollama library models had.
LEGACY = """{{ if .System }}<|system|>{{ .System }}
{{ end }}<|user|>{{ .Prompt }}
<|assistant|>{{ .Response }}<|end|>
"""

# A typical ChatML template for the Ollama library (Qwen-style tools).
CHATML = """{{- if or .System .Tools }}<|im_start|>system
{{ .System }}
{{- if .Tools }}

# Tools
<tools>
{{- range $.Tools }}
{{ json . }}
{{- end }}
</tools>
{{- end }}<|im_end|>
{{ end }}
{{- range $i, $m := .Messages }}
{{- $last := eq (len (slice $.Messages $i)) 1 }}
{{- if eq .Role "user" }}<|im_start|>user
{{ .Content }}<|im_end|>
{{ else if eq .Role "assistant" }}<|im_start|>assistant
{{ if .Content }}{{ .Content }}{{ end }}
{{- with .ToolCalls }}
{{- range . }}<tool_call>
{"name": "{{ .Function.Name }}", "arguments": {{ json .Function.Arguments }}}
</tool_call>
{{- end }}
{{- end }}{{ if not $last }}<|im_end|>
{{ end }}
{{- else if eq .Role "tool" }}<|im_start|>tool
{{ .Content }}<|im_end|>
{{ end }}
{{- if and (ne .Role "assistant") $last }}<|im_start|>assistant
{{ end }}
{{- end }}"""

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
WEATHER_JSON = (
    '{"type":"function","function":{"name":"get_weather","description":"Get the weather",'
    '"parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}'
)


@dataclass
class User:
    Name: str
    _secret: str = "s"

    def Greet(self) -> str:  # a method: templates may not call it
        return "hi"


def render(source: str, data: dict[str, Any] | None = None) -> str:
    return GoTemplate(source).execute(data or {})


DATA: dict[str, Any] = {
    "Name": "Ada",
    "A": {"B": 1},
    "L": [1, 2, 3],
    "M": {"b": 2, "a": 1},
    "Empty": [],
    "Zero": 0,
    "S": "héllo",
    "User": User("Grace"),
    "Nested": [["x", "y"], ["z"]],
}


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        # fields, dot and root
        ("{{ .Name }}", "Ada"),
        ("{{ .A.B }}", "1"),
        ("{{.Name}}", "Ada"),
        ("{{ $.Name }}", "Ada"),
        ("{{ range .L }}{{ . }}{{ $.Name }} {{ end }}", "1Ada 2Ada 3Ada "),
        ("{{ $ | len }}", str(len(DATA))),
        ("{{ .A }}", "map[B:1]"),
        ("{{ .L }}", "[1 2 3]"),
        ("{{ .User.Name }}", "Grace"),
        # a missing key is None: it prints as "" and is false
        ("[{{ .Nope }}]", "[]"),
        ("[{{ .Nope.Deeper }}]", "[]"),
        ("{{ if .Nope }}yes{{ else }}no{{ end }}", "no"),
        # variables: declare, assign (visible after the block that assigned it), range variables
        ('{{ $x := "a" }}{{ $x }}{{ $x = "b" }}{{ $x }}', "ab"),
        ("{{ $x := 1 }}{{ if true }}{{ $x = 2 }}{{ end }}{{ $x }}", "2"),
        ("{{ range $i, $m := .L }}{{ $i }}={{ $m }};{{ end }}", "0=1;1=2;2=3;"),
        ("{{ range $m := .L }}{{ $m }}{{ end }}", "123"),
        ("{{ range $k, $v := .M }}{{ $k }}:{{ $v }} {{ end }}", "a:1 b:2 "),
        ("{{ with $n := .Name }}{{ $n }}{{ . }}{{ end }}", "AdaAda"),
        # literals
        (r'{{ "a\tb\u00e9\x41\"" }}', 'a\tbéA"'),
        (r'{{ "\xe2\x80\x99" }}', "\u2019"),
        ('{{ `raw\\n "x"` }}', 'raw\\n "x"'),
        ("{{ 42 }} {{ -1.5 }} {{ 0x1F }} {{ 1e6 }} {{ 'a' }} {{ 2.0 }} {{ 0.00001 }}", "42 -1.5 31 1e+06 97 2 1e-05"),
        ("{{ true }} {{ false }}", "true false"),
        # pipes and parentheses
        ('{{ .Name | printf "%q" }}', '"Ada"'),
        ('{{ "x" | printf "%s-%s" "y" }}', "y-x"),
        ("{{ (index .L 1) }}", "2"),
        ("{{ (.A).B }}", "1"),
        ("{{ len (slice .L 1) }}", "2"),
        # if / else if / else, with / else with / else, range / else
        ('{{ if eq .Name "Ada" }}a{{ else if eq .Name "Bob" }}b{{ else }}c{{ end }}', "a"),
        ('{{ if eq .Name "X" }}a{{ else if eq .Name "Ada" }}b{{ else }}c{{ end }}', "b"),
        ('{{ if eq .Name "X" }}a{{ else if eq .Name "Y" }}b{{ else }}c{{ end }}', "c"),
        ("{{ with .A }}{{ .B }}{{ else }}none{{ end }}", "1"),
        ("{{ with .Nope }}{{ . }}{{ else with .Name }}name={{ . }}{{ else }}none{{ end }}", "name=Ada"),
        ("{{ with .Zero }}{{ . }}{{ else }}zero{{ end }}", "zero"),
        ("{{ range .Empty }}x{{ else }}empty{{ end }}", "empty"),
        ("{{ range .Nope }}x{{ else }}nil is empty{{ end }}", "nil is empty"),
        (
            "{{ range .L }}{{ if eq . 2 }}{{ continue }}{{ end }}{{ if eq . 3 }}{{ break }}{{ end }}{{ . }}{{ end }}",
            "1",
        ),
        # comments and trimming: `{{- ` and ` -}}` remove all spaces, tabs and newlines on that side
        ("a{{/* a comment */}}b", "ab"),
        ("a {{- /* trimmed */ -}} \n b", "ab"),
        ("a  \n\t {{- .Name -}} \n\n b", "aAdab"),
        ("{{ if true -}}\n    x\n{{- end }}", "x"),
        ("a {{ .Name }} b", "a Ada b"),
        ("{{ if .Nope -}} x {{- else -}} \n y \n {{- end }}", "y"),
        ("a {{-3}} b", "a -3 b"),
        ("a\n{{- /* multi\nline */ -}}\nb", "ab"),
        # truthiness and logic; and/or return the deciding value and short-circuit
        ('{{ or .Nope "default" }}', "default"),
        ("{{ and 1 0 2 }} {{ and 1 2 }} {{ or 0 .Empty }} {{ or 0 3 }}", "0 2 [] 3"),
        ("{{ or true (index .L 10) }} {{ and false (index .L 10) }}", "true false"),
        ("{{ .Nope | or 7 }}", "7"),
        ('{{ not .Empty }} {{ not .L }} {{ not "" }} {{ not 0.0 }}', "true false true true"),
        # comparisons: eq takes several arguments, nil equals only nil
        ('{{ eq .Name "Bob" "Ada" }} {{ eq .Name "Bob" }} {{ ne 1 2 }}', "true false true"),
        ('{{ eq .Nope "x" }} {{ eq .Nope nil }}', "false true"),
        ('{{ lt 1 2 }} {{ le 2 2 }} {{ gt "b" "a" }} {{ ge 1 2 }} {{ lt 1 1.5 }}', "true true true false true"),
        # len, slice, index: strings count characters
        ("{{ len .L }} {{ len .S }} {{ len .M }} {{ len .Empty }}", "3 5 2 0"),
        ('{{ slice .L 1 }} {{ slice .L 0 2 }} {{ slice .L }} {{ slice "hello" 1 3 }}', "[2 3] [1 2] [1 2 3] el"),
        ('{{ index .L 0 }} {{ index .M "a" }} {{ index .Nested 1 0 }} {{ index .M "zz" }}|', "1 1 z |"),
        # json, print, println, printf
        ('{{ json .M }} {{ json .L }} {{ json "a\\"b" }} {{ json .Nope }}', '{"b":2,"a":1} [1,2,3] "a\\"b" null'),
        ('{{ print "a" 1 2 "b" }}|{{ println 1 "x" }}|', "a1 2b|1 x\n|"),
        (
            '{{ printf "%s|%d|%v|%q|%5.1f|%-4s|%03d|%t|%x|%%" "s" 7 .L "q" 3.14159 "ab" 7 true 255 }}',
            's|7|[1 2 3]|"q"|  3.1|ab  |007|true|ff|%',
        ),
        (
            '{{ printf "%d %d" 1 }}|{{ printf "x" 1 }}|{{ printf "%d" "s" }}',
            "1 %!d(MISSING)|x%!(EXTRA int=1)|%!d(string=s)",
        ),
    ],
)
def test_execute(source: str, expected: str) -> None:
    assert GoTemplate(source).execute(DATA) == expected


@pytest.mark.parametrize(
    ("source", "message", "line"),
    [
        ("{{ .X", "unclosed action", 1),
        ("a\n\n{{ .X ", "unclosed action", 3),
        ("{{ .X }", "unexpected '}' in action", 1),
        ("a\n{{ foo .X }}", 'function "foo" not defined', 2),
        ("{{ end }}", "unexpected {{end}}", 1),
        ("{{ else }}", "unexpected {{else}}", 1),
        ("{{ if .X }}\na", "has no {{end}}", 1),
        ("{{ range .X }}{{ else }}{{ else }}{{ end }}", "expected {{end}}, found {{else}}", 1),
        ("{{ range .X }}{{ else if .Y }}{{ end }}", "unexpected 'if' in {{else}}", 1),
        ('{{ "abc }}', "unterminated quoted string", 1),
        ('{{ "a\nb" }}', "unterminated quoted string", 1),
        ("{{ `abc }}", "unterminated raw quoted string", 1),
        (r'{{ "\q" }}', "invalid syntax", 1),
        ("{{/* abc }}", "unclosed comment", 1),
        ("{{/* abc */ }}", "comment ends before closing delimiter", 1),
        ("{{ $y }}", "undefined variable '$y'", 1),
        ("{{ $y = 1 }}", "undefined variable '$y'", 1),
        ("{{ if true }}{{ $x := 1 }}{{ end }}\n{{ $x }}", "undefined variable '$x'", 2),
        ("{{ }}", "missing value for command", 1),
        ("{{ len }}", "wrong number of args for len: want 1 got 0", 1),
        ("{{ .L | len 1 }}", "wrong number of args for len: want 1 got 2", 1),
        ("{{ eq 1 }}", "wrong number of args for eq: want at least 2 got 1", 1),
        ("{{ .X .Y }}", "can't give argument to non-function", 1),
        ("{{ .X | .Y }}", "non executable command in pipeline stage 2", 1),
        ("{{ nil }}", "nil is not a command", 1),
        ("{{ break }}", "{{break}} outside {{range}}", 1),
        ('{{ define "x" }}{{ end }}', "{{define}} is not supported", 1),
        ('{{ template "x" }}', "{{template}} is not supported", 1),
        ("{{ (len .L }}", "unclosed left paren", 1),
        ("{{ len .L) }}", "unexpected ')' in command", 1),
        ("{{ 3-}}", "unexpected '-' in action", 1),
        ("{{ 12ab }}", "bad number syntax", 1),
        ("{{ % }}", "unexpected '%' in action", 1),
        ("{{ $a, $b := .L }}", "too many declarations outside {{range}}", 1),
        ("{{ range $a, $b, $c := .L }}{{ end }}", "too many declarations", 1),
        ("{{ end x }}", "unexpected {{end}}", 1),
        ("{{ if 1 }}{{ end 2 }}", "unexpected '2' in {{end}}", 1),
        ("{{ if }}{{ end }}", "missing value for command", 1),
    ],
)
def test_parse_errors_are_raised_at_create_time(source: str, message: str, line: int) -> None:
    with pytest.raises(TemplateError) as info:
        GoTemplate(source)
    assert message in str(info.value)
    assert info.value.line == line
    assert isinstance(info.value, InvalidRequest) and info.value.status == 400


def test_absurd_nesting_is_a_template_error() -> None:
    with pytest.raises(TemplateError, match="nests too deeply"):
        GoTemplate("{{ if 1 }}" * 3000 + "{{ end }}" * 3000)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("{{ index .L 5 }}", "index out of range: 5"),
        ('{{ index .L "a" }}', "cannot index slice/array with type string"),
        ("{{ index 3 0 }}", "can't index item of type int"),
        ("{{ len 3 }}", "len of int"),
        ("{{ len .Nope }}", "len of nil"),
        ("{{ slice .L 2 1 }}", "slice index out of range"),
        ('{{ slice "abc" 0 1 2 }}', "cannot 3-index slice a string"),
        ("{{ .Name.First }}", "can't evaluate field First in type string"),
        ("{{ .User.Missing }}", "can't evaluate field Missing"),
        ("{{ .User._secret }}", "can't evaluate field _secret"),
        ("{{ .User.Greet }}", "can't evaluate field Greet"),
        ("{{ range .Name }}{{ end }}", "range can't iterate over Ada"),
        ('{{ eq 1 "1" }}', "incompatible types for comparison"),
        ("{{ eq .L .L }}", "non-comparable type slice"),
        ("{{ lt true false }}", "invalid type for comparison: bool"),
        ("{{ json .User }}", "json:"),
        ("{{ printf 3 }}", "format must be a string"),
    ],
)
def test_runtime_errors(source: str, message: str) -> None:
    with pytest.raises(TemplateError, match="template line 1: .*" + re.escape(message)):
        GoTemplate(source).execute(DATA)


def test_runtime_error_reports_the_line_of_the_failing_action() -> None:
    template = GoTemplate("a\n{{ range .L }}\n{{ index $.L . }}\n{{ end }}")
    with pytest.raises(TemplateError) as info:
        template.execute({"L": [1, 2, 3]})
    assert info.value.line == 3 and "index out of range: 3" in info.value.message


def test_execute_does_not_leak_state_between_calls() -> None:
    template = GoTemplate("{{ $x := .N }}{{ range .L }}{{ $x = . }}{{ end }}{{ $x }}")
    assert template.execute({"N": 0, "L": [1, 2]}) == "2"
    assert template.execute({"N": 5, "L": []}) == "5"


# --- render_chat: Ollama's data model ----------------------------------------------------------------------------
def test_lfm2_template_single_turn_uses_the_default_system() -> None:
    prompt = render_chat(GoTemplate(LFM2), [Message("user", "Hi")], system="Be brief.", tools=None)
    assert prompt == (
        "<|startoftext|><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    ("messages", "system", "expected_system"),
    [
        ([Message("user", "Hi")], None, ""),
        ([Message("system", "Mine."), Message("user", "Hi")], "Default.", "Mine."),
        ([Message("developer", "Dev."), Message("user", "Hi")], "Default.", "Dev."),
    ],
)
def test_lfm2_template_system_precedence(messages: list[Message], system: str | None, expected_system: str) -> None:
    prompt = render_chat(GoTemplate(LFM2), messages, system=system, tools=None)
    assert prompt.startswith(f"<|startoftext|><|im_start|>system\n{expected_system}<|im_end|>\n")


def test_lfm2_template_multi_turn_repeats_the_template_as_ollama_does() -> None:
    # The template has no .Response, so (as in Ollama) the earlier assistant reply does not appear.
    messages = [Message("user", "U1"), Message("assistant", "A1"), Message("user", "U2")]
    prompt = render_chat(GoTemplate(LFM2), messages, system="S", tools=None)
    turn = "<|startoftext|><|im_start|>system\n{}<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    assert prompt == turn.format("S", "U1") + turn.format("", "U2")


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        ([Message("user", "U")], "<|user|>U\n<|assistant|>"),
        (
            [Message("system", "S"), Message("user", "U1"), Message("assistant", "A1"), Message("user", "U2")],
            "<|system|>S\n<|user|>U1\n<|assistant|>A1<|end|>\n<|user|>U2\n<|assistant|>",
        ),
        # a last assistant message is continued: the final pass stops right after .Response
        ([Message("user", "U"), Message("assistant", "Sure,")], "<|user|>U\n<|assistant|>Sure,"),
        # consecutive messages of one role are merged with a blank line (Ollama's collate)
        ([Message("user", "a"), Message("user", "b")], "<|user|>a\n\nb\n<|assistant|>"),
    ],
)
def test_legacy_template_renders_per_exchange_and_cuts_after_response(messages: list[Message], expected: str) -> None:
    template = GoTemplate(LEGACY)
    assert not template.uses_messages
    assert render_chat(template, messages, system=None, tools=None) == expected


def test_chatml_messages_template_with_tools() -> None:
    template = GoTemplate(CHATML)
    assert template.uses_messages
    messages = [
        Message("system", "You are helpful."),
        Message("user", "Weather in Paris?"),
        Message("assistant", "", tool_calls=[ToolCall("get_weather", '{"city": "Paris"}', id="c1")]),
        Message("tool", "18C", tool_call_id="c1"),
    ]
    assert render_chat(template, messages, system=None, tools=[WEATHER_TOOL]) == (
        "<|im_start|>system\nYou are helpful.\n\n# Tools\n<tools>\n" + WEATHER_JSON + "\n</tools><|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>tool\n18C<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        ([Message("user", "Hi")], "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
        # a final assistant message is left open (no <|im_end|>, no new header): the model continues it
        (
            [Message("user", "Hi"), Message("assistant", "Hel")],
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHel",
        ),
    ],
)
def test_chatml_messages_template_without_system_or_tools(messages: list[Message], expected: str) -> None:
    assert render_chat(GoTemplate(CHATML), messages, system=None, tools=None) == expected


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (
            "{{ range .Tools }}{{ .Function.Name }}/{{ .function.name }}/{{ .Type }}{{ end }}",
            "get_weather/get_weather/function",
        ),
        ("{{ range .Tools }}{{ . }}{{ end }}", WEATHER_JSON),
        (
            "{{ range .Tools }}{{ range $k, $v := .Function.Parameters.Properties }}"
            "{{ $k }}:{{ $v.Type }}{{ end }}{{ end }}",
            "city:string",
        ),
        (
            "{{ range .Messages }}{{ range .ToolCalls }}"
            "{{ .Function.Arguments }}|{{ .Function.Arguments.city }}{{ end }}{{ end }}",
            '{"city":"Paris"}|Paris',
        ),
        (
            "{{ range .Messages }}{{ .Role }}:{{ .ToolCallID }}{{ .ToolName }},{{ end }}",
            "system:,user:,assistant:,tool:c1get_weather,",
        ),
        ("{{ .System }}|{{ .Prompt }}|{{ .Response }}|{{ .AddGenerationPrompt }}|{{ len .Messages }}", "S|Q||true|4"),
    ],
)
def test_messages_data_model(source: str, expected: str) -> None:
    messages = [
        Message("user", "Q"),
        Message("assistant", "", tool_calls=[ToolCall("get_weather", '{"city": "Paris"}')]),
        Message("tool", "18C", tool_call_id="c1", name="get_weather"),
    ]
    template = GoTemplate("{{ if .Messages }}{{ end }}" + source)  # .Tools is only given to .Messages templates
    assert render_chat(template, messages, system="S", tools=[WEATHER_TOOL]) == expected


def test_legacy_template_does_not_see_tools() -> None:
    template = GoTemplate("{{ if .Tools }}tools{{ end }}{{ .Prompt }}")
    assert render_chat(template, [Message("user", "Hi")], system=None, tools=[WEATHER_TOOL]) == "Hi"


@pytest.mark.parametrize("tools", [None, []])
def test_no_tools_is_false(tools: list[dict[str, Any]] | None) -> None:
    template = GoTemplate("{{ if .Tools }}tools{{ else }}no tools{{ end }}:{{ .Messages | len }}")
    assert render_chat(template, [Message("user", "Hi")], system=None, tools=tools) == "no tools:1"


def test_tool_json_round_trips() -> None:
    template = GoTemplate("{{ range .Tools }}{{ json . }}{{ end }}{{ if .Messages }}{{ end }}")
    assert json.loads(render_chat(template, [], system=None, tools=[WEATHER_TOOL])) == WEATHER_TOOL


def test_messages_template_errors_surface_as_template_error() -> None:
    template = GoTemplate("{{ range .Messages }}{{ index .ToolCalls 0 }}{{ end }}")
    with pytest.raises(TemplateError, match="index out of range: 0"):
        render_chat(template, [Message("user", "Hi")], system=None, tools=None)


THINKS = (
    "{{ range .Messages }}{{ .Role }}:{{ if .Thinking }}[{{ .Thinking }}]{{ end }}{{ .Content }};{{ end }}"
    "{{ if .IsThinkSet }}think={{ .Think }}{{ if .ThinkLevel }}/{{ .ThinkLevel }}{{ end }}{{ else }}unset{{ end }}"
)


@pytest.mark.parametrize(("think", "tail"), [(None, "unset"), (False, "think=false"), (True, "think=true"),
                                             ("high", "think=true/high")])
def test_a_template_reads_the_thinking_switch_and_earlier_thinking(think: bool | str | None, tail: str) -> None:
    messages = [Message("user", "Hi"), Message("assistant", "Hello", thinking="greet")]
    prompt = render_chat(GoTemplate(THINKS), messages, system=None, tools=None, think=think)
    assert prompt == "user:Hi;assistant:[greet]Hello;" + tail
