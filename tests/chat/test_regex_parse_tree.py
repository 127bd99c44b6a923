"""Pins what `lmserve.chat.structured` relies on in the standard library's private regex parser (`re._parser`).

`pattern` is compiled to GBNF by walking the tree `re._parser.parse` builds. That module is private: a Python
release may change its tree. These cases spell out, for every regex feature the compiler reads or refuses, the
tree it expects, so such a change fails here, loudly, rather than as a wrong grammar.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

import pytest

_parser: Any = importlib.import_module("re._parser")
_constants: Any = importlib.import_module("re._constants")


def shape(node: Any) -> Any:
    """The parse tree with opcodes as their names, MAXREPEAT as "MAXREPEAT" and sub-patterns as lists."""
    if isinstance(node, list | _parser.SubPattern):
        return [shape(item) for item in node]
    if isinstance(node, tuple) and len(node) == 2 and hasattr(node[0], "name"):
        return (node[0].name, shape(node[1]))
    if isinstance(node, tuple):
        return tuple(shape(item) for item in node)
    if hasattr(node, "name"):
        return node.name
    return "MAXREPEAT" if node == _constants.MAXREPEAT else node


A, B, C = ("LITERAL", 97), ("LITERAL", 98), ("LITERAL", 99)

TREES: dict[str, tuple[str, list[Any]]] = {
    "literals and anchors": ("^ab$", [("AT", "AT_BEGINNING"), A, B, ("AT", "AT_END")]),
    "string anchors": (r"\Aa\Z", [("AT", "AT_BEGINNING_STRING"), A, ("AT", "AT_END_STRING")]),
    "alternatives": ("a|bc", [("BRANCH", (None, [[A], [B, C]]))]),
    "capturing group": ("(a)", [("SUBPATTERN", (1, 0, 0, [A]))]),
    "non-capturing group is inlined": ("(?:a)", [A]),
    "group with flags": ("(?i:a)", [("SUBPATTERN", (None, re.IGNORECASE, 0, [A]))]),
    "lazy counted repeat": ("a{2,5}?", [("MIN_REPEAT", (2, 5, [A]))]),
    "greedy open repeat": ("a*", [("MAX_REPEAT", (0, "MAXREPEAT", [A]))]),
    "any": (".", [("ANY", None)]),
    "negated single character": ("[^a]", [("NOT_LITERAL", 97)]),
    "negated class": (r"[^a-c\d]", [("IN", [("NEGATE", None), ("RANGE", (97, 99)), ("CATEGORY", "CATEGORY_DIGIT")])]),
    "categories": (
        r"[\w\s\D\S\W]",
        [("IN", [("CATEGORY", name) for name in ("CATEGORY_WORD", "CATEGORY_SPACE", "CATEGORY_NOT_DIGIT",
                                                  "CATEGORY_NOT_SPACE", "CATEGORY_NOT_WORD")])],
    ),
    "word boundary": (r"\b", [("AT", "AT_BOUNDARY")]),
    "lookahead": ("(?=a)", [("ASSERT", (1, [A]))]),
    "negative lookahead": ("(?!a)", [("ASSERT_NOT", (1, [A]))]),
    "backreference": (r"(a)\1", [("SUBPATTERN", (1, 0, 0, [A])), ("GROUPREF", 1)]),
    "conditional group": (
        "(a)?(?(1)b)",
        [("MAX_REPEAT", (0, 1, [("SUBPATTERN", (1, 0, 0, [A]))])), ("GROUPREF_EXISTS", (1, [B], None))],
    ),
    "atomic group": ("(?>a)", [("ATOMIC_GROUP", [A])]),
    "possessive repeat": ("a++", [("POSSESSIVE_REPEAT", (1, "MAXREPEAT", [A]))]),
}


@pytest.mark.parametrize(("pattern", "tree"), TREES.values(), ids=TREES.keys())
def test_parse_tree_shape(pattern: str, tree: list[Any]) -> None:
    assert shape(_parser.parse(pattern)) == tree


FLAGS: dict[str, tuple[str, int]] = {
    "none (a str pattern is unicode)": ("a", re.UNICODE),
    "verbose": ("(?x) a", re.UNICODE | re.VERBOSE),
    "dotall": ("(?s)a", re.UNICODE | re.DOTALL),
    "ascii": ("(?a)a", re.ASCII),
    "ignorecase": ("(?i)a", re.UNICODE | re.IGNORECASE),
}


@pytest.mark.parametrize(("pattern", "flags"), FLAGS.values(), ids=FLAGS.keys())
def test_global_flags_are_on_the_parse_state(pattern: str, flags: int) -> None:
    assert _parser.parse(pattern).state.flags == flags


def test_the_literal_opcode_is_importable_and_named() -> None:
    assert _parser.LITERAL.name == "LITERAL"
    assert isinstance(_constants.MAXREPEAT, int)


@pytest.mark.parametrize("pattern", ["(a", "a{2,1}", "[b-a]"])
def test_invalid_patterns_raise_re_error(pattern: str) -> None:
    with pytest.raises(re.error):
        _parser.parse(pattern)
