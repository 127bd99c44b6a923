"""The one path of a request: resolve the model, load it, render the prompt, submit, stream the pieces.

Both HTTP dialects call this service with engine-neutral records (lmserve.types) and translate its
chunks back to their own wire format.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from lmserve.chat.gotemplate import GoChatTemplate
from lmserve.chat.media import to_bitmap
from lmserve.chat.tools import StreamingToolParser, ToolCallParser, detect_parser, get_parser
from lmserve.chat.tools.forcing import forced_call_grammar
from lmserve.engine.base import PromptImage
from lmserve.engine.loop import RequestStream
from lmserve.engine.quantize import parse_quant
from lmserve.engine.quantize import quantize as run_quantize
from lmserve.errors import EngineFailure, InvalidRequest, LmserveError, ModelNotFound
from lmserve.loaded import LoadedModel, LoadedModels, Resident
from lmserve.store.modelfile import Modelfile
from lmserve.store.store import Store
from lmserve.types import (
    IMAGE_PLACEHOLDER,
    ChatRequest,
    Chunk,
    CompletionRequest,
    LoadOptions,
    Message,
    SamplingParams,
    ToolCall,
)

log = logging.getLogger(__name__)

DEFAULT_KEEP_ALIVE = 300.0
MAX_KEEP_ALIVE = 100 * 365 * 24 * 3600.0
"""A longer keep_alive means forever (and keeps expiry dates representable)."""

FinishObserver = Callable[[str, Chunk], None]
"""Told (model name, final chunk) when a generation yields its final chunk (e.g. to record metrics)."""


@dataclass(slots=True)
class ModelListing:
    """A model the server can serve, loaded or not."""

    name: str
    created: int
    owned_by: str = "lmserve"
    size: int = 0
    digest: str = ""
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class ModelDescription:
    """What `show` tells about a model."""

    listing: ModelListing
    modelfile: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    template: str = ""
    system: str = ""
    license: str = ""
    model_info: dict[str, Any] = field(default_factory=dict)
    capabilities: list[str] = field(default_factory=lambda: ["completion"])


class Catalog(Protocol):
    """Where model names come from (the store, or a fixed list)."""

    def listing(self) -> list[ModelListing]: ...

    def resolve(self, name: str) -> str:
        """The canonical name of `name`; ModelNotFound when there is none."""
        ...

    def describe(self, name: str) -> ModelDescription: ...

    def has_vision(self, name: str) -> bool:
        """Whether the model has a vision projector (cheaper than `describe`)."""
        ...

    def sampling_defaults(self, name: str) -> SamplingParams:
        """The model's own sampling defaults (its Modelfile PARAMETERs) over the server's."""
        ...

    def load_parameters(self, name: str) -> dict[str, Any]:
        """The model's own load-time options, as LoadOptions field names (e.g. {"num_ctx": 2048})."""
        ...

    def copy(self, source: str, destination: str) -> None: ...

    def delete(self, name: str) -> None: ...


@dataclass(slots=True)
class Generation:
    """A submitted request: its prompt size, its stream of chunks, and the model lease it holds.

    With a tool parser, text is filtered through it: call markup never reaches `Chunk.text`, parsed calls
    arrive in `Chunk.tool_calls`, and a reply that made calls finishes with "tool_calls".
    """

    model: str
    num_prompt_tokens: int
    stream: RequestStream
    on_done: Callable[[], None] = lambda: None
    load_ns: int = 0
    tool_parser: ToolCallParser | None = None
    max_tool_calls: int | None = None
    on_finish: FinishObserver | None = None
    _is_released: bool = field(default=False, repr=False)

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        parsing = StreamingToolParser(self.tool_parser) if self.tool_parser is not None else None
        num_calls = 0
        try:
            async for chunk in self.stream:
                if parsing is not None:
                    chunk, added = _parse_tools(parsing, chunk, num_calls, self.max_tool_calls)
                    num_calls += added
                if chunk.finish_reason is not None and self.on_finish is not None:
                    _notify(self.on_finish, self.model, chunk)
                yield chunk
        finally:
            self._release()

    async def collect(self) -> tuple[str, Chunk]:
        """The whole answer: all its text, and the final chunk carrying every tool call; aborts if this stops early."""
        parts: list[str] = []
        calls: list[ToolCall] = []
        try:
            async for chunk in self:
                parts.append(chunk.text)
                calls += chunk.tool_calls
                if chunk.finish_reason is not None:
                    if chunk.finish_reason in ("error", "abort"):
                        raise EngineFailure(chunk.error or "the generation failed")
                    return "".join(parts), replace(chunk, tool_calls=calls)
        finally:
            self.abort()
        raise EngineFailure("the generation ended without a result")

    @property
    def output_tokens(self) -> list[int]:
        return self.stream.seq.output

    @property
    def prompt_tokens(self) -> list[int]:
        return self.stream.seq.prompt

    def abort(self) -> None:
        self.stream.abort()
        self._release()

    def _release(self) -> None:
        if not self._is_released:
            self._is_released = True
            self.on_done()


def _notify(observer: FinishObserver, model: str, chunk: Chunk) -> None:
    """An observer's failure is logged, never the request's."""
    try:
        observer(model, chunk)
    except Exception:
        log.exception("finish observer failed")


def _parse_tools(
    parsing: StreamingToolParser, chunk: Chunk, num_calls_before: int, max_calls: int | None
) -> tuple[Chunk, int]:
    text, calls = parsing.push(chunk.text)
    if chunk.finish_reason is not None:
        tail, more = parsing.finish()
        text, calls = text + tail, calls + more
    if max_calls is not None:
        calls = calls[: max(0, max_calls - num_calls_before)]
    finish = chunk.finish_reason
    if finish == "stop" and num_calls_before + len(calls) > 0:
        finish = "tool_calls"
    tool_calls = [ToolCall(call.name, call.arguments, call.id) for call in calls]
    return replace(chunk, text=text, tool_calls=tool_calls, finish_reason=finish), len(calls)


class Service:
    """Answers chat and completion requests over the catalog's models, loading them on demand."""

    def __init__(
        self,
        catalog: Catalog,
        loaded: LoadedModels,
        *,
        load_options: LoadOptions | None = None,
        keep_alive: float | None = DEFAULT_KEEP_ALIVE,
        hf_endpoint: str | None = None,
        tool_call_parser: str | None = None,
        max_messages: int = 1024,
        max_images: int = 16,
        on_finish: FinishObserver | None = None,
    ) -> None:
        self.catalog = catalog
        self.loaded = loaded
        self.load_options = load_options or LoadOptions()
        self.keep_alive = keep_alive
        self.hf_endpoint = hf_endpoint
        self.tool_call_parser = get_parser(tool_call_parser).name if tool_call_parser else None
        self.max_messages = max_messages
        self.max_images = max_images
        self.on_finish = on_finish
        """Told of every generation's final chunk; None (the default) observes nothing."""

    # ---- models ----------------------------------------------------------------------------------

    def list_models(self) -> list[ModelListing]:
        return self.catalog.listing()

    def get_model(self, name: str) -> ModelListing:
        canonical = self.catalog.resolve(name)
        for listing in self.catalog.listing():
            if listing.name == canonical:
                return listing
        raise ModelNotFound(name)

    async def acquire(
        self, name: str, options: LoadOptions | None = None, keep_alive: float | None = None
    ) -> Resident:
        """Load (or find) the model and hold it until `loaded.release`.

        `keep_alive` None leaves a loaded model's lease as it is (a model preloaded by `serve` stays loaded) and
        gives a newly loaded one the server default; negative means forever; otherwise seconds after last use.
        """
        canonical = self.catalog.resolve(name)
        current = self.loaded.get(canonical)
        if keep_alive is None:
            lease = current.keep_alive if current is not None else self.keep_alive
        else:
            lease = self._keep_alive(keep_alive)
        return await self.loaded.acquire(canonical, options or self.load_defaults(canonical), lease)

    def load_defaults(self, name: str) -> LoadOptions:
        """Load-time options for `name`: its Modelfile PARAMETERs (num_ctx, num_batch …) over the server's."""
        return replace(self.load_options, **self.catalog.load_parameters(self.catalog.resolve(name)))

    async def sampling_defaults(self, name: str) -> SamplingParams:
        """The model's Modelfile PARAMETERs over the server defaults (a request's own fields go on top)."""
        defaults = self.catalog.sampling_defaults(self.catalog.resolve(name))
        return replace(defaults, stop=list(defaults.stop), logit_bias=dict(defaults.logit_bias))

    @staticmethod
    def _keep_alive(keep_alive: float) -> float | None:
        """Negative, infinite or beyond a century → forever (None); else seconds. NaN is refused."""
        if math.isnan(keep_alive):
            raise InvalidRequest("keep_alive must be a number of seconds or a duration, not NaN", param="keep_alive")
        if keep_alive < 0 or keep_alive > MAX_KEEP_ALIVE:
            return None
        return keep_alive

    # ---- requests --------------------------------------------------------------------------------

    def render_chat(self, model: LoadedModel, request: ChatRequest) -> str:
        _check_messages(request.messages)
        if len(request.messages) > self.max_messages:
            raise InvalidRequest(
                f"{len(request.messages)} messages is more than this server accepts ({self.max_messages})",
                param="messages",
            )
        return model.template.render(
            self._conversation(model, request), tools=request.tools or None,
            add_generation_prompt=request.add_generation_prompt,
        )

    def _conversation(self, model: LoadedModel, request: ChatRequest) -> list[Message]:
        """The Modelfile's MESSAGEs, then the request's (images as markers), with the model's SYSTEM if none."""
        messages = list(model.messages) + [
            self._with_image_markers(model, m, f"messages[{i}]") for i, m in enumerate(request.messages)
        ]
        if model.system is not None and not any(m.role in ("system", "developer") for m in messages):
            messages.insert(0, Message(role="system", content=model.system))
        return messages

    def _system_checkpoint(self, model: LoadedModel, request: ChatRequest, tokens: list[int]) -> list[int]:
        """Where the system prompt ends in `tokens`, for a model whose memory cannot be cut (its state there is
        snapshotted, so other conversations with that system prompt start from it); [] when unknown."""
        if model.engine.info.can_cut_memory:
            return []
        messages = self._conversation(model, request)
        count = next((i for i, m in enumerate(messages) if m.role not in ("system", "developer")), len(messages))
        if count == 0 or count == len(messages):
            return []
        try:  # some templates refuse a conversation without a user turn: then there is no checkpoint
            head = model.template.render(messages[:count], tools=request.tools or None, add_generation_prompt=False)
        except LmserveError:
            return []
        prefix = self._tokenize(model, head)
        return [len(prefix)] if tokens[: len(prefix)] == prefix else []

    async def chat(self, request: ChatRequest) -> Generation:
        started = time.perf_counter_ns()
        resident = await self.acquire(request.model, request.options, request.keep_alive)
        try:
            model = resident.model
            prompt = self.render_chat(model, request)
            parser = self.tool_parser(model) if request.tools else None
            sampling = request.sampling
            if request.forced_tool is not None:
                if parser is None:
                    raise InvalidRequest(
                        f"model '{model.name}' has no known tool-call format to force a call in; start the server "
                        "with --tool-call-parser",
                        param="tool_choice",
                    )
                grammar = forced_call_grammar(parser, request.tools, request.forced_tool)
                sampling = replace(sampling, grammar=grammar, stop=[], logit_bias=dict(sampling.logit_bias))
            images = [image for message in request.messages for image in message.images]
            tokens, places = await self._tokenize_prompt(model, prompt, images)
            checkpoints = self._system_checkpoint(model, request, tokens) if not images else []
            generation = self._submit(resident, tokens, sampling, parser, places, checkpoints)
            generation.max_tool_calls = None if request.parallel_tool_calls else 1
            generation.load_ns = time.perf_counter_ns() - started
            return generation
        except BaseException:
            self.loaded.release(resident)
            raise

    def tool_parser(self, model: LoadedModel) -> ToolCallParser | None:
        """The server's --tool-call-parser, else the one the model's template implies; None when unknown."""
        name = self.tool_call_parser or detect_parser(model.template_source or model.engine.info.chat_template)
        return get_parser(name) if name else None

    async def complete(self, request: CompletionRequest) -> Generation:
        resident = await self.acquire(request.model, request.options, request.keep_alive)
        try:
            tokens = list(request.context) + self._tokenize(resident.model, request.prompt)
            return self._submit(resident, tokens, request.sampling)
        except BaseException:
            self.loaded.release(resident)
            raise

    async def generate(
        self, request: CompletionRequest, *, system: str | None = None, template: str | None = None, raw: bool = False
    ) -> Generation:
        """The native generate: `prompt` rendered as one user turn (unless `raw`), after any `context` tokens."""
        if raw and not request.images:
            return await self.complete(request)
        started = time.perf_counter_ns()
        resident = await self.acquire(request.model, request.options, request.keep_alive)
        try:
            model = resident.model
            user = self._with_image_markers(model, Message("user", request.prompt, list(request.images)), "images")
            messages = [replace(user, images=[])]
            if system is not None:
                messages.insert(0, Message(role="system", content=system))
            if raw:
                prompt = user.content  # the images' markers, then the prompt as it is
            elif template is not None:
                prompt = GoChatTemplate(template, system=model.system).render(messages)
            else:
                prompt = self.render_chat(model, ChatRequest(request.model, messages, request.sampling))
            tokens, places = await self._tokenize_prompt(model, prompt, request.images)
            if request.context:
                tokens = list(request.context) + tokens
                places = [PromptImage(p.start + len(request.context), p.length, p.handle) for p in places]
            generation = self._submit(resident, tokens, request.sampling, images=places)
            generation.load_ns = time.perf_counter_ns() - started
            return generation
        except BaseException:
            self.loaded.release(resident)
            raise

    async def load(self, name: str, options: LoadOptions | None = None, keep_alive: float | None = None) -> str:
        """Load a model without generating (an empty prompt); returns its canonical name."""
        resident = await self.acquire(name, options, keep_alive)
        self.loaded.release(resident)
        return resident.model.name

    def describe(self, name: str) -> ModelDescription:
        return self.catalog.describe(self.catalog.resolve(name))

    def check_images(self, name: str, count: int, *, param: str = "messages") -> None:
        """Raise InvalidRequest unless model `name` can see images (it has a vision projector) and `count` images
        are within the server's per-request limit."""
        if not self.catalog.has_vision(self.catalog.resolve(name)):
            raise InvalidRequest(
                f"model '{name}' has no vision projector (it cannot see images); use a vision model", param=param
            )
        if count > self.max_images:
            raise InvalidRequest(f"{count} images is more than this server accepts in one request ({self.max_images})",
                                 param=param)

    def copy(self, source: str, destination: str) -> None:
        self.catalog.copy(self.catalog.resolve(source), destination)

    async def delete(self, name: str) -> None:
        canonical = self.catalog.resolve(name)
        await self.loaded.unload(canonical)
        self.catalog.delete(canonical)

    def create(
        self, name: str, modelfile: Modelfile, *, base_dir: Path | None = None, quantize: str | None = None
    ) -> None:
        """Create (or replace) a stored model from a Modelfile, quantizing its weights when asked."""
        create = getattr(self.catalog, "create", None)
        if create is None:
            raise InvalidRequest("this server serves a fixed model; start it with a model store to create models")
        quantizer = None
        if quantize is not None:
            level = quantize
            parse_quant(level)

            def quantizer(source: Path) -> Path:
                destination = source.with_name(f".quantized-{level}-{source.name}")
                run_quantize(source, destination, level)
                return destination

        create(name, modelfile, base_dir=base_dir, quantize=quantizer)

    @property
    def store(self) -> Store:
        store = getattr(self.catalog, "store", None)
        if not isinstance(store, Store):
            raise InvalidRequest("this server serves a fixed model and has no model store")
        return store

    def running(self) -> list[Resident]:
        return self.loaded.running()

    async def unload(self, name: str) -> bool:
        return await self.loaded.unload(self.catalog.resolve(name))

    def _tokenize(self, model: LoadedModel, prompt: str) -> list[int]:
        return model.engine.tokenize(prompt, add_special=True, parse_special=True)

    @staticmethod
    def _with_image_markers(model: LoadedModel, message: Message, where: str) -> Message:
        """`message` with the model's image marker where each image goes (its placeholders, else before the text);
        400 when the model has no vision."""
        if not message.images:
            return message
        param = "messages" if where.startswith("messages") else "images"
        marker = model.engine.info.image_marker
        if marker is None:
            raise InvalidRequest(
                f"{where} contains an image, but model '{model.name}' has no vision projector (it cannot see images)",
                param=param,
            )
        places = message.content.count(IMAGE_PLACEHOLDER)
        if places == 0:
            return replace(message, content=marker * len(message.images) + message.content)
        if places != len(message.images):
            raise InvalidRequest(f"{where} has {len(message.images)} images but {places} image placeholders "
                                 "(U+FFFC) in its text", param=param)
        return replace(message, content=message.content.replace(IMAGE_PLACEHOLDER, marker))

    async def _tokenize_prompt(
        self, model: LoadedModel, prompt: str, images: list[bytes]
    ) -> tuple[list[int], list[PromptImage]]:
        """The prompt's tokens and, with images, their places (decoded and preprocessed off the event loop)."""
        if not images:
            return self._tokenize(model, prompt), []

        def prepare() -> tuple[list[int], list[PromptImage]]:
            return model.engine.tokenize_images(prompt, [to_bitmap(image) for image in images])

        return await asyncio.to_thread(prepare)

    def _submit(
        self, resident: Resident, tokens: list[int], sampling: SamplingParams, parser: ToolCallParser | None = None,
        images: list[PromptImage] | None = None, checkpoints: list[int] | None = None,
    ) -> Generation:
        # With a tool parser, special tokens are kept in the text: call markers are often special tokens.
        stream = resident.model.engine.submit(tokens, sampling, special=parser is not None, images=images,
                                              checkpoints=checkpoints)
        return Generation(
            model=resident.model.name,
            num_prompt_tokens=len(tokens),
            stream=stream,
            on_done=lambda: self.loaded.release(resident),
            tool_parser=parser,
            on_finish=self.on_finish,
        )

    def fail_all(self, message: str) -> None:
        """End every request in flight, on every loaded model, with an error carrying `message`."""
        for resident in self.loaded.running():
            resident.model.engine.fail_all(message)

    def close(self) -> None:
        self.loaded.close()

    def pull(self, name: str, progress: Callable[[dict[str, Any]], None]) -> None:
        """Download `hf.co/<org>/<repo>[:QUANT]` (and its mmproj projector) and register it as that model.

        Blocking: run it in a worker thread. Files go to `<store>/hf-cache` (so a second pull downloads nothing and
        an interrupted one resumes) and are hard-linked into the store. `progress` gets the local runner's
        `/api/pull` lines, `{status, digest, total, completed}` without empty fields, then "writing manifest" and
        "success"; an exception it raises stops the download. The hub is `hf_endpoint`, else HF_ENDPOINT, else
        huggingface.co; the token is HF_TOKEN, else the stored huggingface token.
        """
        from lmserve.store.names import parse_name
        from lmserve.store.pull import PullProgress
        from lmserve.store.pull import pull as pull_files

        parsed = parse_name(name)
        if not parsed.is_hub:
            raise InvalidRequest(
                f"cannot pull '{name}': only hf.co/<org>/<repo>[:QUANT] names can be pulled (there is no other "
                "registry); create local models with `create`",
                param="model",
            )
        cache_dir = self.store.root / "hf-cache"

        def report(event: PullProgress) -> None:
            fields = {"status": event.status, "digest": event.digest, "total": event.total,
                      "completed": event.completed}
            progress({key: value for key, value in fields.items() if value is not None})

        files = pull_files(
            parsed,
            endpoint=self.hf_endpoint or os.environ.get("HF_ENDPOINT") or None,
            token=os.environ.get("HF_TOKEN") or None,
            cache_dir=cache_dir,
            progress=report,
        )
        progress({"status": "writing manifest"})
        projector = str(files.projector.resolve()) if files.projector is not None else None
        self.create(str(parsed), Modelfile(from_=str(files.model.resolve()), projector=projector))
        progress({"status": "success"})

    async def embed(
        self,
        model: str,
        inputs: list[str],
        *,
        truncate: bool = True,
        options: LoadOptions | None = None,
        keep_alive: float | None = None,
        normalize: bool = True,
        dimensions: int | None = None,
    ) -> tuple[str, list[list[float]], int]:
        """Embed each input: (canonical model name, one vector per input, total prompt tokens).

        Vectors are unit length (unless `normalize` is false); `dimensions` keeps the first N components and
        normalizes again. A text longer than one sequence's context is cut to it when `truncate`, else it is a
        ContextOverflow.
        """
        from lmserve.engine.loop import unit_vector

        if not inputs:
            raise InvalidRequest("input must contain at least one text", param="input")
        for i, text in enumerate(inputs):
            if not text:
                raise InvalidRequest(f"input[{i}] is empty", param="input")
        if dimensions is not None and dimensions < 1:
            raise InvalidRequest("dimensions must be at least 1", param="dimensions")
        resident = await self.acquire(model, options, keep_alive)
        try:
            engine = resident.model.engine
            prompts = [engine.embedding_tokens(text, truncate=truncate) for text in inputs]
            vectors = await engine.embed_tokens(prompts, normalize=normalize and dimensions is None)
        finally:
            self.loaded.release(resident)
        if dimensions is not None:
            vectors = [unit_vector(v[:dimensions]) if normalize else v[:dimensions] for v in vectors]
        return resident.model.name, vectors, sum(len(p) for p in prompts)


def _check_messages(messages: list[Message]) -> None:
    if not messages:
        raise InvalidRequest("messages must contain at least one message", param="messages")


