"""Errors on the wire that every dialect shares: the OpenAI error body (also that of the Responses dialect and of
the routes that are no dialect), {"error": {"message", "type", "param", "code"}}, and request-validation errors as
one InvalidRequest. Each dialect's own body is in its package; dialects/table.py picks one by path."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lmserve.errors import InvalidRequest, LmserveError

INTERNAL_ERROR = "The server had an error while processing your request."

# pydantic adds the union member it tried to a location; these are not field names
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})
# lists of tagged parts, and what one element is called in a message
_PART_LISTS = {"content": "content part"}


def openai_error(err: LmserveError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


def invalid_from_validation(errors: Sequence[Mapping[str, Any]], *, strip: int = 0) -> InvalidRequest:
    """Turn pydantic/FastAPI validation errors into one InvalidRequest naming the offending field.

    `strip` drops leading location parts (FastAPI prefixes "body", "query" …). `param` is the top-level
    field; the message names the full path of the most telling error: where a field takes one of several shapes
    (`content`: a string or a list of parts), the complaint of a shape the value did not have at all ("Input should
    be a valid string" for a list) gives way to the one from the shape it has.
    """
    if not errors:
        return InvalidRequest("invalid request body")
    first = next((e for e in errors if not _is_other_member(e, strip)), errors[0])
    loc = tuple(first.get("loc", ()))[strip:]
    kind = str(first.get("type", ""))
    message = str(first.get("msg", "invalid value"))
    if kind == "json_invalid":
        return InvalidRequest(f"We could not parse the JSON body of your request: {message}", code="invalid_json")
    if not loc or not isinstance(loc[0], str):
        return InvalidRequest(f"Invalid request body: {message}")
    param = loc[0]
    path = location(loc)
    if kind == "missing":
        return InvalidRequest(f"Missing required parameter: '{path}'.", param=param)
    if kind == "union_tag_not_found":
        return InvalidRequest(f"Missing required parameter: '{path}.type'.", param=param)
    if kind == "union_tag_invalid":
        return InvalidRequest(f"Invalid value for '{path}': {_unsupported_tag(loc, first.get('ctx') or {})}",
                              param=param)
    if kind == "value_error":
        message = message.removeprefix("Value error, ")
    return InvalidRequest(f"Invalid value for '{path}': {message}", param=param)


def _is_other_member(error: Mapping[str, Any], strip: int) -> bool:
    """An error that only says the value is not one member of a union (its location ends at that member)."""
    loc = tuple(error.get("loc", ()))[strip:]
    return bool(loc) and isinstance(loc[-1], str) and _is_member_tag(loc[-1])


def _unsupported_tag(loc: Sequence[int | str], ctx: Mapping[str, Any]) -> str:
    """"content part type 'input_audio' is not supported; use 'text', 'image_url' or 'refusal'"."""
    noun = "type"
    named = [part for part in loc if isinstance(part, str) and not _is_member_tag(part)]
    if isinstance(loc[-1], int) and named and named[-1] in _PART_LISTS:
        noun = f"{_PART_LISTS[named[-1]]} type"
    expected = [tag.strip() for tag in str(ctx.get("expected_tags", "")).split(",") if tag.strip()]
    choices = ", ".join(expected[:-1]) + f" or {expected[-1]}" if len(expected) > 1 else "".join(expected)
    return f"{noun} '{ctx.get('tag', '')}' is not supported" + (f"; use {choices}" if choices else "")


def location(loc: Sequence[int | str]) -> str:
    """("messages", 0, "content") → "messages[0].content", without pydantic's union-member tags.

    A discriminated union puts the member's tag in the location, and OpenAI names a member's payload after its
    type (`{"type": "image_url", "image_url": …}`), so a name repeated right after itself is the tag: said once.
    """
    parts = [part for part in loc if not (isinstance(part, str) and _is_member_tag(part))]
    out = ""
    for i, part in enumerate(parts):
        if isinstance(part, int):
            out += f"[{part}]"
        elif i + 1 < len(parts) and parts[i + 1] == part:
            continue
        else:
            out += f".{part}" if out else part
    return out


def _is_member_tag(part: str) -> bool:
    """Pydantic's name for a union member in a location: a type ("str", "list[…]") or a model ("NamedToolChoice")."""
    return "[" in part or part in _UNION_TAGS or part[:1].isupper()
