"""Forced tool calls: a grammar that lets the model write only a valid call, in its own call format.

`tool_choice: "required"` allows any of the request's tools; a named choice allows that one only. The call is
written as the JSON form each parser reads (`{"name": …, "arguments": {…}}`), wrapped in the format's markers,
and its arguments must validate against the tool's `parameters` schema.

The `json` format (lmserve's own, for any model) is a JSON list of calls: `required` allows one or more calls (one
when `single`: `parallel_tool_calls: false`), a named choice exactly one. The other formats force one call.
"""

from __future__ import annotations

import re
from typing import Any

from lmserve.chat.structured import schema_grammar
from lmserve.chat.tools.base import ToolCallParser
from lmserve.errors import InvalidRequest

ANY_TOOL = "*"
_WRAPPERS = {
    "hermes": '"<tool_call>" call "</tool_call>"',
    "lfm2": '"<|tool_call_start|>[" call "]<|tool_call_end|>"',
    "llama3_json": "call",
}


def forced_call_grammar(parser: ToolCallParser, tools: list[dict[str, Any]], forced: str, *,
                        single: bool = True) -> str:
    """GBNF for a call of `forced` (a tool name, or ANY_TOOL) in `parser`'s format; in the `json` format, for one
    or more calls of ANY_TOOL unless `single`."""
    wrapper = _WRAPPERS.get(parser.name)
    if wrapper is None and parser.name != "json":
        raise InvalidRequest(
            f"tool_choice cannot force a call in the '{parser.name}' tool-call format", param="tool_choice"
        )
    functions = [t["function"] for t in tools if forced == ANY_TOOL or t["function"]["name"] == forced]
    if not functions:
        raise InvalidRequest(f"no tool named '{forced}'", param="tool_choice")
    schemas = [_call_schema(f) for f in functions]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if wrapper is None:  # json: the whole output is the list of calls
        many = forced == ANY_TOOL and not single
        calls = {"type": "array", "items": schema, "minItems": 1, **({} if many else {"maxItems": 1})}
        return schema_grammar(calls, param="tool_choice")
    body = schema_grammar(schema, param="tool_choice")
    renamed, count = re.subn(r"^root(\s*::=)", r"call\1", body, count=1, flags=re.MULTILINE)
    if count != 1 or re.search(r"(?<![\w-])root(?![\w-])", renamed):
        raise InvalidRequest("the tool's parameters schema cannot be forced", param="tool_choice")
    return f"root ::= {wrapper}\n{renamed}"


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters") or {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
