"""The schema compiler: a JSON schema walked once into GBNF rules, each keyword enforced by the grammar it writes or
refused with `InvalidRequest` naming it."""

from __future__ import annotations

import json
import math
import re
from typing import Any, NoReturn
from urllib.parse import unquote

from lmserve.chat.structured.gbnf import PRIMITIVES, UNSAFE, UNSAFE_RANGES, char_class, group, repeat, string_literal
from lmserve.chat.structured.keywords import (
    ANNOTATIONS,
    CONTAINERS,
    FORMATS,
    KNOWN,
    MAX_COUNT,
    MAX_DEPTH,
    NUMBER_KW,
    STRING_KW,
    TYPE_KEYWORDS,
    TYPES,
)
from lmserve.chat.structured.numbers import number_alternatives
from lmserve.chat.structured.pattern import Pattern
from lmserve.errors import InvalidRequest


class Compiler:
    """One compilation: the rules written so far, the primitive rules used, and the references being resolved."""

    def __init__(self, *, param: str, root: Any = None) -> None:
        self.param = param
        self.root = root
        self.rules: dict[str, str] = {}
        self.used: set[str] = {"space"}
        self.refs: dict[str, str] = {}
        self.resolving: dict[str, int] = {}
        self.nesting = 0
        """How many objects/arrays enclose the schema being compiled: each consumes a "{" or "[" first."""

    # ---- output --------------------------------------------------------------------------------

    def finish(self, root: str) -> str:
        if root in PRIMITIVES:
            self.use(root)
        lines = [f"root ::= {root}"]
        lines += [f"{name} ::= {body}" for name, body in self.rules.items()]
        lines += [f"{name} ::= {PRIMITIVES[name][0]}" for name in sorted(self.used)]
        return "\n".join(lines) + "\n"

    def use(self, name: str) -> str:
        if name not in self.used:
            self.used.add(name)
            for dep in PRIMITIVES[name][1]:
                self.use(dep)
        return name

    def rule(self, hint: str, body: str) -> str:
        name = self.reserve(hint)
        self.rules[name] = body
        return name

    def reserve(self, hint: str) -> str:
        stem = re.sub(r"[^a-zA-Z0-9]+", "-", hint).strip("-")[:24] or "s"
        name = f"{stem}-{len(self.rules)}"  # a primitive's name never ends in -<digits>
        self.rules[name] = ""
        return name

    def fail(self, path: str, what: str) -> NoReturn:
        raise InvalidRequest(f"{self.param}: {what} (at {path}); structured output cannot enforce it",
                             param=self.param)

    # ---- schemas -------------------------------------------------------------------------------

    def visit(self, schema: Any, path: str, hint: str, depth: int) -> str:
        """A GBNF expression for the JSON text (with its trailing `space`) of any instance of `schema`."""
        if depth > MAX_DEPTH:
            self.fail(path, f"the schema nests deeper than {MAX_DEPTH} levels")
        if schema is True:
            return self.use("value")
        keys = self.keywords(schema, path)
        if "$ref" in keys:
            return self.reference(schema["$ref"], path, depth)
        if "anyOf" in keys:
            return self.any_of(schema["anyOf"], path, hint, depth)
        if "allOf" in keys:
            parts = schema["allOf"]
            if not isinstance(parts, list) or len(parts) != 1:
                self.fail(path, "JSON schema keyword 'allOf' with more than one schema is not supported")
            return self.visit(parts[0], f"{path}/allOf/0", hint, depth + 1)
        if "enum" in keys or "const" in keys:
            return self.constants(schema, keys, path)
        if "format" in keys and schema["format"] not in FORMATS:  # refused even where it would not apply
            supported = ", ".join(sorted(FORMATS))
            self.fail(path, f"JSON schema keyword 'format' with value {schema['format']!r} is not supported "
                            f"({supported} are)")
        if schema.get("uniqueItems", False) is not False:
            self.fail(path, "JSON schema keyword 'uniqueItems' (true) is not supported")
        return self.typed(schema, keys, path, hint, depth)

    def keywords(self, schema: Any, path: str) -> set[str]:
        """The constraining keywords of `schema` (a dict, else refused); unknown keywords, `$id` below the root and
        `$ref`/`anyOf`/`allOf` combined with anything are refused."""
        if schema is False:
            self.fail(path, "the schema false accepts no value")
        if not isinstance(schema, dict):
            self.fail(path, "a schema must be an object or a boolean")
        for key in schema:
            if key not in KNOWN:
                self.fail(path, f"JSON schema keyword '{key}' is not supported")
        if "$id" in schema and path != "#":
            self.fail(path, "JSON schema keyword '$id' is only supported at the root")
        keys = {k for k in schema if k not in ANNOTATIONS and k not in CONTAINERS}
        for solo in ("$ref", "anyOf", "allOf"):
            if solo in keys:
                others = sorted(keys - {solo})
                if others:
                    self.fail(path, f"JSON schema keyword '{solo}' combined with '{others[0]}' is not supported")
        return keys

    def any_of(self, alternatives: Any, path: str, hint: str, depth: int) -> str:
        if not isinstance(alternatives, list) or not alternatives:
            self.fail(path, "'anyOf' must be a non-empty list of schemas")
        return group([self.visit(s, f"{path}/anyOf/{i}", hint, depth + 1) for i, s in enumerate(alternatives)])

    def typed(self, schema: dict[str, Any], keys: set[str], path: str, hint: str, depth: int) -> str:
        """The alternatives of each type `schema` allows (any value when it names none)."""
        types = self.types(schema, keys, path)
        if types is None:
            return self.use("value")
        parts = []
        for kind in types:
            if kind in ("null", "boolean"):
                parts.append(self.use(kind))
            elif kind == "string":
                parts.append(self.string(schema, keys, path, hint))
            elif kind in ("integer", "number"):
                parts.append(self.number(schema, path, hint, integer=kind == "integer"))
            elif kind == "object":
                parts.append(self.object(schema, path, hint, depth))
            else:
                parts.append(self.array(schema, path, hint, depth))
        return group(parts)

    def types(self, schema: dict[str, Any], keys: set[str], path: str) -> list[str] | None:
        """The JSON types an instance may have; None for any. Without `type`, those its keywords imply."""
        raw = schema.get("type")
        if raw is None:
            inferred = [kind for kind, words in TYPE_KEYWORDS if words & keys]
            return inferred or None
        names = [raw] if isinstance(raw, str) else raw
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            self.fail(path, "'type' must be a type name or a non-empty list of them")
        for name in names:
            if name not in TYPES:
                self.fail(path, f"unknown type '{name}'")
        unique = list(dict.fromkeys(names))
        if "number" in unique and "integer" in unique:
            unique.remove("integer")  # every integer is a number
        return unique

    def reference(self, ref: Any, path: str, depth: int) -> str:
        if not isinstance(ref, str) or not ref.startswith("#"):
            self.fail(path, f"'$ref' {ref!r}: only references inside the schema ('#/...') are supported")
        if ref in self.resolving:
            if self.resolving[ref] == self.nesting:
                self.fail(path, f"'$ref' {ref!r} refers back to itself without nesting inside an object or array")
            return self.refs[ref]
        if ref in self.refs:
            return self.refs[ref]
        target = self.resolve(ref, path)
        name = self.reserve(ref.rsplit("/", 1)[-1] or "ref")
        self.refs[ref] = name
        self.resolving[ref] = self.nesting
        try:
            self.rules[name] = self.visit(target, ref, name, depth + 1)
        finally:
            del self.resolving[ref]
        return name

    def resolve(self, ref: str, path: str) -> Any:
        pointer = unquote(ref[1:])
        node = self.root
        if pointer == "":
            return node
        if not pointer.startswith("/"):
            self.fail(path, f"'$ref' {ref!r}: anchors are not supported, only JSON pointers ('#/...')")
        for raw in pointer[1:].split("/"):
            part = raw.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                self.fail(path, f"'$ref' {ref!r} does not resolve inside the schema")
        return node

    def constants(self, schema: dict[str, Any], keys: set[str], path: str) -> str:
        others = sorted(keys - {"enum", "const", "type"})
        if others:
            word = "enum" if "enum" in keys else "const"
            self.fail(path, f"JSON schema keyword '{word}' combined with '{others[0]}' is not supported")
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                self.fail(path, "'enum' must be a non-empty list")
            if "const" in schema:
                values = [v for v in values if _canonical(v) == _canonical(schema["const"])]
        else:
            values = [schema["const"]]
        if "type" in schema:
            types = self.types(schema, keys, path) or list(TYPES)
            values = [v for v in values if any(_has_type(v, t) for t in types)]
        if not values:
            self.fail(path, "no value satisfies 'enum'/'const' together with 'type'")
        texts = []
        for value in values:
            try:
                texts.append(string_literal(json.dumps(value, ensure_ascii=False, allow_nan=False)))
            except ValueError:
                self.fail(path, "'enum'/'const' values must be JSON (no NaN or infinity)")
        return group(list(dict.fromkeys(texts))) + " space"

    def count(self, schema: dict[str, Any], key: str, path: str) -> int | None:
        value = schema.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0 or value != int(value):
            self.fail(path, f"'{key}' must be a non-negative integer")
        if value > MAX_COUNT:
            self.fail(path, f"'{key}' {int(value)} is larger than {MAX_COUNT}")
        return int(value)

    def bounds(self, low: int | None, high: int | None, path: str) -> tuple[int, int | None]:
        lo = 0 if low is None else low
        if high is not None and lo > high:
            self.fail(path, "no length satisfies both bounds")
        return lo, high

    # ---- strings -------------------------------------------------------------------------------

    def string(self, schema: dict[str, Any], keys: set[str], path: str, hint: str) -> str:
        if "format" in keys:
            fmt = schema["format"]
            others = sorted(keys & (STRING_KW - {"format"}))
            if others:
                self.fail(path, f"JSON schema keyword 'format' combined with '{others[0]}' is not supported")
            return self.use(FORMATS[fmt])
        if "pattern" in keys:
            others = sorted(keys & {"minLength", "maxLength"})
            if others:
                self.fail(path, f"JSON schema keyword 'pattern' combined with '{others[0]}' is not supported")
            pattern = schema["pattern"]
            if not isinstance(pattern, str):
                self.fail(path, "'pattern' must be a string")
            return self.rule(hint, '"\\"" ' + Pattern(self, path).compile(pattern) + ' "\\"" space')
        lo, hi = self.bounds(self.count(schema, "minLength", path), self.count(schema, "maxLength", path), path)
        if lo == 0 and hi is None:
            return self.use("string")
        return self.rule(hint, '"\\"" ' + repeat(self.use("char"), lo, hi) + ' "\\"" space')

    # ---- numbers -------------------------------------------------------------------------------

    def number(self, schema: dict[str, Any], path: str, hint: str, *, integer: bool) -> str:
        given = {k: schema[k] for k in sorted(NUMBER_KW) if k in schema}
        if not given:
            return self.use("integer" if integer else "number")
        for key, value in given.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                self.fail(path, f"'{key}' must be a number")
            if not integer and value != int(value):
                self.fail(path, f"JSON schema keyword '{key}' with the fraction {value} is not supported "
                                "for type number (whole-number bounds are)")
        # The tightest lower and upper bound, as (value, exclusive).
        lows = [(math.ceil(v) if integer else int(v), False) for k, v in given.items() if k == "minimum"]
        lows += [(math.floor(v) + 1, False) if integer else (int(v), True)
                 for k, v in given.items() if k == "exclusiveMinimum"]
        highs = [(math.floor(v) if integer else int(v), False) for k, v in given.items() if k == "maximum"]
        highs += [(math.ceil(v) - 1, False) if integer else (int(v), True)
                  for k, v in given.items() if k == "exclusiveMaximum"]
        low = max(lows, key=lambda b: (b[0], b[1])) if lows else None
        high = min(highs, key=lambda b: (b[0], not b[1])) if highs else None
        alternatives = number_alternatives(low, high, fractions=not integer)
        if not alternatives:
            self.fail(path, "no number satisfies the bounds")
        if not integer:
            self.use("frac-nz")
        return self.rule(hint, group(alternatives) + " space")

    # ---- objects and arrays ----------------------------------------------------------------

    def object(self, schema: dict[str, Any], path: str, hint: str, depth: int) -> str:
        properties = schema.get("properties", {})
        required = schema.get("required", [])
        extra = schema.get("additionalProperties")
        if not isinstance(properties, dict):
            self.fail(path, "'properties' must be an object")
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            self.fail(path, "'required' must be a list of property names")
        if extra is not None and not isinstance(extra, bool | dict):
            self.fail(path, "'additionalProperties' must be a schema")
        if not properties and not required and extra in (None, True):
            return self.use("object")
        schemas: dict[str, Any] = dict(properties)
        for name in required:
            if name not in schemas:
                if extra is False:
                    self.fail(path, f"required property {name!r} is not in 'properties' and "
                                    "additionalProperties is false")
                schemas[name] = True if extra is None else extra
        must = set(required)
        self.nesting += 1
        try:
            members: list[tuple[str, str]] = []  # (kv rule, "required" | "optional" | "many")
            for name, sub in schemas.items():
                value = self.visit(sub, f"{path}/properties/{_pointer(name)}", f"{hint}-{name}", depth + 1)
                kv = self.rule(f"{hint}-{name}-kv", f'{string_literal(json.dumps(name, ensure_ascii=False))} space ":" '
                                                    f"space {value}")
                members.append((kv, "required" if name in must else "optional"))
            members.sort(key=lambda m: m[1] != "required")
            if extra is True or isinstance(extra, dict):
                key = self.key_excluding(list(schemas), hint)
                value = self.visit(extra, f"{path}/additionalProperties", f"{hint}-extra", depth + 1)
                members.append((self.rule(f"{hint}-extra-kv", f'{key} ":" space {value}'), "many"))
        finally:
            self.nesting -= 1
        return self.rule(hint, '"{" space ' + self.members(members, hint) + '"}" space')

    def members(self, members: list[tuple[str, str]], hint: str) -> str:
        """Object members in order: required ones always, optional ones or not, "many" any number of times."""
        def more(kv: str, kind: str) -> str:
            return f'"," space {kv} ' if kind == "required" else (
                f'( "," space {kv} )? ' if kind == "optional" else f'( "," space {kv} )* ')

        if not members:
            return ""
        if members[0][1] == "required":
            return f"{members[0][0]} " + "".join(more(kv, kind) for kv, kind in members[1:])
        # Nothing is required: the first member present is written without a comma.
        tails = [""] * (len(members) + 1)
        for i in range(len(members) - 1, 0, -1):
            text = more(*members[i]) + tails[i + 1]
            tails[i] = self.rule(f"{hint}-rest", text.strip()) + " " if i < len(members) - 1 else text
        firsts = []
        for i, (kv, kind) in enumerate(members):
            head = f'{kv} ( "," space {kv} )*' if kind == "many" else kv
            firsts.append(f"{head} {tails[i + 1]}".strip())
        return f"( {' | '.join(firsts)} )? "

    def key_excluding(self, names: list[str], hint: str) -> str:
        """A JSON string key (with `space`) that is none of `names`; written without escapes when names exist."""
        if not names:
            return self.use("string")
        self.use("safe")
        trie: dict[str, Any] = {}
        for name in names:
            if all(ord(c) not in UNSAFE for c in name):  # an excluded name with such a character is never written
                node = trie
                for c in name:
                    node = node.setdefault(c, {})
                node[""] = {}

        def rule_for(node: dict[str, Any]) -> str:
            children = sorted(c for c in node if c)
            other = char_class([(ord(c), ord(c)) for c in children] + list(UNSAFE_RANGES), negated=True)
            parts = [f"{other} safe*"] + [f"{string_literal(c)} {rule_for(node[c])}" for c in children]
            body = " | ".join(parts)
            return self.rule(f"{hint}-key", f"( {body} )" if "" in node else f"( {body} )?")

        return f'"\\"" {rule_for(trie)} "\\"" space'

    def array(self, schema: dict[str, Any], path: str, hint: str, depth: int) -> str:
        prefix = schema.get("prefixItems")
        items = schema.get("items")
        if isinstance(items, list):  # the draft-07 tuple form
            if prefix is not None:
                self.fail(path, "'items' as a list beside 'prefixItems' is not supported")
            prefix, items = items, None
        lo, hi = self.bounds(self.count(schema, "minItems", path), self.count(schema, "maxItems", path), path)
        self.nesting += 1
        try:
            if prefix is not None:
                if not isinstance(prefix, list):
                    self.fail(path, "'prefixItems' must be a list of schemas")
                if lo > len(prefix) or (hi is not None and hi < len(prefix)):
                    self.fail(path, "JSON schema keyword 'prefixItems' combined with 'minItems'/'maxItems' "
                                    "other than its length is not supported")
                parts = [self.visit(s, f"{path}/prefixItems/{i}", f"{hint}-{i}", depth + 1)
                         for i, s in enumerate(prefix)]
                body = ' "," space '.join(parts)
            elif items is False or hi == 0:
                if lo > 0:
                    self.fail(path, "no array satisfies 'items' false with 'minItems'")
                body = ""
            else:
                item = self.visit(True if items is None else items, f"{path}/items", f"{hint}-item", depth + 1)
                rest = repeat(f'( "," space {item} )', max(lo - 1, 0), None if hi is None else hi - 1)
                body = f"{item} {rest}" if lo > 0 else f"( {item} {rest} )?"
        finally:
            self.nesting -= 1
        return self.rule(hint, f'"[" space {body} "]" space')


def _pointer(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _has_type(value: Any, kind: str) -> bool:
    if kind == "null":
        return value is None
    if kind == "boolean":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind == "integer":
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if kind == "number":
        return isinstance(value, int | float)
    return isinstance(value, {"string": str, "array": list, "object": dict}[kind])
