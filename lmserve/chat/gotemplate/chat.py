"""Ollama's chat data model: a conversation turned into a Go template's `.Messages`, `.Tools`, `.System`,
`.Prompt` and `.Response`, and `GoChatTemplate`, which renders it."""

from __future__ import annotations

import json
from typing import Any

from lmserve.chat.gotemplate.functions import wrap
from lmserve.chat.gotemplate.template import GoTemplate
from lmserve.types import Message, ToolCall


def _tool_call(call: ToolCall) -> Any:
    try:
        arguments = json.loads(call.arguments) if call.arguments.strip() else {}
    except ValueError:
        arguments = call.arguments
    return wrap({**({"id": call.id} if call.id else {}), "function": {"name": call.name, "arguments": arguments}})


def _collate(messages: list[Message]) -> tuple[str, list[dict[str, Any]]]:
    """Ollama's collate: all system texts joined, and consecutive same-role messages (not tool) merged."""
    systems: list[str] = []
    turns: list[dict[str, Any]] = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        calls = [_tool_call(c) for c in m.tool_calls]
        if role == "system":
            systems.append(m.content)
        if turns and turns[-1]["Role"] == role and role != "tool":
            turns[-1]["Content"] += "\n\n" + m.content
            turns[-1]["ToolCalls"].extend(calls)
        else:
            turn = {"Role": role, "Content": m.content, "Thinking": m.thinking, "ToolCalls": calls,
                    "ToolName": m.name or ""}
            turns.append({**turn, "ToolCallID": m.tool_call_id or ""})
    return "\n\n".join(systems), turns


def _render_turns(template: GoTemplate, turns: list[dict[str, Any]]) -> str:
    """Ollama's legacy mode: one execution per exchange; the last one stops after the `.Response` action."""
    parts: list[str] = []
    values = {"System": "", "Prompt": "", "Response": "", "Suffix": ""}
    for turn in turns:
        role = turn["Role"]
        if (role == "system" and (values["Prompt"] or values["Response"])) or (role == "user" and values["Response"]):
            parts.append(template.execute(values))
            values = dict.fromkeys(values, "")
        if key := {"system": "System", "user": "Prompt", "assistant": "Response"}.get(role):
            values[key] = turn["Content"]
    return "".join(parts) + template._run(template._last_turn, values)


def render_chat(
    template: GoTemplate,
    messages: list[Message],
    *,
    system: str | None,
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool = True,
    think: bool | str | None = None,
) -> str:
    """Render chat messages through a Modelfile TEMPLATE with Ollama's data model.

    `system` (the Modelfile SYSTEM) is used only when no message is a system message. A template that reads
    `.Messages` is executed once with `.System` (all system texts), `.Prompt` (last user text), `.Response`/`.Suffix`
    (""), `.Messages` (`Role`, `Content`, `Thinking`, `ToolCalls` [{`Function`: {`Name`, `Arguments` map}}],
    `ToolName`, `ToolCallID`), `.Tools` (the request's tools; `.Function.Name` and `.function.name` both work; a tool
    prints as JSON), `.AddGenerationPrompt`, and the request's `think` as `.Think` (on), `.ThinkLevel` (its effort,
    or "") and `.IsThinkSet`. Any other template is executed per exchange as Ollama does (`.System`,
    `.Prompt`, and the assistant's reply as `.Response`), the last time only up to `.Response`, so it always ends
    ready for the assistant: `add_generation_prompt` cannot change that.
    """
    if system and not any(m.role in ("system", "developer") for m in messages):
        messages = [Message(role="system", content=system), *messages]
    system_text, turns = _collate(messages)
    if not template.uses_messages:
        return _render_turns(template, turns)
    prompt = next((t["Content"] for t in reversed(turns) if t["Role"] == "user"), "")
    return template.execute({
        "System": system_text, "Prompt": prompt, "Response": "", "Suffix": "", "Messages": turns,
        "Tools": wrap(list(tools or [])), "AddGenerationPrompt": add_generation_prompt,
        "Think": think is not None and think is not False, "ThinkLevel": think if isinstance(think, str) else "",
        "IsThinkSet": think is not None,
    })  # fmt: skip


class GoChatTemplate:
    """A Modelfile TEMPLATE as a chat prompter: `render(messages, tools=…, add_generation_prompt=…)`."""

    def __init__(self, source: str, *, system: str | None = None) -> None:
        self.template = GoTemplate(source)
        self.system = system

    def render(
        self, messages: list[Message], *, tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
        think: bool | str | None = None,
    ) -> str:
        return render_chat(self.template, messages, system=self.system, tools=tools,
                           add_generation_prompt=add_generation_prompt, think=think)
