"""Wire models of the native (local-runner) dialect: /api/generate, /api/chat and model management."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr, WithJsonSchema

from lmserve.options import json_schema


class Wire(BaseModel):
    model_config = ConfigDict(extra="allow")


Options = Annotated[dict[str, Any], WithJsonSchema(json_schema())]
"""`options` of a request: the names of lmserve/options.py's table (as Modelfile PARAMETERs), checked there."""


class FunctionCall(Wire):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolCallWire(Wire):
    function: FunctionCall


class ChatMessage(Wire):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = ""
    images: list[str] | None = None
    tool_calls: list[ToolCallWire] | None = None
    tool_name: str | None = None
    thinking: str | None = None


KeepAlive = StrictStr | StrictInt | StrictFloat | None
"""A duration ("5m", "1h30m"), seconds, or negative for forever; strict, so `true` is not 1 s."""


class GenerateBody(Wire):
    model: str = Field(min_length=1)
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    raw: bool = False
    context: list[int] | None = None
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    stream: bool = True
    keep_alive: KeepAlive = None
    images: list[str] | None = None
    think: bool | str | None = None
    logprobs: bool | None = None
    """Each generated token's log-probability on each chunk (`logprobs: [{token, logprob, bytes, top_logprobs}]`)."""
    top_logprobs: int | None = None
    """With `logprobs`: how many likeliest alternatives each token gets (0..20)."""


class ChatBody(Wire):
    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    stream: bool = True
    keep_alive: KeepAlive = None
    think: bool | str | None = None
    logprobs: bool | None = None
    """As GenerateBody's."""
    top_logprobs: int | None = None


class ModelBody(Wire):
    model: str | None = Field(None, min_length=1)
    name: str | None = Field(None, min_length=1)
    verbose: bool = False

    @property
    def target(self) -> str | None:
        return self.model or self.name


class CopyBody(Wire):
    source: str = Field(min_length=1)
    destination: str = Field(min_length=1)


class CreateBody(Wire):
    model: str | None = Field(None, min_length=1)
    name: str | None = Field(None, min_length=1)
    modelfile: str | None = None
    from_: str | None = Field(None, alias="from")
    files: dict[str, str] | None = None
    adapters: dict[str, str] | None = None
    template: str | None = None
    system: str | None = None
    parameters: dict[str, Any] | None = None
    messages: list[ChatMessage] | None = None
    license: str | list[str] | None = None
    quantize: str | None = None
    stream: bool = True

    @property
    def target(self) -> str | None:
        return self.model or self.name


class PullBody(Wire):
    model: str | None = Field(None, min_length=1)
    name: str | None = Field(None, min_length=1)
    insecure: bool = False
    """Accepted for compatibility; the hub is always reached over HTTPS (or the configured endpoint)."""
    stream: bool = True

    @property
    def target(self) -> str | None:
        return self.model or self.name


class EmbedBody(Wire):
    """Body of POST /api/embed. An empty `input` string (or none) only loads the model."""

    model: str = Field(min_length=1)
    input: str | list[str] = ""
    truncate: bool = True
    options: Options | None = None
    keep_alive: KeepAlive = None
    dimensions: int | None = Field(None, ge=1)


class EmbeddingsBody(Wire):
    """Body of the legacy POST /api/embeddings. An empty `prompt` only loads the model."""

    model: str = Field(min_length=1)
    prompt: str = ""
    options: Options | None = None
    keep_alive: KeepAlive = None
