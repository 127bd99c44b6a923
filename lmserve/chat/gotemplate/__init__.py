"""Ollama Modelfile TEMPLATEs: the subset of Go's text/template they use, parsed once and rendered per request.

Supported: `{{ .A.B }}`, `{{ . }}`, `{{ $ }}`/`{{ $.A }}`, variables (`$x := …`, `$x = …`), `if`/`else if`/`else`,
`range` (`$i, $v :=`, `else`, `break`, `continue`), `with`/`else with`, `{{/* comments */}}`, `{{- `/` -}}`
trimming, string (Go escapes), raw string, number, character and `true`/`false`/`nil` literals, parenthesised
pipelines and `|` pipes; the functions `and or not eq ne lt le gt ge len index slice print printf println json
currentDate`. `define`/`template`/`block` are rejected. A syntax error, an unknown function or variable, or a wrong
argument count fails in `GoTemplate()` (create time), never at request time.

Deliberate differences from Go:
- a missing map key, or a field of nil, is None, which prints as "" (Go prints "<no value>" or fails on nil);
- strings are measured and sliced in characters (Go: bytes); `index` of a string yields the code point;
- `eq`, `lt` … compare ints with floats (Go refuses mixed kinds);
- `json` (and printing a tool or an arguments map) writes compact JSON in the request's key order, without Go's
  HTML escaping; `range` over a map visits sorted keys, as Go does.
"""

from lmserve.chat.gotemplate.chat import GoChatTemplate, render_chat
from lmserve.chat.gotemplate.syntax import TemplateError
from lmserve.chat.gotemplate.template import GoTemplate

__all__ = ["GoChatTemplate", "GoTemplate", "TemplateError", "render_chat"]
