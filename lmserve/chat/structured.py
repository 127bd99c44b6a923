"""Structured output: JSON schemas (or "any JSON object") compiled to GBNF grammars for llama.cpp's grammar sampler.

Every keyword this module accepts is enforced by the grammar it writes, so whatever the model samples under the
grammar parses as JSON and validates against the schema. Anything else (a keyword, a combination of keywords, a
regular-expression feature) is refused with `InvalidRequest` naming it; nothing is silently dropped. Annotations
(`title`, `description`, `default`, `examples` …) and the `$defs`/`definitions` containers are accepted as they are.

Some keywords are enforced by generating only part of what they allow; the output stays valid, the model merely
has less freedom: properties come in schema order; a property that `properties` does not declare appears only
when `additionalProperties` is true or a schema; whitespace between tokens is at most one space; numbers have at
most 16 integer digits (and no exponent when bounded); strings under `pattern` escape only the characters the
pattern itself names; `\\d`, `\\w`, `\\s` mean their ASCII forms; `format: date` never writes February 29th.

`pattern` is read through the standard library's private regex parser (`re._parser`); the tree shapes used are
pinned by `tests/chat/test_regex_parse_tree.py`.
"""

from __future__ import annotations

import importlib
import json
import math
import re
from typing import Any, NoReturn
from urllib.parse import unquote

from lmserve.errors import InvalidRequest

__all__ = ["ANNOTATIONS", "ENFORCED", "FORMATS", "json_object_grammar", "schema_grammar"]

# The standard library's regex parser (sre_parse), private: the parse-tree shapes `_Pattern` reads are pinned by
# tests/chat/test_regex_parse_tree.py, so a Python release that changes them fails there.
_sre: Any = importlib.import_module("re._parser")
_MAXREPEAT: int = importlib.import_module("re._constants").MAXREPEAT

ANNOTATIONS = frozenset({
    "title", "description", "examples", "default", "$comment", "deprecated", "readOnly", "writeOnly", "$schema",
    "$id",
})
"""Keywords that constrain nothing; accepted anywhere (`$id` only at the root: references resolve from there)."""
_CONTAINERS = frozenset({"$defs", "definitions"})
_STRING_KW = frozenset({"minLength", "maxLength", "pattern", "format"})
_NUMBER_KW = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
_OBJECT_KW = frozenset({"properties", "required", "additionalProperties"})
_ARRAY_KW = frozenset({"items", "prefixItems", "minItems", "maxItems", "uniqueItems"})
ENFORCED = (frozenset({"type", "enum", "const", "$ref", "anyOf", "allOf"})
            | _STRING_KW | _NUMBER_KW | _OBJECT_KW | _ARRAY_KW)
"""Keywords the grammar enforces (`allOf` with one schema only, `uniqueItems` only when false)."""
_KNOWN = ANNOTATIONS | _CONTAINERS | ENFORCED
_TYPES = ("string", "number", "integer", "boolean", "null", "object", "array")
_TYPE_KEYWORDS = (("object", _OBJECT_KW), ("array", _ARRAY_KW), ("string", _STRING_KW), ("number", _NUMBER_KW))

FORMATS = {"date": "date-string", "time": "time-string", "date-time": "date-time-string", "uuid": "uuid-string"}
"""String formats the grammar enforces, and the rule that writes each."""

MAX_COUNT = 4096
"""The largest minLength/maxLength/minItems/maxItems or regex repetition count compiled into a grammar."""
MAX_DEPTH = 64

_HEX = "[0-9a-fA-F]"
_PRIMITIVES: dict[str, tuple[str, tuple[str, ...]]] = {
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
_UNSAFE = frozenset(range(0x20)) | {0x22, 0x5C, 0x7F}
_UNSAFE_RANGES = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0x7F, 0x7F))
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


def json_object_grammar() -> str:
    """A grammar for any JSON object (OpenAI `json_object`, native `format: "json"`)."""
    return _Compiler(param="response_format").finish("object")


def schema_grammar(schema: Any, *, param: str = "response_format") -> str:
    """A grammar for the JSON texts that validate against `schema`; InvalidRequest (naming `param`) otherwise."""
    compiler = _Compiler(param=param, root=schema)
    return compiler.finish(compiler.visit(schema, "#", "root", 0))


class _Compiler:
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
        if root in _PRIMITIVES:
            self.use(root)
        lines = [f"root ::= {root}"]
        lines += [f"{name} ::= {body}" for name, body in self.rules.items()]
        lines += [f"{name} ::= {_PRIMITIVES[name][0]}" for name in sorted(self.used)]
        return "\n".join(lines) + "\n"

    def use(self, name: str) -> str:
        if name not in self.used:
            self.used.add(name)
            for dep in _PRIMITIVES[name][1]:
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
        if schema is False:
            self.fail(path, "the schema false accepts no value")
        if not isinstance(schema, dict):
            self.fail(path, "a schema must be an object or a boolean")
        for key in schema:
            if key not in _KNOWN:
                self.fail(path, f"JSON schema keyword '{key}' is not supported")
        if "$id" in schema and path != "#":
            self.fail(path, "JSON schema keyword '$id' is only supported at the root")
        keys = {k for k in schema if k not in ANNOTATIONS and k not in _CONTAINERS}
        for solo in ("$ref", "anyOf", "allOf"):
            if solo in keys:
                others = sorted(keys - {solo})
                if others:
                    self.fail(path, f"JSON schema keyword '{solo}' combined with '{others[0]}' is not supported")
        if "$ref" in keys:
            return self.reference(schema["$ref"], path, depth)
        if "anyOf" in keys:
            alternatives = schema["anyOf"]
            if not isinstance(alternatives, list) or not alternatives:
                self.fail(path, "'anyOf' must be a non-empty list of schemas")
            parts = [self.visit(s, f"{path}/anyOf/{i}", hint, depth + 1) for i, s in enumerate(alternatives)]
            return _group(parts)
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
        return _group(parts)

    def types(self, schema: dict[str, Any], keys: set[str], path: str) -> list[str] | None:
        """The JSON types an instance may have; None for any. Without `type`, those its keywords imply."""
        raw = schema.get("type")
        if raw is None:
            inferred = [kind for kind, words in _TYPE_KEYWORDS if words & keys]
            return inferred or None
        names = [raw] if isinstance(raw, str) else raw
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            self.fail(path, "'type' must be a type name or a non-empty list of them")
        for name in names:
            if name not in _TYPES:
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
            types = self.types(schema, keys, path) or list(_TYPES)
            values = [v for v in values if any(_has_type(v, t) for t in types)]
        if not values:
            self.fail(path, "no value satisfies 'enum'/'const' together with 'type'")
        texts = []
        for value in values:
            try:
                texts.append(_literal(json.dumps(value, ensure_ascii=False, allow_nan=False)))
            except ValueError:
                self.fail(path, "'enum'/'const' values must be JSON (no NaN or infinity)")
        return _group(list(dict.fromkeys(texts))) + " space"

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
            others = sorted(keys & (_STRING_KW - {"format"}))
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
            return self.rule(hint, '"\\"" ' + _Pattern(self, path).compile(pattern) + ' "\\"" space')
        lo, hi = self.bounds(self.count(schema, "minLength", path), self.count(schema, "maxLength", path), path)
        if lo == 0 and hi is None:
            return self.use("string")
        return self.rule(hint, '"\\"" ' + _repeat(self.use("char"), lo, hi) + ' "\\"" space')

    # ---- numbers -------------------------------------------------------------------------------

    def number(self, schema: dict[str, Any], path: str, hint: str, *, integer: bool) -> str:
        given = {k: schema[k] for k in sorted(_NUMBER_KW) if k in schema}
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
        alternatives = _number_alternatives(low, high, fractions=not integer)
        if not alternatives:
            self.fail(path, "no number satisfies the bounds")
        if not integer:
            self.use("frac-nz")
        return self.rule(hint, _group(alternatives) + " space")

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
                kv = self.rule(f"{hint}-{name}-kv", f'{_literal(json.dumps(name, ensure_ascii=False))} space ":" '
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
            if all(ord(c) not in _UNSAFE for c in name):  # an excluded name with such a character is never written
                node = trie
                for c in name:
                    node = node.setdefault(c, {})
                node[""] = {}

        def rule_for(node: dict[str, Any]) -> str:
            children = sorted(c for c in node if c)
            other = _char_class([(ord(c), ord(c)) for c in children] + list(_UNSAFE_RANGES), negated=True)
            parts = [f"{other} safe*"] + [f"{_literal(c)} {rule_for(node[c])}" for c in children]
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
                rest = _repeat(f'( "," space {item} )', max(lo - 1, 0), None if hi is None else hi - 1)
                body = f"{item} {rest}" if lo > 0 else f"( {item} {rest} )?"
        finally:
            self.nesting -= 1
        return self.rule(hint, f'"[" space {body} "]" space')


class _Pattern:
    """A regular expression (`pattern`, search semantics) → GBNF for the JSON text inside a string's quotes."""

    def __init__(self, compiler: _Compiler, path: str) -> None:
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
                out.append(_literal("".join(literal)))
                literal = []
            if (first or last) and _op(item) in ("BRANCH", "SUBPATTERN"):
                out.append(self.node(item, head=first, tail=last))  # the alternatives pad themselves
                head = head and not first
                tail = tail and not last
            else:
                out.append(self.node(item, head=False, tail=False))
        if literal:
            out.append(_literal("".join(literal)))
        pad = self.compiler.use("safe") + "*"
        if head:
            out.insert(0, pad)
        if tail and not (head and not items):
            out.append(pad)
        return " ".join(out) or '""'

    def node(self, item: tuple[Any, Any], *, head: bool, tail: bool) -> str:
        op, av = _op(item), item[1]
        if op == "BRANCH":
            return _group([self.sequence(list(alt), head=head, tail=tail) for alt in av[1]])
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
            return _repeat(inner, low, None if high == _MAXREPEAT else high)
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
            return _char_class(ranges + list(_UNSAFE_RANGES), negated=True)
        if has_category or negated:  # spell the class out over printable ASCII
            members = [c for c in _PRINTABLE if c not in _UNSAFE and _surely(items, c, negated=negated)]
            ranges = _runs(members)
            escapes = [] if negated else [c for c in sorted(_UNSAFE) if _surely(items, c, negated=False)]
        else:
            escapes = [c for c in sorted(_UNSAFE) if any(lo <= c <= hi for lo, hi in ranges)]
            ranges = _subtract(ranges, _UNSAFE_RANGES)
        parts = ([_char_class(ranges, negated=False)] if ranges else []) + [_literal(self.char(c)) for c in escapes]
        if not parts:
            self.fail("a character class matches no character that can be written")
        return _group(parts)


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


def _char_class(ranges: list[tuple[int, int]], *, negated: bool) -> str:
    def esc(code: int) -> str:
        if chr(code).isascii() and chr(code).isalnum():
            return chr(code)
        return f"\\x{code:02X}" if code < 0x100 else f"\\u{code:04X}" if code < 0x10000 else f"\\U{code:08X}"

    inner = "".join(esc(lo) if lo == hi else f"{esc(lo)}-{esc(hi)}" for lo, hi in ranges)
    return f"[{'^' if negated else ''}{inner}]"


def _literal(text: str) -> str:
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


def _group(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else "( " + " | ".join(parts) + " )"


def _repeat(expr: str, low: int, high: int | None) -> str:
    if high is None:
        return f"{expr}*" if low == 0 else f"{expr}+" if low == 1 else f"{expr}{{{low},}}"
    if high == 0:
        return '""'
    if low == high:
        return expr if low == 1 else f"{expr}{{{low}}}"
    return f"{expr}?" if (low, high) == (0, 1) else f"{expr}{{{low},{high}}}"


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


# ---- number ranges ---------------------------------------------------------------------------------

Bound = tuple[int, bool]  # (value, exclusive)


def _number_alternatives(low: Bound | None, high: Bound | None, *, fractions: bool) -> list[str]:
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
    return _group(parts)


def _same_length(lo: str, hi: str) -> str:
    """GBNF for the digit strings of length len(lo) between lo and hi (fixed width; lo <= hi)."""
    if lo == hi:
        return _literal(lo)
    if len(lo) == 1:
        return f"[{lo}-{hi}]"
    if lo[0] == hi[0]:
        return f"{_literal(lo[0])} {_same_length(lo[1:], hi[1:])}"
    rest = len(lo) - 1
    parts = []
    first = lo[0]
    if lo[1:] != "0" * rest:
        parts.append(f"{_literal(lo[0])} {_wrap(_same_length(lo[1:], '9' * rest))}")
        first = chr(ord(lo[0]) + 1)
    last = hi[0] if hi[1:] == "9" * rest else chr(ord(hi[0]) - 1)
    if first <= last:
        parts.append(f"[{first}-{last}] [0-9]{{{rest}}}")
    if hi[1:] != "9" * rest:
        parts.append(f"{_literal(hi[0])} {_wrap(_same_length('0' * rest, hi[1:]))}")
    return _group(parts)


def _wrap(expr: str) -> str:
    return expr if expr.startswith("(") or " " not in expr else f"( {expr} )"
