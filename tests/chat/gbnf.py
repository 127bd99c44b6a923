"""A small GBNF reader and random sentence generator: tests draw texts from a grammar without a model.

It reads the subset of GBNF that lmserve.chat.structured writes (one rule per line; literals, classes, groups,
alternation, `* + ? {m} {m,} {m,n}`), and draws sentences that the grammar accepts, preferring short ones as
the derivation gets deep so that every draw ends.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from typing import Union

_TOKEN = re.compile(r'\s*(?:(?P<lit>"(?:\\.|[^"\\])*")|(?P<cls>\[(?:\\.|[^\]\\])*\])|(?P<name>[a-zA-Z0-9-]+)'
                    r"|(?P<rep>\{\d+(?:,\d*)?\})|(?P<op>[()|*+?]))")
# Characters a negated class may produce: printable ASCII, a few controls, and some beyond ASCII.
_POOL = [chr(c) for c in range(0x20, 0x7F)] + ["\t", "\n", "\x01", "\x7f", "é", "ß", "中", "€", "😀"]


@dataclass
class Lit:
    text: str


@dataclass
class Cls:
    ranges: list[tuple[int, int]]
    negated: bool


@dataclass
class Ref:
    name: str


@dataclass
class Rep:
    item: Node
    low: int
    high: int | None


@dataclass
class Alt:
    seqs: list[list[Node]]


Node = Union[Lit, Cls, Ref, Rep, Alt]  # noqa: UP007 (a runtime alias; | would need every class defined first)


def _unescape(text: str) -> list[int]:
    out: list[int] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c != "\\":
            out.append(ord(c))
            i += 1
            continue
        e = text[i + 1]
        width = {"x": 2, "u": 4, "U": 8}.get(e)
        if width:
            out.append(int(text[i + 2 : i + 2 + width], 16))
            i += 2 + width
        else:
            out.append(ord({"n": "\n", "r": "\r", "t": "\t"}.get(e, e)))
            i += 2
    return out


def _parse_class(token: str) -> Cls:
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
    return Cls(ranges, negated)


class Grammar:
    def __init__(self, text: str) -> None:
        self.rules: dict[str, Alt] = {}
        for line in text.strip().splitlines():
            name, _, body = line.partition(" ::= ")
            tokens = [m for m in _TOKEN.finditer(body)]
            self._tokens = [(m.lastgroup or "", m.group(m.lastgroup or "")) for m in tokens]
            assert "".join(m.group(0) for m in tokens).strip() == body.strip(), f"unreadable rule: {line}"
            self._pos = 0
            self.rules[name] = self._alternatives()
            assert self._pos == len(self._tokens), f"trailing tokens in {line}"
        self.min_size = self._min_sizes()

    def _alternatives(self) -> Alt:
        seqs = [self._sequence()]
        while self._peek() == ("op", "|"):
            self._pos += 1
            seqs.append(self._sequence())
        return Alt(seqs)

    def _peek(self) -> tuple[str, str] | None:
        return self._tokens[self._pos] if self._pos < len(self._tokens) else None

    def _sequence(self) -> list[Node]:
        seq: list[Node] = []
        while (token := self._peek()) is not None and token not in (("op", "|"), ("op", ")")):
            kind, text = token
            self._pos += 1
            node: Node
            if kind == "lit":
                node = Lit("".join(chr(c) for c in _unescape(text[1:-1])))
            elif kind == "cls":
                node = _parse_class(text)
            elif kind == "name":
                node = Ref(text)
            elif text == "(":
                node = self._alternatives()
                assert self._peek() == ("op", ")")
                self._pos += 1
            else:
                raise AssertionError(f"unexpected {text!r}")
            while (post := self._peek()) is not None and (post[0] == "rep" or (post[1] in "*+?" and post[0] == "op")):
                self._pos += 1
                if post[1] == "*":
                    node = Rep(node, 0, None)
                elif post[1] == "+":
                    node = Rep(node, 1, None)
                elif post[1] == "?":
                    node = Rep(node, 0, 1)
                else:
                    low, comma, high = post[1][1:-1].partition(",")
                    node = Rep(node, int(low), int(low) if not comma else int(high) if high else None)
            seq.append(node)
        return seq

    def _min_sizes(self) -> dict[str, float]:
        sizes = {name: math.inf for name in self.rules}
        changed = True
        while changed:
            changed = False
            for name, alt in self.rules.items():
                size = self._size(alt, sizes)
                if size < sizes[name]:
                    sizes[name], changed = size, True
        return sizes

    def _size(self, node: Node, sizes: dict[str, float]) -> float:
        if isinstance(node, Lit):
            return len(node.text)
        if isinstance(node, Cls):
            return 1
        if isinstance(node, Ref):
            return sizes[node.name]
        if isinstance(node, Rep):
            return node.low * self._size(node.item, sizes)
        return min(sum(self._size(n, sizes) for n in seq) for seq in node.seqs)

    def sample(self, rng: random.Random, depth_limit: int = 12) -> str:
        out: list[str] = []
        self._emit(Ref("root"), rng, 0, depth_limit, out)
        return "".join(out)

    def _emit(self, node: Node, rng: random.Random, depth: int, limit: int, out: list[str]) -> None:
        deep = depth > limit
        if isinstance(node, Lit):
            out.append(node.text)
        elif isinstance(node, Cls):
            if node.negated:
                pool = [c for c in _POOL if not any(lo <= ord(c) <= hi for lo, hi in node.ranges)]
                out.append(rng.choice(pool))
            else:
                lo, hi = rng.choice(node.ranges)
                out.append(chr(rng.randint(lo, hi)))
        elif isinstance(node, Ref):
            self._emit(self.rules[node.name], rng, depth + 1, limit, out)
        elif isinstance(node, Rep):
            high = node.low + 3 if node.high is None else min(node.high, node.low + 3)
            count = node.low if deep else rng.randint(node.low, high)
            for _ in range(count):
                self._emit(node.item, rng, depth + 1, limit, out)
        else:
            if deep:
                seq = min(node.seqs, key=lambda s: sum(self._size(n, self.min_size) for n in s))
            else:
                seq = rng.choice(node.seqs)
            for item in seq:
                self._emit(item, rng, depth + 1, limit, out)
