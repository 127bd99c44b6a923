"""`pattern`: a regular expression compiled to GBNF for the characters of a JSON string, read through the standard
library's private regex parser (`re._parser`); the features it cannot enforce are refused."""

from __future__ import annotations

import importlib
import json
import re
from typing import TYPE_CHECKING, Any, NoReturn

from lmserve.chat.structured.gbnf import UNSAFE, UNSAFE_RANGES, char_class, group, repeat, string_literal
from lmserve.chat.structured.keywords import MAX_COUNT

if TYPE_CHECKING:
    from lmserve.chat.structured.compiler import Compiler


# The standard library's regex parser (sre_parse), private: the parse-tree shapes `Pattern` reads are pinned by
# tests/chat/test_regex_parse_tree.py, so a Python release that changes them fails there.
_sre: Any = importlib.import_module("re._parser")
_MAXREPEAT: int = importlib.import_module("re._constants").MAXREPEAT
_PRINTABLE = range(0x20, 0x7F)
_CATEGORIES = {
    "CATEGORY_DIGIT": r"\d", "CATEGORY_NOT_DIGIT": r"\D", "CATEGORY_SPACE": r"\s", "CATEGORY_NOT_SPACE": r"\S",
    "CATEGORY_WORD": r"\w", "CATEGORY_NOT_WORD": r"\W",
}
_ALLOWED_FLAGS = re.UNICODE | re.VERBOSE | re.DOTALL | re.ASCII
_REGEX_FEATURES = {
    "ASSERT": "lookahead/lookbehind", "ASSERT_NOT": "negative lookahead/lookbehind", "GROUPREF": "backreferences",
    "GROUPREF_EXISTS": "conditional groups", "ATOMIC_GROUP": "atomic groups",
    "POSSESSIVE_REPEAT": "possessive quantifiers",
}


class Pattern:
    """A regular expression (`pattern`, search semantics) → GBNF for the JSON text inside a string's quotes."""

    def __init__(self, compiler: Compiler, path: str) -> None:
        self.compiler = compiler
        self.path = path

    def fail(self, what: str) -> NoReturn:
        self.compiler.fail(self.path, f"JSON schema keyword 'pattern': {what}")

    def compile(self, pattern: str) -> str:
        try:
            parsed = _sre.parse(pattern)
        except (re.error, RecursionError, OverflowError) as exc:
            self.fail(f"not a valid regular expression ({exc})")
        if parsed.state.flags & ~_ALLOWED_FLAGS:
            self.fail("inline flags other than (?x), (?s) and (?a) are not supported")
        return self.sequence(list(parsed), head=True, tail=True)

    def sequence(self, items: list[tuple[Any, Any]], *, head: bool, tail: bool) -> str:
        """`head`/`tail`: this sequence starts/ends the match, so unless anchored there, any text may precede/follow."""
        if head:
            while items and _op(items[0]) == "AT" and items[0][1].name in ("AT_BEGINNING", "AT_BEGINNING_STRING"):
                items, head = items[1:], False
        if tail:
            while items and _op(items[-1]) == "AT" and items[-1][1].name in ("AT_END", "AT_END_STRING"):
                items, tail = items[:-1], False
        out: list[str] = []
        literal: list[str] = []
        for i, item in enumerate(items):
            first, last = head and i == 0, tail and i == len(items) - 1
            if _op(item) == "LITERAL":
                literal.append(self.char(item[1]))
                continue
            if literal:
                out.append(string_literal("".join(literal)))
                literal = []
            if (first or last) and _op(item) in ("BRANCH", "SUBPATTERN"):
                out.append(self.node(item, head=first, tail=last))  # the alternatives pad themselves
                head = head and not first
                tail = tail and not last
            else:
                out.append(self.node(item, head=False, tail=False))
        if literal:
            out.append(string_literal("".join(literal)))
        pad = self.compiler.use("safe") + "*"
        if head:
            out.insert(0, pad)
        if tail and not (head and not items):
            out.append(pad)
        return " ".join(out) or '""'

    def node(self, item: tuple[Any, Any], *, head: bool, tail: bool) -> str:
        op, av = _op(item), item[1]
        if op == "BRANCH":
            return group([self.sequence(list(alt), head=head, tail=tail) for alt in av[1]])
        if op == "SUBPATTERN":
            _, add_flags, del_flags, sub = av
            if add_flags or del_flags:
                self.fail("inline flags in groups are not supported")
            return f"( {self.sequence(list(sub), head=head, tail=tail)} )"
        if op in ("MAX_REPEAT", "MIN_REPEAT"):  # laziness changes which match is found, not whether one is
            low, high, sub = av
            if low > MAX_COUNT or (high != _MAXREPEAT and high > MAX_COUNT):
                self.fail(f"repetition counts above {MAX_COUNT} are not supported")
            inner = f"( {self.sequence(list(sub), head=False, tail=False)} )"
            return repeat(inner, low, None if high == _MAXREPEAT else high)
        if op == "ANY":
            return self.compiler.use("safe")
        if op == "NOT_LITERAL":
            return self.char_set([(_sre.LITERAL, av)], negated=True)
        if op == "IN":
            negated = bool(av) and _op(av[0]) == "NEGATE"
            return self.char_set(av[1:] if negated else av, negated=negated)
        if op == "AT":
            self.fail("anchors and word boundaries are only supported at the start (^) and the end ($)")
        self.fail(f"{_REGEX_FEATURES.get(op, op.lower())} are not supported")

    def char(self, code: int) -> str:
        if 0xD800 <= code <= 0xDFFF:
            self.fail("surrogate code points are not supported")
        return json.dumps(chr(code), ensure_ascii=False)[1:-1]  # as JSON writes it inside a string

    def char_set(self, items: list[tuple[Any, Any]], *, negated: bool) -> str:
        """A character class: the characters it matches that a JSON string holds raw, plus the escapes of those
        it names that need one. Categories mean their ASCII forms (a subset of their Unicode forms)."""
        ranges: list[tuple[int, int]] = []
        has_category = False
        for item in items:
            op, av = _op(item), item[1]
            if op == "LITERAL":
                ranges.append((av, av))
            elif op == "RANGE":
                ranges.append((av[0], av[1]))
            elif op == "CATEGORY" and av.name in _CATEGORIES:
                has_category = True
            else:
                self.fail(f"{op.lower()} inside a character class is not supported")
        if negated and not has_category:
            return char_class(ranges + list(UNSAFE_RANGES), negated=True)
        if has_category or negated:  # spell the class out over printable ASCII
            members = [c for c in _PRINTABLE if c not in UNSAFE and _surely(items, c, negated=negated)]
            ranges = _runs(members)
            escapes = [] if negated else [c for c in sorted(UNSAFE) if _surely(items, c, negated=False)]
        else:
            escapes = [c for c in sorted(UNSAFE) if any(lo <= c <= hi for lo, hi in ranges)]
            ranges = _subtract(ranges, UNSAFE_RANGES)
        parts = [char_class(ranges, negated=False)] if ranges else []
        parts += [string_literal(self.char(c)) for c in escapes]
        if not parts:
            self.fail("a character class matches no character that can be written")
        return group(parts)


# ---- helpers ---------------------------------------------------------------------------------------


def _op(item: tuple[Any, Any]) -> str:
    return str(item[0].name)


def _surely(items: list[tuple[Any, Any]], code: int, *, negated: bool) -> bool:
    """Whether the class (`negated` or not) matches `code` both with ASCII and with Unicode categories."""
    return all(_matches(items, code, flags) != negated for flags in (re.ASCII, re.UNICODE))


def _matches(items: list[tuple[Any, Any]], code: int, flags: int) -> bool:
    for item in items:
        op, av = _op(item), item[1]
        if (op == "LITERAL" and av == code) or (op == "RANGE" and av[0] <= code <= av[1]):
            return True
        if op == "CATEGORY" and re.fullmatch(_CATEGORIES[av.name], chr(code), flags):
            return True
    return False


def _runs(codes: list[int]) -> list[tuple[int, int]]:
    """Sorted code points as ranges of consecutive ones."""
    out: list[tuple[int, int]] = []
    for code in codes:
        if out and out[-1][1] == code - 1:
            out[-1] = (out[-1][0], code)
        else:
            out.append((code, code))
    return out


def _subtract(ranges: list[tuple[int, int]], holes: tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
    out = []
    for lo, hi in ranges:
        pieces = [(lo, hi)]
        for h_lo, h_hi in holes:
            pieces = [p for a, b in pieces for p in ((a, min(b, h_lo - 1)), (max(a, h_hi + 1), b)) if p[0] <= p[1]]
        out += pieces
    return out
