"""Writing GBNF: the rules of JSON's primitives (value, string, number, date …) and the literals, groups,
repeats and character classes the compiler builds rules from."""

from __future__ import annotations

_HEX = "[0-9a-fA-F]"
PRIMITIVES: dict[str, tuple[str, tuple[str, ...]]] = {
    "space": ('" "?', ()),
    "value": ("object | array | string | number | boolean | null",
              ("object", "array", "string", "number", "boolean", "null")),
    "object": ('"{" space ( string ":" space value ( "," space string ":" space value )* )? "}" space',
               ("space", "string", "value")),
    "array": ('"[" space ( value ( "," space value )* )? "]" space', ("space", "value")),
    "string": ('"\\"" char* "\\"" space', ("char", "space")),
    # Any character JSON allows unescaped (less DEL), or an escape; \u escapes name no surrogate, so that every
    # `char` is exactly one character of the decoded string (minLength/maxLength count those).
    "char": (r'[^"\\\x7F\x00-\x1F] | "\\" ( ["\\/bfnrt] | "u" ( [0-9a-cA-CeEfF] '
             + _HEX + "{3} | [dD] [0-7] " + _HEX + "{2} ) )", ()),
    "safe": (r'[^"\\\x7F\x00-\x1F]', ()),
    "int-part": ('"0" | [1-9] [0-9]{0,15}', ()),
    "integer": ('"-"? int-part space', ("int-part", "space")),
    "number": ('"-"? int-part ( "." [0-9]{1,16} )? ( [eE] [-+]? [0-9]{1,2} )? space', ("int-part", "space")),
    "frac-nz": ('"0"{0,8} [1-9] [0-9]{0,8}', ()),
    "boolean": ('( "true" | "false" ) space', ("space",)),
    "null": ('"null" space', ("space",)),
    "date": ('[1-9] [0-9]{3} "-" ( ( "0" [13578] | "1" [02] ) "-" ( "0" [1-9] | [12] [0-9] | "3" [01] ) '
             '| ( "0" [469] | "11" ) "-" ( "0" [1-9] | [12] [0-9] | "30" ) '
             '| "02-" ( "0" [1-9] | "1" [0-9] | "2" [0-8] ) )', ()),
    "time": ('( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] ":" [0-5] [0-9] ( "." [0-9]{1,6} )? '
             '( "Z" | [-+] ( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] )', ()),
    "date-time": ('date "T" time', ("date", "time")),
    "date-string": ('"\\"" date "\\"" space', ("date", "space")),
    "time-string": ('"\\"" time "\\"" space', ("time", "space")),
    "date-time-string": ('"\\"" date-time "\\"" space', ("date-time", "space")),
    "uuid-string": ('"\\"" ' + ' "-" '.join(f"{_HEX}{{{n}}}" for n in (8, 4, 4, 4, 12)) + ' "\\"" space', ("space",)),
}

# Characters a JSON string may not hold unescaped (plus DEL): generated strings never write them raw.
UNSAFE = frozenset(range(0x20)) | {0x22, 0x5C, 0x7F}
UNSAFE_RANGES = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0x7F, 0x7F))


def char_class(ranges: list[tuple[int, int]], *, negated: bool) -> str:
    def esc(code: int) -> str:
        if chr(code).isascii() and chr(code).isalnum():
            return chr(code)
        return f"\\x{code:02X}" if code < 0x100 else f"\\u{code:04X}" if code < 0x10000 else f"\\U{code:08X}"

    inner = "".join(esc(lo) if lo == hi else f"{esc(lo)}-{esc(hi)}" for lo, hi in ranges)
    return f"[{'^' if negated else ''}{inner}]"


def string_literal(text: str) -> str:
    """`text` as a GBNF string literal."""
    out = []
    for c in text:
        if c in '"\\':
            out.append("\\" + c)
        elif c == "\n":
            out.append("\\n")
        elif c == "\r":
            out.append("\\r")
        elif c == "\t":
            out.append("\\t")
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\x{ord(c):02X}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def group(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else "( " + " | ".join(parts) + " )"


def repeat(expr: str, low: int, high: int | None) -> str:
    if high is None:
        return f"{expr}*" if low == 0 else f"{expr}+" if low == 1 else f"{expr}{{{low},}}"
    if high == 0:
        return '""'
    if low == high:
        return expr if low == 1 else f"{expr}{{{low}}}"
    return f"{expr}?" if (low, high) == (0, 1) else f"{expr}{{{low},{high}}}"
