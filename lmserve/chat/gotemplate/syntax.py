"""The parsed form of a Go template: its operands, pipelines and nodes, and the error a bad template raises."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmserve.errors import InvalidRequest


class TemplateError(InvalidRequest):
    """A Modelfile TEMPLATE that does not parse (raised by `GoTemplate()`) or fails while rendering (`execute`).

    `line` is the 1-based line of the offending action in the template text, when known.
    """

    def __init__(self, detail: str, *, line: int | None = None) -> None:
        super().__init__(f"template{'' if line is None else f' line {line}'}: {detail}", param="template")
        self.detail = detail
        self.line = line


@dataclass(frozen=True, slots=True)
class Expr:
    """An operand, also a token. kind: "lit" (value), "dot", "field" (names), "var" (value = "$name", names),
    "func" (value = name), "sub" (value = a parenthesised Pipe, names read from its result); the lexer adds
    "ident" and punctuation ("(", ")", "|", ",", ":=", "=")."""

    kind: str
    value: Any = None
    names: tuple[str, ...] = ()
    pos: int = 0
    end: int = 0


@dataclass(frozen=True, slots=True)
class Pipe:
    cmds: tuple[tuple[Expr, ...], ...]  # each command: a function or a value, then the function's arguments
    decl: tuple[str, ...] = ()
    is_assign: bool = False


@dataclass(frozen=True, slots=True)
class Node:
    """kind: "text" (text), "action" (pipe), "if"/"with"/"range" (pipe, body, orelse), "break", "continue"."""

    kind: str
    line: int = 0
    text: str = ""
    pipe: Pipe = Pipe(())
    body: tuple[Node, ...] = ()
    orelse: tuple[Node, ...] = ()
