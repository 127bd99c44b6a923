"""The shape of the first `POST /v1/responses` the Codex CLI (0.171.0, `codex exec`, a custom provider with
`wire_api = "responses"`) sends, cut down: developer messages of input_text parts, function tools, a `namespace`
tool of function tools (`multi_agent_v1`), a `web_search` tool, `include: ["reasoning.encrypted_content"]`,
`store: false`, `stream: true`, `reasoning: {"summary": "auto"}`, `prompt_cache_key` and `client_metadata`."""

from __future__ import annotations

from typing import Any

EXEC_COMMAND: dict[str, Any] = {
    "type": "function",
    "name": "exec_command",
    "description": "Runs a command in a PTY, returning output or a session ID for ongoing interaction.",
    "strict": False,
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string", "description": "Shell command."}},
                   "required": ["cmd"], "additionalProperties": False},
}
SPAWN_AGENT: dict[str, Any] = {
    "type": "function",
    "name": "spawn_agent",
    "description": "Spawn a sub-agent for a well-scoped task.",
    "strict": False,
    "parameters": {"type": "object", "properties": {"message": {"type": "string"}}, "required": ["message"],
                   "additionalProperties": False},
}
CLOSE_AGENT: dict[str, Any] = {
    "type": "function",
    "name": "close_agent",
    "description": "Close an agent when it is no longer needed.",
    "strict": False,
    "parameters": {"type": "object", "properties": {"target": {"type": "string"}}, "required": ["target"],
                   "additionalProperties": False},
}
MULTI_AGENT: dict[str, Any] = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Tools for spawning and managing sub-agents.",
    "tools": [SPAWN_AGENT, CLOSE_AGENT],
}
WEB_SEARCH: dict[str, Any] = {"type": "web_search", "external_web_access": False}


def developer(*texts: str) -> dict[str, Any]:
    return {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": t} for t in texts]}


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def codex_request(model: str, prompt: str = "hi") -> dict[str, Any]:
    """A Codex-shaped request body for `model` whose user turn is `prompt`."""
    return {
        "model": model,
        "stream": True,
        "input": [
            developer("You are a coding agent running in the Codex CLI. Be concise."),
            developer("<permissions instructions>sandbox_mode is read-only.</permissions instructions>"),
            user("<environment_context>\n  <cwd>/tmp/work</cwd>\n  <shell>bash</shell>\n</environment_context>"),
            user(prompt),
        ],
        "tools": [EXEC_COMMAND, MULTI_AGENT, WEB_SEARCH],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "01a217b2-b21e-7891-baec-b5ee0cec9c27",
        "client_metadata": {"session_id": "01a217b2-b21e-7891-baec-b5ee0cec9c27", "turn_id": "01a217b2"},
    }
