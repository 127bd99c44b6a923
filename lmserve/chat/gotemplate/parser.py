"""The Go-template lexer and parser: template text to a tree of `Node`s, every function and variable checked at
parse time."""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import NoReturn

from lmserve.chat.gotemplate.functions import FUNCS
from lmserve.chat.gotemplate.syntax import Expr, Node, Pipe, TemplateError

_SPACE = " \t\r\n"
_SPACES = frozenset(_SPACE)
_KEYWORDS = frozenset({"if", "else", "end", "range", "with", "break", "continue", "define", "template", "block"})
_FIELD = re.compile(r"(?:\.[^\W\d]\w*)+")
_VAR = re.compile(r"\$\w*(?:\.[^\W\d]\w*)*")
_IDENT = re.compile(r"[^\W\d]\w*")
_NUMBER = re.compile(
    r"[+-]?(?:0[xX][\da-fA-F_]+|0[bB][01_]+|0[oO][0-7_]+|(?:\d[\d_]*(?:\.[\d_]*)?|\.\d[\d_]*)(?:[eE][+-]?\d+)?)"
)
_ESCAPE = re.compile(r"""\\(?:([abfnrtv\\'"])|([0-7]{3})|x([\da-fA-F]{2})|u([\da-fA-F]{4})|U([\da-fA-F]{8}))""")
_SIMPLE_ESCAPES = MappingProxyType(dict(zip("abfnrtv\\'\"", b"\a\b\f\n\r\t\v\\'\"", strict=True)))


@dataclass(frozen=True, slots=True)
class _Act:
    """One `{{ … }}` as lexed: its tokens and where it starts."""

    tokens: tuple[Expr, ...]
    pos: int

    @property
    def word(self) -> str:
        first = self.tokens[0] if self.tokens else None
        return str(first.value) if first and first.kind == "ident" and first.value in _KEYWORDS else ""


def _right_delim(s: str, i: int) -> tuple[int, bool]:
    """(position after `}}`, trims) if a closing delimiter starts at i, else (-1, False)."""
    if s.startswith("}}", i):
        return i + 2, False
    if s[i : i + 1] in _SPACES and s.startswith("-}}", i + 1):
        return i + 4, True
    return -1, False


def _unquote(body: str) -> str:
    out, i = bytearray(), 0
    while (j := body.find("\\", i)) >= 0:
        out += body[i:j].encode("utf-8", "surrogatepass")
        if not (m := _ESCAPE.match(body, j)):
            raise ValueError("unknown escape sequence")
        simple, octal, hex2, u4, u8 = m.groups()
        if simple or octal or hex2:  # a byte, as in Go: "\xe2\x80\x99" is one character
            out.append(_SIMPLE_ESCAPES[simple] if simple else int(octal, 8) if octal else int(hex2, 16))
        else:
            out += chr(int(u4 or u8, 16)).encode()
        i = m.end()
    return (out + body[i:].encode("utf-8", "surrogatepass")).decode("utf-8", "replace")


def _number(text: str) -> int | float:
    t = text.replace("_", "")
    if re.fullmatch(r"[+-]?0\d+", t):
        return int(t, 8)
    if t.lstrip("+-")[:2].lower() in ("0x", "0b", "0o"):
        return int(t, 0)
    return float(t) if any(c in t for c in ".eE") else int(t)


class Parser:
    """Lexes and parses template text, checking functions, variables and argument counts as it goes."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.items = self._lex()
        self.i = 0  # next item
        self.toks: tuple[Expr, ...] = ()  # tokens of the action being parsed, and the next one's index
        self.t = 0
        self.vars = ["$"]
        self.range_depth = 0

    def fail(self, message: str, pos: int) -> NoReturn:
        raise TemplateError(message, line=self.source.count("\n", 0, pos) + 1)

    def _lex(self) -> list[str | _Act]:
        s, items, pos, trim = self.source, list[str | _Act](), 0, False
        while True:
            start = s.find("{{", pos)
            text = s[pos:] if start < 0 else s[pos:start]
            text = text.lstrip(_SPACE) if trim else text
            if start < 0:
                return [*items, text] if text else items
            i = start + 2
            if s.startswith("-", i) and s[i + 1 : i + 2] in _SPACES:
                text, i = text.rstrip(_SPACE), i + 2
            if text:
                items.append(text)
            if s.startswith("/*", i):
                close = s.find("*/", i + 2)
                if close < 0:
                    self.fail("unclosed comment", start)
                pos, trim = _right_delim(s, close + 2)
                if pos < 0:
                    self.fail("comment ends before closing delimiter", start)
                continue
            tokens: list[Expr] = []
            while (closing := _right_delim(s, i))[0] < 0:
                if i >= len(s):
                    self.fail("unclosed action", start)
                if s[i] in _SPACES:
                    i += 1
                    continue
                tokens.append(self._token(i))
                i = tokens[-1].end
            pos, trim = closing
            items.append(_Act(tuple(tokens), start))

    def _token(self, i: int) -> Expr:
        s, c = self.source, self.source[i]
        if c in "\"'":
            j = i + 1
            while j < len(s) and s[j] not in (c, "\n"):
                j += 2 if s[j] == "\\" else 1
            if j >= len(s) or s[j] != c:
                self.fail("unterminated quoted string" if c == '"' else "unterminated character constant", i)
            try:
                text = _unquote(s[i + 1 : j])
            except ValueError:
                self.fail(f"invalid syntax: {s[i : j + 1]}", i)
            if c == "'" and len(text) != 1:
                self.fail(f"malformed character constant: {s[i : j + 1]}", i)
            return Expr("lit", ord(text) if c == "'" else text, pos=i, end=j + 1)
        if c == "`":
            if (j := s.find("`", i + 1)) < 0:
                self.fail("unterminated raw quoted string", i)
            return Expr("lit", s[i + 1 : j], pos=i, end=j + 1)
        if c == "." and not s[i + 1 : i + 2].isdigit():
            m = _FIELD.match(s, i)
            return (
                Expr("field", None, tuple(m.group()[1:].split(".")), i, m.end())
                if m
                else Expr("dot", None, (), i, i + 1)
            )
        if c == "$" and (m := _VAR.match(s, i)):
            name, *chain = m.group().split(".")
            return Expr("var", name, tuple(chain), i, m.end())
        if m := _NUMBER.match(s, i):
            if (after := s[m.end() : m.end() + 1]).isalnum() or after in ("_", "."):
                self.fail(f"bad number syntax: {m.group()}{after}", i)
            return Expr("lit", _number(m.group()), pos=i, end=m.end())
        if m := _IDENT.match(s, i):
            return Expr("ident", m.group(), pos=i, end=m.end())
        for punct in (":=", "=", "(", ")", "|", ","):
            if s.startswith(punct, i):
                return Expr(punct, pos=i, end=i + len(punct))
        self.fail(f"unexpected {c!r} in action", i)

    def parse(self) -> tuple[Node, ...]:
        nodes, stop = self._list()
        if stop is not None:
            self.fail("unexpected {{" + stop.word + "}}", stop.pos)
        return nodes

    def _list(self) -> tuple[tuple[Node, ...], _Act | None]:
        """Nodes up to the next `{{end}}`/`{{else}}` (returned to the caller) or the end of input (None)."""
        nodes: list[Node] = []
        while self.i < len(self.items):
            item = self.items[self.i]
            self.i += 1
            if isinstance(item, str):
                nodes.append(Node("text", text=item))
                continue
            word, line = item.word, self.source.count("\n", 0, item.pos) + 1
            if word in ("end", "else"):
                return tuple(nodes), item
            if word in ("if", "with", "range"):
                nodes.append(self._block(word, item, 1))
            elif word in ("break", "continue"):
                if not self.range_depth:
                    self.fail("{{" + word + "}} outside {{range}}", item.pos)
                self._expect_end(item, 1)
                nodes.append(Node(word, line))
            elif word:
                self.fail("{{" + word + "}} is not supported", item.pos)
            else:
                nodes.append(Node("action", line, pipe=self._pipeline(item, 0, max_decl=1)))
        return tuple(nodes), None

    def _block(self, word: str, act: _Act, start: int) -> Node:
        mark = len(self.vars)
        pipe = self._pipeline(act, start, max_decl=2 if word == "range" else 1)
        self.range_depth += word == "range"
        body, stop = self._list()
        self.range_depth -= word == "range"
        orelse: tuple[Node, ...] = ()
        chained = False
        if stop is not None and stop.word == "else":
            nxt = stop.tokens[1] if len(stop.tokens) > 1 else None
            if nxt and word != "range" and nxt.kind == "ident" and nxt.value == word:
                orelse, chained = (self._block(word, stop, 2),), True  # `else if` = else { if … end }
            else:
                self._expect_end(stop, 1)
                orelse, stop = self._list()
        if not chained:
            if stop is None:
                self.fail("unexpected EOF: {{" + word + "}} has no {{end}}", act.pos)
            if stop.word != "end":
                self.fail("expected {{end}}, found {{" + stop.word + "}}", stop.pos)
            self._expect_end(stop, 1)
        del self.vars[mark:]
        return Node(word, self.source.count("\n", 0, act.pos) + 1, pipe=pipe, body=body, orelse=orelse)

    def _expect_end(self, act: _Act, n: int) -> None:
        if len(act.tokens) > n:
            tok = act.tokens[n]
            self.fail(f"unexpected {self.source[tok.pos : tok.end]!r} in {{{{{act.word}}}}}", tok.pos)

    def _peek(self) -> Expr | None:
        return self.toks[self.t] if self.t < len(self.toks) else None

    def _pipeline(self, act: _Act, start: int, *, max_decl: int) -> Pipe:
        """`[$x[, $y] (:=|=)] command [| command]…` from token `start` of `act` to its end."""
        self.toks, self.t, names = act.tokens, start, list[str]()
        while (tok := self._peek()) and tok.kind == "var" and not tok.names and len(names) < max_decl:
            names.append(tok.value)
            self.t += 1
            if not ((sep := self._peek()) and sep.kind == ","):
                break
            if len(names) == max_decl:
                self.fail("too many declarations" + " outside {{range}}" * (max_decl == 1), sep.pos)
            self.t += 1
        op = self._peek()
        if names and op and op.kind in (":=", "="):
            self.t += 1
            for name in names if op.kind == "=" else ():
                if name not in self.vars:
                    self.fail(f"undefined variable {name!r}", op.pos)
        else:
            self.t, names = start, []
        cmds = self._commands(act, closing=False)
        if names and op and op.kind == ":=":
            self.vars.extend(names)
        return Pipe(cmds, tuple(names), bool(names) and op is not None and op.kind == "=")

    def _commands(self, act: _Act, *, closing: bool) -> tuple[tuple[Expr, ...], ...]:
        cmds: list[tuple[Expr, ...]] = []
        while True:
            args: list[Expr] = []
            while (tok := self._peek()) and tok.kind not in ("|", ")"):
                args.append(self._operand(act))
            pos = tok.pos if tok else act.pos
            if not args:
                self.fail("missing value for command", pos)
            self._check(args, len(cmds), pos)
            cmds.append(tuple(args))
            if not tok or tok.kind != "|":
                break
            self.t += 1
        if closing:
            if not tok or tok.kind != ")":
                self.fail("unclosed left paren", act.pos)
            self.t += 1
        elif tok:
            self.fail(f"unexpected {self.source[tok.pos : tok.end]!r} in command", tok.pos)
        return tuple(cmds)

    def _operand(self, act: _Act) -> Expr:
        tok = self.toks[self.t]
        self.t += 1
        if tok.kind in ("field", "dot", "lit"):
            return tok
        if tok.kind == "var":
            if tok.value not in self.vars:
                self.fail(f"undefined variable {tok.value!r}", tok.pos)
            return tok
        if tok.kind == "ident":
            word = tok.value
            if word in ("true", "false", "nil"):
                return Expr("lit", None if word == "nil" else word == "true")
            if word in FUNCS:
                return Expr("func", word)
            self.fail(
                f"unexpected {word!r} in command" if word in _KEYWORDS else f'function "{word}" not defined', tok.pos
            )
        if tok.kind == "(":
            sub = Pipe(self._commands(act, closing=True))
            nxt = self._peek()
            if nxt and nxt.kind == "field" and nxt.pos == self.toks[self.t - 1].end:  # (pipeline).Field
                self.t += 1
                return Expr("sub", sub, nxt.names)
            return Expr("sub", sub)
        self.fail(f"unexpected {self.source[tok.pos : tok.end]!r} in operand", tok.pos)

    def _check(self, args: list[Expr], stage: int, pos: int) -> None:
        """Go's static checks, and the argument counts Go would only check at run time."""
        head = args[0]
        for arg in args[1:]:
            if arg.kind == "func":
                self._check_arity(arg.value, 0, pos)
        if head.kind == "func":
            self._check_arity(head.value, len(args) - 1 + (stage > 0), pos)
        elif len(args) > 1:
            self.fail("can't give argument to non-function", pos)
        elif stage:
            self.fail(f"non executable command in pipeline stage {stage + 1}", pos)
        elif head.kind == "lit" and head.value is None:
            self.fail("nil is not a command", pos)

    def _check_arity(self, name: str, num_args: int, pos: int) -> None:
        low, high, _ = FUNCS[name]
        if num_args < low or (high is not None and num_args > high):
            want = str(low) if low == high else f"at least {low}" if high is None else f"{low} to {high}"
            self.fail(f"wrong number of args for {name}: want {want} got {num_args}", pos)
