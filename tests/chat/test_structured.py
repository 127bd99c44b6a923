"""JSON schema → GBNF: what is refused (naming the keyword), and that every text a grammar allows is valid.

Validity is checked without a model: texts are drawn at random from each grammar (tests/chat/gbnf.py), parsed
with `json.loads` and validated with `jsonschema` (formats checked too). llama.cpp must parse every grammar.
"""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest

from lmserve.chat.structured import ANNOTATIONS, ENFORCED, json_object_grammar, schema_grammar
from lmserve.engine.llamacpp.backend import LlamaCppBackend
from lmserve.errors import InvalidRequest
from tests.chat.gbnf import Grammar

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}

ACCEPTED: dict[str, Any] = {
    "person": PERSON,
    "empty": {},
    "true": True,
    "annotations": {"title": "T", "description": "d", "examples": [1], "default": 0, "$comment": "c",
                    "$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "urn:x", "type": "integer"},
    "optional properties": {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "null"},
                                                             "c": {"type": "string", "minLength": 2}}},
    "mixed required": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"},
                                                        "c": {"type": "integer"}}, "required": ["b"]},
    "required but not declared": {"type": "object", "required": ["x", "y"], "properties": {"y": {"type": "null"}}},
    "map": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}},
    "declared and extra": {"type": "object", "properties": {"ab": {"type": "null"}, "a": {"type": "boolean"}},
                           "additionalProperties": {"type": "string", "maxLength": 1}},
    "extra true": {"type": "object", "properties": {"k": {"const": 1}}, "required": ["k"],
                   "additionalProperties": True},
    "closed empty object": {"type": "object", "additionalProperties": False},
    "any object": {"type": "object"},
    "string lengths": {"type": "string", "minLength": 3, "maxLength": 6},
    "exact length": {"type": "string", "minLength": 2, "maxLength": 2},
    "empty string only": {"type": "string", "maxLength": 0},
    "enum": {"enum": ["red", "green", 3, None, True, [1, "a"], {"k": "v"}, "quote\"back\\slash\nnew"]},
    "enum with type": {"type": "string", "enum": ["a", 1, "b"]},
    "const": {"const": {"nested": [1, 2.5, "é"]}},
    "integer range": {"type": "integer", "minimum": -123, "maximum": 4567},
    "integer exclusive": {"type": "integer", "exclusiveMinimum": 9.5, "exclusiveMaximum": 1000},
    "integer lower bound": {"type": "integer", "minimum": 17},
    "integer upper bound": {"type": "integer", "maximum": -3},
    "number range": {"type": "number", "minimum": -2, "maximum": 3},
    "number exclusive": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    "number one side": {"type": "number", "exclusiveMaximum": -1},
    "number": {"type": "number"},
    "type list": {"type": ["string", "null", "integer"], "maxLength": 2, "minimum": 5, "maximum": 6},
    "integer and number": {"type": ["integer", "number"]},
    "inferred types": {"properties": {"a": {"type": "null"}}, "required": ["a"], "minLength": 1, "maxLength": 1},
    "array": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    "array min only": {"type": "array", "items": {"type": "boolean"}, "minItems": 1},
    "array of anything": {"type": "array", "maxItems": 2, "uniqueItems": False},
    "empty array": {"type": "array", "items": False},
    "tuple": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string", "maxLength": 2}],
              "items": False},
    "draft-07 tuple": {"$schema": "http://json-schema.org/draft-07/schema#", "type": "array",
                       "items": [{"type": "boolean"}, {"const": "x"}]},
    "anyOf": {"anyOf": [{"type": "integer", "minimum": 10}, {"type": "string", "maxLength": 1},
                        {"type": "array", "items": {"type": "null"}}]},
    "single allOf": {"allOf": [{"$ref": "#/$defs/color"}], "description": "wrapped", "$defs": {
        "color": {"enum": ["red", "blue"]}}},
    "refs": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                                 "required": ["x", "y"], "additionalProperties": False}},
             "type": "object", "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}},
             "required": ["from", "to"]},
    "draft-07 definitions": {"definitions": {"a/b": {"type": "integer"}}, "$ref": "#/definitions/a~1b"},
    "recursive": {"$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
        "required": ["value"], "additionalProperties": False}}, "$ref": "#/$defs/node"},
    "root recursion": {"type": "array", "items": {"anyOf": [{"type": "integer"}, {"$ref": "#"}]}, "maxItems": 3},
    "formats": {"type": "object", "properties": {f: {"type": "string", "format": f} for f in
                                                  ("date", "time", "date-time", "uuid")},
                "required": ["date", "time", "date-time", "uuid"]},
    "pattern anchored": {"type": "string", "pattern": "^[A-Z][a-z]{1,5}-\\d{2,3}$"},
    "pattern unanchored": {"type": "string", "pattern": "ab+c"},
    "pattern alternatives": {"type": "string", "pattern": "^(cat|dog)s?$|^bird$"},
    "pattern factored anchors": {"type": "string", "pattern": "^a$|^b$"},
    "pattern escapes": {"type": "string", "pattern": '^"q"\\\\x\\.\\n\\t$'},
    "pattern classes": {"type": "string", "pattern": "^[^a-z\"]\\s\\S\\w\\W\\D[\\d_.-][^\\d]$"},
    "pattern dot and lazy": {"type": "string", "pattern": "^.+?x.*$"},
    "pattern counts": {"type": "string", "pattern": "^(ab){2}c{1,}d{0,2}e?$"},
    "pattern unicode": {"type": "string", "pattern": "^[é-ë]中+$"},
    "pattern flags": {"type": "string", "pattern": "(?x) ^ a b $"},
    "pattern empty": {"type": "string", "pattern": ""},
    "unicode names": {"type": "object", "properties": {"naïve \"key\"": {"type": "integer"}},
                      "required": ["naïve \"key\""]},
}

REJECTED: dict[str, tuple[Any, str]] = {
    "not": ({"not": {"type": "string"}}, "'not'"),
    "if": ({"if": {"type": "string"}, "then": {"minLength": 1}}, "'if'"),
    "oneOf": ({"oneOf": [{"type": "string"}, {"type": "integer"}]}, "'oneOf'"),
    "dependentSchemas": ({"type": "object", "dependentSchemas": {"a": {}}}, "'dependentSchemas'"),
    "dependentRequired": ({"type": "object", "dependentRequired": {"a": ["b"]}}, "'dependentRequired'"),
    "uniqueItems": ({"type": "array", "uniqueItems": True}, "'uniqueItems'"),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, "'multipleOf'"),
    "patternProperties": ({"type": "object", "patternProperties": {"^a": {}}}, "'patternProperties'"),
    "propertyNames": ({"type": "object", "propertyNames": {"maxLength": 3}}, "'propertyNames'"),
    "minProperties": ({"type": "object", "minProperties": 1}, "'minProperties'"),
    "maxProperties": ({"type": "object", "maxProperties": 1}, "'maxProperties'"),
    "contains": ({"type": "array", "contains": {"type": "integer"}}, "'contains'"),
    "additionalItems": ({"type": "array", "items": [{}], "additionalItems": False}, "'additionalItems'"),
    "unevaluatedProperties": ({"type": "object", "unevaluatedProperties": False}, "'unevaluatedProperties'"),
    "nullable": ({"type": "string", "nullable": True}, "'nullable'"),
    "format email": ({"type": "string", "format": "email"}, "'format'"),
    "format on integer": ({"type": "integer", "format": "int64"}, "'int64'"),
    "format with length": ({"type": "string", "format": "date", "maxLength": 20}, "'format' combined"),
    "pattern with length": ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "'pattern' combined"),
    "fractional number bound": ({"type": "number", "minimum": 0.5}, "'minimum'"),
    "allOf of two": ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, "'allOf'"),
    "ref with siblings": ({"$ref": "#/$defs/a", "type": "string", "$defs": {"a": {}}}, "'$ref' combined"),
    "anyOf with siblings": ({"anyOf": [{}], "type": "string"}, "'anyOf' combined"),
    "enum with siblings": ({"enum": ["a"], "minLength": 1}, "'enum' combined"),
    "remote ref": ({"$ref": "https://example.com/schema.json"}, "'$ref'"),
    "dangling ref": ({"$ref": "#/$defs/missing"}, "'$ref'"),
    "anchor ref": ({"$ref": "#thing"}, "'$ref'"),
    "ref cycle": ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"anyOf": [{"$ref": "#/$defs/a"}]}},
                   "$ref": "#/$defs/a"}, "'$ref'"),
    "nested $id": ({"type": "object", "properties": {"a": {"$id": "urn:a"}}}, "'$id'"),
    "$anchor": ({"$anchor": "x"}, "'$anchor'"),
    "$dynamicRef": ({"$dynamicRef": "#x"}, "'$dynamicRef'"),
    "false schema": ({"type": "object", "properties": {"a": False}}, "false"),
    "unknown type": ({"type": "text"}, "'text'"),
    "unsatisfiable enum": ({"type": "integer", "enum": ["a"]}, "'enum'"),
    "unsatisfiable range": ({"type": "integer", "minimum": 5, "maximum": 4}, "bounds"),
    "unsatisfiable lengths": ({"type": "string", "minLength": 5, "maxLength": 4}, "bounds"),
    "required but forbidden": ({"type": "object", "required": ["a"], "additionalProperties": False}, "'a'"),
    "huge maxLength": ({"type": "string", "maxLength": 100000}, "'maxLength'"),
    "tuple bounds": ({"prefixItems": [{}], "minItems": 2}, "'prefixItems'"),
    "lookahead": ({"type": "string", "pattern": "^(?=a)a$"}, "lookahead"),
    "backreference": ({"type": "string", "pattern": "^(a)\\1$"}, "backreferences"),
    "word boundary": ({"type": "string", "pattern": "\\bword\\b"}, "anchors"),
    "anchor inside": ({"type": "string", "pattern": "a^b"}, "anchors"),
    "ignorecase": ({"type": "string", "pattern": "(?i)^abc$"}, "flags"),
    "group flags": ({"type": "string", "pattern": "^(?i:abc)$"}, "flags"),
    "possessive": ({"type": "string", "pattern": "^a++$"}, "possessive"),
    "atomic": ({"type": "string", "pattern": "^(?>a)$"}, "atomic"),
    "invalid regex": ({"type": "string", "pattern": "^(a$"}, "not a valid regular expression"),
    "huge repeat": ({"type": "string", "pattern": "^a{5000}$"}, "repetition"),
    "deep nesting": ({"type": "array", "items": json.loads('{"items": ' * 70 + "{}" + "}" * 70)}, "nests deeper"),
}


def check_texts(grammar: str, schema: Any, draws: int = 150) -> list[Any]:
    LlamaCppBackend.check_grammar(grammar)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
    rng = random.Random(1234)
    parsed = Grammar(grammar)
    values = []
    for _ in range(draws):
        text = parsed.sample(rng)
        value = json.loads(text)  # strict: raw control characters inside strings would fail here
        errors = list(validator.iter_errors(value))
        assert not errors, f"{text!r} is invalid: {errors[0].message}\n{grammar}"
        values.append(value)
    return values


@pytest.mark.parametrize("name", ACCEPTED)
def test_every_text_the_grammar_allows_parses_and_validates(name: str) -> None:
    schema = ACCEPTED[name]
    check_texts(schema_grammar(schema), schema)


def test_any_json_object_grammar_gives_objects() -> None:
    values = check_texts(json_object_grammar(), {"type": "object"})
    assert any(values)  # not only {}


@pytest.mark.parametrize("name", REJECTED)
@pytest.mark.parametrize("param", ["response_format", "format"])
def test_unenforceable_schemas_are_refused_naming_the_problem(name: str, param: str) -> None:
    schema, fragment = REJECTED[name]
    with pytest.raises(InvalidRequest) as info:
        schema_grammar(schema, param=param)
    assert info.value.status == 400
    assert info.value.param == param
    assert info.value.message.startswith(f"{param}: ")
    assert fragment in info.value.message


def test_a_refusal_says_where_in_the_schema() -> None:
    with pytest.raises(InvalidRequest, match=r"'not' is not supported \(at #/properties/a~1b/items\)"):
        schema_grammar({"properties": {"a/b": {"items": {"not": {}}}}})


def test_keyword_lists_are_disjoint_and_cover_the_common_ones() -> None:
    assert not ANNOTATIONS & ENFORCED
    assert {"type", "properties", "required", "items", "enum", "anyOf", "pattern", "minimum"} <= ENFORCED


def test_generated_values_cover_the_schema() -> None:
    """The restrictions narrow the output, but not to nothing: optional parts do appear."""
    schema = ACCEPTED["optional properties"]
    values = check_texts(schema_grammar(schema), schema, draws=200)
    assert {frozenset(v) for v in values} >= {frozenset(), frozenset("a"), frozenset("abc")}
    values = check_texts(schema_grammar(ACCEPTED["integer range"]), ACCEPTED["integer range"], draws=300)
    assert min(values) < 0 < max(values)
