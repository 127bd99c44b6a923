"""Ollama Modelfile TEMPLATEs: the subset of Go's text/template they use, parsed once and rendered per request.

Supported: `{{ .A.B }}`, `{{ . }}`, `{{ $ }}`/`{{ $.A }}`, variables (`$x := …`, `$x = …`), `if`/`else if`/`else`,
`range` (`$i, $v :=`, `else`, `break`, `continue`), `with`/`else with`, `{{/* comments */}}`, `{{- `/` -}}`
trimming, string (Go escapes), raw string, number, character and `true`/`false`/`nil` literals, parenthesised
pipelines and `|` pipes; the functions `and or not eq ne lt le gt ge len index slice print printf println json
currentDate`. `define`/`template`/`block` are rejected. A syntax error, an unknown function or variable, or a wrong
argument count fails in `GoTemplate()` (create time), never at request time.

Deliberate differences from Go:
- a missing map key, or a field of nil, is None, which prints as "" (Go prints "<no value>" or fails on nil);
- strings are measured and sliced in characters (Go: bytes); `index` of a string yields the code point;
- `eq`, `lt` … compare ints with floats (Go refuses mixed kinds);
- `json` (and printing a tool or an arguments map) writes compact JSON in the request's key order, without Go's
  HTML escaping; `range` over a map visits sorted keys, as Go does.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import date
from decimal import Decimal
from types import MappingProxyType
from typing import Any, NoReturn, TypeAlias

from lmserve.errors import InvalidRequest
from lmserve.types import Message, ToolCall

__all__ = ["GoTemplate", "TemplateError", "render_chat"]

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
_VERB = re.compile(r"%([-+# 0]*)(\d*)(?:\.(\d*))?(.)", re.DOTALL)
_NOARG = object()  # "no piped value" / "no such attribute"


class TemplateError(InvalidRequest):
    """A Modelfile TEMPLATE that does not parse (raised by `GoTemplate()`) or fails while rendering (`execute`).

    `line` is the 1-based line of the offending action in the template text, when known.
    """

    def __init__(self, detail: str, *, line: int | None = None) -> None:
        super().__init__(f"template{'' if line is None else f' line {line}'}: {detail}", param="template")
        self.detail = detail
        self.line = line


class _Fail(Exception):
    """A runtime failure in a function or a lookup; the executor adds the line."""


class _Break(Exception):
    pass


class _Continue(Exception):
    pass


@dataclass(frozen=True, slots=True)
class _Expr:
    """An operand, also a token. kind: "lit" (value), "dot", "field" (names), "var" (value = "$name", names),
    "func" (value = name), "sub" (value = a parenthesised _Pipe, names read from its result); the lexer adds
    "ident" and punctuation ("(", ")", "|", ",", ":=", "=")."""

    kind: str
    value: Any = None
    names: tuple[str, ...] = ()
    pos: int = 0
    end: int = 0


@dataclass(frozen=True, slots=True)
class _Pipe:
    cmds: tuple[tuple[_Expr, ...], ...]  # each command: a function or a value, then the function's arguments
    decl: tuple[str, ...] = ()
    is_assign: bool = False


@dataclass(frozen=True, slots=True)
class _Node:
    """kind: "text" (text), "action" (pipe), "if"/"with"/"range" (pipe, body, orelse), "break", "continue"."""

    kind: str
    line: int = 0
    text: str = ""
    pipe: _Pipe = _Pipe(())
    body: tuple[_Node, ...] = ()
    orelse: tuple[_Node, ...] = ()


@dataclass(frozen=True, slots=True)
class _Act:
    """One `{{ … }}` as lexed: its tokens and where it starts."""

    tokens: tuple[_Expr, ...]
    pos: int

    @property
    def word(self) -> str:
        first = self.tokens[0] if self.tokens else None
        return str(first.value) if first and first.kind == "ident" and first.value in _KEYWORDS else ""


# --- lexer and parser --------------------------------------------------------------------------------------------
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


class _Parser:
    """Lexes and parses template text, checking functions, variables and argument counts as it goes."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.items = self._lex()
        self.i = 0  # next item
        self.toks: tuple[_Expr, ...] = ()  # tokens of the action being parsed, and the next one's index
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
            tokens: list[_Expr] = []
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

    def _token(self, i: int) -> _Expr:
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
            return _Expr("lit", ord(text) if c == "'" else text, pos=i, end=j + 1)
        if c == "`":
            if (j := s.find("`", i + 1)) < 0:
                self.fail("unterminated raw quoted string", i)
            return _Expr("lit", s[i + 1 : j], pos=i, end=j + 1)
        if c == "." and not s[i + 1 : i + 2].isdigit():
            m = _FIELD.match(s, i)
            return (
                _Expr("field", None, tuple(m.group()[1:].split(".")), i, m.end())
                if m
                else _Expr("dot", None, (), i, i + 1)
            )
        if c == "$" and (m := _VAR.match(s, i)):
            name, *chain = m.group().split(".")
            return _Expr("var", name, tuple(chain), i, m.end())
        if m := _NUMBER.match(s, i):
            if (after := s[m.end() : m.end() + 1]).isalnum() or after in ("_", "."):
                self.fail(f"bad number syntax: {m.group()}{after}", i)
            return _Expr("lit", _number(m.group()), pos=i, end=m.end())
        if m := _IDENT.match(s, i):
            return _Expr("ident", m.group(), pos=i, end=m.end())
        for punct in (":=", "=", "(", ")", "|", ","):
            if s.startswith(punct, i):
                return _Expr(punct, pos=i, end=i + len(punct))
        self.fail(f"unexpected {c!r} in action", i)

    def parse(self) -> tuple[_Node, ...]:
        nodes, stop = self._list()
        if stop is not None:
            self.fail("unexpected {{" + stop.word + "}}", stop.pos)
        return nodes

    def _list(self) -> tuple[tuple[_Node, ...], _Act | None]:
        """Nodes up to the next `{{end}}`/`{{else}}` (returned to the caller) or the end of input (None)."""
        nodes: list[_Node] = []
        while self.i < len(self.items):
            item = self.items[self.i]
            self.i += 1
            if isinstance(item, str):
                nodes.append(_Node("text", text=item))
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
                nodes.append(_Node(word, line))
            elif word:
                self.fail("{{" + word + "}} is not supported", item.pos)
            else:
                nodes.append(_Node("action", line, pipe=self._pipeline(item, 0, max_decl=1)))
        return tuple(nodes), None

    def _block(self, word: str, act: _Act, start: int) -> _Node:
        mark = len(self.vars)
        pipe = self._pipeline(act, start, max_decl=2 if word == "range" else 1)
        self.range_depth += word == "range"
        body, stop = self._list()
        self.range_depth -= word == "range"
        orelse: tuple[_Node, ...] = ()
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
        return _Node(word, self.source.count("\n", 0, act.pos) + 1, pipe=pipe, body=body, orelse=orelse)

    def _expect_end(self, act: _Act, n: int) -> None:
        if len(act.tokens) > n:
            tok = act.tokens[n]
            self.fail(f"unexpected {self.source[tok.pos : tok.end]!r} in {{{{{act.word}}}}}", tok.pos)

    def _peek(self) -> _Expr | None:
        return self.toks[self.t] if self.t < len(self.toks) else None

    def _pipeline(self, act: _Act, start: int, *, max_decl: int) -> _Pipe:
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
        return _Pipe(cmds, tuple(names), bool(names) and op is not None and op.kind == "=")

    def _commands(self, act: _Act, *, closing: bool) -> tuple[tuple[_Expr, ...], ...]:
        cmds: list[tuple[_Expr, ...]] = []
        while True:
            args: list[_Expr] = []
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

    def _operand(self, act: _Act) -> _Expr:
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
                return _Expr("lit", None if word == "nil" else word == "true")
            if word in _FUNCS:
                return _Expr("func", word)
            self.fail(
                f"unexpected {word!r} in command" if word in _KEYWORDS else f'function "{word}" not defined', tok.pos
            )
        if tok.kind == "(":
            sub = _Pipe(self._commands(act, closing=True))
            nxt = self._peek()
            if nxt and nxt.kind == "field" and nxt.pos == self.toks[self.t - 1].end:  # (pipeline).Field
                self.t += 1
                return _Expr("sub", sub, nxt.names)
            return _Expr("sub", sub)
        self.fail(f"unexpected {self.source[tok.pos : tok.end]!r} in operand", tok.pos)

    def _check(self, args: list[_Expr], stage: int, pos: int) -> None:
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
        low, high, _ = _FUNCS[name]
        if num_args < low or (high is not None and num_args > high):
            want = str(low) if low == high else f"at least {low}" if high is None else f"{low} to {high}"
            self.fail(f"wrong number of args for {name}: want {want} got {num_args}", pos)


# --- values and functions ----------------------------------------------------------------------------------------
class _GoMap(dict[str, Any]):
    """A JSON object from a request (tool, call arguments): `.Function` also finds "function"; prints as JSON."""

    __slots__ = ()

    def lookup(self, name: str) -> Any:
        return self[name] if name in self else self.get(name[:1].swapcase() + name[1:])


def _wrap(value: Any) -> Any:
    if isinstance(value, dict):
        return _GoMap({str(k): _wrap(v) for k, v in value.items()})
    return [_wrap(v) for v in value] if isinstance(value, list) else value


def _type_name(v: Any) -> str:
    names = {type(None): "nil", bool: "bool", int: "int", float: "float64", str: "string", list: "slice"}
    return names.get(type(v), "map" if isinstance(v, dict) else type(v).__name__)


def _truth(v: Any) -> bool:
    """Go's truth: false, 0, nil and empty strings, lists and maps are false."""
    if v is None:
        return False
    if isinstance(v, bool | int | float):
        return v != 0
    return len(v) > 0 if isinstance(v, str | bytes | list | tuple | dict) else True


def _go_float(f: float) -> str:
    """Go's %v of a float64: shortest digits, exponent form below 1e-4 and from 1e6 (1e+06)."""
    if math.isinf(f) or math.isnan(f):
        return "NaN" if math.isnan(f) else ("+Inf" if f > 0 else "-Inf")
    d = Decimal(repr(f)).normalize()
    exp, (sign, digits, _) = d.adjusted(), d.as_tuple()
    if f == 0 or -4 <= exp < 6:
        return format(d, "f")
    text = "".join(map(str, digits))
    return f"{'-' * sign}{text[0]}{'.' * (len(text) > 1)}{text[1:]}e{'-' if exp < 0 else '+'}{abs(exp):02d}"


def _to_json(v: Any) -> str:
    try:
        return json.dumps(v, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise _Fail(f"json: {exc}") from exc


def _show(v: Any) -> str:
    """How an action prints a value: Go's %v, with None as "" and request JSON objects as JSON."""
    if v is None:
        return ""
    if isinstance(v, str):
        return v
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return _go_float(v)
    if isinstance(v, _GoMap):
        return _to_json(v)
    if isinstance(v, dict):
        return "map[" + " ".join(f"{_show(k)}:{_show(x)}" for k, x in _items(v)) + "]"
    return "[" + " ".join(_show(x) for x in v) + "]" if isinstance(v, list | tuple) else str(v)


def _items(v: Any) -> list[tuple[Any, Any]]:
    """What `range` visits: (index, element) of a list, (key, value) of a map in sorted key order; nil is empty."""
    if v is None:
        return []
    if isinstance(v, dict):
        try:
            keys = sorted(v)
        except TypeError:
            keys = list(v)
        return [(k, v[k]) for k in keys]
    if isinstance(v, list | tuple):
        return list(enumerate(v))
    raise _Fail(f"range can't iterate over {_show(v)}")


def _field(obj: Any, name: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, _GoMap):
        return obj.lookup(name)
    if isinstance(obj, dict):
        return obj.get(name)
    value = _NOARG
    if not name.startswith("_") and not isinstance(obj, str | int | float | list | tuple):
        value = getattr(obj, name, _NOARG)
    if value is _NOARG or callable(value):
        raise _Fail(f"can't evaluate field {name} in type {_type_name(obj)}")
    return value


def _kind(v: Any) -> str:
    return "number" if isinstance(v, int | float) and not isinstance(v, bool) else _type_name(v)


def _equal(a: Any, b: Any) -> bool:
    ka, kb = _kind(a), _kind(b)
    if "nil" in (ka, kb):
        return ka == kb
    if ka != kb:
        raise _Fail(f"incompatible types for comparison: {ka} and {kb}")
    if ka not in ("bool", "number", "string"):
        raise _Fail(f"non-comparable type {ka}")
    return bool(a == b)


def _less(a: Any, b: Any) -> bool:
    ka, kb = _kind(a), _kind(b)
    for k in (ka, kb):
        if k not in ("number", "string"):
            raise _Fail(f"invalid type for comparison: {k}")
    if ka != kb:
        raise _Fail(f"incompatible types for comparison: {ka} and {kb}")
    return bool(a < b)


def _int_arg(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise _Fail(f"cannot index slice/array with type {_type_name(v)}")
    return v


def _len(args: list[Any]) -> int:
    if not isinstance(args[0], str | list | tuple | dict):
        raise _Fail(f"len of {_type_name(args[0])}")
    return len(args[0])


def _index(args: list[Any]) -> Any:
    item = args[0]
    for key in args[1:]:
        if isinstance(item, dict):
            item = item.get(key)
        elif isinstance(item, str | list | tuple):
            if not 0 <= _int_arg(key) < len(item):
                raise _Fail(f"index out of range: {key}")
            item = ord(item[key]) if isinstance(item, str) else item[key]
        else:
            raise _Fail(f"can't index item of type {_type_name(item)}")
    return item


def _slice(args: list[Any]) -> Any:
    item, bounds = args[0], [_int_arg(i) for i in args[1:]]
    if not isinstance(item, str | list | tuple):
        raise _Fail(f"can't slice item of type {_type_name(item)}")
    if isinstance(item, str) and len(bounds) == 3:
        raise _Fail("cannot 3-index slice a string")
    low, high, cap = [*bounds, *[len(item)] * 3][:3] if bounds else [0, len(item), len(item)]
    if not 0 <= low <= high <= cap <= len(item):
        raise _Fail(f"slice index out of range: {bounds}")
    return item[low:high]


def _sprint(args: list[Any]) -> str:
    """Go's fmt.Sprint: a space between operands when neither is a string."""
    spaced = (i and not isinstance(v, str) and not isinstance(args[i - 1], str) for i, v in enumerate(args))
    return "".join(" " * bool(sp) + _show(v) for sp, v in zip(spaced, args, strict=True))


def _format_one(verb: str, flags: str, width: str, prec: str | None, v: Any) -> str:
    """One printf verb: %s %v %q %t %d %x %X %c %f %e %g, with Go's -, +, space and 0 flags, width, precision."""
    align, precision = "<" if "-" in flags else "", "" if prec is None else f".{prec or 0}"
    numeric = align + ("+" if "+" in flags else " " if " " in flags else "") + "0" * ("0" in flags and not align)
    if verb in "sv" or (verb == "q" and isinstance(v, str)) or (verb == "t" and isinstance(v, bool)):
        text = json.dumps(v, ensure_ascii=False) if verb == "q" else _show(v)
        return format(text, f"{align or '>'}{width}{precision}s")
    if isinstance(v, bool) or not isinstance(v, int | float):
        pass
    elif verb in "dxXc" and isinstance(v, int):
        return chr(v) if verb == "c" else format(v, f"{numeric}{width}{verb}")
    elif verb in "feEgG":
        return format(float(v), f"{numeric}{width}{precision or '.6' * (verb in 'feE')}{verb}")
    return f"%!{verb}({_type_name(v)}={_show(v)})"


def _printf(args: list[Any]) -> str:
    if not isinstance(args[0], str):
        raise _Fail(f"printf: format must be a string, not {_type_name(args[0])}")
    rest, used = args[1:], 0

    def one(m: re.Match[str]) -> str:
        nonlocal used
        flags, width, prec, verb = m.groups()
        if verb == "%":
            return "%"
        if used >= len(rest):
            return f"%!{verb}(MISSING)"
        used += 1
        return _format_one(verb, flags, width, prec, rest[used - 1])

    out = _VERB.sub(one, args[0])
    extra = ", ".join(f"{_type_name(v)}={_show(v)}" for v in rest[used:])
    return out + (f"%!(EXTRA {extra})" if extra else "")


_Impl: TypeAlias = Callable[[list[Any]], Any]
_FUNCS: Mapping[str, tuple[int, int | None, _Impl]] = MappingProxyType({
    "and": (1, None, lambda a: next((v for v in a if not _truth(v)), a[-1])),
    "or": (1, None, lambda a: next((v for v in a if _truth(v)), a[-1])),
    "not": (1, 1, lambda a: not _truth(a[0])),
    "eq": (2, None, lambda a: any(_equal(a[0], b) for b in a[1:])),
    "ne": (2, 2, lambda a: not _equal(a[0], a[1])),
    "lt": (2, 2, lambda a: _less(a[0], a[1])),
    "le": (2, 2, lambda a: _less(a[0], a[1]) or _equal(a[0], a[1])),
    "gt": (2, 2, lambda a: not (_less(a[0], a[1]) or _equal(a[0], a[1]))),
    "ge": (2, 2, lambda a: not _less(a[0], a[1])),
    "len": (1, 1, _len),
    "index": (1, None, _index),
    "slice": (1, 4, _slice),
    "json": (1, 1, lambda a: _to_json(a[0])),
    "print": (0, None, _sprint),
    "println": (0, None, lambda a: " ".join(_show(v) for v in a) + "\n"),
    "printf": (1, None, _printf),
    "currentDate": (0, 0, lambda a: date.today().isoformat()),
})  # fmt: skip


# --- execution ---------------------------------------------------------------------------------------------------
class _Exec:
    """One rendering: the variable stack (`$` first), the output pieces and the line being executed."""

    def __init__(self, root: Any) -> None:
        self.vars: list[list[Any]] = [["$", root]]
        self.out: list[str] = []
        self.line = 1

    def walk(self, nodes: tuple[_Node, ...], dot: Any) -> None:
        for node in nodes:
            if node.kind == "text":
                self.out.append(node.text)
                continue
            self.line = node.line
            if node.kind == "action":
                value = self.pipe(node.pipe, dot)
                if not node.pipe.decl:
                    self.out.append(_show(value))
            elif node.kind in ("break", "continue"):
                raise _Break() if node.kind == "break" else _Continue()
            else:
                self.block(node, dot)

    def block(self, node: _Node, dot: Any) -> None:
        mark = len(self.vars)
        try:
            value = self.pipe(node.pipe, dot)  # as in Go, range's variables first hold the whole value
            if node.kind == "range":
                self.loop(node, value, dot)
            elif _truth(value):
                self.walk(node.body, value if node.kind == "with" else dot)
            else:
                self.walk(node.orelse, dot)
        finally:
            del self.vars[mark:]

    def loop(self, node: _Node, value: Any, dot: Any) -> None:
        items, names = _items(value), node.pipe.decl
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
            except _Continue:
                pass
            except _Break:
                break
            finally:
                del self.vars[mark:]

    def pipe(self, pipe: _Pipe, dot: Any) -> Any:
        value: Any = _NOARG
        for cmd in pipe.cmds:
            value = self.command(cmd, dot, value)
        for name in pipe.decl:
            if pipe.is_assign:
                self.assign(name, value)
            else:
                self.vars.append([name, value])
        return value

    def command(self, cmd: tuple[_Expr, ...], dot: Any, piped: Any) -> Any:
        head, rest = cmd[0], cmd[1:]
        if head.kind != "func":
            return self.arg(head, dot)
        if head.value in ("and", "or"):  # short-circuit: the deciding value, or the last one
            value = None
            for i in range(len(rest) + (piped is not _NOARG)):
                value = self.arg(rest[i], dot) if i < len(rest) else piped
                if _truth(value) != (head.value == "and"):
                    break
            return value
        args = [self.arg(a, dot) for a in rest] + ([] if piped is _NOARG else [piped])
        return _FUNCS[head.value][2](args)

    def arg(self, expr: _Expr, dot: Any) -> Any:
        if expr.kind == "lit":
            return expr.value
        if expr.kind == "func":  # a function named as an argument is called without arguments
            return self.command((expr,), dot, _NOARG)
        value = (
            self.lookup(expr.value) if expr.kind == "var" else self.pipe(expr.value, dot) if expr.kind == "sub" else dot
        )
        for name in expr.names:
            value = _field(value, name)
        return value

    def lookup(self, name: str) -> Any:
        return next(entry for entry in reversed(self.vars) if entry[0] == name)[1]

    def assign(self, name: str, value: Any) -> None:
        next(entry for entry in reversed(self.vars) if entry[0] == name)[1] = value


def _exprs(pipe: _Pipe) -> Iterator[_Expr]:
    for cmd in pipe.cmds:
        for expr in cmd:
            yield expr
            if expr.kind == "sub":
                yield from _exprs(expr.value)


def _field_names(nodes: tuple[_Node, ...]) -> Iterator[str]:
    for node in nodes:
        for expr in _exprs(node.pipe):
            yield from expr.names
        yield from _field_names(node.body + node.orelse)


def _cut_after_response(nodes: tuple[_Node, ...], cut: list[bool]) -> tuple[_Node, ...]:
    """Ollama's last-turn tree: everything after the first action that prints a `.Response` field is dropped."""
    kept: list[_Node] = []
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
            self._nodes = _Parser(source).parse()
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

    def _run(self, nodes: tuple[_Node, ...], data: dict[str, Any]) -> str:
        ex = _Exec(data)
        try:
            ex.walk(nodes, data)
        except _Fail as exc:
            raise TemplateError(str(exc), line=ex.line) from exc
        except RecursionError as exc:
            raise TemplateError("template nests too deeply", line=ex.line) from exc
        except Exception as exc:
            raise TemplateError(f"{type(exc).__name__}: {exc}", line=ex.line) from exc
        return "".join(ex.out)


# --- Ollama's chat data model ------------------------------------------------------------------------------------
def _tool_call(call: ToolCall) -> Any:
    try:
        arguments = json.loads(call.arguments) if call.arguments.strip() else {}
    except ValueError:
        arguments = call.arguments
    return _wrap({**({"id": call.id} if call.id else {}), "function": {"name": call.name, "arguments": arguments}})


def _collate(messages: list[Message]) -> tuple[str, list[dict[str, Any]]]:
    """Ollama's collate: all system texts joined, and consecutive same-role messages (not tool) merged."""
    systems: list[str] = []
    turns: list[dict[str, Any]] = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        calls = [_tool_call(c) for c in m.tool_calls]
        if role == "system":
            systems.append(m.content)
        if turns and turns[-1]["Role"] == role and role != "tool":
            turns[-1]["Content"] += "\n\n" + m.content
            turns[-1]["ToolCalls"].extend(calls)
        else:
            turn = {"Role": role, "Content": m.content, "Thinking": m.thinking, "ToolCalls": calls,
                    "ToolName": m.name or ""}
            turns.append({**turn, "ToolCallID": m.tool_call_id or ""})
    return "\n\n".join(systems), turns


def _render_turns(template: GoTemplate, turns: list[dict[str, Any]]) -> str:
    """Ollama's legacy mode: one execution per exchange; the last one stops after the `.Response` action."""
    parts: list[str] = []
    values = {"System": "", "Prompt": "", "Response": "", "Suffix": ""}
    for turn in turns:
        role = turn["Role"]
        if (role == "system" and (values["Prompt"] or values["Response"])) or (role == "user" and values["Response"]):
            parts.append(template.execute(values))
            values = dict.fromkeys(values, "")
        if key := {"system": "System", "user": "Prompt", "assistant": "Response"}.get(role):
            values[key] = turn["Content"]
    return "".join(parts) + template._run(template._last_turn, values)


def render_chat(
    template: GoTemplate,
    messages: list[Message],
    *,
    system: str | None,
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool = True,
    think: bool | str | None = None,
) -> str:
    """Render chat messages through a Modelfile TEMPLATE with Ollama's data model.

    `system` (the Modelfile SYSTEM) is used only when no message is a system message. A template that reads
    `.Messages` is executed once with `.System` (all system texts), `.Prompt` (last user text), `.Response`/`.Suffix`
    (""), `.Messages` (`Role`, `Content`, `Thinking`, `ToolCalls` [{`Function`: {`Name`, `Arguments` map}}],
    `ToolName`, `ToolCallID`), `.Tools` (the request's tools; `.Function.Name` and `.function.name` both work; a tool
    prints as JSON), `.AddGenerationPrompt`, and the request's `think` as `.Think` (on), `.ThinkLevel` (its effort,
    or "") and `.IsThinkSet`. Any other template is executed per exchange as Ollama does (`.System`,
    `.Prompt`, and the assistant's reply as `.Response`), the last time only up to `.Response`, so it always ends
    ready for the assistant: `add_generation_prompt` cannot change that.
    """
    if system and not any(m.role in ("system", "developer") for m in messages):
        messages = [Message(role="system", content=system), *messages]
    system_text, turns = _collate(messages)
    if not template.uses_messages:
        return _render_turns(template, turns)
    prompt = next((t["Content"] for t in reversed(turns) if t["Role"] == "user"), "")
    return template.execute({
        "System": system_text, "Prompt": prompt, "Response": "", "Suffix": "", "Messages": turns,
        "Tools": _wrap(list(tools or [])), "AddGenerationPrompt": add_generation_prompt,
        "Think": think is not None and think is not False, "ThinkLevel": think if isinstance(think, str) else "",
        "IsThinkSet": think is not None,
    })  # fmt: skip


class GoChatTemplate:
    """A Modelfile TEMPLATE as a chat prompter: `render(messages, tools=…, add_generation_prompt=…)`."""

    def __init__(self, source: str, *, system: str | None = None) -> None:
        self.template = GoTemplate(source)
        self.system = system

    def render(
        self, messages: list[Message], *, tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
        think: bool | str | None = None,
    ) -> str:
        return render_chat(self.template, messages, system=self.system, tools=tools,
                           add_generation_prompt=add_generation_prompt, think=think)
