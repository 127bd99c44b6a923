"""Pythonic calls, read with `ast` as literals only (never evaluated): the `pythonic` format, where the whole
output is a bare list `[f(a=1), g(b="x")]`, and the list reader the `lfm2` format shares."""

from __future__ import annotations

import ast
from typing import Any

from lmserve.chat.tools.base import ParsedCall, WholeOutputFormat, call_from_object, make_call

__all__ = ["PythonicParser", "parse_call_list"]

_JSON_NAMES: dict[str, Any] = {"true": True, "false": False, "null": None}


class _JsonNames(ast.NodeTransformer):
    """Reads the JSON spellings `true`, `false`, `null` as the Python constants (models mix them in)."""

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in _JSON_NAMES:
            return ast.copy_location(ast.Constant(_JSON_NAMES[node.id]), node)
        return node


def _literal(node: ast.expr) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(_JsonNames().visit(node))
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return False, None


def _function_name(node: ast.expr, dotted: bool) -> str | None:
    """A call's function: a plain name, or with `dotted` a dotted one (`a.b.c`); None for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if dotted and isinstance(node, ast.Attribute):
        head = _function_name(node.value, dotted)
        return None if head is None else f"{head}.{node.attr}"
    return None


def parse_call_list(source: str, *, lenient: bool, dotted: bool = False) -> list[ParsedCall] | None:
    """`[f(a=1), g(b="x")]` → calls; literals only, never evaluated.

    `lenient` also takes one bare call `f(a=1)`, and JSON-like dicts `{"name": …, "arguments": …}` as list items;
    `dotted` takes dotted function names (`a.b.c(x=1)` calls `a.b.c`).
    """
    try:
        node = ast.parse(source.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if isinstance(node, ast.List):
        items = node.elts
    elif lenient and isinstance(node, ast.Call):
        items = [node]
    else:
        return None
    calls: list[ParsedCall] = []
    for item in items:
        call: ParsedCall | None = None
        name = _function_name(item.func, dotted) if isinstance(item, ast.Call) else None
        if isinstance(item, ast.Call) and name is not None and not item.args:
            args: dict[str, Any] = {}
            for kw in item.keywords:
                ok, value = _literal(kw.value)
                if kw.arg is None or kw.arg in args or not ok:
                    return None
                args[kw.arg] = value
            call = make_call(name, args)
        elif lenient and isinstance(item, ast.Dict):
            ok, value = _literal(item)
            call = call_from_object(value) if ok else None
        if call is None:
            return None
        calls.append(call)
    return calls or None


class PythonicParser(WholeOutputFormat):
    """The whole output is a bare Python list of calls: `[f(a=1), g(b="x")]`."""

    name = "pythonic"
    start_marker = "["

    def _scan(self, text: str, final: bool) -> list[ParsedCall] | bool | None:
        t = text.strip()
        if final:
            return parse_call_list(t, lenient=False) if t.startswith("[") else None
        return True if call_list_head_viable(text.lstrip()) else None


def call_list_head_viable(t: str, *, dotted: bool = False) -> bool:
    """Whether a prefix of the output may still start a call list `[name(` (with `dotted`, also `[a.b(`); errs
    towards True (holding back is always safe)."""
    if not t:
        return True
    if t[0] != "[":
        return False
    i = 1
    while i < len(t) and t[i].isspace():
        i += 1
    if i == len(t) or t[i] in "(#\\":
        return True
    j = i
    while j < len(t) and ("a" + (t[i : j + 1].replace(".", "_") if dotted else t[i : j + 1])).isidentifier():
        j += 1
    if j == i:  # not a name: a string, a number, `]`, …: no call
        return False
    while j < len(t) and t[j].isspace():
        j += 1
    return j == len(t) or t[j] in "(#\\"
