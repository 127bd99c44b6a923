"""The one path of a request: resolve the model, render the prompt, submit, stream the pieces.

Both HTTP dialects call this service with engine-neutral records (lmserve.types) and translate its
chunks back to their own wire format.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from lmserve.chat.template import ChatTemplate
from lmserve.engine.loop import Engine, RequestStream
from lmserve.errors import InvalidRequest, ModelNotFound
from lmserve.types import ChatRequest, Chunk, CompletionRequest, Message, SamplingParams


@dataclass(slots=True)
class LoadedModel:
    """A model ready to serve: its engine, its chat template, and the names it answers to."""

    name: str
    engine: Engine
    template: ChatTemplate
    created: int = field(default_factory=lambda: int(time.time()))
    aliases: tuple[str, ...] = ()
    owned_by: str = "lmserve"


@dataclass(slots=True)
class Generation:
    """A submitted request: how many prompt tokens it has, and its stream of chunks."""

    model: str
    num_prompt_tokens: int
    stream: RequestStream

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self.stream.__aiter__()

    def abort(self) -> None:
        self.stream.abort()


class Service:
    """Answers chat and completion requests over the loaded models."""

    def __init__(self, models: list[LoadedModel]) -> None:
        self._models: dict[str, LoadedModel] = {}
        for model in models:
            for name in (model.name, *model.aliases):
                self._models[name] = model

    def list_models(self) -> list[LoadedModel]:
        seen: dict[int, LoadedModel] = {}
        for model in self._models.values():
            seen.setdefault(id(model), model)
        return list(seen.values())

    def get_model(self, name: str) -> LoadedModel:
        model = self._models.get(name)
        if model is None and ":" not in name:
            model = self._models.get(name + ":latest")
        if model is None:
            raise ModelNotFound(name)
        return model

    def render_chat(self, request: ChatRequest) -> tuple[LoadedModel, str]:
        """Resolve the model and render the chat prompt (raises InvalidRequest on bad messages)."""
        model = self.get_model(request.model)
        _check_messages(request.messages)
        prompt = model.template.render(
            request.messages, tools=request.tools or None, add_generation_prompt=request.add_generation_prompt
        )
        return model, prompt

    async def chat(self, request: ChatRequest) -> Generation:
        model, prompt = self.render_chat(request)
        return self._submit(model, prompt, request.sampling, add_special=True)

    async def complete(self, request: CompletionRequest) -> Generation:
        model = self.get_model(request.model)
        return self._submit(model, request.prompt, request.sampling, add_special=True)

    def _submit(self, model: LoadedModel, prompt: str, sampling: SamplingParams, *, add_special: bool) -> Generation:
        tokens = model.engine.tokenize(prompt, add_special=add_special, parse_special=True)
        stream = model.engine.submit(tokens, sampling)
        return Generation(model=model.name, num_prompt_tokens=len(tokens), stream=stream)

    def close(self) -> None:
        for model in self.list_models():
            model.engine.close()


def _check_messages(messages: list[Message]) -> None:
    if not messages:
        raise InvalidRequest("messages must contain at least one message", param="messages")
    for i, message in enumerate(messages):
        if message.images:
            raise InvalidRequest(
                f"messages[{i}] contains an image, but this model has no vision projector", param="messages"
            )
