"""Tool calls in a model's output text → structured calls, whole or while streaming.

One parser per output format, in a registry by name (`--tool-call-parser NAME`; otherwise `detect_parser()` reads
the chat template):

    lfm2         `<|tool_call_start|>[f(a=1), g(b="x")]<|tool_call_end|>` (Pythonic) or the same markers around a
                 JSON list `[{"name": …, "arguments": {…}}]`; an echo of the call body after the end marker is dropped;
                 LFM2.5's quirks: a bare `[f(a=1)]` as the whole output, dotted names `a.b(x=1)`, Python literals
    hermes       `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, one block per call (Qwen, Hermes)
    llama3_json  the whole output is `[<|python_tag|>]{"name": …, "parameters": {…}}`, several joined by `;`
    pythonic     the whole output is a bare list `[f(a=1), g(b="x")]`
    json         lmserve's own, for models that know no format (FALLBACK_PARSER): the whole output is a JSON list
                 `[{"name": …, "arguments": {…}}]` (or one such object); the service teaches it in the system prompt
                 (`tools_prompt`) when the model's template does not render tools, and forces it with a grammar

Pythonic calls are read with `ast` as literals only (never evaluated): a call is a plain name with keyword arguments
whose values are literals. Anything malformed stays in the content, as the model wrote it; no parser raises.
`StreamingToolParser` gives the same result as `parse()` for any split of the text into deltas, and never shows
text that could still turn into a call: a possible start of a marker is held back until it is decided.
"""

from __future__ import annotations

from lmserve.chat.tools.base import ParsedCall, ToolCallParser
from lmserve.chat.tools.hermes import HermesParser
from lmserve.chat.tools.json_calls import JsonCallsParser, tools_prompt
from lmserve.chat.tools.lfm2 import Lfm2Parser
from lmserve.chat.tools.llama3_json import Llama3JsonParser
from lmserve.chat.tools.pythonic import PythonicParser
from lmserve.chat.tools.streaming import StreamingToolParser
from lmserve.errors import InvalidRequest

__all__ = [
    "FALLBACK_PARSER",
    "PARSERS",
    "HermesParser",
    "JsonCallsParser",
    "Lfm2Parser",
    "Llama3JsonParser",
    "ParsedCall",
    "PythonicParser",
    "StreamingToolParser",
    "ToolCallParser",
    "detect_parser",
    "get_parser",
    "tools_prompt",
]


PARSERS: dict[str, type[ToolCallParser]] = {
    "lfm2": Lfm2Parser,
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "pythonic": PythonicParser,
    "json": JsonCallsParser,
}

FALLBACK_PARSER = "json"
"""The format of a model whose template names none (`detect_parser` None): lmserve's own JSON calls."""


def get_parser(name: str) -> ToolCallParser:
    """The parser registered under `name`; `InvalidRequest` naming the valid ones otherwise."""
    try:
        return PARSERS[name]()
    except KeyError:
        valid = ", ".join(sorted(PARSERS))
        raise InvalidRequest(
            f"unknown tool-call parser {name!r}; valid parsers: {valid}", param="tool_call_parser"
        ) from None


def detect_parser(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches its model, from tell-tale text in it; None when unknown."""
    if not chat_template:
        return None
    t = chat_template
    if "<|tool_call_start|>" in t or "List of tools" in t:
        return "lfm2"
    if "<tool_call>" in t:
        return "hermes"
    if "[func_name1(" in t:  # Llama 3.2/4 "pythonic" templates
        return "pythonic"
    if "<|python_tag|>" in t or ("ipython" in t and "<|start_header_id|>" in t):
        return "llama3_json"
    return None
