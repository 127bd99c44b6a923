"""What every tool-call format shares: the call record, the parser protocol, JSON call objects, and the drivers
for the two kinds of format (call blocks between markers; the whole output as the call)."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "BlockFormat",
    "ParsedCall",
    "ToolCallParser",
    "WholeOutputFormat",
    "call_from_object",
    "calls_from_json",
    "make_call",
]


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(slots=True)
class ParsedCall:
    """One call found in the output; `arguments` is the compact JSON text of an object."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)


class ToolCallParser(Protocol):
    """A tool-call format. Beyond `parse()`, the members below let `StreamingToolParser` drive any format."""

    name: str
    start_marker: str
    """Text that starts a call block (for a whole-output format: what the output starts with)."""

    @property
    def end_marker(self) -> str | None:
        """Text that ends a call block; None when the whole output is the call."""

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        """The whole output → (content outside the calls, calls). A malformed block stays in the content."""

    def parse_block(self, body: str) -> list[ParsedCall] | None:
        """The text between the markers → its calls, or None when it is malformed (or holds no call)."""

    def echo_length(self, body: str, text: str, final: bool) -> int | None:
        """How much of `text` (what follows a parsed block) repeats the block's `body` and is dropped.

        0 when it is no echo; None when `text` may still grow into one (only when not `final`). The answer for a
        prefix of `text` is never contradicted by a longer `text`.
        """

    def viable(self, text: str) -> bool:
        """Whole-output formats: False once `text` (a prefix of the output) certainly is not a call."""

    def bare(self, text: str, final: bool) -> list[ParsedCall] | bool | None:
        """Block formats whose model may also write its calls without the markers, as the whole output (LFM2.5:
        a bare `[f(a=1)]`): what `text` is, as `WholeOutputFormat._scan` says; None when the format has no bare
        form. A None for a prefix is never contradicted by a longer `text`."""


def make_call(name: Any, args: Any) -> ParsedCall | None:
    """A call from a name and an arguments object (or the JSON text of one); None when either is unusable."""
    if not isinstance(name, str) or not name.strip():
        return None
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None
    try:
        text = json.dumps(args, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None
    return ParsedCall(name.strip(), text)


def call_from_object(obj: Any) -> ParsedCall | None:
    """`{"name", "arguments"|"parameters"}`, or OpenAI's `{"type": "function", "function": {…}}`."""
    if not isinstance(obj, dict):
        return None
    if "name" not in obj and isinstance(obj.get("function"), dict):
        obj = obj["function"]
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters")
    return make_call(obj.get("name"), args)


def calls_from_json(value: Any) -> list[ParsedCall] | None:
    items = value if isinstance(value, list) else [value]
    calls = [call_from_object(item) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


class BlockFormat:
    """A format of call blocks between `start_marker` and `end_marker`, with content around them."""

    name: str = ""
    start_marker: str = ""
    end_marker: str | None = ""

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        """Every `start…end` block is parsed; text around the blocks is content; an echo after a block is dropped."""
        start, end = self.start_marker, self.end_marker
        assert end is not None
        content: list[str] = []
        calls: list[ParsedCall] = []
        pos = 0
        while (i := text.find(start, pos)) >= 0:
            content.append(text[pos:i])
            j = text.find(end, i + len(start))
            if j < 0:  # unterminated: content
                pos = i
                break
            body = text[i + len(start) : j]
            pos = j + len(end)
            got = self.parse_block(body)
            if got is None:
                content.append(text[i:pos])
                continue
            calls.extend(got)
            pos += self.echo_length(body, text[pos:], True) or 0
        content.append(text[pos:])
        return "".join(content), calls

    def parse_block(self, body: str) -> list[ParsedCall] | None:
        raise NotImplementedError

    def echo_length(self, body: str, text: str, final: bool) -> int | None:
        return 0

    def viable(self, text: str) -> bool:
        return True

    def bare(self, text: str, final: bool) -> list[ParsedCall] | bool | None:
        return None


class WholeOutputFormat:
    """A format where the whole output is the call, or else all content.

    `_scan(text, final)` says what `text` is: its calls (a list), certainly no call (None), or, while not `final`,
    not yet known (True).
    """

    name: str = ""
    start_marker: str = ""
    end_marker: str | None = None

    def _scan(self, text: str, final: bool) -> list[ParsedCall] | bool | None:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        calls = self._scan(text, True)
        return ("", calls) if isinstance(calls, list) else (text, [])

    def parse_block(self, body: str) -> list[ParsedCall] | None:
        calls = self._scan(body, True)
        return calls if isinstance(calls, list) else None

    def echo_length(self, body: str, text: str, final: bool) -> int | None:
        return 0

    def viable(self, text: str) -> bool:
        return self._scan(text, False) is not None

    def bare(self, text: str, final: bool) -> list[ParsedCall] | bool | None:
        return None
