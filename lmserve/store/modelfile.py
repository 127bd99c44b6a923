r'''Modelfile: `parse(text)` → `Modelfile`, errors with line numbers; `to_text()` prints text that parses back equal.

- Directives FROM, PARAMETER, TEMPLATE, SYSTEM, MESSAGE, ADAPTER, LICENSE, REQUIRES, VERIFY: any case, any order. Blank
  lines and lines whose first non-blank character is `#` are skipped; a later `#` is part of the value.
- A value is bare (rest of the line, stripped), `"quoted"` on one line with escapes \" \\ \n \r \t (another
  backslash stays as written), or `"""multi-line"""`: verbatim up to the first closing triple quote. Only blanks
  may follow a closing quote.
- FROM is required: a model name, a `.gguf` path (relative to the Modelfile; the store resolves it) or a
  directory. Our choice: a FROM naming a `.gguf` file whose file name starts with `mmproj` (any case) is the
  vision projector, before or after the model's FROM; so is a second FROM naming a store blob (`…/sha256-<hex>`,
  as `show --modelfile` prints a stored projector). Any other second FROM is an error.
- PARAMETER takes only the names of lmserve/options.py's table, typed int/float/bool/str and range-checked there;
  an unknown name, a refused option or a bad value fails at create with the line. `stop` repeats into a list;
  otherwise, and for TEMPLATE, SYSTEM and REQUIRES, the last value wins.
- MESSAGE <role> <text>, role system/user/assistant/tool, repeats, as do ADAPTER and LICENSE.
- VERIFY off|warn|require (lmserve's): how the files this Modelfile brings in are checked against their signatures
  (store/signatures.py), over the server's --verify-signatures.

Errors are `ModelfileError` (an `InvalidRequest`, 400) with the 1-based `.line`; a missing FROM is on line 1.
'''

from __future__ import annotations

import re
from dataclasses import dataclass, field

from lmserve import options
from lmserve.errors import InvalidRequest
from lmserve.options import PARAMETERS, ParameterValue
from lmserve.types import VERIFY_MODES

PARAMETER_TYPES: dict[str, type] = {name: option.kind for name, option in PARAMETERS.items()}
"""Every PARAMETER name a Modelfile accepts, with the type of its value (lmserve/options.py's table; the refused
ones fail at create). `stop` may repeat."""
LOAD_TIME_PARAMETERS = frozenset(name for name, option in PARAMETERS.items() if option.lifetime == "load")
"""Parameters fixed when the model loads (a change means a reload); the others are per-request sampling."""
MESSAGE_ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
DIRECTIVES: tuple[str, ...] = ("FROM", "PARAMETER", "TEMPLATE", "SYSTEM", "MESSAGE", "ADAPTER", "LICENSE", "REQUIRES",
                               "VERIFY")

_UNESCAPE = {'"': '"', "\\": "\\", "n": "\n", "r": "\r", "t": "\t"}
_ESCAPE = str.maketrans({'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"})
_TRIPLE = '"""'


class ModelfileError(InvalidRequest):
    """A Modelfile that does not parse; `.line` is the 1-based line of the offending directive."""

    def __init__(self, message: str, line: int) -> None:
        super().__init__(f"Modelfile line {line}: {message}", param="modelfile")
        self.line = line


@dataclass(slots=True)
class Modelfile:
    """A parsed Modelfile. `from_` is the base model (name or path as written), `projector` the mmproj FROM."""

    from_: str
    projector: str | None = None
    parameters: dict[str, int | float | bool | str | list[str]] = field(default_factory=dict)
    template: str | None = None
    system: str | None = None
    messages: list[tuple[str, str]] = field(default_factory=list)
    adapters: list[str] = field(default_factory=list)
    license: list[str] = field(default_factory=list)
    requires: str | None = None
    verify: str | None = None
    """VERIFY: off, warn or require; None: the server's --verify-signatures."""

    def to_text(self) -> str:
        """Print this Modelfile; `parse(m.to_text()) == m` for every Modelfile `parse` can return."""
        lines = [f"FROM {_bare(self.from_)}"]
        if self.projector is not None:
            lines.append(f"FROM {_bare(self.projector)}")
        lines += [f"ADAPTER {_bare(adapter)}" for adapter in self.adapters]
        for name, value in self.parameters.items():
            values = value if isinstance(value, list) else [value]
            lines += [f"PARAMETER {name} {_parameter_text(item)}" for item in values]
        if self.template is not None:
            lines.append(f"TEMPLATE {_block(self.template)}")
        if self.system is not None:
            lines.append(f"SYSTEM {_text(self.system)}")
        lines += [f"MESSAGE {role} {_text(content)}" for role, content in self.messages]
        lines += [f"LICENSE {_block(text)}" for text in self.license]
        if self.requires is not None:
            lines.append(f"REQUIRES {_bare(self.requires)}")
        if self.verify is not None:
            lines.append(f"VERIFY {self.verify}")
        return "\n".join(lines) + "\n"


def parse(text: str) -> Modelfile:
    """Parse Modelfile text; raise ModelfileError (with `.line`) on the first problem."""
    lines = text.replace("\r\n", "\n").split("\n")
    modelfile = Modelfile(from_="")
    index = 0
    while index < len(lines):
        number, line = index + 1, lines[index]
        index += 1
        match = re.match(r"\s*(\S+)\s*(.*)", line, re.DOTALL)
        if match is None or match[1].startswith("#"):
            continue
        directive, rest = match[1].upper(), match[2]
        if directive not in DIRECTIVES:
            raise ModelfileError(f"unknown directive {match[1]!r}; expected one of {', '.join(DIRECTIVES)}", number)
        key = ""
        if directive in ("PARAMETER", "MESSAGE"):
            key, rest = _split_key(directive, rest, number)
        value, index = _read_value(rest, lines, index, number)
        if value is None:
            raise ModelfileError(f"{directive} needs a value", number)
        _apply(modelfile, directive, key, value, number)
    if not modelfile.from_:
        hint = " (an mmproj*.gguf FROM is only the vision projector)" if modelfile.projector else ""
        raise ModelfileError(f"FROM is required: name the base model or a .gguf file{hint}", 1)
    return modelfile


def parse_parameter(name: str, value: str) -> ParameterValue:
    """Type one PARAMETER value by its name and check it (options.py); raise InvalidRequest naming the parameter."""
    return options.parse_parameter(name, value)


def _split_key(directive: str, rest: str, number: int) -> tuple[str, str]:
    """`PARAMETER name value` / `MESSAGE role text`: split off the first word."""
    match = re.match(r"(\S+)\s*(.*)", rest, re.DOTALL)
    if match is None:
        what = "a name and a value" if directive == "PARAMETER" else "a role and a text"
        raise ModelfileError(f"{directive} needs {what}", number)
    return match[1], match[2]


def _read_value(rest: str, lines: list[str], index: int, number: int) -> tuple[str | None, int]:
    """Read a bare, quoted or triple-quoted value starting at `rest`; return it and the next line index."""
    if rest.startswith(_TRIPLE):
        value, tail, index = _read_block(rest[3:], lines, index, number)
    elif rest.startswith('"'):
        value, tail = _read_quoted(rest[1:], number)
    else:
        stripped = rest.strip()
        return (stripped or None), index
    if tail.strip():
        raise ModelfileError(f"unexpected text after the closing quote: {tail.strip()!r}", number)
    return value, index


def _read_block(body: str, lines: list[str], index: int, number: int) -> tuple[str, str, int]:
    """The inside of `\"\"\"…\"\"\"`, which may span lines; return (value, text after it, next line index)."""
    pieces: list[str] = []
    while True:
        end = body.find(_TRIPLE)
        if end >= 0:
            pieces.append(body[:end])
            return "\n".join(pieces), body[end + 3 :], index
        pieces.append(body)
        if index >= len(lines):
            raise ModelfileError('unterminated """ value (opened on this line)', number)
        body, index = lines[index], index + 1


def _read_quoted(body: str, number: int) -> tuple[str, str]:
    """The inside of `"…"` on one line, with escapes; return (value, text after it)."""
    out: list[str] = []
    position = 0
    while position < len(body):
        char = body[position]
        if char == '"':
            return "".join(out), body[position + 1 :]
        if char == "\\" and position + 1 < len(body):
            following = body[position + 1]
            out.append(_UNESCAPE.get(following, "\\" + following))
            position += 2
            continue
        out.append(char)
        position += 1
    raise ModelfileError('unterminated " value', number)


def _apply(modelfile: Modelfile, directive: str, key: str, value: str, number: int) -> None:
    """Record one directive's value in `modelfile`."""
    if not value and directive in ("FROM", "ADAPTER", "REQUIRES", "VERIFY"):
        raise ModelfileError(f"{directive} needs a value", number)
    if directive == "FROM":
        _apply_from(modelfile, value, number)
    elif directive == "PARAMETER":
        _apply_parameter(modelfile, key.lower(), value, number)
    elif directive == "MESSAGE":
        if key.lower() not in MESSAGE_ROLES:
            raise ModelfileError(f"MESSAGE role {key!r} is not one of {', '.join(MESSAGE_ROLES)}", number)
        modelfile.messages.append((key.lower(), value))
    elif directive == "TEMPLATE":
        modelfile.template = value
    elif directive == "SYSTEM":
        modelfile.system = value
    elif directive == "ADAPTER":
        modelfile.adapters.append(value)
    elif directive == "LICENSE":
        modelfile.license.append(value)
    elif directive == "VERIFY":
        if value not in VERIFY_MODES:
            raise ModelfileError(f"VERIFY {value!r}: choose {', '.join(VERIFY_MODES)}", number)
        modelfile.verify = value
    else:
        modelfile.requires = value


def _apply_from(modelfile: Modelfile, value: str, number: int) -> None:
    if _is_projector(value):
        if modelfile.projector is not None:
            raise ModelfileError("a second vision projector (mmproj*.gguf) FROM", number)
        modelfile.projector = value
    elif modelfile.from_ and modelfile.projector is None and _is_blob(value):
        modelfile.projector = value
    elif modelfile.from_:
        raise ModelfileError("a second FROM must be a vision projector: a .gguf file named mmproj*", number)
    else:
        modelfile.from_ = value


def _apply_parameter(modelfile: Modelfile, name: str, value: str, number: int) -> None:
    try:
        typed = parse_parameter(name, value)
    except InvalidRequest as error:
        raise ModelfileError(error.message, number) from error
    if name == "stop":
        stops = modelfile.parameters.setdefault("stop", [])
        assert isinstance(stops, list)
        stops.append(str(typed))
    else:
        modelfile.parameters[name] = typed


def _is_blob(value: str) -> bool:
    return re.fullmatch(r"sha256-[0-9a-f]{64}", re.split(r"[\\/]", value)[-1]) is not None


def _is_projector(value: str) -> bool:
    file_name = re.split(r"[\\/]", value)[-1].lower()
    return file_name.startswith("mmproj") and file_name.endswith(".gguf")


def _parameter_text(value: ParameterValue) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return _quoted(value)
    return repr(value)


def _quoted(value: str) -> str:
    return '"' + value.translate(_ESCAPE) + '"'


def _bare(value: str) -> str:
    """Bare when it reads back the same (one line, no edge blanks, no leading quote), else quoted."""
    is_safe = bool(value) and value == value.strip() and "\n" not in value and not value.startswith('"')
    return value if is_safe else _quoted(value)


def _block(value: str) -> str:
    """Triple-quoted when it reads back the same, else quoted with escapes."""
    is_safe = _TRIPLE not in value and not value.endswith('"') and "\r" not in value
    return _TRIPLE + value + _TRIPLE if is_safe else _quoted(value)


def _text(value: str) -> str:
    """Multi-line text as a block, one-line text bare."""
    return _block(value) if "\n" in value else _bare(value)
