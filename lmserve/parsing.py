"""One parser each for the small texts every layer reads: durations, host:port addresses, chat roles, GGUF file names.

Each parser raises `ParseError` (a ValueError) with a message that names what it expected; a caller wraps it in
its own typed error (the API in InvalidRequest naming the field, the configuration in ConfigError naming the flag).
This is a base module: it imports nothing from lmserve but `types` and `errors`, so every layer may use it.
"""

from __future__ import annotations

import hashlib
import math
import re
import unicodedata
from dataclasses import dataclass
from pathlib import PurePath

from lmserve.types import Role

__all__ = ["Address", "ParseError", "chat_role", "format_duration", "model_name_for_file", "parse_address",
           "parse_duration"]


class ParseError(ValueError):
    """A text is not in the form its parser reads; the message says which form was expected."""


# ---- durations -----------------------------------------------------------------------------------------------------

_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_DURATION_EXPECTED = "a duration like 5m, 1h30m or 300ms, or a number of seconds (negative: forever)"


def parse_duration(value: str | float) -> float:
    """Seconds from a Go-style duration (`1h30m`, `5m`, `300ms`, `-1s`) or a plain number of seconds (`300`, 300).

    A negative result means "forever" to the callers that keep things alive; it is returned as it is.
    """
    if isinstance(value, bool):
        raise ParseError(f"expected {_DURATION_EXPECTED}, got {value!r}")
    seconds = float(value) if isinstance(value, int | float) else _duration_text(value)
    if math.isnan(seconds) or math.isinf(seconds):
        raise ParseError(f"expected {_DURATION_EXPECTED}, got {value!r}")
    return seconds


def _duration_text(text: str) -> float:
    body = text.strip()
    try:
        return float(body)
    except ValueError:
        pass
    sign = -1.0 if body.startswith("-") else 1.0
    rest = body.lstrip("+-") if body[:1] in "+-" else body
    if body[:1] in "+-" and len(body) - len(rest) != 1:
        raise ParseError(f"expected {_DURATION_EXPECTED}, got {text!r}")
    seconds, at = 0.0, 0
    while at < len(rest):
        match = _DURATION_PART.match(rest, at)
        if match is None:
            raise ParseError(f"expected {_DURATION_EXPECTED}, got {text!r}")
        seconds += float(match[1]) * _UNIT_SECONDS[match[2]]
        at = match.end()
    if not rest:
        raise ParseError(f"expected {_DURATION_EXPECTED}, got {text!r}")
    return sign * seconds


def format_duration(seconds: float | None) -> str:
    """The shortest Go-style text for a number of seconds: 300 → `5m`, 5400 → `1h30m`, None → `forever`."""
    if seconds is None or seconds < 0:
        return "forever"
    if seconds != int(seconds) or seconds == 0:
        return f"{seconds:g}s"
    whole, parts = int(seconds), []
    for unit, size in (("h", 3600), ("m", 60), ("s", 1)):
        if whole >= size:
            parts.append(f"{whole // size}{unit}")
            whole %= size
    return "".join(parts)


# ---- host:port -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Address:
    """A parsed `[scheme://]host[:port][/path]`. `host` is bare (no IPv6 brackets); "" and None mean not given."""

    host: str = ""
    port: int | None = None
    scheme: str | None = None
    path: str = ""

    @property
    def url_host(self) -> str:
        """The host as a URL holds it: an IPv6 literal in brackets."""
        return f"[{self.host}]" if ":" in self.host else self.host


def parse_address(text: str) -> Address:
    """Read `host`, `host:port`, `:port`, `[::1]:8080`, a bare IPv6 literal (`::1`), each with an optional
    `http://`/`https://` scheme and an optional path. A port must be a number from 0 to 65535."""
    body = text.strip()
    scheme = None
    if "://" in body:
        scheme, _, body = body.partition("://")
        scheme = scheme.lower()
        if scheme not in ("http", "https"):
            raise ParseError(f"expected an http:// or https:// address, got {text!r}")
    body, slash, path = body.partition("/")
    path = (slash + path).rstrip("/")
    host, port = _split_host_port(text, body)
    return Address(host=host, port=port, scheme=scheme, path=path)


def _split_host_port(text: str, body: str) -> tuple[str, int | None]:
    if body.startswith("["):
        host, bracket, rest = body[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ParseError(f"expected [IPv6]:port, got {text!r}")
        return host, _port(text, rest[1:]) if rest else None
    if body.count(":") > 1:  # a bare IPv6 literal carries no port
        return body, None
    host, colon, port = body.partition(":")
    return host, _port(text, port) if colon else None


def _port(text: str, port: str) -> int:
    if not port.isascii() or not port.isdigit() or int(port) > 65535:
        raise ParseError(f"expected a port number from 0 to 65535 in {text!r}, got {port!r}")
    return int(port)


# ---- chat roles ----------------------------------------------------------------------------------------------------


def chat_role(role: Role) -> Role:
    """The role a chat template sees: OpenAI's `developer` is the `system` role; the others stay as they are."""
    return "system" if role == "developer" else role


# ---- a .gguf file name → a model name ------------------------------------------------------------------------------

_MAX_NAME = 128
_NOT_NAME = re.compile(r"[^A-Za-z0-9_.-]+")
_EDGES = re.compile(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$")


def model_name_for_file(path: str | PurePath) -> str:
    """The model name (`name:latest`) a .gguf file, or a repository directory, is served and run under, from its
    file name (pass a resolved path: `.` has no name and gives `model`).

    Accented letters lose their accents (`modèle` → `modele`); any other character a name may not hold becomes
    `-`; runs of `-` and `.` shrink to one; the name starts and ends with a letter or digit and has at most 128
    characters. A file name with nothing name-like left gives `model-` and 8 hex digits of its hash.
    """
    stem = PurePath(path).name
    if stem.lower().endswith(".gguf"):
        stem = stem[: -len(".gguf")]
    ascii_text = unicodedata.normalize("NFKD", stem).encode("ascii", "ignore").decode("ascii")
    name = _NOT_NAME.sub("-", ascii_text)
    name = re.sub(r"-{2,}", "-", re.sub(r"\.{2,}", ".", name))
    name = _EDGES.sub("", _EDGES.sub("", name)[:_MAX_NAME])
    if not name:  # nothing name-like was left: a stable name from the text itself
        name = "model-" + hashlib.sha256(stem.encode()).hexdigest()[:8] if stem.strip() else "model"
    return name + ":latest"
