"""Number ranges in GBNF: `minimum`/`maximum` (exclusive or not) as alternatives of whole numbers and fractions,
written digit by digit."""

from __future__ import annotations

from lmserve.chat.structured.gbnf import group, string_literal

# ---- number ranges ---------------------------------------------------------------------------------

Bound = tuple[int, bool]  # (value, exclusive)


def number_alternatives(low: Bound | None, high: Bound | None, *, fractions: bool) -> list[str]:
    """GBNF alternatives for the numbers within the bounds, without exponent: whole numbers, and (when
    `fractions`) numbers with a nonzero fractional part. `I.F` lies strictly between I and I+1 (or -I-1 and -I)."""
    lo = None if low is None else low[0]
    hi = None if high is None else high[0]
    whole_lo = None if low is None else low[0] + low[1]
    whole_hi = None if high is None else high[0] - high[1]
    out = []
    # whole numbers ≥ 0, then ≤ -1
    positive = _uint_range(max(whole_lo or 0, 0), whole_hi)
    if positive:
        out.append(positive)
    negative = _uint_range(max(1, -whole_hi if whole_hi is not None else 1), None if whole_lo is None else -whole_lo)
    if negative:
        out.append(f'"-" {negative}')
    if fractions:
        positive = _uint_range(max(lo or 0, 0), None if hi is None else hi - 1)
        if positive:
            out.append(f'{positive} "." frac-nz')
        negative = _uint_range(max(0, -hi if hi is not None else 0), None if lo is None else -lo - 1)
        if negative:
            out.append(f'"-" {negative} "." frac-nz')
    return out


def _uint_range(low: int, high: int | None) -> str | None:
    """GBNF for the decimal integers in [low, high] (high None: no bound, up to 16 digits), no leading zeros."""
    if high is not None and low > high:
        return None
    parts = []
    digits = len(str(low))
    top = len(str(high)) if high is not None else digits
    for n in range(digits, top + 1):
        start = max(low, 10 ** (n - 1) if n > 1 else 0)
        end = 10**n - 1 if high is None else min(high, 10**n - 1)
        parts.append(_same_length(str(start), str(end)))
    if high is None and digits < 16:
        parts.append(f"[1-9] [0-9]{{{digits},15}}")
    return group(parts)


def _same_length(lo: str, hi: str) -> str:
    """GBNF for the digit strings of length len(lo) between lo and hi (fixed width; lo <= hi)."""
    if lo == hi:
        return string_literal(lo)
    if len(lo) == 1:
        return f"[{lo}-{hi}]"
    if lo[0] == hi[0]:
        return f"{string_literal(lo[0])} {_same_length(lo[1:], hi[1:])}"
    rest = len(lo) - 1
    parts = []
    first = lo[0]
    if lo[1:] != "0" * rest:
        parts.append(f"{string_literal(lo[0])} {_wrap(_same_length(lo[1:], '9' * rest))}")
        first = chr(ord(lo[0]) + 1)
    last = hi[0] if hi[1:] == "9" * rest else chr(ord(hi[0]) - 1)
    if first <= last:
        parts.append(f"[{first}-{last}] [0-9]{{{rest}}}")
    if hi[1:] != "9" * rest:
        parts.append(f"{string_literal(hi[0])} {_wrap(_same_length('0' * rest, hi[1:]))}")
    return group(parts)


def _wrap(expr: str) -> str:
    return expr if expr.startswith("(") or " " not in expr else f"( {expr} )"
