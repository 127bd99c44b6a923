"""Native requests as the service's records: keep_alive, options, format as a grammar, think and the reasoning options,
messages with their base64 images."""

from __future__ import annotations

import json
from typing import Any

from lmserve import options as opts
from lmserve.chat.audio import decode_base64 as decode_audio
from lmserve.chat.audio import is_audio, is_audio_base64
from lmserve.chat.media import MediaPolicy, decode_base64
from lmserve.chat.structured import json_object_grammar, schema_grammar
from lmserve.dialects.native import schemas as wire
from lmserve.errors import InvalidRequest
from lmserve.parsing import ParseError, chat_role, parse_duration
from lmserve.types import (
    EFFORTS,
    Message,
    RequestOptions,
    SamplingParams,
    ToolCall,
)

# ---- requests → records ---------------------------------------------------------------------------


def parse_keep_alive(value: wire.KeepAlive) -> float | None:
    """Seconds from "5m", "1h30m", "300", 300 or -1 (negative: forever); None when not given."""
    if value is None or value == "":
        return None
    try:
        return parse_duration(value)
    except ParseError:
        raise InvalidRequest(f"keep_alive {value!r} is not a duration like '5m' or '1h30m' or a number of seconds",
                             param="keep_alive") from None


def to_options(options: wire.Options | None) -> RequestOptions:
    """The request's `options` (lmserve/options.py checks them), sampling and load-time, over the native routes'
    server defaults (the service puts them over the model's)."""
    return RequestOptions(opts.from_native(options), "native")


def to_sampling_params(format: str | dict[str, Any] | None, logprobs: int | None) -> SamplingParams:
    """What the request asks beyond its options: `format` → grammar, and the log-probabilities."""
    return SamplingParams(grammar=format_grammar(format), logprobs=logprobs)


def format_grammar(format: str | dict[str, Any] | None) -> str | None:
    """The grammar enforcing a request's `format`: "json" (any JSON object) or a JSON schema."""
    if format is None or format == "":
        return None
    if format == "json":
        return json_object_grammar()
    if isinstance(format, dict):
        return schema_grammar(format, param="format")
    raise InvalidRequest(f"format {format!r} is not supported: use \"json\" or a JSON schema", param="format")


def to_think(think: bool | str | None) -> bool | str | None:
    """`think`: true/false, or an effort "low" | "medium" | "high" (on); None leaves it to the model."""
    if think is None or isinstance(think, bool):
        return think
    level = think.strip().lower()
    if level in ("true", "false"):
        return level == "true"
    if level not in ("low", "medium", "high"):
        raise InvalidRequest(f"think {think!r} is not true, false, \"low\", \"medium\" or \"high\"", param="think")
    return level


def split_reasoning(options: wire.Options | None, think: bool | str | None
                    ) -> tuple[wire.Options | None, int | None, bool | str | None]:
    """The request's `options` without the two reasoning options the local runner's clients put there, and what
    they ask: `reasoning_budget` (most thinking tokens, lmserve's own) and `reasoning_effort` (Open WebUI's
    "Reasoning Effort", an OpenAI effort name read as `think` where the request's own `think` is absent)."""
    if not options:
        return options, None, think
    rest = {name: value for name, value in options.items() if name not in ("reasoning_budget", "reasoning_effort")}
    budget = options.get("reasoning_budget")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
        raise InvalidRequest("option 'reasoning_budget' must be a whole number of tokens, 0 or more",
                             param="reasoning_budget")
    effort = options.get("reasoning_effort")
    if effort is not None and not (isinstance(effort, str) and effort.strip().lower() in EFFORTS):
        raise InvalidRequest(f"option 'reasoning_effort' must be one of {', '.join(EFFORTS)}",
                             param="reasoning_effort")
    if think is None and isinstance(effort, str):
        think = EFFORTS[effort.strip().lower()]
    return rest, budget, think


def to_messages(messages: list[wire.ChatMessage], media: MediaPolicy | None = None) -> list[Message]:
    """The engine-neutral messages; their base64 `images` are decoded and checked under `media`."""
    policy = media or MediaPolicy()
    out = []
    for i, m in enumerate(messages):
        calls = [ToolCall(c.function.name, json.dumps(c.function.arguments)) for c in m.tool_calls or ()]
        sent = [decode_image(img, f"messages[{i}].images[{j}]", policy) for j, img in enumerate(m.images or ())]
        images, clips = [item for item in sent if not is_audio(item)], [item for item in sent if is_audio(item)]
        role = chat_role(m.role)
        out.append(Message(role=role, content=m.content or "", images=images, tool_calls=calls, name=m.tool_name,
                           thinking=m.thinking or "", audio=clips))
    return out


def decode_image(data: str, where: str, policy: MediaPolicy) -> bytes:
    """Checked image bytes from base64, with or without a data: prefix (size, format and pixel caps); or a checked
    audio clip's, for an entry that is an audio file (the native API has no field of its own for audio: its
    `images` carry an audio model's clips, told apart by their content)."""
    try:
        if is_audio_base64(data):
            return decode_audio(data, None, policy, param="images")
        return decode_base64(data, policy).data
    except InvalidRequest as exc:
        raise InvalidRequest(f"{where}: {exc.message}", param="images") from None
