"""The `llama3_json` format (Llama 3.x): the whole output is `[<|python_tag|>]{"name": …, "parameters": {…}}`,
several calls joined by `;`."""

from __future__ import annotations

import json

from lmserve.chat.tools.base import ParsedCall, WholeOutputFormat, call_from_object

__all__ = ["Llama3JsonParser"]


class Llama3JsonParser(WholeOutputFormat):
    """Llama 3.x JSON calls: `[<|python_tag|>]{"name": …, "parameters": {…}}[; {…}]`, nothing else around."""

    name = "llama3_json"
    start_marker = "<|python_tag|>"

    def _scan(self, text: str, final: bool) -> list[ParsedCall] | bool | None:
        t = text.lstrip()
        if t.startswith(self.start_marker):
            t = t[len(self.start_marker) :].lstrip()
        elif self.start_marker.startswith(t):
            return None if final else True
        decoder = json.JSONDecoder()
        calls: list[ParsedCall] = []
        pos, expect_object = 0, True
        while True:
            while pos < len(t) and t[pos].isspace():
                pos += 1
            if pos == len(t):
                return (calls or None) if final else True
            if not expect_object:
                if t[pos] != ";":
                    return None
                pos, expect_object = pos + 1, True
                continue
            if t[pos] != "{":
                return None
            try:
                obj, pos = decoder.raw_decode(t, pos)
            except (ValueError, RecursionError):
                return None if final else True  # maybe just incomplete
            call = call_from_object(obj)
            if call is None:
                return None
            calls.append(call)
            expect_object = False
