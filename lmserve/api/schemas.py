"""Pydantic wire models of the OpenAI dialect's requests.

These live at the edge only: a route parses the body into one of these, translates it once into the
engine-neutral records of `lmserve.types`, and never passes a wire model further in. Unknown fields are
accepted (`extra="allow"`) so that clients sending newer or vendor-specific fields keep working; the
routes log them at debug level.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOPS = 16

_WIRE = ConfigDict(extra="allow")


# ---- message content ------------------------------------------------------------------------------


class TextPart(BaseModel):
    model_config = _WIRE
    type: Literal["text"]
    text: str


class ImageUrl(BaseModel):
    model_config = _WIRE
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(BaseModel):
    model_config = _WIRE
    type: Literal["image_url"]
    image_url: ImageUrl


class RefusalPart(BaseModel):
    """A past assistant refusal sent back in the history; it is read as text."""

    model_config = _WIRE
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[TextPart | ImagePart | RefusalPart, Field(discriminator="type")]


class FunctionCall(BaseModel):
    model_config = _WIRE
    name: str
    arguments: str | dict[str, Any] = ""


class MessageToolCall(BaseModel):
    model_config = _WIRE
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One message of a chat request. Only an assistant message may have null content."""

    model_config = _WIRE
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    """An assistant turn's thinking, sent back (as lmserve and vLLM return it)."""

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message must have content")
        return self


# ---- tools and formats ----------------------------------------------------------------------------


class FunctionDefinition(BaseModel):
    model_config = _WIRE
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _WIRE
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = _WIRE
    name: str


class NamedToolChoice(BaseModel):
    model_config = _WIRE
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextFormat(BaseModel):
    model_config = _WIRE
    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    model_config = _WIRE
    type: Literal["json_object"]


class JsonSchemaResponseFormat(BaseModel):
    model_config = _WIRE
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")]


class StreamOptions(BaseModel):
    model_config = _WIRE
    include_usage: bool | None = None


# ---- requests -------------------------------------------------------------------------------------


class SamplingFields(BaseModel):
    """Sampling fields common to chat and legacy completions (plus the non-standard llama.cpp ones)."""

    model_config = _WIRE
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    repeat_penalty: float | None = Field(default=None, gt=0.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences are supported")
        return stop

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
    """Body of POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    metadata: dict[str, str] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    """A thinking model's effort; "none" switches thinking off (a model that cannot think ignores it)."""
    reasoning_budget: int | None = Field(default=None, ge=0)
    """Non-standard: most thinking tokens before the thinking is closed and the answer follows."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Non-standard (as vLLM): variables for the chat template; `enable_thinking` switches thinking."""


class CompletionRequest(SamplingFields):
    """Body of POST /v1/completions (legacy)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    suffix: str | None = None
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=5)


class EmbeddingRequest(BaseModel):
    """Body of POST /v1/embeddings. `truncate` (not OpenAI's) cuts inputs longer than the context."""

    model_config = _WIRE
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    truncate: bool = False
