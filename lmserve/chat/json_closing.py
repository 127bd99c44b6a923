"""Closing a constrained reply: at any point of a text the grammar allows, the shortest text that completes it.

A structured-output reply (chat/structured/'s GBNF) that runs out of tokens is cut JSON. To close it in time,
the service (service/json_budget.py) feeds the reply's text into a `Tracker` as it is generated and asks, after
each token, for `closing()`: the shortest text that turns what came so far into a complete sentence of the
grammar, i.e. a JSON document that validates against the schema (open strings closed, a started number or
literal finished, missing required properties filled with their shortest values, `minItems` met, arrays and
objects closed).

The tracker works on the grammar, not on the schema, so it covers every construct the grammar writer emits
(patterns, formats, number ranges, enums, excluded keys …) without a second reading of the schema. It is
llama.cpp's own recognizer: a set of stacks of grammar positions, advanced one character at a time; the closing
of one stack is the shortest text of what remains of each of its frames, and the closing of the set is the
shortest over its stacks. Shortest means fewest characters; each character class is written as one member of it
(a digit or a letter where the class has one).

It reads the GBNF subset chat/structured/ writes (one rule per line; literals, character classes, rule names,
groups, alternation, `* + ? {m} {m,} {m,n}`) and refuses anything else with `ValueError`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache

__all__ = ["Closer", "Tracker", "closer_for"]

_END, _CHAR, _REF = 0, 1, 2
Ranges = tuple[tuple[int, int], ...]
Element = tuple[int, Ranges, bool, int]
"""(kind, ranges, negated, rule): `_END` of an alternative, a `_CHAR` of a class, or a `_REF` to a rule."""
Stack = tuple[int, ...]
"""Positions in the flat element list, the next one to match on top (last); empty: the sentence is complete."""

_TOKEN = re.compile(r'\s*(?:(?P<lit>"(?:\\.|[^"\\])*")|(?P<cls>\[(?:\\.|[^\]\\])*\])|(?P<name>[a-zA-Z0-9_-]+)'
                    r"|(?P<rep>\{\d+(?:,\d*)?\})|(?P<op>[()|*+?.]))")
_ESCAPES = {"n": "\n", "r": "\r", "t": "\t"}
_PREFERRED = "0a "
"""The characters a class is written as, when it has one of them (else its lowest member)."""
_MAX_STACKS = 4096
"""A grammar position set larger than this gives up (the reply is then left as the engine ends it)."""


@dataclass(slots=True)
class _Item:
    """A parsed element before flattening: a character class or a rule name."""

    ranges: Ranges = ()
    negated: bool = False
    rule: str | None = None


class _Reader:
    """GBNF text → rules of alternatives of items; groups and repetitions become rules of their own."""

    def __init__(self, text: str) -> None:
        self.rules: dict[str, list[list[_Item]]] = {}
        self._fresh = 0
        for line in text.splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            name, sep, body = line.partition("::=")
            name = name.strip()
            if not sep or not re.fullmatch(r"[a-zA-Z0-9_-]+", name):
                raise ValueError(f"not a GBNF rule: {line[:80]!r}")
            matches = list(_TOKEN.finditer(body))
            if "".join(m.group(0) for m in matches).strip() != body.strip():
                raise ValueError(f"unreadable GBNF rule: {line[:80]!r}")
            self._tokens = [(m.lastgroup or "", m.group(m.lastgroup or "")) for m in matches]
            self._pos = 0
            self.rules[name] = self._alternatives()
            if self._pos != len(self._tokens):
                raise ValueError(f"unbalanced GBNF rule: {line[:80]!r}")
        if "root" not in self.rules:
            raise ValueError("the grammar has no root rule")
        for alternatives in self.rules.values():
            for seq in alternatives:
                for item in seq:
                    if item.rule is not None and item.rule not in self.rules:
                        raise ValueError(f"the grammar names an undefined rule {item.rule!r}")

    def _peek(self) -> tuple[str, str] | None:
        return self._tokens[self._pos] if self._pos < len(self._tokens) else None

    def _alternatives(self) -> list[list[_Item]]:
        seqs = [self._sequence()]
        while self._peek() == ("op", "|"):
            self._pos += 1
            seqs.append(self._sequence())
        return seqs

    def _sequence(self) -> list[_Item]:
        seq: list[_Item] = []
        while (token := self._peek()) is not None and token not in (("op", "|"), ("op", ")")):
            self._pos += 1
            kind, text = token
            if kind == "lit":
                unit = [_Item(((c, c),)) for c in _unescape(text[1:-1])]
            elif kind == "cls":
                unit = [_class(text)]
            elif kind == "name":
                unit = [_Item(rule=text)]
            elif text == ".":
                unit = [_Item((), negated=True)]
            elif text == "(":
                unit = [_Item(rule=self._new_rule(self._alternatives()))]
                if self._peek() != ("op", ")"):
                    raise ValueError("a GBNF group is not closed")
                self._pos += 1
            else:
                raise ValueError(f"unexpected {text!r} in a GBNF rule")
            while (post := self._peek()) is not None and (post[0] == "rep" or post[1] in ("*", "+", "?")):
                self._pos += 1
                unit = self._repeat(unit, post[1])
            seq += unit
        return seq

    def _new_rule(self, alternatives: list[list[_Item]]) -> str:
        self._fresh += 1
        name = f" {self._fresh}"  # a space: no GBNF name has one
        self.rules[name] = alternatives
        return name

    def _repeat(self, unit: list[_Item], op: str) -> list[_Item]:
        """`unit` repeated as `op` says, as llama.cpp expands it: the required copies, then nested optional ones."""
        item = unit[0] if len(unit) == 1 else _Item(rule=self._new_rule([unit]))
        if op in ("*", "+", "?"):
            low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[op]
        else:
            lo_text, comma, hi_text = op[1:-1].partition(",")
            low, high = int(lo_text), (int(lo_text) if not comma else int(hi_text) if hi_text else None)
        if high is not None and high < low:
            raise ValueError(f"a GBNF repetition {op} has its bounds reversed")
        out = [item] * low
        if high is None:
            star = self._new_rule([])
            self.rules[star] += [[item, _Item(rule=star)], []]
            return [*out, _Item(rule=star)]
        tail: str | None = None
        for _ in range(high - low):
            tail = self._new_rule([[item] + ([_Item(rule=tail)] if tail else []), []])
        return out + ([_Item(rule=tail)] if tail else [])


def _unescape(text: str) -> list[int]:
    out: list[int] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c != "\\":
            out.append(ord(c))
            i += 1
            continue
        if i + 1 >= len(text):
            raise ValueError("a GBNF escape is cut")
        e = text[i + 1]
        width = {"x": 2, "u": 4, "U": 8}.get(e)
        if width:
            out.append(int(text[i + 2 : i + 2 + width], 16))
            i += 2 + width
        else:
            out.append(ord(_ESCAPES.get(e, e)))
            i += 2
    return out


def _class(token: str) -> _Item:
    body = token[1:-1]
    negated = body.startswith("^")
    codes = _unescape(body[1:] if negated else body)
    ranges = []
    i = 0
    while i < len(codes):
        if i + 2 < len(codes) and codes[i + 1] == ord("-"):
            ranges.append((codes[i], codes[i + 2]))
            i += 3
        else:
            ranges.append((codes[i], codes[i]))
            i += 1
    return _Item(tuple(ranges), negated)


def _matches(ranges: Ranges, negated: bool, code: int) -> bool:
    return any(lo <= code <= hi for lo, hi in ranges) != negated


def _member(ranges: Ranges, negated: bool) -> str:
    """The character a class is written as in a closing."""
    for c in _PREFERRED:
        if _matches(ranges, negated, ord(c)):
            return c
    if not negated:
        return chr(min(lo for lo, _ in ranges))
    code = 0x21
    while not _matches(ranges, negated, code):
        code += 1
    return chr(code)


class Closer:
    """A grammar made ready for closing: flat elements, and the shortest text of every rule and position."""

    def __init__(self, grammar: str) -> None:
        reader = _Reader(grammar)
        ids = {name: i for i, name in enumerate(reader.rules)}
        self._elements: list[Element] = []
        self._starts: list[list[int]] = [[] for _ in ids]
        """Per rule, the position of each alternative's first element."""
        for name, alternatives in reader.rules.items():
            for seq in alternatives:
                self._starts[ids[name]].append(len(self._elements))
                for item in seq:
                    if item.rule is not None:
                        self._elements.append((_REF, (), False, ids[item.rule]))
                    else:
                        self._elements.append((_CHAR, item.ranges, item.negated, -1))
                self._elements.append((_END, (), False, -1))
        self._root = ids["root"]
        self._shortest_alt = self._shortest_alternatives()
        self._rule_text: dict[int, str] = {}
        self._rest_len = self._rest_lengths()

    def _shortest_alternatives(self) -> list[int]:
        """Per rule, the start of its alternative with the shortest text (fixpoint: strict improvements only, so
        the choices never form a cycle)."""
        inf = float("inf")
        sizes = [inf] * len(self._starts)
        chosen = [-1] * len(self._starts)
        changed = True
        while changed:
            changed = False
            for rule, starts in enumerate(self._starts):
                for start in starts:
                    size = self._alternative_size(start, sizes)
                    if size < sizes[rule]:
                        sizes[rule], chosen[rule], changed = size, start, True
        for start in chosen:
            if start < 0:
                raise ValueError("a rule of the grammar matches no finite text")
        return chosen

    def _alternative_size(self, start: int, sizes: list[float]) -> float:
        total = 0.0
        pos = start
        while (element := self._elements[pos])[0] != _END:
            total += 1 if element[0] == _CHAR else sizes[element[3]]
            pos += 1
        return total

    def _rest_lengths(self) -> list[int]:
        """Per position, the length of the shortest text of the elements from it to its alternative's end."""
        lengths = [0] * len(self._elements)
        for pos in range(len(self._elements) - 1, -1, -1):
            kind, _, _, rule = self._elements[pos]
            if kind == _END:
                continue
            size = 1 if kind == _CHAR else len(self.rule_text(rule))
            lengths[pos] = size + lengths[pos + 1]
        return lengths

    def rule_text(self, rule: int) -> str:
        """The shortest text of `rule`."""
        text = self._rule_text.get(rule)
        if text is None:
            text = self._rest_text(self._shortest_alt[rule])
            self._rule_text[rule] = text
        return text

    def _rest_text(self, pos: int) -> str:
        parts = []
        while (element := self._elements[pos])[0] != _END:
            kind, ranges, negated, rule = element
            parts.append(_member(ranges, negated) if kind == _CHAR else self.rule_text(rule))
            pos += 1
        return "".join(parts)

    @property
    def shortest(self) -> str:
        """The shortest sentence of the grammar: the minimal document."""
        return self.rule_text(self._root)

    def start(self) -> Tracker:
        """A tracker at the start of a reply."""
        stacks: set[Stack] = set()
        for start in self._starts[self._root]:
            self._expand(() if self._elements[start][0] == _END else (start,), stacks)
        return Tracker(self, frozenset(stacks))

    def _expand(self, stack: Stack, out: set[Stack]) -> None:
        """Add to `out` the stacks `stack` stands for whose top is a character to match (or that are complete):
        rule references on top are replaced by each of their alternatives (llama.cpp's advance_stack)."""
        todo = [stack]
        seen: set[Stack] = set()
        while todo:
            stack = todo.pop()
            if stack in seen:
                continue
            seen.add(stack)
            if not stack or self._elements[stack[-1]][0] == _CHAR:
                out.add(stack)
                if len(out) > _MAX_STACKS:
                    raise OverflowError("the grammar is too ambiguous to track")
                continue
            top = stack[-1]
            rest = stack[:-1] if self._elements[top + 1][0] == _END else (*stack[:-1], top + 1)
            for start in self._starts[self._elements[top][3]]:
                todo.append(rest if self._elements[start][0] == _END else (*rest, start))

    def advance(self, stacks: Iterable[Stack], code: int) -> frozenset[Stack]:
        """The stacks after the character `code` (empty: the grammar does not allow it here)."""
        out: set[Stack] = set()
        for stack in stacks:
            if not stack:
                continue
            top = stack[-1]
            _, ranges, negated, _ = self._elements[top]
            if _matches(ranges, negated, code):
                rest = stack[:-1] if self._elements[top + 1][0] == _END else (*stack[:-1], top + 1)
                self._expand(rest, out)
        return frozenset(out)

    def closing(self, stacks: Iterable[Stack]) -> str:
        """The shortest text that completes a sentence from any of `stacks` (ties: the first in text order)."""
        best: tuple[int, str] | None = None
        for stack in stacks:
            size = sum(self._rest_len[pos] for pos in stack)
            if best is not None and size > best[0]:
                continue
            text = "".join(self._rest_text(pos) for pos in reversed(stack))
            if best is None or (size, text) < best:
                best = (size, text)
        if best is None:
            raise ValueError("no stack to close")
        return best[1]


@dataclass(slots=True)
class Tracker:
    """Where a reply stands in its grammar. `feed` the text as it comes; `closing()` completes it."""

    closer: Closer
    stacks: frozenset[Stack]
    lost: bool = False
    """The text left the grammar (or became too ambiguous to follow): nothing can be closed any more."""
    _closing: str | None = field(default=None, repr=False)

    def feed(self, text: str) -> bool:
        """Advance over `text`; False (and `lost`) when the grammar does not allow it."""
        if self.lost:
            return False
        for char in text:
            try:
                self.stacks = self.closer.advance(self.stacks, ord(char))
            except OverflowError:
                self.stacks = frozenset()
            if not self.stacks:
                self.lost = True
                return False
        if text:
            self._closing = None
        return True

    @property
    def is_complete(self) -> bool:
        """What came so far is a whole sentence already (the closing is empty)."""
        return () in self.stacks

    def closing(self) -> str:
        """The shortest text that completes what came so far (empty when it is complete)."""
        if self.lost:
            raise ValueError("the text left the grammar; it cannot be closed")
        if self._closing is None:
            self._closing = self.closer.closing(self.stacks)
        return self._closing


@lru_cache(maxsize=64)
def closer_for(grammar: str) -> Closer:
    """The `Closer` of `grammar`, kept for the next request with the same grammar (its preparation is the cost)."""
    return Closer(grammar)
