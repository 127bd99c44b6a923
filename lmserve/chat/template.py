"""Messages → prompt text, through the model's own Jinja2 chat template in a sandbox.

A GGUF's `tokenizer.chat_template` is untrusted input: it is compiled once, in jinja2's immutable sandbox, with
the globals and filters Hugging Face transformers gives templates (`raise_exception`, `strftime_now`, `tojson`),
so that templates written for `apply_chat_template` render the same here. Every failure, at compile time or at
render time, surfaces as `InvalidRequest`; no other exception leaves this module.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, NoReturn

from jinja2 import TemplateError, Undefined, nodes
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from lmserve.errors import InvalidRequest, LmserveError, TemplateRejected
from lmserve.types import Message, ToolCall

__all__ = ["CHATML_TEMPLATE", "ChatTemplate"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""The fallback used when a model ships no chat template: plain ChatML."""

# LFM2/LFM2.5 templates (recognised by this text, as llama.cpp does) ignore `tool_calls`: when a template with this
# marker never reads them, a past assistant call is folded into its content as `<|tool_call_start|>[f(x=1)]…`.
_LFM2_MARKER = "List of tools:"


class _GenerationTag(Extension):
    """Accepts HF's `{% generation %}…{% endgeneration %}` (assistant-mask markers) and renders the body as is."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it a plain set attribute)

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return list(parser.parse_statements(("name:endgeneration",), drop_needle=True))


class _Sandbox(ImmutableSandboxedEnvironment):
    """HF's sandbox, but an unsafe attribute fails at once instead of rendering as a silent empty Undefined."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


def _raise_exception(message: str) -> NoReturn:
    raise TemplateRejected(f"the chat template rejected the messages: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    """Like transformers' `tojson`: no HTML escaping, non-ASCII kept, `indent` honoured."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _py_literal(value: Any) -> str:
    """Python literal syntax for a JSON value, as LFM2 writes call arguments (`city="Paris"`, `n=3`, `on=True`)."""
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_py_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_py_literal(k)}: {_py_literal(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def _parse_arguments(text: str) -> Any:
    """Arguments as an object when they are a JSON object (HF templates index them), else the text unchanged."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _lfm2_tool_calls_text(calls: list[ToolCall]) -> str:
    parts = []
    for call in calls:
        args = _parse_arguments(call.arguments)
        if isinstance(args, dict):
            parts.append(f"{call.name}(" + ", ".join(f"{k}={_py_literal(v)}" for k, v in args.items()) + ")")
        else:
            parts.append(json.dumps({"name": call.name, "arguments": args}, ensure_ascii=False))
    return "<|tool_call_start|>[" + ", ".join(parts) + "]<|tool_call_end|>"


def thinking_variables(think: bool | str | None) -> dict[str, Any]:
    """The chat-template variables that switch thinking on or off: `enable_thinking` (Qwen3), `think`, and
    `reasoning_effort` for an effort level; none when the request leaves it to the model (`think` None)."""
    if think is None:
        return {}
    if think is False:
        return {"enable_thinking": False, "think": False}
    variables: dict[str, Any] = {"enable_thinking": True, "think": True}
    if isinstance(think, str):
        variables["reasoning_effort"] = think
    return variables


class ChatTemplate:
    """A compiled chat template; `render()` turns messages (and tools) into the prompt text.

    `source` is the Jinja2 text from GGUF metadata (`tokenizer.chat_template`); `None` selects the ChatML fallback.
    A template that does not compile raises `InvalidRequest` here, once, rather than on every request.
    """

    __slots__ = ("_bos_token", "_eos_token", "_folds_tool_calls", "_is_fallback", "_template")

    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = "") -> None:
        self._is_fallback = source is None
        text = CHATML_TEMPLATE if source is None else source
        self._bos_token = bos_token
        self._eos_token = eos_token
        self._folds_tool_calls = _LFM2_MARKER in text and "tool_calls" not in text
        env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag])
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(text)
        except TemplateError as exc:
            line = getattr(exc, "lineno", None)
            where = f" (line {line})" if line else ""
            raise InvalidRequest(f"the model's chat template is invalid{where}: {exc}") from exc
        except Exception as exc:  # e.g. RecursionError on absurd nesting: still the template's fault
            raise InvalidRequest(f"the model's chat template is invalid: {type(exc).__name__}: {exc}") from exc

    @property
    def is_fallback(self) -> bool:
        """True when the model had no template and ChatML is used instead."""
        return self._is_fallback

    def render(
        self, messages: list[Message], *, tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
        think: bool | str | None = None,
    ) -> str:
        """Render the prompt. An empty `tools` list is passed as `None` (templates test `tools is not none`).
        `think` sets the variables that switch thinking (`thinking_variables`)."""
        context = {
            **thinking_variables(think),
            "messages": [self._message_dict(m) for m in messages],
            "tools": tools or None,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self._bos_token,
            "eos_token": self._eos_token,
        }
        try:
            return self._template.render(context)
        except LmserveError:
            raise
        except SecurityError as exc:
            raise InvalidRequest(f"the model's chat template attempted an unsafe operation: {exc}") from exc
        except TemplateError as exc:
            raise TemplateRejected(f"the model's chat template failed to render: {exc}") from exc
        except Exception as exc:
            raise TemplateRejected(f"the model's chat template failed to render: {type(exc).__name__}: {exc}") from exc

    def _message_dict(self, message: Message) -> dict[str, Any]:
        """One message in the shape HF templates expect (OpenAI-style tool calls with parsed arguments)."""
        content = message.content or ""
        out: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role}
        if message.tool_calls:
            out["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": _parse_arguments(call.arguments)},
                }
                for call in message.tool_calls
            ]
            if self._folds_tool_calls:
                content = _lfm2_tool_calls_text(message.tool_calls) + content
        out["content"] = content
        if message.thinking:
            out["reasoning_content"] = message.thinking
        if message.tool_call_id is not None:
            out["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            out["name"] = message.name
        return out
