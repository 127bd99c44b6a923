"""Pydantic wire models of the OpenAI Responses API's requests (`POST /v1/responses`).

As in schemas.py these live at the edge only: the route parses a body into `ResponseRequest` and translates it once
(api/responses.py). Unknown fields are accepted (`extra="allow"`). Input items are the shapes the `openai` client
sends: messages (an `EasyInputMessage` may leave out `type`), function calls and their outputs, and reasoning items
(read back from an earlier response, dropped from the prompt). Stored items are read back through the same models.
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


ContentPart = Annotated[InputText | InputImage | OutputText | Refusal, Field(discriminator="type")]


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
    """A call the model made (from an earlier response's output)."""

    model_config = _WIRE
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
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
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(BaseModel):
    model_config = _WIRE
    type: Literal["function"]
    name: str


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


# ---- the request ----------------------------------------------------------------------------------


class ResponseRequest(BaseModel):
    """Body of POST /v1/responses."""

    model_config = _WIRE
    model: str
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
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
