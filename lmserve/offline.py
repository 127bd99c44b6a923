"""The offline engine: lmserve's service as a Python object, without HTTP (the counterpart of vLLM's `LLM`).

`LLM(model, **options)` builds the service `lmserve serve` runs (lmserve/server.py `build_service`) from the same
options: `model` is what `serve` takes, each keyword a `serve` option by its field name in lmserve/config.py
(`ctx_size`, `parallel`, `engine`, `mmproj`, `dtype` …), LMSERVE_* variables filling in the rest. The model loads
at once and stays loaded until `close()`.

`chat`, `generate` and `embed` submit all their inputs together, so the engine's continuous batching runs them side
by side (at most `parallel` + `max_queue` in flight). Requests are translated by the OpenAI dialect's own translators
(lmserve/dialects/openai/): messages, tools, `response_format` and the sampling options (lmserve/options.py, by their
OpenAI names) mean what they mean on /v1/chat/completions, and what the service refuses raises lmserve's errors
(lmserve/errors.py). The service runs on an event loop in a thread of the object; the methods block."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar, cast, overload

from pydantic import TypeAdapter

from lmserve import options as opts
from lmserve.chat.media import MediaPolicy
from lmserve.config import OPTIONS, flag_dest, resolve
from lmserve.dialects.openai import schemas
from lmserve.dialects.openai.output import collect
from lmserve.dialects.openai.translate import (
    has_images,
    image_urls,
    load_images,
    response_grammar,
    to_chat_request,
    to_completion_request,
)
from lmserve.dialects.shared.logprobs import asked
from lmserve.errors import Overloaded
from lmserve.server import build_service
from lmserve.service import Generation, Service
from lmserve.types import Chunk, FinishReason, TokenLogprob, ToolCall, Usage

__all__ = ["LLM", "ChatOutput", "CompletionOutput", "TokenLogprob", "ToolCall", "Usage"]

T = TypeVar("T")
Message = Mapping[str, Any]
Conversation = Sequence[Message]
Sampling = Mapping[str, Any]

SAMPLING_NAMES = frozenset(
    {name for option in opts.TABLE.values() if option.lifetime == "sampling"
     for name in (*option.openai, *((option.name,) if option.native else ()))}
    | {"logprobs", "top_logprobs", "response_format"}
)
"""What a `sampling` mapping may name: the options table's sampling options (OpenAI and native names), the
log-probabilities (`logprobs`, `top_logprobs`) and structured output (`response_format`)."""
CHAT_FIELDS = frozenset({"parallel_tool_calls", "reasoning_effort", "reasoning_budget", "chat_template_kwargs"})
"""The chat completion request's fields `chat` takes besides the messages, the sampling, `tools` and `tool_choice`."""
MAX_OVERLOADED_RETRIES = 200
"""How often a request the engine's full queue refused is submitted again (a few seconds in all) before the
Overloaded error is raised: within the in-flight bound the queue is full only for an instant."""


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One generated reply.

    `text` is the reply (stop strings cut); `token_ids` the tokens generated, `prompt_token_ids` the prompt as the
    engine prefilled it; `finish_reason` "stop" (the model ended, or `stop_string` did), "length" (`max_tokens` or
    the context) or "tool_calls"; `usage` counts the tokens (`cached_tokens`: prompt tokens reused from the prompt
    cache); `logprobs`, when asked for, one entry per generated token (natural logs, with `top_logprobs`
    alternatives each), else None."""

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    logprobs: list[TokenLogprob] | None = None
    stop_string: str | None = None


@dataclass(frozen=True, slots=True)
class ChatOutput(CompletionOutput):
    """One assistant turn: a `CompletionOutput` whose `text` is the answer, with the thinking of a reasoning model
    apart in `reasoning`, and the calls of the `tools` the model made in `tool_calls` (the call markup is not in
    `text`; `finish_reason` is "tool_calls")."""

    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


class LLM:
    """A model loaded in this process, answering batches of chats, prompts and embeddings (see the module).

    Use it as a context manager, or call `close()`, to unload the model (and end vLLM's processes); an instance
    left open is closed when it is garbage-collected or the interpreter exits.
    """

    def __init__(self, model: str | os.PathLike[str] | None = None, **load: Any) -> None:
        """Load `model` (None: `serve`'s default, LMSERVE_MODEL or smollm2:135m) with `serve`'s options by field name
        (e.g. `ctx_size=4096, parallel=8, engine="vllm", dtype="float32"`). An unknown option is a TypeError, a bad
        value a ValueError (lmserve.config.ConfigError); a model that cannot load raises lmserve's error."""
        unknown = sorted(set(load) - set(OPTIONS))
        if unknown:
            raise TypeError(f"LLM() got unknown option(s) {', '.join(unknown)}; the options are lmserve serve's, by "
                            f"field name: {', '.join(sorted(OPTIONS))}")
        flags = {flag_dest(name): value for name, value in load.items()}
        if model is not None:
            flags[flag_dest("model")] = os.fspath(model)
        config = resolve(flags)
        self._media = MediaPolicy(allowed_hosts=frozenset(config.image_allow_hosts),
                                  max_bytes=config.image_max_bytes, max_audio_seconds=config.audio_max_seconds)
        self._runner = _Runner()
        self._closer = weakref.finalize(self, self._runner.close)
        try:
            self._service, name = build_service(config)
            self._runner.service = self._service
            self.model, room = self._runner.call(_preload(self._service, name))
        except BaseException:
            self.close()
            raise
        self._room = room + config.max_queue
        """The most requests in flight at once: the model's slots and the engine's queue bound."""

    # ---- chat ---------------------------------------------------------------------------------------------------

    @overload
    def chat(self, conversations: Conversation, sampling: Sampling | Sequence[Sampling] | None = None, *,
             tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: str | Mapping[str, Any] | None = None,
             **chat_fields: Any) -> ChatOutput: ...

    @overload
    def chat(self, conversations: Sequence[Conversation], sampling: Sampling | Sequence[Sampling] | None = None, *,
             tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: str | Mapping[str, Any] | None = None,
             **chat_fields: Any) -> list[ChatOutput]: ...

    def chat(self, conversations: Conversation | Sequence[Conversation],
             sampling: Sampling | Sequence[Sampling] | None = None, *,
             tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: str | Mapping[str, Any] | None = None,
             **chat_fields: Any) -> ChatOutput | list[ChatOutput]:
        """Answer each conversation (OpenAI messages; one conversation gives one ChatOutput, a list of them a list).

        Content is a text or a list of parts: `{"type": "text", "text": …}`, `{"type": "image_url", "image_url":
        {"url": …}}` (a data: URI, an http(s) URL, a file path) or `{"type": "image", "image": …}` (a path, bytes or
        a PIL image); any other part type is a ValueError naming it. `sampling` (one mapping for all, or one per
        conversation) holds the options by their OpenAI names, `logprobs` (true, or the number of alternatives) and
        `top_logprobs`, and `response_format`; `tools` and `tool_choice` are OpenAI's; `chat_fields` are the other
        fields of a chat completion request in CHAT_FIELDS (`parallel_tool_calls`, `reasoning_effort` …).
        """
        unknown = sorted(set(chat_fields) - CHAT_FIELDS)
        if unknown:
            known = ", ".join(sorted(CHAT_FIELDS))
            raise TypeError(f"chat() got unknown field(s) {', '.join(unknown)}; known: {known}")
        single = _is_conversation(conversations)
        batch = [cast("Conversation", conversations)] if single else cast("Sequence[Conversation]", conversations)
        extra: dict[str, Any] = {**chat_fields, "tools": tools, "tool_choice": tool_choice}
        bodies = [self._chat_body(i, conversation, settings, extra)
                  for i, (conversation, settings) in enumerate(zip(batch, _each(sampling, len(batch)), strict=True))]
        outputs = self._runner.call(self._all([partial(self._answer_chat, body) for body in bodies]))
        return outputs[0] if single else outputs

    def _chat_body(self, index: int, conversation: Conversation, sampling: Sampling,
                   extra: Mapping[str, Any]) -> schemas.ChatCompletionRequest:
        """The chat completion request of one conversation (images as data: URIs or http(s) URLs)."""
        if isinstance(conversation, str | bytes) or not isinstance(conversation, Sequence):
            raise ValueError(f"conversation {index} must be a list of messages, not {type(conversation).__name__}")
        messages = [_message(f"conversation {index}, message {j}", message) for j, message in enumerate(conversation)]
        fields = {key: value for key, value in extra.items() if value is not None}
        return schemas.ChatCompletionRequest.model_validate(
            {**fields, **_sampling_fields(sampling), "model": self.model, "messages": messages})

    async def _answer_chat(self, body: schemas.ChatCompletionRequest) -> ChatOutput:
        images = None
        if has_images(body):
            if count := sum(map(len, image_urls(body))):
                self._service.generation.check_images(self.model, count)
            images = await load_images(body, self._media)
        request = to_chat_request(body, images, policy=self._media)
        generation, text, final, usage = await self._generate(lambda: self._service.generation.chat(request))
        wants = request.sampling.logprobs is not None
        return ChatOutput(text=text, token_ids=list(generation.output_tokens),
                          prompt_token_ids=list(generation.prompt_tokens), finish_reason=_finish(final), usage=usage,
                          logprobs=final.logprobs if wants else None, stop_string=final.stop_string,
                          reasoning=final.reasoning, tool_calls=list(final.tool_calls))

    # ---- generate -----------------------------------------------------------------------------------------------

    @overload
    def generate(self, prompts: str,  # type: ignore[overload-overlap]  # a text is a sequence of texts too
                 sampling: Sampling | Sequence[Sampling] | None = None) -> CompletionOutput: ...

    @overload
    def generate(self, prompts: Sequence[str],
                 sampling: Sampling | Sequence[Sampling] | None = None) -> list[CompletionOutput]: ...

    def generate(self, prompts: str | Sequence[str],
                 sampling: Sampling | Sequence[Sampling] | None = None) -> CompletionOutput | list[CompletionOutput]:
        """Continue each raw prompt (no chat template), as /v1/completions does; one prompt gives one output, a list
        of them a list. `sampling` as for `chat` (`response_format` included)."""
        single = isinstance(prompts, str)
        batch = [prompts] if isinstance(prompts, str) else list(prompts)
        bodies = [self._completion_body(prompt, settings)
                  for prompt, settings in zip(batch, _each(sampling, len(batch)), strict=True)]
        outputs = self._runner.call(self._all([partial(self._answer_completion, *body) for body in bodies]))
        return outputs[0] if single else outputs

    def _completion_body(self, prompt: str, sampling: Sampling) -> tuple[schemas.CompletionRequest, Sampling]:
        if not isinstance(prompt, str):
            raise ValueError(f"a prompt must be a text, not {type(prompt).__name__}")
        fields = _sampling_fields(sampling)
        own: dict[str, Any] = {key: fields.pop(key) for key in ("logprobs", "top_logprobs", "response_format")
                               if key in fields}
        return schemas.CompletionRequest.model_validate({**fields, "model": self.model, "prompt": prompt}), own

    async def _answer_completion(self, body: schemas.CompletionRequest, own: Sampling) -> CompletionOutput:
        request = to_completion_request(body)
        request.sampling.logprobs = asked(own.get("logprobs"), own.get("top_logprobs"))
        if own.get("response_format") is not None:
            request.sampling.grammar = response_grammar(_FORMAT.validate_python(own["response_format"]))
        generation, text, final, usage = await self._generate(lambda: self._service.generation.complete(request))
        wants = request.sampling.logprobs is not None
        return CompletionOutput(text=text, token_ids=list(generation.output_tokens),
                                prompt_token_ids=list(generation.prompt_tokens), finish_reason=_finish(final),
                                usage=usage, logprobs=final.logprobs if wants else None,
                                stop_string=final.stop_string)

    # ---- embed --------------------------------------------------------------------------------------------------

    @overload
    def embed(self, texts: str, *, normalize: bool = True,  # type: ignore[overload-overlap]  # as generate's
              dimensions: int | None = None, truncate: bool = False) -> list[float]: ...

    @overload
    def embed(self, texts: Sequence[str], *, normalize: bool = True, dimensions: int | None = None,
              truncate: bool = False) -> list[list[float]]: ...

    def embed(self, texts: str | Sequence[str], *, normalize: bool = True, dimensions: int | None = None,
              truncate: bool = False) -> list[float] | list[list[float]]:
        """The embedding of each text (the mean of the model's final hidden states; unit length unless not
        `normalize`; the first `dimensions` components when given), as /v1/embeddings makes them, in one batch. A
        text longer than the context is an error, or cut to it with `truncate`."""
        batch = [texts] if isinstance(texts, str) else list(texts)
        work = self._service.generation.embed(self.model, batch, truncate=truncate, normalize=normalize,
                                              dimensions=dimensions)
        _, vectors, _ = self._runner.call(work)
        return vectors[0] if isinstance(texts, str) else vectors

    # ---- running ------------------------------------------------------------------------------------------------

    async def _all(self, work: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
        """Each request's result, run concurrently (at most `_room` in flight); the first failure cancels the rest
        and is raised."""
        room = asyncio.Semaphore(self._room)

        async def bounded(one: Callable[[], Awaitable[T]]) -> T:
            async with room:
                return await one()

        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(bounded(one)) for one in work]
        except* Exception as failed:
            raise failed.exceptions[0] from None
        return [task.result() for task in tasks]

    async def _generate(self, start: Callable[[], Awaitable[Generation]]) -> tuple[Generation, str, Chunk, Usage]:
        """Submit one request (again while the engine's queue is full for an instant) and collect its reply."""
        for attempt in range(MAX_OVERLOADED_RETRIES + 1):
            try:
                generation = await start()
                break
            except Overloaded:
                if attempt == MAX_OVERLOADED_RETRIES:
                    raise
                await asyncio.sleep(min(0.001 * 2**attempt, 0.05))
        text, final, usage = await collect(generation)
        return generation, text, final, usage

    def close(self) -> None:
        """Unload the model and stop this object's event loop; later calls raise RuntimeError."""
        self._closer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _Runner:
    """The event loop the service runs on, in a thread of its own; `call` runs a coroutine there and waits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="lmserve-offline", daemon=True)
        self.thread.start()
        self.service: Service | None = None
        self.is_closed = False

    def call(self, work: Coroutine[Any, Any, T]) -> T:
        if self.is_closed:
            work.close()
            raise RuntimeError("this LLM is closed")
        future = asyncio.run_coroutine_threadsafe(work, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # interrupted (Ctrl-C): the requests still running are aborted
            raise

    def close(self) -> None:
        """Cancel what still runs on the loop and stop it (as `asyncio.run` ends), then close the service off the
        loop, as `serve` does at its exit: vLLM's engine then waits for its processes to end."""
        if self.is_closed:
            return
        self.is_closed = True
        asyncio.run_coroutine_threadsafe(_settle(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        try:
            if self.service is not None:
                self.service.close()
        finally:
            self.loop.close()


async def _settle() -> None:
    """Cancel every other task of the running loop and wait for them; finish its async generators."""
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_asyncgens()


async def _preload(service: Service, name: str) -> tuple[str, int]:
    """Load `name` for good: its canonical name and its number of slots."""
    resident = await service.generation.acquire(name, keep_alive=-1)
    try:
        return resident.model.name, resident.model.engine.info.num_parallel
    finally:
        service.residency.release(resident)


_FORMAT: TypeAdapter[schemas.ResponseFormat] = TypeAdapter(schemas.ResponseFormat)


def _is_conversation(value: object) -> bool:
    """Whether `value` is one conversation (a list of message mappings), not a list of conversations."""
    return isinstance(value, Sequence) and bool(value) and isinstance(value[0], Mapping)


def _each(sampling: Sampling | Sequence[Sampling] | None, count: int) -> list[Sampling]:
    """The sampling of each of `count` inputs: one mapping for all, or one per input."""
    if sampling is None or isinstance(sampling, Mapping):
        return [sampling or {}] * count
    if len(sampling) != count:
        raise ValueError(f"{len(sampling)} sampling settings for {count} inputs: give one, or one per input")
    return list(sampling)


def _sampling_fields(sampling: Sampling) -> dict[str, Any]:
    """`sampling` as chat completion fields, checked by name; `logprobs` given as a count (vLLM's way) is
    `logprobs: true` with that many `top_logprobs`."""
    unknown = sorted(set(sampling) - SAMPLING_NAMES)
    if unknown:
        raise ValueError(f"unknown sampling option(s) {', '.join(unknown)}; known: {', '.join(sorted(SAMPLING_NAMES))}")
    fields = {key: value for key, value in sampling.items() if value is not None}
    count = fields.get("logprobs")
    if isinstance(count, int) and not isinstance(count, bool):
        fields["logprobs"] = True
        fields.setdefault("top_logprobs", count)
    if fields.get("n", 1) != 1:
        raise ValueError("n > 1 is not taken offline: give the input n times (with different seeds)")
    return fields


def _message(where: str, message: Message) -> dict[str, Any]:
    """One OpenAI message with its image parts as data: URIs or http(s) URLs; another part type is a ValueError."""
    if not isinstance(message, Mapping):
        raise ValueError(f"{where} must be a mapping (role, content), not {type(message).__name__}")
    content = message.get("content")
    if isinstance(content, str) or content is None:
        return dict(message)
    if not isinstance(content, Sequence):
        raise ValueError(f"{where}: content must be a text or a list of parts")
    return {**message, "content": [_part(f"{where}, part {k}", part) for k, part in enumerate(content)]}


def _part(where: str, part: Any) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, Mapping) else None
    if kind in ("text", "refusal"):
        return dict(part)
    if kind == "image_url":
        image_url = part.get("image_url")
        if isinstance(image_url, Mapping):
            return {"type": "image_url", "image_url": {**image_url, "url": _image_url(where, image_url.get("url"))}}
        return {"type": "image_url", "image_url": {"url": _image_url(where, image_url)}}
    if kind == "image":
        return {"type": "image_url", "image_url": {"url": _image_url(where, part.get("image"))}}
    raise ValueError(f"{where}: a content part of type {kind!r} is not supported (text, image_url or image parts)")


def _image_url(where: str, image: Any) -> str:
    """An image given as a data: URI or http(s) URL (kept), a file path, bytes or a PIL image (a data: URI)."""
    if isinstance(image, str) and image.lower().startswith(("data:", "http://", "https://")):
        return image
    if isinstance(image, bytes | bytearray | memoryview):
        return _data_uri(bytes(image))
    if isinstance(image, str | os.PathLike):
        path = Path(os.fspath(image).removeprefix("file://")).expanduser()
        if not path.is_file():
            raise ValueError(f"{where}: {os.fspath(image)}: no such image file")
        return _data_uri(path.read_bytes())
    if hasattr(image, "save") and hasattr(image, "mode"):  # a PIL image
        out = io.BytesIO()
        image.save(out, "PNG")
        return _data_uri(out.getvalue())
    raise ValueError(f"{where}: an image must be a data: URI, an http(s) URL, a file path, bytes or a PIL image, "
                     f"not {type(image).__name__}")


def _data_uri(data: bytes) -> str:
    """Bytes as a data: URI; lmserve reads the format from the bytes (chat/media.py checks them)."""
    return "data:application/octet-stream;base64," + base64.b64encode(data).decode("ascii")


def _finish(final: Chunk) -> FinishReason:
    assert final.finish_reason is not None
    return final.finish_reason
