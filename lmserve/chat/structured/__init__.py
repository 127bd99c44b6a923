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

from typing import Any

from lmserve.chat.structured.compiler import Compiler
from lmserve.chat.structured.keywords import ANNOTATIONS, ENFORCED, FORMATS

__all__ = ["ANNOTATIONS", "ENFORCED", "FORMATS", "json_object_grammar", "schema_grammar"]


def json_object_grammar() -> str:
    """A grammar for any JSON object (OpenAI `json_object`, native `format: "json"`)."""
    return Compiler(param="response_format").finish("object")


def schema_grammar(schema: Any, *, param: str = "response_format") -> str:
    """A grammar for the JSON texts that validate against `schema`; InvalidRequest (naming `param`) otherwise."""
    compiler = Compiler(param=param, root=schema)
    return compiler.finish(compiler.visit(schema, "#", "root", 0))
