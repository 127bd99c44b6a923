"""Running a parsed Go template: the variable stack, the output, and the line a failure is reported at."""

from __future__ import annotations

from typing import Any

from lmserve.chat.gotemplate.functions import FUNCS, NOARG, field_of, items_of, show, truth
from lmserve.chat.gotemplate.syntax import Expr, Node, Pipe


class Break(Exception):
    pass


class Continue(Exception):
    pass


class Executor:
    """One rendering: the variable stack (`$` first), the output pieces and the line being executed."""

    def __init__(self, root: Any) -> None:
        self.vars: list[list[Any]] = [["$", root]]
        self.out: list[str] = []
        self.line = 1

    def walk(self, nodes: tuple[Node, ...], dot: Any) -> None:
        for node in nodes:
            if node.kind == "text":
                self.out.append(node.text)
                continue
            self.line = node.line
            if node.kind == "action":
                value = self.pipe(node.pipe, dot)
                if not node.pipe.decl:
                    self.out.append(show(value))
            elif node.kind in ("break", "continue"):
                raise Break() if node.kind == "break" else Continue()
            else:
                self.block(node, dot)

    def block(self, node: Node, dot: Any) -> None:
        mark = len(self.vars)
        try:
            value = self.pipe(node.pipe, dot)  # as in Go, range's variables first hold the whole value
            if node.kind == "range":
                self.loop(node, value, dot)
            elif truth(value):
                self.walk(node.body, value if node.kind == "with" else dot)
            else:
                self.walk(node.orelse, dot)
        finally:
            del self.vars[mark:]

    def loop(self, node: Node, value: Any, dot: Any) -> None:
        items, names = items_of(value), node.pipe.decl
        if not items:
            self.walk(node.orelse, dot)
            return
        base = len(self.vars) - (0 if node.pipe.is_assign else len(names))
        for key, elem in items:
            for j, (name, v) in enumerate(zip(names, (elem,) if len(names) == 1 else (key, elem), strict=False)):
                if node.pipe.is_assign:
                    self.assign(name, v)
                else:
                    self.vars[base + j][1] = v
            mark = len(self.vars)
            try:
                self.walk(node.body, elem)
            except Continue:
                pass
            except Break:
                break
            finally:
                del self.vars[mark:]

    def pipe(self, pipe: Pipe, dot: Any) -> Any:
        value: Any = NOARG
        for cmd in pipe.cmds:
            value = self.command(cmd, dot, value)
        for name in pipe.decl:
            if pipe.is_assign:
                self.assign(name, value)
            else:
                self.vars.append([name, value])
        return value

    def command(self, cmd: tuple[Expr, ...], dot: Any, piped: Any) -> Any:
        head, rest = cmd[0], cmd[1:]
        if head.kind != "func":
            return self.arg(head, dot)
        if head.value in ("and", "or"):  # short-circuit: the deciding value, or the last one
            value = None
            for i in range(len(rest) + (piped is not NOARG)):
                value = self.arg(rest[i], dot) if i < len(rest) else piped
                if truth(value) != (head.value == "and"):
                    break
            return value
        args = [self.arg(a, dot) for a in rest] + ([] if piped is NOARG else [piped])
        return FUNCS[head.value][2](args)

    def arg(self, expr: Expr, dot: Any) -> Any:
        if expr.kind == "lit":
            return expr.value
        if expr.kind == "func":  # a function named as an argument is called without arguments
            return self.command((expr,), dot, NOARG)
        value = (
            self.lookup(expr.value) if expr.kind == "var" else self.pipe(expr.value, dot) if expr.kind == "sub" else dot
        )
        for name in expr.names:
            value = field_of(value, name)
        return value

    def lookup(self, name: str) -> Any:
        return next(entry for entry in reversed(self.vars) if entry[0] == name)[1]

    def assign(self, name: str, value: Any) -> None:
        next(entry for entry in reversed(self.vars) if entry[0] == name)[1] = value
