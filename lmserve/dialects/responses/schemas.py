"""Pydantic wire models of the OpenAI Responses API's requests (`POST /v1/responses`) and of the Conversations API's
(`/v1/conversations`).

As in schemas.py these live at the edge only: the route parses a body into `ResponseRequest` and translates it once
(translate.py). Unknown fields are accepted (`extra="allow"`). Input items are the shapes the `openai` client
sends: messages (an `EasyInputMessage` may leave out `type`), function calls (with the `namespace` of a namespaced
function) and their outputs, and reasoning items (read back from an earlier response, their text the thinking of the
turn after them). Stored items are read back through the same models. A tool is a function, a namespace of
functions, or any other type (`HostedTool`: left out by tools.py); a tool choice is a mode, a
function, `allowed_tools`, or any other type (`HostedChoice`: refused).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from lmserve.types import MAX_TOP_LOGPROBS

_WIRE = ConfigDict(extra="allow")


# ---- content parts --------------------------------------------------------------------------------


class InputText(BaseModel):
    model_config = _WIRE
    type: Literal["input_text"]
    text: str


class InputImage(BaseModel):
    """An image by URL (http(s) or a `data:image/…;base64,` URI); `file_id` (the Files API) is not served here."""

    model_config = _WIRE
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


class AudioData(BaseModel):
    model_config = _WIRE
    data: str
    """The clip's file, base64-encoded."""
    format: str
    """Its format: wav, mp3, flac or ogg."""


class InputAudio(BaseModel):
    """An audio clip, inline (as the chat completions' `input_audio` part)."""

    model_config = _WIRE
    type: Literal["input_audio"]
    input_audio: AudioData


class OutputText(BaseModel):
    """Text an assistant wrote (an earlier response's output sent back as input)."""

    model_config = _WIRE
    type: Literal["output_text"]
    text: str
    annotations: list[Any] = Field(default_factory=list)


class Refusal(BaseModel):
    model_config = _WIRE
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[InputText | InputImage | InputAudio | OutputText | Refusal, Field(discriminator="type")]


class SummaryText(BaseModel):
    model_config = _WIRE
    type: Literal["summary_text"]
    text: str


class ReasoningText(BaseModel):
    model_config = _WIRE
    type: Literal["reasoning_text"]
    text: str


# ---- input items ----------------------------------------------------------------------------------


class MessageItem(BaseModel):
    """A message: the user's, the instructions' (system, developer), or an assistant's earlier reply."""

    model_config = _WIRE
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(BaseModel):
    """A call the model made (from an earlier response's output); `namespace` names the namespace tool of the
    function it called, if any."""

    model_config = _WIRE
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(BaseModel):
    """What a call returned, sent back by the client."""

    model_config = _WIRE
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None
    status: str | None = None


class ReasoningItem(BaseModel):
    """An earlier response's reasoning, sent back: its text is the next assistant turn's thinking (a template that
    keeps earlier thinking shows it; others drop it)."""

    model_config = _WIRE
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: str | None = None


def _item_type(value: Any) -> str:
    """An item's tag: its `type`, where a message may leave it out."""
    if isinstance(value, dict):
        return str(value.get("type", "message"))
    return str(getattr(value, "type", "message"))


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


# ---- tools, formats, reasoning --------------------------------------------------------------------


class FunctionTool(BaseModel):
    """A function the model may call (the Responses shape: name and parameters at the top level)."""

    model_config = _WIRE
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class HostedTool(BaseModel):
    """A tool of any other type (web or file search, computer use, MCP, code interpreter, shell, custom …): one
    that runs at OpenAI, or whose calls are not function calls. lmserve runs none of them: they are left out of
    the prompt and named in the response's `x-lmserve-ignored-tools` header."""

    model_config = _WIRE
    type: str = Field(min_length=1)


def _type_of(value: Any) -> str:
    """A tool's or a choice's `type` if it is a string, else "" (the member that takes any type says it is bad)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if isinstance(kind, str) else ""


def _tool_type(value: Any) -> str:
    """A tool's union member: FunctionTool, NamespaceTool, or HostedTool for every other type (or none)."""
    kind = _type_of(value)
    return {"function": "FunctionTool", "namespace": "NamespaceTool"}.get(kind, "HostedTool")


NamespacedTool = Annotated[
    Annotated[FunctionTool, Tag("FunctionTool")] | Annotated[HostedTool, Tag("HostedTool")],
    Discriminator(_tool_type),
]


class NamespaceTool(BaseModel):
    """A group of function tools under a shared name: the model sees the functions; its calls come back with the
    namespace."""

    model_config = _WIRE
    type: Literal["namespace"]
    name: str = Field(min_length=1)
    description: str | None = None
    tools: list[NamespacedTool] = Field(min_length=1)


Tool = Annotated[
    Annotated[FunctionTool, Tag("FunctionTool")]
    | Annotated[NamespaceTool, Tag("NamespaceTool")]
    | Annotated[HostedTool, Tag("HostedTool")],
    Discriminator(_tool_type),
]


class FunctionChoice(BaseModel):
    """Call this function; `namespace` (lmserve's own, optional) picks it among namespaces that share the name."""

    model_config = _WIRE
    type: Literal["function"]
    name: str
    namespace: str | None = None


class AllowedToolsChoice(BaseModel):
    """Only these tools (`{"type": "function", "name": …}` each), optional (`auto`) or one of them at least
    (`required`)."""

    model_config = _WIRE
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]]


class HostedChoice(BaseModel):
    """A choice that forces a tool lmserve does not run (a hosted type, `mcp`, `custom`, `shell` …): refused."""

    model_config = _WIRE
    type: str = Field(min_length=1)


def _choice_type(value: Any) -> str:
    """A tool choice's union member: FunctionChoice, AllowedToolsChoice, or HostedChoice for every other type."""
    kind = _type_of(value)
    return {"function": "FunctionChoice", "allowed_tools": "AllowedToolsChoice"}.get(kind, "HostedChoice")


ToolChoice = Annotated[
    Annotated[FunctionChoice, Tag("FunctionChoice")]
    | Annotated[AllowedToolsChoice, Tag("AllowedToolsChoice")]
    | Annotated[HostedChoice, Tag("HostedChoice")],
    Discriminator(_choice_type),
]


class TextFormat(BaseModel):
    model_config = _WIRE
    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    model_config = _WIRE
    type: Literal["json_object"]


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    type: Literal["json_schema"]
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


Format = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class TextConfig(BaseModel):
    model_config = _WIRE
    format: Format | None = None
    verbosity: str | None = None


Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ReasoningConfig(BaseModel):
    model_config = _WIRE
    effort: Effort | None = None
    summary: str | None = None


class ConversationRef(BaseModel):
    """`conversation` as an object: `{"id": "conv_…"}`."""

    model_config = _WIRE
    id: str


# ---- the request ----------------------------------------------------------------------------------


class ResponseRequest(BaseModel):
    """Body of POST /v1/responses."""

    model_config = _WIRE
    model: str
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    store: bool | None = None
    stream: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    """Extra output: "message.output_text.logprobs" is honoured; the others name tools lmserve has not (file or web
    search, code interpreter, computer use) or data it does not make (encrypted reasoning), so they add nothing."""
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    reasoning_budget: int | None = Field(default=None, ge=0)
    """Non-standard (as on /v1/chat/completions): most thinking tokens before the thinking is closed."""
    conversation: str | ConversationRef | None = None
    """A stored conversation (`/v1/conversations`): its items come before the input; the input and the output are
    added to it."""
    prompt: dict[str, Any] | None = None
    """A stored prompt template: refused (no prompt store here)."""
    moderation: dict[str, Any] | None = None
    """Moderation by an OpenAI model: refused (none runs here)."""
    # Advisory: accepted, echoed where the response has the field, without effect.
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    max_tool_calls: int | None = Field(default=None, ge=0)
    """Bounds calls to hosted tools, and lmserve runs none."""
    stream_options: dict[str, Any] | None = None
    """`include_obfuscation`: lmserve adds no obfuscation field."""
    context_management: list[dict[str, Any]] | None = None
    """Server-side compaction: lmserve does not compact (a conversation too long for the context is a 400)."""


# ---- conversations (/v1/conversations) ------------------------------------------------------------

Metadata = Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                     Field(max_length=16)]
"""At most 16 pairs, keys up to 64 characters, values up to 512."""
MAX_NEW_ITEMS = 20
"""The most items one request adds to a conversation."""


class ConversationCreate(BaseModel):
    """Body of POST /v1/conversations: its first items (optional) and metadata."""

    model_config = _WIRE
    items: list[InputItem] | None = Field(default=None, max_length=MAX_NEW_ITEMS)
    metadata: Metadata | None = None


class ConversationUpdate(BaseModel):
    """Body of POST /v1/conversations/{id}: the metadata that replaces the conversation's."""

    model_config = _WIRE
    metadata: Metadata


class ConversationItems(BaseModel):
    """Body of POST /v1/conversations/{id}/items: the items to add at the end."""

    model_config = _WIRE
    items: list[InputItem] = Field(min_length=1, max_length=MAX_NEW_ITEMS)
