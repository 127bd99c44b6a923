"""Model names: `name[:tag]`, `namespace/name[:tag]` and hub names `hf.co/<org>/<repo>[:QUANT]`.

A name is untrusted input (it becomes a path in the store), so `parse_name` is strict:

- each part (namespace, name, org, repo, tag) is 1-128 characters of letters, digits, `_`, `-` and `.`,
  and starts with a letter or digit;
- `..` anywhere, absolute paths, backslashes, whitespace and any other character are refused;
- at most one `:` (the tag, after the last `/`); at most two parts, or three for `hf.co/<org>/<repo>`;
- a text ending in `.gguf` is a path, not a name: callers check `is_gguf_path` first.

The tag defaults to `latest`. For hub names the tag is the quantization (`Q4_K_M`), upper-cased, or `latest`;
`huggingface.co/` is accepted as a spelling of `hf.co/`. Case is otherwise kept as written. `pull` fetches both
`hf.co/<org>/<repo>` and two-part `<org>/<repo>` names from the hub, and stores each under the name as written.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NoReturn

from lmserve.errors import InvalidRequest

DEFAULT_TAG = "latest"
HUB_HOST = "hf.co"
_HUB_HOSTS = frozenset({"hf.co", "huggingface.co"})
_MAX_PART = 128
_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_ALLOWED_CHAR = re.compile(r"[A-Za-z0-9_.:/-]")
_FORMS = "name[:tag], namespace/name[:tag] or hf.co/<org>/<repo>[:QUANT]"


@dataclass(frozen=True, slots=True)
class ModelName:
    """A parsed model name. `host` is `"hf.co"` for hub names, else None."""

    host: str | None
    namespace: str | None
    name: str
    tag: str = DEFAULT_TAG

    def __str__(self) -> str:
        """Canonical form: `name:tag`, `namespace/name:tag` or `hf.co/org/repo:TAG`."""
        parts = [part for part in (self.host, self.namespace, self.name) if part is not None]
        return "/".join(parts) + ":" + self.tag

    @property
    def is_hub(self) -> bool:
        """True for `hf.co/<org>/<repo>` names, which are pulled from the Hugging Face hub."""
        return self.host is not None


def is_gguf_path(text: str) -> bool:
    """True when `text` names a GGUF file rather than a model (it ends with `.gguf`, any case). Pure: no I/O."""
    return text.lower().endswith(".gguf")


def parse_name(text: str) -> ModelName:
    """Parse a model name; raise InvalidRequest (param `model`) naming the rule it breaks."""
    _check_text(text)
    path, tag = _split_tag(text)
    parts = path.split("/")
    for part in parts:
        _check_part(text, part, "name part")
    if parts[0].lower() in _HUB_HOSTS:
        return _hub_name(text, parts, tag)
    if len(parts) == 3:
        _fail(text, f"only hub names have three parts; the forms are {_FORMS}")
    if len(parts) > 3:
        _fail(text, f"too many '/'; the forms are {_FORMS}")
    namespace = parts[0] if len(parts) == 2 else None
    return ModelName(host=None, namespace=namespace, name=parts[-1], tag=tag or DEFAULT_TAG)


def _check_text(text: str) -> None:
    """Whole-text rules, checked before the text is split."""
    if not text:
        _fail(text, "a model name is empty")
    if ".." in text:
        _fail(text, "'..' is not allowed in a model name")
    if text.startswith(("/", "\\", "~")) or re.match(r"[A-Za-z]:[\\/]", text):
        _fail(text, "an absolute path is not a model name")
    if is_gguf_path(text):
        _fail(text, "a path to a .gguf file is not a model name")
    for char in text:
        if not _ALLOWED_CHAR.fullmatch(char):
            _fail(text, f"character {char!r} is not allowed; use letters, digits, '_', '-', '.'")


def _split_tag(text: str) -> tuple[str, str | None]:
    """Split `path:tag`; the tag must come after the last `/` and there is at most one `:`."""
    path, colon, tag = text.partition(":")
    if not colon:
        return text, None
    if ":" in tag or "/" in tag:
        _fail(text, f"the tag comes last, after one ':'; the forms are {_FORMS}")
    _check_part(text, tag, "tag")
    return path, tag


def _check_part(text: str, part: str, what: str) -> None:
    if not part:
        _fail(text, f"a {what} is empty; the forms are {_FORMS}")
    if len(part) > _MAX_PART:
        _fail(text, f"a {what} is longer than {_MAX_PART} characters")
    if not _PART.fullmatch(part):
        _fail(text, f"a {what} starts with a letter or digit")


def _hub_name(text: str, parts: list[str], tag: str | None) -> ModelName:
    if len(parts) != 3:
        _fail(text, "hub names are hf.co/<org>/<repo>[:QUANT]")
    quant = DEFAULT_TAG if tag is None or tag.lower() == DEFAULT_TAG else tag.upper()
    return ModelName(host=HUB_HOST, namespace=parts[1], name=parts[2], tag=quant)


def _fail(text: str, rule: str) -> NoReturn:
    raise InvalidRequest(f"invalid model name {text!r}: {rule}", param="model")
