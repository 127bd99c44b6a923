"""Pydantic wire models of the Anthropic Messages API's requests (`/v1/messages`, `/v1/messages/count_tokens`).

Like schemas.py for the OpenAI dialect, these live at the edge only: the route parses a body into one of these and
translate.py turns it once into a `ChatRequest`. Unknown fields are accepted (`extra="allow"`, e.g.
`cache_control`, `citations`, `anthropic-beta` extras) and logged at debug level; unknown block, tool-choice or
thinking types are refused with a 400 naming the allowed ones.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from lmserve.dialects.shared.limits import MAX_STOPS

_WIRE = ConfigDict(extra="allow")


# ---- content blocks -------------------------------------------------------------------------------


class TextBlock(BaseModel):
    model_config = _WIRE
    type: Literal["text"]
    text: str


class Base64Source(BaseModel):
    model_config = _WIRE
    type: Literal["base64"]
    media_type: str
    data: str


class UrlSource(BaseModel):
    model_config = _WIRE
    type: Literal["url"]
    url: str


ImageSource = Annotated[Base64Source | UrlSource, Field(discriminator="type")]


class ImageBlock(BaseModel):
    model_config = _WIRE
    type: Literal["image"]
    source: ImageSource


class ToolUseBlock(BaseModel):
    """A call the assistant made earlier, sent back in the history."""

    model_config = _WIRE
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


ToolResultPart = Annotated[TextBlock | ImageBlock, Field(discriminator="type")]


class ToolResultBlock(BaseModel):
    """The result of a call, in a user message: `content` a string or text and image blocks."""

    model_config = _WIRE
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ToolResultPart] | None = None
    is_error: bool | None = None


class ThinkingBlock(BaseModel):
    """Earlier thinking sent back in the history: the assistant turn's thinking (a template that keeps earlier
    thinking shows it; others drop it)."""

    model_config = _WIRE
    type: Literal["thinking"]
    thinking: str = ""
    signature: str | None = None


class RedactedThinkingBlock(BaseModel):
    """Earlier redacted thinking sent back in the history: dropped from the prompt."""

    model_config = _WIRE
    type: Literal["redacted_thinking"]
    data: str = ""


ContentBlock = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class InputMessage(BaseModel):
    """One turn of the conversation: a string or a list of content blocks. A `system` turn (Anthropic's
    mid-conversation system messages) is operator text placed at that point of the conversation: text blocks only."""

    model_config = _WIRE
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


# ---- tools and thinking ---------------------------------------------------------------------------


class Tool(BaseModel):
    """A client tool. Anthropic's server tools (`type: "bash_20250124"` …) are refused: only custom tools run here."""

    model_config = _WIRE
    type: Literal["custom"] | None = None
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoiceAuto(BaseModel):
    model_config = _WIRE
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(BaseModel):
    model_config = _WIRE
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(BaseModel):
    model_config = _WIRE
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(BaseModel):
    model_config = _WIRE
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


class ThinkingEnabled(BaseModel):
    model_config = _WIRE
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1)


class ThinkingAdaptive(BaseModel):
    """Thinking on, as much as the model wants (no budget)."""

    model_config = _WIRE
    type: Literal["adaptive"]


class ThinkingDisabled(BaseModel):
    model_config = _WIRE
    type: Literal["disabled"]


ThinkingConfig = Annotated[ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled, Field(discriminator="type")]


class JsonOutputFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class ClearThinking(BaseModel):
    """Context editing: drop the thinking of earlier assistant turns, keeping the last `keep` thinking turns
    (`"all"` or `{"type": "thinking_turns", "value": N}`; default: the last one)."""

    model_config = _WIRE
    type: Literal["clear_thinking_20251015"]
    keep: Literal["all"] | dict[str, Any] | None = None


class ClearToolUses(BaseModel):
    """Context editing: once the prompt passes `trigger` (default 100,000 input tokens), replace the results of the
    oldest tool uses with a placeholder, keeping the last `keep` (default 3) and clearing at least `clear_at_least`
    tokens; tools in `exclude_tools` are kept; `clear_tool_inputs` also empties the calls' inputs."""

    model_config = _WIRE
    type: Literal["clear_tool_uses_20250919"]
    trigger: dict[str, Any] | None = None
    keep: dict[str, Any] | None = None
    clear_at_least: dict[str, Any] | None = None
    exclude_tools: list[str] | None = None
    clear_tool_inputs: bool | list[str] | None = None


ContextEdit = Annotated[ClearThinking | ClearToolUses, Field(discriminator="type")]


class ContextManagement(BaseModel):
    """`context_management` (beta context-management-2025-06-27): edits applied to the conversation before it
    is rendered; what was applied is reported in the response."""

    model_config = _WIRE
    edits: list[ContextEdit] = Field(default_factory=list)


class OutputConfig(BaseModel):
    """`format`: the reply must be JSON matching the schema; `effort`: the thinking effort when thinking is on."""

    model_config = _WIRE
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


# ---- requests -------------------------------------------------------------------------------------


class CountTokensRequest(BaseModel):
    """Body of POST /v1/messages/count_tokens: what shapes the prompt, without the sampling fields."""

    model_config = _WIRE
    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    context_management: ContextManagement | None = None


class MessagesRequest(CountTokensRequest):
    """Body of POST /v1/messages. `max_tokens` is required, as in Anthropic's API; `metadata` is accepted and
    ignored. The sampling fields are not in the official client's signature any more (it sends them as extra body
    fields), but agents still send them."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOPS)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool | None = False
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
