"""Anthropic's context editing (`context_management.edits`, beta context-management-2025-06-27), applied to a chat
request before it is rendered, and what was applied, as the response reports it (`applied_edits`).

- `clear_thinking_20251015`: the thinking of earlier assistant turns is dropped, but for the last `keep` turns that
  have thinking (`{"type": "thinking_turns", "value": N}`; `"all"` keeps everything; default: the last one).
- `clear_tool_uses_20250919`: once the prompt passes `trigger` (`{"type": "input_tokens" | "tool_uses", "value":
  N}`; default 100,000 input tokens), the results of the oldest tool uses are replaced with a placeholder, keeping
  the last `keep` (`{"type": "tool_uses", "value": N}`, default 3); tools named in `exclude_tools` are never
  cleared; `clear_tool_inputs` (true, or a list of tool names) also empties those calls' inputs; when fewer than
  `clear_at_least` (`{"type": "input_tokens", "value": N}`) tokens would be freed, nothing is cleared.
Token counts come from the served model's own tokenizer (the rendered prompt before and after).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from lmserve.dialects.anthropic import schemas as wire
from lmserve.errors import InvalidRequest
from lmserve.types import ChatRequest, Message, ToolCall

CLEARED_RESULT = "[tool result cleared to save context]"
DEFAULT_TRIGGER_TOKENS = 100_000
DEFAULT_KEEP_TOOL_USES = 3

Count = Callable[[ChatRequest], Awaitable[int]]


async def apply_edits(chat: ChatRequest, config: wire.ContextManagement | None,
                      count: Count) -> tuple[ChatRequest, list[dict[str, Any]]]:
    """`chat` with the edits of `config` applied in order, and the applied edits (those that changed something)."""
    applied: list[dict[str, Any]] = []
    for i, edit in enumerate(config.edits if config is not None else ()):
        _check(edit, f"context_management.edits[{i}]")
    size = _Sizes(count)
    for i, edit in enumerate(config.edits if config is not None else ()):
        before = chat
        if isinstance(edit, wire.ClearThinking):
            chat, report = _clear_thinking(chat, edit, f"context_management.edits[{i}]")
        else:
            chat, report = await _clear_tool_uses(chat, edit, size, f"context_management.edits[{i}]")
        if report is None:
            continue
        cleared = await size(before) - await size(chat)
        if isinstance(edit, wire.ClearToolUses) and cleared < _value(edit.clear_at_least, "input_tokens", 0):
            chat = before
            continue
        applied.append({"type": edit.type, **report, "cleared_input_tokens": max(cleared, 0)})
    return chat, applied


class _Sizes:
    """`count`, once per request (a prompt is rendered and tokenized at most once however many edits ask)."""

    def __init__(self, count: Count) -> None:
        self._count = count
        self._known: list[tuple[ChatRequest, int]] = []

    async def __call__(self, request: ChatRequest) -> int:
        for known, size in self._known:
            if known is request:
                return size
        size = await self._count(request)
        self._known.append((request, size))
        return size


def _check(edit: wire.ClearThinking | wire.ClearToolUses, where: str) -> None:
    """400 for a setting of `edit` that is not `{"type": …, "value": N}` with the type its field takes."""
    if isinstance(edit, wire.ClearThinking):
        if edit.keep != "all":
            _value(edit.keep if isinstance(edit.keep, dict) else None, "thinking_turns", 1, where=f"{where}.keep")
        return
    trigger = (edit.trigger or {}).get("type", "input_tokens")
    _value(edit.trigger, trigger if trigger == "tool_uses" else "input_tokens", 0, where=f"{where}.trigger")
    _value(edit.keep, "tool_uses", 0, where=f"{where}.keep")
    _value(edit.clear_at_least, "input_tokens", 0, where=f"{where}.clear_at_least")


def _clear_thinking(chat: ChatRequest, edit: wire.ClearThinking,
                    where: str) -> tuple[ChatRequest, dict[str, int] | None]:
    if edit.keep == "all":
        return chat, None
    keep = _value(edit.keep if isinstance(edit.keep, dict) else None, "thinking_turns", 1, where=f"{where}.keep")
    thinking = [i for i, m in enumerate(chat.messages) if m.role == "assistant" and m.thinking]
    dropped = set(thinking[:max(len(thinking) - keep, 0)])
    if not dropped:
        return chat, None
    messages = [replace(m, thinking="") if i in dropped else m for i, m in enumerate(chat.messages)]
    return replace(chat, messages=messages), {"cleared_thinking_turns": len(dropped)}


async def _clear_tool_uses(chat: ChatRequest, edit: wire.ClearToolUses, count: Count,
                           where: str) -> tuple[ChatRequest, dict[str, int] | None]:
    results = [i for i, m in enumerate(chat.messages) if m.role == "tool" and m.content != CLEARED_RESULT]
    if not await _triggered(chat, edit, len(results), count, f"{where}.trigger"):
        return chat, None
    keep = _value(edit.keep, "tool_uses", DEFAULT_KEEP_TOOL_USES, where=f"{where}.keep")
    excluded = set(edit.exclude_tools or ())
    cleared = [i for i in results[:max(len(results) - keep, 0)] if chat.messages[i].name not in excluded]
    if not cleared:
        return chat, None
    ids = {chat.messages[i].tool_call_id for i in cleared}
    messages = [replace(m, content=CLEARED_RESULT, images=[]) if i in set(cleared) else m
                for i, m in enumerate(chat.messages)]
    if edit.clear_tool_inputs:
        names = None if edit.clear_tool_inputs is True else set(edit.clear_tool_inputs)
        messages = [_without_inputs(m, ids, names) if m.role == "assistant" else m for m in messages]
    return replace(chat, messages=messages), {"cleared_tool_uses": len(cleared)}


async def _triggered(chat: ChatRequest, edit: wire.ClearToolUses, num_results: int, count: Count, where: str) -> bool:
    kind = (edit.trigger or {}).get("type", "input_tokens")
    if kind == "tool_uses":
        return num_results > _value(edit.trigger, "tool_uses", 0, where=where)
    return await count(chat) > _value(edit.trigger, "input_tokens", DEFAULT_TRIGGER_TOKENS, where=where)


def _without_inputs(message: Message, ids: set[str | None], names: set[str] | None) -> Message:
    calls = [ToolCall(c.name, "{}", c.id) if c.id in ids and (names is None or c.name in names) else c
             for c in message.tool_calls]
    return replace(message, tool_calls=calls)


def _value(setting: dict[str, Any] | None, kind: str, default: int, *, where: str = "context_management") -> int:
    """The `value` of a `{"type": kind, "value": N}` setting (`default` when absent); 400 for another shape."""
    if setting is None:
        return default
    value = setting.get("value")
    if setting.get("type") != kind or not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidRequest(f"{where}: expected {{\"type\": \"{kind}\", \"value\": <a whole number ≥ 0>}}",
                             param="context_management")
    return value
