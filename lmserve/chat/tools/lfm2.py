"""The `lfm2` format (LFM2, LFM2.5): `<|tool_call_start|>[f(a=1), g(b="x")]<|tool_call_end|>`, or the markers
around a JSON list `[{"name": …, "arguments": {…}}]`. An echo of the call body after the end marker is dropped.

LFM2.5's quirks are read too: Python literals (`True`, `False`, `None`) and single-quoted strings, dotted function
names (`a.b.c(x=1)` calls `a.b.c`), and calls without the start marker: a bare `[f(a=1)]` as the whole output
(a stray end marker after it is dropped).
"""

from __future__ import annotations

import json

from lmserve.chat.tools.base import BlockFormat, ParsedCall, calls_from_json
from lmserve.chat.tools.pythonic import call_list_head_viable, parse_call_list

__all__ = ["Lfm2Parser"]

_END = "<|tool_call_end|>"


def _match_skipping_space(form: str, text: str) -> int | None:
    """Matches `text` against `form`, whitespace ignored on both sides: the length of `text` that spells all of
    `form`; None when `text` ends while still matching; -1 on a mismatch."""
    f = t = 0
    while True:
        while f < len(form) and form[f].isspace():
            f += 1
        if f == len(form):
            return t
        while t < len(text) and text[t].isspace():
            t += 1
        if t == len(text):
            return None
        if form[f] != text[t]:
            return -1
        f += 1
        t += 1


class Lfm2Parser(BlockFormat):
    """LFM2/LFM2.5: a Pythonic or JSON list between `<|tool_call_start|>` and `<|tool_call_end|>`."""

    name = "lfm2"
    start_marker = "<|tool_call_start|>"
    end_marker = _END

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        """A bare call list as the whole output, or else call blocks between the markers with content around."""
        calls = self.bare(text, True)
        return ("", calls) if isinstance(calls, list) else super().parse(text)

    def parse_block(self, body: str) -> list[ParsedCall] | None:
        stripped = body.strip()
        if stripped.startswith(("{", "[{")):
            try:
                return calls_from_json(json.loads(stripped))
            except (ValueError, RecursionError):
                pass  # maybe Python-style dicts: the literal reader below takes them
        return parse_call_list(stripped, lenient=True, dotted=True)

    def bare(self, text: str, final: bool) -> list[ParsedCall] | bool | None:
        """The whole output as a bare `[f(a=1), g.h(b='x')]` (maybe with a stray end marker after it)."""
        t = text.strip()
        if not final:
            return True if call_list_head_viable(text.lstrip(), dotted=True) else None
        if t.endswith(_END):
            t = t[: -len(_END)].rstrip()
        if not t.startswith("["):
            return None
        return parse_call_list(t, lenient=False, dotted=True)

    def echo_length(self, body: str, text: str, final: bool) -> int | None:
        form = body.strip()
        forms = [form, form[1:-1].strip()] if form.startswith("[") and form.endswith("]") else [form]
        partial = False
        for candidate in filter(None, forms):
            n = _match_skipping_space(candidate, text)
            if n is None:
                partial = True
            elif n > 0:
                return n
        if partial:  # the output ended inside an echo (or in whitespace after the block): drop it
            return len(text) if final else None
        return 0
