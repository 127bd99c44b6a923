"""Closing a constrained reply: at every cut point of every text a structured-output grammar allows, the text so
far plus `closing()` parses as JSON and validates against the schema; the minimal documents are the shortest.

Texts are drawn from the grammars without a model (tests/chat/gbnf.py), for every schema the structured-output
tests accept (tests/chat/test_structured.py), so every construct the grammar writer emits is covered.
"""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest

from lmserve.chat.json_closing import Closer, closer_for
from lmserve.chat.structured import json_object_grammar, schema_grammar
from lmserve.chat.tools import ToolCallParser, get_parser
from lmserve.chat.tools.forcing import ANY_TOOL, forced_call_grammar
from tests.chat.gbnf import Grammar
from tests.chat.test_structured import ACCEPTED

UNBOUNDED: dict[str, Any] = {
    "type": "object",
    "properties": {"topic": {"type": "string"}, "items": {"type": "array", "items": {"type": "string"}}},
    "required": ["topic", "items"],
    "additionalProperties": False,
}


def validator(schema: Any) -> Any:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def check_every_cut(grammar: str, schema: Any, draws: int = 12) -> None:
    closer = Closer(grammar)
    check = validator(schema)
    rng = random.Random(4321)
    sampler = Grammar(grammar)
    for _ in range(draws):
        text = sampler.sample(rng)
        tracker = closer.start()
        for cut in range(len(text) + 1):
            if cut:
                assert tracker.feed(text[cut - 1]), (text, cut)
            document = text[:cut] + tracker.closing()
            errors = list(check.iter_errors(json.loads(document)))
            assert not errors, f"{text[:cut]!r} closed as {document!r}: {errors[0].message}"
        assert tracker.is_complete and tracker.closing() == ""


@pytest.mark.parametrize("name", ACCEPTED)
def test_every_prefix_of_every_allowed_text_closes_into_a_valid_document(name: str) -> None:
    check_every_cut(schema_grammar(ACCEPTED[name]), ACCEPTED[name])


def test_any_json_object_closes_into_an_object() -> None:
    check_every_cut(json_object_grammar(), {"type": "object"}, draws=30)


@pytest.mark.parametrize("name", ACCEPTED)
def test_the_minimal_document_is_valid_and_no_sampled_text_is_shorter(name: str) -> None:
    grammar = schema_grammar(ACCEPTED[name])
    shortest = Closer(grammar).shortest
    assert not list(validator(ACCEPTED[name]).iter_errors(json.loads(shortest)))
    rng = random.Random(99)
    sampler = Grammar(grammar)
    assert all(len(sampler.sample(rng)) >= len(shortest) for _ in range(50))


@pytest.mark.parametrize(("schema", "shortest"), [
    (UNBOUNDED, '{"topic":"","items":[]}'),
    ({"type": "object"}, "{}"),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, "[0,0]"),
    ({"type": "string", "minLength": 3}, '"000"'),
    ({"type": "integer", "minimum": 17}, "17"),
    ({"type": "string", "format": "date"}, '"1000-01-01"'),
    ({"enum": ["red", "green", 3]}, "3"),
])
def test_minimal_documents(schema: Any, shortest: str) -> None:
    assert Closer(schema_grammar(schema)).shortest == shortest


@pytest.mark.parametrize(("prefix", "closing"), [
    ("", '{"topic":"","items":[]}'),
    ('{"topic": "count', '","items":[]}'),
    ('{"topic": "x", "items": ["a", "b', '"]}'),
    ('{"topic": "x", "items": ["a", ', '""]}'),
    ('{"topic": "x", "items": ["a"] ', "}"),
    ('{"topic": "x", "items": ["a"]}', ""),
    ('{"topic": "a\\', '"","items":[]}'),  # the escape finished as \", then the string closed
])
def test_closings_of_an_unbounded_array(prefix: str, closing: str) -> None:
    tracker = Closer(schema_grammar(UNBOUNDED)).start()
    assert tracker.feed(prefix)
    assert tracker.closing() == closing
    jsonschema.validate(json.loads(prefix + closing), UNBOUNDED)


def test_a_started_number_or_literal_is_finished() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "number"}, "ok": {"type": "boolean"}},
              "required": ["n", "ok"]}
    tracker = Closer(schema_grammar(schema)).start()
    for prefix, closing in [('{"n": -', '0,"ok":true}'), ("1.", '0,"ok":true}'), ('5, "ok": f', 'alse}')]:
        assert tracker.feed(prefix)
        assert tracker.closing() == closing


def test_text_outside_the_grammar_is_lost() -> None:
    tracker = Closer(schema_grammar(UNBOUNDED)).start()
    assert not tracker.feed("[")
    assert tracker.lost and not tracker.feed("{")
    with pytest.raises(ValueError):
        tracker.closing()


def test_repetitions_as_gbnf_writes_them() -> None:
    grammar = 'root ::= "a"{2} b{1,3} ( "c" | "de" )+ "f"? [x-z]{2,} .\nb ::= "b"\n'
    closer = Closer(grammar)
    assert closer.shortest == "aabcxx0"
    tracker = closer.start()
    assert tracker.feed("aabbbdecy")
    assert tracker.closing() == "x0"
    assert not closer.start().feed("aabbbb")


@pytest.mark.parametrize("grammar", ["root ::= ( \"a\"", "nothing ::= \"a\"", "root ::= b", "root ::= root \"a\""])
def test_unreadable_grammars_are_refused(grammar: str) -> None:
    with pytest.raises(ValueError):
        Closer(grammar)


def test_closers_are_kept_per_grammar() -> None:
    grammar = schema_grammar(UNBOUNDED)
    assert closer_for(grammar) is closer_for(grammar)


# ---- forced tool calls: the call format's markers around the JSON (chat/tools/forcing.py) ----

WEATHER: dict[str, Any] = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "note": {"type": "string"}},
    "required": ["city", "note"], "additionalProperties": False}}}
TIME: dict[str, Any] = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
FORCED = [  # (format, forced tool, single call): every format that can force one, one call or a list of calls
    ("json", ANY_TOOL, True), ("json", ANY_TOOL, False), ("json", "get_time", True), ("hermes", ANY_TOOL, True),
    ("lfm2", "get_weather", True), ("llama3_json", ANY_TOOL, True),
]


def check_calls(parser: ToolCallParser, text: str) -> None:
    """`text` is nothing but calls of the tools, each with arguments valid against its parameters."""
    content, calls = parser.parse(text)
    assert calls and not content.strip(), text
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), tools[call.name])


@pytest.mark.parametrize(("fmt", "forced", "single"), FORCED)
def test_every_prefix_of_a_forced_call_closes_into_complete_calls(fmt: str, forced: str, single: bool) -> None:
    parser = get_parser(fmt)
    grammar = forced_call_grammar(parser, [WEATHER, TIME], forced, single=single)
    closer = Closer(grammar)
    check_calls(parser, closer.shortest)
    rng = random.Random(77)
    sampler = Grammar(grammar)
    for _ in range(6):
        text = sampler.sample(rng)
        tracker = closer.start()
        for cut in range(len(text) + 1):
            if cut:
                assert tracker.feed(text[cut - 1]), (text, cut)
            check_calls(parser, text[:cut] + tracker.closing())


@pytest.mark.parametrize(("fmt", "prefix", "closing"), [
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',
     '","note":""}}</tool_call>'),
    ("lfm2", '<|tool_call_start|>[{"name": "get_weather", "arguments": {"city": "Paris", "note": "x"} ',
     "}]<|tool_call_end|>"),
    ("json", '[{"name": "get_time", "arguments": {"tz": "UTC"}}, {"name": "get_weather", "arguments": {"ci',
     'ty":"","note":""}}]'),  # a list of calls closes after the call under way
    ("json", '[{"name": "get_time", "arguments": {"tz": "UTC"}}, ', '{"name":"get_time","arguments":{"tz":""}}]'),
])
def test_a_forced_call_closes_its_json_then_its_markers(fmt: str, prefix: str, closing: str) -> None:
    grammar = forced_call_grammar(get_parser(fmt), [WEATHER, TIME], ANY_TOOL, single=False)
    tracker = Closer(grammar).start()
    assert tracker.feed(prefix)
    assert tracker.closing() == closing
