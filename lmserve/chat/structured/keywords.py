"""The JSON-schema keywords structured output accepts (enforced, or annotations), the `format`s it knows, and
the limits of what it compiles."""

from __future__ import annotations

ANNOTATIONS = frozenset({
    "title", "description", "examples", "default", "$comment", "deprecated", "readOnly", "writeOnly", "$schema",
    "$id",
})
"""Keywords that constrain nothing; accepted anywhere (`$id` only at the root: references resolve from there)."""
CONTAINERS = frozenset({"$defs", "definitions"})
STRING_KW = frozenset({"minLength", "maxLength", "pattern", "format"})
NUMBER_KW = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
_OBJECT_KW = frozenset({"properties", "required", "additionalProperties"})
_ARRAY_KW = frozenset({"items", "prefixItems", "minItems", "maxItems", "uniqueItems"})
ENFORCED = (frozenset({"type", "enum", "const", "$ref", "anyOf", "allOf"})
            | STRING_KW | NUMBER_KW | _OBJECT_KW | _ARRAY_KW)
"""Keywords the grammar enforces (`allOf` with one schema only, `uniqueItems` only when false)."""
KNOWN = ANNOTATIONS | CONTAINERS | ENFORCED
TYPES = ("string", "number", "integer", "boolean", "null", "object", "array")
TYPE_KEYWORDS = (("object", _OBJECT_KW), ("array", _ARRAY_KW), ("string", STRING_KW), ("number", NUMBER_KW))

FORMATS = {"date": "date-string", "time": "time-string", "date-time": "date-time-string", "uuid": "uuid-string"}
"""String formats the grammar enforces, and the rule that writes each."""

MAX_COUNT = 4096
"""The largest minLength/maxLength/minItems/maxItems or regex repetition count compiled into a grammar."""
MAX_DEPTH = 64
