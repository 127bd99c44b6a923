"""Spec for lmserve's own `json` call format: the tools prompt that teaches it, and the grammar that forces it."""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest

from lmserve.chat.tools import FALLBACK_PARSER, get_parser, tools_prompt
from lmserve.chat.tools.forcing import ANY_TOOL, forced_call_grammar
from lmserve.chat.tools.json_calls import CALL_SHAPE
from tests.chat.gbnf import Grammar

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                       "additionalProperties": False},
    },
}
TIME: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}},
                                                    "required": ["tz"], "additionalProperties": False}},
}
TOOLS = [WEATHER, TIME]


def test_the_fallback_format_is_json() -> None:
    assert FALLBACK_PARSER == "json" and get_parser(FALLBACK_PARSER).name == "json"


def test_the_tools_prompt_lists_every_tool_as_json_schema_and_shows_the_call_shape() -> None:
    block = tools_prompt(TOOLS)
    listed = [json.loads(line) for line in block.splitlines() if line.startswith('{"name"')]
    assert listed == [
        {"name": "get_weather", "description": "Get the weather for a city",
         "parameters": WEATHER["function"]["parameters"]},
        {"name": "get_time", "parameters": TIME["function"]["parameters"]},
    ]
    assert CALL_SHAPE in block


def _check(calls: Any, allowed: list[dict[str, Any]]) -> None:
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in allowed}
    assert isinstance(calls, list) and calls
    for call in calls:
        assert set(call) == {"name", "arguments"} and call["name"] in by_name
        jsonschema.validate(call["arguments"], by_name[call["name"]])


@pytest.mark.parametrize(("forced", "single", "allowed", "most"), [
    (ANY_TOOL, False, TOOLS, None),  # required: one or more calls of any tool
    (ANY_TOOL, True, TOOLS, 1),  # required with parallel_tool_calls false: exactly one
    ("get_time", False, [TIME], 1),  # named: exactly one call of that function
    ("get_time", True, [TIME], 1),
])
def test_a_forced_call_is_a_valid_list_of_calls_the_parser_reads_back(
    forced: str, single: bool, allowed: list[dict[str, Any]], most: int | None
) -> None:
    parser = get_parser("json")
    grammar = forced_call_grammar(parser, TOOLS, forced, single=single)
    sizes = set()
    rng = random.Random(3)
    for _ in range(60):
        text = Grammar(grammar).sample(rng)
        calls = json.loads(text)
        _check(calls, allowed)
        sizes.add(len(calls))
        content, parsed = parser.parse(text)
        assert content == "" and [(c.name, json.loads(c.arguments)) for c in parsed] == [
            (c["name"], c["arguments"]) for c in calls
        ]
    assert max(sizes) == 1 if most == 1 else max(sizes) > 1


def test_other_formats_still_force_one_call_in_their_markers() -> None:
    grammar = forced_call_grammar(get_parser("hermes"), TOOLS, ANY_TOOL, single=False)
    text = Grammar(grammar).sample(random.Random(1))
    assert text.startswith("<tool_call>") and text.endswith("</tool_call>")
    assert len(get_parser("hermes").parse(text)[1]) == 1
