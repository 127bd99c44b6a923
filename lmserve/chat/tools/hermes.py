"""The `hermes` format (Hermes, Qwen): `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, one block per call."""

from __future__ import annotations

import json

from lmserve.chat.tools.base import BlockFormat, ParsedCall, calls_from_json

__all__ = ["HermesParser"]


class HermesParser(BlockFormat):
    """Hermes/Qwen: `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, one block per call."""

    name = "hermes"
    start_marker = "<tool_call>"
    end_marker = "</tool_call>"

    def parse_block(self, body: str) -> list[ParsedCall] | None:
        try:
            return calls_from_json(json.loads(body))
        except (ValueError, RecursionError):
            return None
