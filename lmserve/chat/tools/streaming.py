"""Tool calls while the output streams: the same result as `parse()` for any split of the text into deltas."""

from __future__ import annotations

from lmserve.chat.tools.base import ParsedCall, ToolCallParser

__all__ = ["StreamingToolParser"]

_TEXT, _BLOCK, _ECHO = 0, 1, 2


def _marker_prefix_len(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class StreamingToolParser:
    """Feeds output deltas through a parser; for any split, the results add up to `parser.parse(whole)`.

    Content before a call block streams out at once; text that could be the start of a marker is held back until
    decided; a block is held until its end marker, then becomes calls or, when malformed, content again.
    """

    __slots__ = ("_bare", "_body", "_buf", "_parser", "_passthrough", "_state")

    def __init__(self, parser: ToolCallParser) -> None:
        self._parser = parser
        self._buf = ""
        self._state = _TEXT
        self._body = ""
        self._passthrough = False
        self._bare = True
        """A block format's output may still be a bare call list (held back until decided)."""

    def push(self, delta: str) -> tuple[str, list[ParsedCall]]:
        """Content safe to show now, and the calls completed by this delta."""
        if self._parser.end_marker is not None:
            self._buf += delta
            if self._bare:
                if self._parser.bare(self._buf, False) is not None:
                    return "", []
                self._bare = False
            return self._drain(final=False)
        if self._passthrough:
            return delta, []
        before = self._buf.rstrip()
        self._buf += delta
        # `viable` may scan the whole buffer: ask again only where its answer can have changed.
        if len(self._buf) > 256 and not any(c in delta for c in "};]") and not before.endswith(("}", ";", "]")):
            return "", []
        if self._parser.viable(self._buf):
            return "", []
        self._passthrough = True
        out, self._buf = self._buf, ""
        return out, []

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """At the end of the output: the held-back content and the calls of a last complete block."""
        if self._parser.end_marker is not None:
            if self._bare:
                self._bare = False
                calls = self._parser.bare(self._buf, True)
                if isinstance(calls, list):
                    self._buf = ""
                    return "", calls
            return self._drain(final=True)
        out, self._buf = self._buf, ""
        if self._passthrough:
            return out, []
        self._passthrough = True
        return self._parser.parse(out)

    def _drain(self, *, final: bool) -> tuple[str, list[ParsedCall]]:
        start, end = self._parser.start_marker, self._parser.end_marker
        assert end is not None
        out: list[str] = []
        calls: list[ParsedCall] = []
        while True:
            if self._state == _TEXT:
                i = self._buf.find(start)
                if i < 0:
                    cut = len(self._buf) - (0 if final else _marker_prefix_len(self._buf, start))
                    out.append(self._buf[:cut])
                    self._buf = self._buf[cut:]
                    break
                out.append(self._buf[:i])
                self._buf = self._buf[i + len(start) :]
                self._state = _BLOCK
            elif self._state == _BLOCK:
                j = self._buf.find(end)
                if j < 0:
                    if final:  # unterminated: content
                        out.append(start + self._buf)
                        self._buf, self._state = "", _TEXT
                    break
                body, self._buf = self._buf[:j], self._buf[j + len(end) :]
                got = self._parser.parse_block(body)
                if got is None:
                    out.append(start + body + end)
                    self._state = _TEXT
                else:
                    calls.extend(got)
                    self._body, self._state = body, _ECHO
            else:
                n = self._parser.echo_length(self._body, self._buf, final)
                if n is None:
                    break
                self._buf, self._state = self._buf[n:], _TEXT
        return "".join(out), calls
