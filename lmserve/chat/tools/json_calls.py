"""The `json` format, lmserve's own for models that know no call format of their own: the whole output is a JSON
list of calls, `[{"name": "get_weather", "arguments": {"city": "Paris"}}]`.

This is the shape vLLM forces for `tool_choice: "required"` on any model (it names the arguments `parameters`; both
spellings are read). A single call object without the list, and the list inside a Markdown code fence
(```` ```json … ``` ````), are read too: small models write both when they call unforced. A call object has exactly
the keys `name` and `arguments` (or `parameters`), the arguments an object: any other JSON (`{"answer": 42}`,
`["a", "b"]`) is content, as is a call with text around it.

`tools_prompt()` is the system-prompt block that teaches a model this format: the tools as JSON schema and the exact
call shape. The service puts it in the prompt when a model's template does not render tools itself.
"""

from __future__ import annotations

import json
from typing import Any

from lmserve.chat.tools.base import ParsedCall, WholeOutputFormat, make_call

__all__ = ["CALL_SHAPE", "JsonCallsParser", "tools_prompt"]

CALL_SHAPE = '[{"name": "<function name>", "arguments": {<the arguments, a JSON object>}}]'
"""The call shape the tools prompt teaches (one object per call in the list)."""

_ARGUMENT_KEYS = ("arguments", "parameters")
_KEYS = ("name", *_ARGUMENT_KEYS)
_FENCE = "```"
_FENCE_LANGUAGE = "json"


def tools_prompt(tools: list[dict[str, Any]]) -> str:
    """The system-prompt block that describes `tools` (OpenAI function tools) and the JSON call shape."""
    functions = [_function_summary(tool) for tool in tools]
    listing = "\n".join(json.dumps(f, ensure_ascii=False) for f in functions)
    return (
        "You can call the following functions (their parameters are described as JSON schema):\n"
        f"{listing}\n\n"
        "To call one or more of them, answer with only a JSON list of calls and nothing else, in this shape:\n"
        f"{CALL_SHAPE}\n"
        "If no function is needed, answer the user in plain text."
    )


def _function_summary(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool.get("function", tool)
    summary: dict[str, Any] = {"name": function.get("name")}
    if function.get("description"):
        summary["description"] = function["description"]
    summary["parameters"] = function.get("parameters") or {"type": "object", "properties": {}}
    return summary


def _call(obj: Any) -> ParsedCall | None:
    """A call object: exactly `name` and one of `arguments`/`parameters` (an object, or the JSON text of one)."""
    if not isinstance(obj, dict) or set(obj) - set(_KEYS) or "name" not in obj:
        return None
    keys = [k for k in _ARGUMENT_KEYS if k in obj]
    if len(keys) != 1:
        return None
    return make_call(obj["name"], obj[keys[0]])


def _calls(value: Any) -> list[ParsedCall] | None:
    items = value if isinstance(value, list) else [value]
    calls = [_call(item) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


def _key_viable(t: str, pos: int) -> bool:
    """Whether the object starting at `t[pos]` (`{`) may still have only call keys; errs towards True."""
    i = pos + 1
    while i < len(t) and t[i].isspace():
        i += 1
    if i == len(t):
        return True
    if t[i] != '"':
        return False
    end = t.find('"', i + 1)
    key = t[i + 1 :] if end < 0 else t[i + 1 : end]
    if "\\" in key:
        return True  # an escaped key: leave it to the decoder
    return any(k.startswith(key) for k in _KEYS) if end < 0 else key in _KEYS


def _unfence(t: str, final: bool) -> tuple[str, bool] | bool | None:
    """`t` (stripped on the left) without an opening code fence: (the rest, fenced); True while the fence is not
    yet complete (not `final`); None when `t` starts like a fence but is none."""
    if not t.startswith(_FENCE):
        if _FENCE.startswith(t):
            return None if final else True
        return t, False
    rest = t[len(_FENCE) :]
    if rest.startswith(_FENCE_LANGUAGE):
        rest = rest[len(_FENCE_LANGUAGE) :]
    elif _FENCE_LANGUAGE.startswith(rest) and not final:
        return True
    stripped = rest.lstrip()
    if stripped == rest and rest:  # the fence's line must end before the JSON
        return None
    return stripped, True


class JsonCallsParser(WholeOutputFormat):
    """The whole output is a JSON list of `{"name", "arguments"}` objects (or one such object), maybe fenced."""

    name = "json"
    start_marker = "["

    def _scan(self, text: str, final: bool) -> list[ParsedCall] | bool | None:
        unfenced = _unfence(text.lstrip(), final)
        if not isinstance(unfenced, tuple):
            return unfenced
        t, fenced = unfenced
        if not t:
            return None if final else True
        if t[0] == "[":
            i = 1
            while i < len(t) and t[i].isspace():
                i += 1
            if i < len(t) and (t[i] != "{" or not _key_viable(t, i)):
                return None
        elif t[0] != "{" or not _key_viable(t, 0):
            return None
        try:
            value, end = json.JSONDecoder().raw_decode(t)
        except (ValueError, RecursionError):
            return None if final else True  # maybe just incomplete
        rest = t[end:].strip()
        if fenced:  # the closing fence, or a start of it, or none (the output ended first)
            rest = rest[len(_FENCE) :].strip() if rest.startswith(_FENCE) else "" if _FENCE.startswith(rest) else rest
        if rest:
            return None
        return _calls(value)
