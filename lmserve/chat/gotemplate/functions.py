"""The values a Go template works on and its functions (`and`, `eq`, `len`, `index`, `printf` …): Go's truth,
printing, comparison and formatting of JSON-like values."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from datetime import date
from decimal import Decimal
from types import MappingProxyType
from typing import Any, TypeAlias

_VERB = re.compile(r"%([-+# 0]*)(\d*)(?:\.(\d*))?(.)", re.DOTALL)
NOARG = object()  # "no piped value" / "no such attribute"


class Fail(Exception):
    """A runtime failure in a function or a lookup; the executor adds the line."""


class _GoMap(dict[str, Any]):
    """A JSON object from a request (tool, call arguments): `.Function` also finds "function"; prints as JSON."""

    __slots__ = ()

    def lookup(self, name: str) -> Any:
        return self[name] if name in self else self.get(name[:1].swapcase() + name[1:])


def wrap(value: Any) -> Any:
    if isinstance(value, dict):
        return _GoMap({str(k): wrap(v) for k, v in value.items()})
    return [wrap(v) for v in value] if isinstance(value, list) else value


def _type_name(v: Any) -> str:
    names = {type(None): "nil", bool: "bool", int: "int", float: "float64", str: "string", list: "slice"}
    return names.get(type(v), "map" if isinstance(v, dict) else type(v).__name__)


def truth(v: Any) -> bool:
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
        raise Fail(f"json: {exc}") from exc


def show(v: Any) -> str:
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
        return "map[" + " ".join(f"{show(k)}:{show(x)}" for k, x in items_of(v)) + "]"
    return "[" + " ".join(show(x) for x in v) + "]" if isinstance(v, list | tuple) else str(v)


def items_of(v: Any) -> list[tuple[Any, Any]]:
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
    raise Fail(f"range can't iterate over {show(v)}")


def field_of(obj: Any, name: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, _GoMap):
        return obj.lookup(name)
    if isinstance(obj, dict):
        return obj.get(name)
    value = NOARG
    if not name.startswith("_") and not isinstance(obj, str | int | float | list | tuple):
        value = getattr(obj, name, NOARG)
    if value is NOARG or callable(value):
        raise Fail(f"can't evaluate field {name} in type {_type_name(obj)}")
    return value


def _kind(v: Any) -> str:
    return "number" if isinstance(v, int | float) and not isinstance(v, bool) else _type_name(v)


def _equal(a: Any, b: Any) -> bool:
    ka, kb = _kind(a), _kind(b)
    if "nil" in (ka, kb):
        return ka == kb
    if ka != kb:
        raise Fail(f"incompatible types for comparison: {ka} and {kb}")
    if ka not in ("bool", "number", "string"):
        raise Fail(f"non-comparable type {ka}")
    return bool(a == b)


def _less(a: Any, b: Any) -> bool:
    ka, kb = _kind(a), _kind(b)
    for k in (ka, kb):
        if k not in ("number", "string"):
            raise Fail(f"invalid type for comparison: {k}")
    if ka != kb:
        raise Fail(f"incompatible types for comparison: {ka} and {kb}")
    return bool(a < b)


def _int_arg(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise Fail(f"cannot index slice/array with type {_type_name(v)}")
    return v


def _len(args: list[Any]) -> int:
    if not isinstance(args[0], str | list | tuple | dict):
        raise Fail(f"len of {_type_name(args[0])}")
    return len(args[0])


def _index(args: list[Any]) -> Any:
    item = args[0]
    for key in args[1:]:
        if isinstance(item, dict):
            item = item.get(key)
        elif isinstance(item, str | list | tuple):
            if not 0 <= _int_arg(key) < len(item):
                raise Fail(f"index out of range: {key}")
            item = ord(item[key]) if isinstance(item, str) else item[key]
        else:
            raise Fail(f"can't index item of type {_type_name(item)}")
    return item


def _slice(args: list[Any]) -> Any:
    item, bounds = args[0], [_int_arg(i) for i in args[1:]]
    if not isinstance(item, str | list | tuple):
        raise Fail(f"can't slice item of type {_type_name(item)}")
    if isinstance(item, str) and len(bounds) == 3:
        raise Fail("cannot 3-index slice a string")
    low, high, cap = [*bounds, *[len(item)] * 3][:3] if bounds else [0, len(item), len(item)]
    if not 0 <= low <= high <= cap <= len(item):
        raise Fail(f"slice index out of range: {bounds}")
    return item[low:high]


def _sprint(args: list[Any]) -> str:
    """Go's fmt.Sprint: a space between operands when neither is a string."""
    spaced = (i and not isinstance(v, str) and not isinstance(args[i - 1], str) for i, v in enumerate(args))
    return "".join(" " * bool(sp) + show(v) for sp, v in zip(spaced, args, strict=True))


def _format_one(verb: str, flags: str, width: str, prec: str | None, v: Any) -> str:
    """One printf verb: %s %v %q %t %d %x %X %c %f %e %g, with Go's -, +, space and 0 flags, width, precision."""
    align, precision = "<" if "-" in flags else "", "" if prec is None else f".{prec or 0}"
    numeric = align + ("+" if "+" in flags else " " if " " in flags else "") + "0" * ("0" in flags and not align)
    if verb in "sv" or (verb == "q" and isinstance(v, str)) or (verb == "t" and isinstance(v, bool)):
        text = json.dumps(v, ensure_ascii=False) if verb == "q" else show(v)
        return format(text, f"{align or '>'}{width}{precision}s")
    if isinstance(v, bool) or not isinstance(v, int | float):
        pass
    elif verb in "dxXc" and isinstance(v, int):
        return chr(v) if verb == "c" else format(v, f"{numeric}{width}{verb}")
    elif verb in "feEgG":
        return format(float(v), f"{numeric}{width}{precision or '.6' * (verb in 'feE')}{verb}")
    return f"%!{verb}({_type_name(v)}={show(v)})"


def _printf(args: list[Any]) -> str:
    if not isinstance(args[0], str):
        raise Fail(f"printf: format must be a string, not {_type_name(args[0])}")
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
    extra = ", ".join(f"{_type_name(v)}={show(v)}" for v in rest[used:])
    return out + (f"%!(EXTRA {extra})" if extra else "")


_Impl: TypeAlias = Callable[[list[Any]], Any]
FUNCS: Mapping[str, tuple[int, int | None, _Impl]] = MappingProxyType({
    "and": (1, None, lambda a: next((v for v in a if not truth(v)), a[-1])),
    "or": (1, None, lambda a: next((v for v in a if truth(v)), a[-1])),
    "not": (1, 1, lambda a: not truth(a[0])),
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
    "println": (0, None, lambda a: " ".join(show(v) for v in a) + "\n"),
    "printf": (1, None, _printf),
    "currentDate": (0, 0, lambda a: date.today().isoformat()),
})  # fmt: skip
