"""The tools of a Responses request as the chat request carries them, and what `tool_choice` forces among them.

- A function tool is offered as it is.
- A namespace tool's functions are offered under their own names (what models are trained to call); a name that
  another function of the request also has is qualified as `<namespace>.<name>` instead. The namespace's
  description opens each of its functions' descriptions. A call comes back as the function's own name and its
  namespace (`ToolSet.origin`); a call sent back as input (with its `namespace`) is shown under the name it was
  offered as (`ToolSet.shown`).
- Every other type (web or file search, computer use, MCP, code interpreter, image generation, shell, apply_patch,
  custom, tool search, and types the spec does not know) either runs at OpenAI or is called in a shape lmserve does
  not make: it is left out of the prompt and listed in `ToolSet.ignored` (the route names them in the
  `x-lmserve-ignored-tools` header and a log warning) instead of failing the request.

A `tool_choice` that forces a tool lmserve does not run (`{"type": "web_search"}`, an `mcp` or `custom` choice, an
`allowed_tools` entry of such a type) is a 400 naming it; so is one that names a function the request does not offer.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

from lmserve.dialects.responses import schemas as wire
from lmserve.errors import InvalidRequest

IGNORED_TOOLS_HEADER = "x-lmserve-ignored-tools"
_HEADER_UNSAFE = re.compile(r"[^A-Za-z0-9_.:-]")
_MAX_NAMED = 16
"""The most ignored tool types the header lists (then "...")."""

Choice = Literal["none", "auto", "required"] | wire.FunctionChoice | wire.AllowedToolsChoice | wire.HostedChoice


@dataclass(slots=True)
class Function:
    """One function offered to the model: the name it sees, its own name, its namespace (None: top level)."""

    shown: str
    name: str
    namespace: str | None
    tool: wire.FunctionTool
    description: str | None

    def chat_tool(self) -> dict[str, Any]:
        """The function in the chat request's shape (`{"type": "function", "function": {…}}`)."""
        function = self.tool.model_dump(mode="json", exclude_none=True, exclude={"type"})
        function["name"] = self.shown
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(slots=True)
class ToolSet:
    """The functions a request offers (top-level and in namespaces), and the tool types it gave that were left out."""

    functions: list[Function] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)

    def shown(self, name: str, namespace: str | None) -> str:
        """The name the model sees for function `name` of `namespace` (its own name if this request offers none)."""
        for function in self.functions:
            if (function.name, function.namespace) == (name, namespace):
                return function.shown
        return name

    def origin(self, shown: str) -> tuple[str, str | None]:
        """(name, namespace) of the function the model called as `shown`; an unknown name is taken as it is, and
        `<namespace>.<name>` of an offered namespaced function is understood too."""
        for function in self.functions:
            if function.shown == shown:
                return function.name, function.namespace
        for function in self.functions:
            if function.namespace and shown == f"{function.namespace}.{function.name}":
                return function.name, function.namespace
        return shown, None


def offered_tools(tools: list[wire.Tool] | None) -> ToolSet:
    """The request's functions (namespaces expanded, each under a name no other has) and its ignored tool types."""
    offered = ToolSet()
    taken = Counter(_function_names(tools or []))
    for tool in tools or []:
        if isinstance(tool, wire.FunctionTool):
            offered.functions.append(Function(tool.name, tool.name, None, tool, tool.description))
        elif isinstance(tool, wire.NamespaceTool):
            _expand(tool, taken, offered)
        else:
            offered.ignored.append(tool.type)
    shown = Counter(function.shown for function in offered.functions)
    twice = [name for name, count in shown.items() if count > 1]
    if twice:
        raise InvalidRequest(f"tools: more than one function is named '{twice[0][:100]}'", param="tools")
    return offered


def _function_names(tools: list[wire.Tool]) -> list[str]:
    names: list[str] = []
    for tool in tools:
        if isinstance(tool, wire.FunctionTool):
            names.append(tool.name)
        elif isinstance(tool, wire.NamespaceTool):
            names += [inner.name for inner in tool.tools if isinstance(inner, wire.FunctionTool)]
    return names


def _expand(namespace: wire.NamespaceTool, taken: Counter[str], offered: ToolSet) -> None:
    for inner in namespace.tools:
        if not isinstance(inner, wire.FunctionTool):
            offered.ignored.append(inner.type)
            continue
        shown = inner.name if taken[inner.name] == 1 else f"{namespace.name}.{inner.name}"
        description = "\n\n".join(text for text in (namespace.description, inner.description) if text)
        offered.functions.append(Function(shown, inner.name, namespace.name, inner, description or None))


def ignored_header(ignored: list[str]) -> dict[str, str]:
    """The `x-lmserve-ignored-tools` header naming the ignored tool types (each once, in order), or no header."""
    if not ignored:
        return {}
    names = list(dict.fromkeys(_HEADER_UNSAFE.sub("_", kind[:64]) for kind in ignored))
    shown = names[:_MAX_NAMED] + (["..."] if len(names) > _MAX_NAMED else [])
    return {IGNORED_TOOLS_HEADER: ", ".join(shown)}


def chat_tools(offered: ToolSet, choice: Choice | None) -> tuple[list[dict[str, Any]], str | None]:
    """The tools as the chat request carries them (OpenAI chat shape), and the forced one ("*": any, or the name
    the model sees)."""
    if isinstance(choice, wire.HostedChoice):
        raise InvalidRequest(f"tool_choice forces {_hosted(choice.type, choice.model_extra)}", param="tool_choice")
    if not offered.functions or choice == "none":
        if choice not in (None, "auto", "none"):
            raise InvalidRequest("tool_choice requires tools" + _served_note(offered), param="tool_choice")
        return [], None
    if choice in (None, "auto"):
        return [function.chat_tool() for function in offered.functions], None
    if choice == "required":
        return [function.chat_tool() for function in offered.functions], "*"
    if isinstance(choice, wire.FunctionChoice):
        forced = _named(offered, choice.name, choice.namespace, "tool_choice")
        return [function.chat_tool() for function in offered.functions], forced.shown
    assert isinstance(choice, wire.AllowedToolsChoice)
    allowed = _allowed(offered, choice)
    if not allowed and choice.mode == "required":
        raise InvalidRequest("tool_choice requires one of no tools: allowed_tools is empty", param="tool_choice")
    return [function.chat_tool() for function in allowed], "*" if choice.mode == "required" else None


def _allowed(offered: ToolSet, choice: wire.AllowedToolsChoice) -> list[Function]:
    """The offered functions that `allowed_tools` names (each `{"type": "function", "name": …}`), in offer order."""
    named: list[Function] = []
    for index, entry in enumerate(choice.tools):
        where = f"tool_choice.tools[{index}]"
        kind = entry.get("type")
        if kind != "function":
            extra = {key: value for key, value in entry.items() if key != "type"}
            raise InvalidRequest(f"{where} allows {_hosted(str(kind)[:64], extra)}", param="tool_choice")
        name, namespace = entry.get("name"), entry.get("namespace")
        if not isinstance(name, str) or not (namespace is None or isinstance(namespace, str)):
            raise InvalidRequest(f"{where} needs the function's name (a string)", param="tool_choice")
        named.append(_named(offered, name, namespace, where))
    return [function for function in offered.functions if any(function is other for other in named)]


def _named(offered: ToolSet, name: str, namespace: str | None, where: str) -> Function:
    """The offered function `name` of `namespace`; without a namespace, the one shown as `name`, or else the one
    namespaced function of that name."""
    functions = offered.functions
    if namespace is None:
        found = [f for f in functions if f.shown == name] or [f for f in functions if f.name == name]
    else:
        found = [f for f in functions if (f.name, f.namespace) == (name, namespace)]
    if not found:
        label = f"'{namespace[:100]}.{name[:100]}'" if namespace else f"'{name[:100]}'"
        raise InvalidRequest(f"{where} names {label}, which is not among the tools", param="tool_choice")
    if len(found) > 1:
        spaces = ", ".join(f"'{function.namespace}'" for function in found if function.namespace)
        raise InvalidRequest(f"{where} names '{name[:100]}', a function of more than one namespace ({spaces}): add "
                             "its `namespace`", param="tool_choice")
    return found[0]


def _hosted(kind: str, extra: dict[str, Any] | None) -> str:
    """"a 'web_search' tool, which lmserve does not run …" (with the MCP server's label or the tool's name)."""
    extra = extra or {}
    label = extra.get("server_label") or extra.get("name")
    which = f"'{kind[:64]}' tool" + (f" '{str(label)[:100]}'" if label else "")
    return (f"a {which}, which lmserve does not run: it serves function tools and the functions of namespace "
            "tools only")


def _served_note(offered: ToolSet) -> str:
    if not offered.ignored:
        return ""
    kinds = ", ".join(dict.fromkeys(kind[:64] for kind in offered.ignored))
    return f" that lmserve runs (left out: {kinds})"
