"""`GoTemplate`: a Modelfile TEMPLATE parsed once and rendered per request, and the last-turn tree Ollama renders
when a template does not read `.Messages`."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from lmserve.chat.gotemplate.executor import Executor
from lmserve.chat.gotemplate.functions import Fail
from lmserve.chat.gotemplate.parser import Parser
from lmserve.chat.gotemplate.syntax import Expr, Node, Pipe, TemplateError


def _exprs(pipe: Pipe) -> Iterator[Expr]:
    for cmd in pipe.cmds:
        for expr in cmd:
            yield expr
            if expr.kind == "sub":
                yield from _exprs(expr.value)


def _field_names(nodes: tuple[Node, ...]) -> Iterator[str]:
    for node in nodes:
        for expr in _exprs(node.pipe):
            yield from expr.names
        yield from _field_names(node.body + node.orelse)


def _cut_after_response(nodes: tuple[Node, ...], cut: list[bool]) -> tuple[Node, ...]:
    """Ollama's last-turn tree: everything after the first action that prints a `.Response` field is dropped."""
    kept: list[Node] = []
    for node in nodes:
        if cut[0]:
            break
        if node.kind == "action":
            cut[0] = any(e.kind == "field" and "Response" in e.names for e in _exprs(node.pipe))
        elif node.body or node.orelse:
            node = replace(node, body=_cut_after_response(node.body, cut), orelse=_cut_after_response(node.orelse, cut))
        kept.append(node)
    return tuple(kept)


class GoTemplate:
    """A Modelfile TEMPLATE parsed once; `execute(data)` renders it against a dict root.

    Raises `TemplateError` (an `InvalidRequest`, with the line) for a syntax error, an unknown function or variable,
    a wrong argument count or an unsupported construct.
    """

    __slots__ = ("_last_turn", "_nodes", "_uses_messages", "source")

    def __init__(self, source: str) -> None:
        self.source = source
        try:
            self._nodes = Parser(source).parse()
            self._uses_messages = "messages" in {name.lower() for name in _field_names(self._nodes)}
            self._last_turn = _cut_after_response(self._nodes, [False])
        except RecursionError as exc:
            raise TemplateError("template nests too deeply") from exc

    @property
    def uses_messages(self) -> bool:
        """True when the template reads `.Messages` (rendered once); otherwise Ollama's per-turn legacy mode."""
        return self._uses_messages

    def execute(self, data: dict[str, Any]) -> str:
        """Render with `data` as `.` and `$`. A runtime failure (index out of range, len of a number …) raises
        `TemplateError` with the line of the failing action; no other exception leaves this method."""
        return self._run(self._nodes, data)

    def _run(self, nodes: tuple[Node, ...], data: dict[str, Any]) -> str:
        ex = Executor(data)
        try:
            ex.walk(nodes, data)
        except Fail as exc:
            raise TemplateError(str(exc), line=ex.line) from exc
        except RecursionError as exc:
            raise TemplateError("template nests too deeply", line=ex.line) from exc
        except Exception as exc:
            raise TemplateError(f"{type(exc).__name__}: {exc}", line=ex.line) from exc
        return "".join(ex.out)
