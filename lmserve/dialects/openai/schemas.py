"""Pydantic wire models of the OpenAI dialect's requests.

These live at the edge only: a route parses the body into one of these, translates it once into the
engine-neutral records of `lmserve.types`, and never passes a wire model further in. Unknown fields are
accepted (`extra="allow"`) so that clients sending newer or vendor-specific fields keep working; the
routes log them at debug level.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationInfo, field_validator, model_validator

from lmserve.dialects.shared.limits import MAX_STOPS

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


class InputAudio(BaseModel):
    model_config = _WIRE
    data: str
    """The clip's file, base64-encoded."""
    format: str
    """Its format: wav, mp3 (OpenAI's two), flac or ogg."""


class AudioPart(BaseModel):
    model_config = _WIRE
    type: Literal["input_audio"]
    input_audio: InputAudio


class AudioUrl(BaseModel):
    model_config = _WIRE
    url: str
    """A data: URI or an http(s) URL (fetched under the same guard as images)."""


class AudioUrlPart(BaseModel):
    """vLLM's audio part: a clip by URL."""

    model_config = _WIRE
    type: Literal["audio_url"]
    audio_url: AudioUrl


class RefusalPart(BaseModel):
    """A past assistant refusal sent back in the history; it is read as text."""

    model_config = _WIRE
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[TextPart | ImagePart | AudioPart | AudioUrlPart | RefusalPart, Field(discriminator="type")]


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
    """`json_schema` of a response_format; `name` may be left out (as llama-server allows)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextFormat(BaseModel):
    model_config = _WIRE
    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    """Any JSON object; with `schema` (llama-server's extension), an object valid against it."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    type: Literal["json_object"]
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")


class JsonSchemaResponseFormat(BaseModel):
    model_config = _WIRE
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")]


Metadata = Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                     Field(max_length=16)]
"""OpenAI's metadata: at most 16 pairs, keys of at most 64 characters, string values of at most 512."""


class StreamOptions(BaseModel):
    model_config = _WIRE
    include_usage: bool | None = None


# ---- requests -------------------------------------------------------------------------------------


REFUSED_OUTPUTS: dict[str, str] = {
    "modalities": "only text output is supported (no audio)",
    "audio": "audio output is not supported; lmserve answers with text",
    "web_search_options": "web search is not supported: the model answers from what it knows",
    "moderation": "moderation is not supported",
    "functions": "the deprecated functions are not supported; send tools",
    "function_call": "the deprecated function_call is not supported; send tool_choice",
}
"""Chat fields OpenAI defines for outputs lmserve cannot make: any value but null (and modalities ["text"]) is a 400."""


class LoraPick(BaseModel):
    """One item of `lora`."""

    model_config = _WIRE
    id: int | None = Field(default=None, ge=0)
    name: str | None = None
    scale: float = Field(default=1.0, ge=-16.0, le=16.0, allow_inf_nan=False)


class SamplingFields(BaseModel):
    """Sampling fields common to chat and legacy completions (plus the non-standard llama.cpp ones)."""

    model_config = _WIRE
    model: str
    max_tokens: int | None = Field(default=None, ge=0)
    """0: no tokens, the reply empty with finish "length" (the prompt still counted)."""
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    """0 keeps only the likeliest token: greedy decoding (read as temperature 0)."""
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    repeat_penalty: float | None = Field(default=None, gt=0.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, ge=1, le=128)
    """How many choices to generate from the one prompt (prefilled once); each finishes on its own."""
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    lora: list[LoraPick] | None = Field(default=None, max_length=16)
    """llama-server's per-request LoRA adapters: each by `id` (GET /lora-adapters) or `name`, at a `scale`."""

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences are supported")
        return stop

    @model_validator(mode="after")
    def _top_p_zero_is_greedy(self) -> SamplingFields:
        if self.top_p == 0:  # nothing but the likeliest token is kept (engines refuse 0 itself)
            self.top_p, self.temperature = None, 0.0
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
    """Body of POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    metadata: Metadata | None = None
    """Up to 16 string pairs kept with a stored completion (`store: true`); filters `GET /v1/chat/completions`."""
    store: bool | None = None
    """Keep the request's messages and the reply (GET /v1/chat/completions/{id}); false or absent: nothing kept."""
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    """A thinking model's effort; "none" switches thinking off (a model that cannot think ignores it)."""
    reasoning_budget: int | None = Field(default=None, ge=0)
    """Non-standard: most thinking tokens before the thinking is closed and the answer follows."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Non-standard (as vLLM): variables for the chat template; `enable_thinking` switches thinking."""
    # OpenAI's hints lmserve has no use for (taken, and without effect on the reply) and outputs it cannot make
    # (refused, naming the field): see REFUSED_OUTPUTS.
    service_tier: str | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    prediction: dict[str, Any] | None = None
    """Predicted output: it would only make the reply faster, never different; taken and not used."""
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = Field(default=None, max_length=64)
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None

    @field_validator(*REFUSED_OUTPUTS)
    @classmethod
    def _refused(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None or value == ["text"]:
            return value
        raise ValueError(REFUSED_OUTPUTS[str(info.field_name)])


class ChatCompletionUpdate(BaseModel):
    """Body of POST /v1/chat/completions/{completion_id}: the stored completion's new metadata (null: none)."""

    model_config = _WIRE
    metadata: Metadata | None


class CompletionRequest(SamplingFields):
    """Body of POST /v1/completions (legacy)."""

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    """A text, texts, one prompt's token ids or several prompts' (completions.py)."""
    suffix: str | None = None
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=5)


class EmbeddingRequest(BaseModel):
    """Body of POST /v1/embeddings. `truncate` (not OpenAI's) cuts inputs longer than the context."""

    model_config = _WIRE
    model: str
    input: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    """Texts, or token ids of the served model's own tokenizer (ids from another tokenizer, e.g. tiktoken's, embed
    other tokens: LangChain's OpenAIEmbeddings sends texts with check_embedding_ctx_length=False)."""
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    truncate: bool = False
