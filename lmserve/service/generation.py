"""Generation: chat, completion, native generate and embeddings over the resident models.

Both HTTP dialects call this with engine-neutral records (lmserve.types) and translate its chunks back to their own
wire format. A request resolves its model, leases it from residency, renders and tokenizes its prompt
(service/prompts.py), submits it to the model's engine and streams the pieces through the reasoning parser (the
thinking goes to `Chunk.reasoning`), then the tool-call parser (over the answer only; a `Generation`,
generation_stream.py). How the thinking runs (split off, or first in a phase of its own) is service/thinking.py's."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from lmserve.chat.audio import is_audio
from lmserve.chat.gotemplate import GoChatTemplate
from lmserve.chat.reasoning import (
    ReasoningFormat,
    detect_reasoning,
    get_reasoning_format,
)
from lmserve.chat.tools import FALLBACK_PARSER, ToolCallParser, detect_parser, get_parser
from lmserve.chat.tools.forcing import forced_call_grammar
from lmserve.engine.factory import check_sampling
from lmserve.engine.protocol import GenerationStream, PromptImage, choice_sampling, unit_vector
from lmserve.errors import InvalidRequest
from lmserve.service import embeddings, fim, json_budget, prompts, transcribing
from lmserve.service.catalog import Catalog, ModelSettings
from lmserve.service.embeddings import EmbeddingInput
from lmserve.service.empty import EmptyReply, PromptOnly
from lmserve.service.generation_stream import Generation
from lmserve.service.observers import Observers
from lmserve.service.precedence import Precedence, within_context
from lmserve.service.residency import LoadedModel, Residency, Resident
from lmserve.service.thinking import ThinkingFirst, ThinkingPlan, plan_thinking
from lmserve.types import (
    ChatRequest,
    Chunk,
    CompletionRequest,
    Message,
    RequestOptions,
    SamplingParams,
    Usage,
)


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    """A request's prompt as the engine would prefill it, and what it would sample with (nothing generated)."""

    model: str
    """The model's canonical name."""
    tokens: list[int]
    sampling: SamplingParams


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    plan: ThinkingPlan
    tokens: list[int]
    images: list[PromptImage]
    sampling: SamplingParams
    parser: ToolCallParser | None


class GenerationService:
    """Answers chat, completion, generate and embedding requests, loading models on demand."""

    def __init__(
        self, catalog: Catalog, residency: Residency, precedence: Precedence, observers: Observers, *,
        tool_call_parser: str | None = None, max_messages: int = 1024, max_images: int = 16,
        reasoning_parser: str | None = None, reasoning_budget: int | None = None,
    ) -> None:
        self.catalog = catalog
        self.residency = residency
        self.precedence = precedence
        self.observers = observers
        self.tool_call_parser = get_parser(tool_call_parser).name if tool_call_parser else None
        self.max_messages = max_messages
        self.max_images = max_images
        self.reasoning_parser = get_reasoning_format(reasoning_parser).name if reasoning_parser else None
        self.reasoning_budget = reasoning_budget
        """Most thinking tokens of a reply when the request says nothing (None: no limit)."""

    async def acquire(self, name: str, options: RequestOptions | None = None,
                      keep_alive: float | None = None) -> Resident:
        """Resolve `name`, load it (or find it loaded) with the load-time `options` a request set, and lease it until
        `residency.release`."""
        _, resident = await self.lease(name, options or RequestOptions(), keep_alive)
        return resident

    async def lease(self, name: str, asked: RequestOptions, keep_alive: float | None,
                     ) -> tuple[ModelSettings, Resident]:
        """The model's settings (read once per version of it), and its lease under the load options in force."""
        model = self.catalog.settings(name)
        load = self.residency.serving(model.name, self.precedence.load(model, asked))
        return model, await self.residency.acquire(model.name, load, keep_alive, plan=model.plan(load))

    def check_images(self, name: str, count: int, *, param: str = "messages") -> None:
        """Raise InvalidRequest unless model `name` can see images (it has a vision projector) and `count` images
        are within the server's per-request limit."""
        if not self.catalog.settings(name).has_vision:
            raise InvalidRequest(
                f"model '{name}' has no vision projector (it cannot see images); use a vision model", param=param
            )
        if count > self.max_images:
            raise InvalidRequest(f"{count} images is more than this server accepts in one request ({self.max_images})",
                                 param=param)

    def tool_parser(self, model: LoadedModel) -> ToolCallParser:
        """The server's --tool-call-parser, else the one the model's template implies, else lmserve's own JSON
        calls (FALLBACK_PARSER: the service puts the tools and that call shape in the prompt when the template does
        not render tools; with --tool-call-parser set, forced calls use the named format and the prompt's JSON
        shape is only a hint)."""
        source = model.template_source or model.engine.info.chat_template
        return get_parser(self.tool_call_parser or detect_parser(source) or FALLBACK_PARSER)

    def reasoning_format(self, model: LoadedModel) -> ReasoningFormat | None:
        """The server's --reasoning-parser, else the thinking format the model's template implies; None when the
        model does not think."""
        name = self.reasoning_parser or detect_reasoning(model.template_source or model.engine.info.chat_template)
        return get_reasoning_format(name) if name else None

    def render_chat(self, model: LoadedModel, request: ChatRequest) -> str:
        return prompts.render_chat(model, request, self.max_messages, self.reasoning_format(model))

    async def count_tokens(self, request: ChatRequest) -> int:
        """How many tokens the rendered prompt of `request` has (with its images, tools and system prompt)."""
        resident = await self.acquire(request.model, request.options, request.keep_alive)
        try:
            prompt = self.render_chat(resident.model, request)
            media = [item for message in request.messages for item in prompts.media_of(message)]
            tokens, _ = await prompts.tokenize_prompt(resident.model, prompt, media)
            return len(tokens)
        finally:
            self.residency.release(resident)

    async def chat(self, request: ChatRequest) -> Generation:
        """The answer to a chat request (see `chat_choices`)."""
        [generation] = await self.chat_choices(request, 1)
        return generation

    async def chat_choices(self, request: ChatRequest, n: int) -> list[Generation]:
        """`n` answers to one chat request (the OpenAI `n`): the prompt is prefilled once and shared by the n choices
        (see `Engine.submit_many`), each a Generation with parsers of its own; the model's lease ends with the last."""
        started = time.perf_counter_ns()
        settings, resident = await self.lease(request.model, request.options, request.keep_alive)
        try:
            model = resident.model
            prompt = await self.chat_prompt(settings, model, request)
            checkpoints = prompts.system_checkpoint(model, request, prompt.tokens) if not prompt.images else []
            return self._submit(resident, prompt.plan, prompt.tokens, prompt.sampling, n, prompt.parser,
                                prompt.images, checkpoints, forced=request.forced_tool is not None,
                                max_tool_calls=None if request.parallel_tool_calls else 1, started_ns=started)
        except BaseException:
            self.residency.release(resident)
            raise

    async def chat_prompt(self, settings: ModelSettings, model: LoadedModel, request: ChatRequest) -> ChatPrompt:
        """What a chat request submits: its prompt rendered with the model's template (the thinking plan's), tokenized
        with its images, and the sampling in force (a forced tool call's grammar added)."""
        if model.engine.info.transcriber:
            return await self._speech_prompt(settings, model, request)
        fmt = self.reasoning_format(model)
        text = prompts.render_chat(model, request, self.max_messages, fmt)
        parser = self.tool_parser(model) if request.tools else None
        sampling = self._forcing(request, self.precedence.sampling(settings, request.options, request.sampling),
                                 parser)
        plan = plan_thinking(fmt, text, request.think, self._budget(request.reasoning_budget), sampling)
        media = [item for message in request.messages for item in prompts.media_of(message)]
        tokens, places = await prompts.tokenize_prompt(model, plan.prompt, media)
        return ChatPrompt(plan, tokens, places, sampling, parser)

    async def _speech_prompt(self, settings: ModelSettings, model: LoadedModel, request: ChatRequest) -> ChatPrompt:
        """What a transcription submits to a speech-to-text model: its decoder's prompt (service/transcribing.py)."""
        sampling = self.precedence.sampling(settings, request.options, request.sampling)
        text, tokens, places = await transcribing.speech_prompt(model, request)
        return ChatPrompt(plan_thinking(None, text, False, None, sampling), tokens, places, sampling, None)

    async def render_chat_tokens(self, request: ChatRequest) -> RenderedPrompt:
        """The token ids `chat` would prefill for `request` (rendered and tokenized as it does), without generating:
        vLLM's render endpoints, which gateways call to route by prompt tokens."""
        settings, resident = await self.lease(request.model, request.options, request.keep_alive)
        try:
            prompt = await self.chat_prompt(settings, resident.model, request)
            return RenderedPrompt(resident.model.name, prompt.tokens, prompt.sampling)
        finally:
            self.residency.release(resident)

    async def render_completion_tokens(self, request: CompletionRequest) -> RenderedPrompt:
        """The token ids `complete` would prefill for `request`, without generating (see `render_chat_tokens`)."""
        settings, resident = await self.lease(request.model, request.options, request.keep_alive)
        try:
            tokens = fim.completion_prompt(resident.model, request)
            sampling = self.precedence.sampling(settings, request.options, request.sampling)
            return RenderedPrompt(resident.model.name, tokens, sampling)
        finally:
            self.residency.release(resident)

    def _forcing(self, request: ChatRequest, sampling: SamplingParams,
                 parser: ToolCallParser | None) -> SamplingParams:
        """The request's `sampling`, with a grammar that forces a tool call when `tool_choice` asks for one (closed
        within `max_tokens` as structured output is: service/json_budget.py)."""
        if request.forced_tool is None:
            return sampling
        if parser is None:
            raise InvalidRequest("tool_choice requires tools", param="tool_choice")
        grammar = forced_call_grammar(parser, request.tools, request.forced_tool,
                                      single=not request.parallel_tool_calls)
        return replace(sampling, grammar=grammar, stop=[], logit_bias=dict(sampling.logit_bias),
                       closes_at_limit=True)

    async def complete(self, request: CompletionRequest) -> Generation:
        """The completion of a raw prompt (see `complete_choices`)."""
        [generation] = await self.complete_choices(request, 1)
        return generation

    async def complete_choices(self, request: CompletionRequest, n: int) -> list[Generation]:
        """`n` completions of one prompt (the OpenAI `n`), prefilled once and shared (see `chat_choices`); with
        `request.infill`, of the gap between its prefix and suffix (fill-in-the-middle, service/fim.py)."""
        settings, resident = await self.lease(request.model, request.options, request.keep_alive)
        try:
            tokens = fim.completion_prompt(resident.model, request)
            sampling = self.precedence.sampling(settings, request.options, request.sampling)
            return self._submit(resident, ThinkingPlan(request.prompt), tokens, sampling, n)
        except BaseException:
            self.residency.release(resident)
            raise

    async def generate(
        self, request: CompletionRequest, *, system: str | None = None, template: str | None = None, raw: bool = False,
        think: bool | str | None = None, reasoning_budget: int | None = None,
    ) -> Generation:
        """The native generate: `prompt` rendered as one user turn (unless `raw`), after any `context` tokens.

        Rendered with the model's template, a thinking model's thinking (`think` switches it, `reasoning_budget`
        bounds it) goes to `Chunk.reasoning`."""
        if (raw and not request.images) or request.infill is not None:
            return await self.complete(request)
        started = time.perf_counter_ns()
        settings, resident = await self.lease(request.model, request.options, request.keep_alive)
        try:
            model = resident.model
            sampling = self.precedence.sampling(settings, request.options, request.sampling)
            sent = Message("user", request.prompt, [item for item in request.images if not is_audio(item)],
                           audio=[item for item in request.images if is_audio(item)])
            user = prompts.with_media_markers(model, sent, "images")
            messages = [replace(user, images=[], audio=[])]
            if system is not None:
                messages.insert(0, Message(role="system", content=system))
            if raw:
                prompt = user.content  # the images' markers, then the prompt as it is
            elif template is not None:
                prompt = GoChatTemplate(template, system=model.system).render(messages)
            else:
                prompt = self.render_chat(model, ChatRequest(request.model, messages, sampling, think=think))
            fmt = self.reasoning_format(model) if not raw and template is None else None
            plan = plan_thinking(fmt, prompt, think, self._budget(reasoning_budget), sampling)
            tokens, places = await prompts.tokenize_prompt(model, plan.prompt, prompts.media_of(sent))
            if request.context:
                tokens = list(request.context) + tokens
                places = [PromptImage(p.start + len(request.context), p.length, p.handle) for p in places]
            [generation] = self._submit(resident, plan, tokens, sampling, 1, images=places, started_ns=started)
            return generation
        except BaseException:
            self.residency.release(resident)
            raise

    async def embed(
        self,
        model: str,
        inputs: Sequence[EmbeddingInput],
        *,
        truncate: bool = True,
        options: RequestOptions | None = None,
        keep_alive: float | None = None,
        normalize: bool = True,
        dimensions: int | None = None,
    ) -> tuple[str, list[list[float]], int]:
        """Embed each input, a text or token ids (service/embeddings.py): (canonical model name, one vector per
        input, total prompt tokens).

        Vectors are unit length (unless `normalize` is false); `dimensions` keeps the first N components and
        normalizes again. An input longer than one sequence's context is cut to it when `truncate`, else it is a
        ContextOverflow.
        """
        embeddings.check_inputs(inputs)
        if dimensions is not None and dimensions < 1:
            raise InvalidRequest("dimensions must be at least 1", param="dimensions")
        settings, resident = await self.lease(model, options or RequestOptions(), keep_alive)
        try:
            engine = resident.model.engine
            if not engine.info.can_embed:
                raise InvalidRequest(f"model '{resident.model.name}' cannot make embeddings", param="model")
            inputs_tokens = [embeddings.embedding_prompt(engine, item, i, truncate=truncate)
                             for i, item in enumerate(inputs)]
            vectors = await engine.embed_tokens(inputs_tokens, normalize=normalize and dimensions is None,
                                                adapters=settings.adapters)
        finally:
            self.residency.release(resident)
        if dimensions is not None:
            vectors = [unit_vector(v[:dimensions]) if normalize else v[:dimensions] for v in vectors]
        num_tokens = sum(len(p) for p in inputs_tokens)
        self.observers.finished(resident.model.name, Chunk(finish_reason="stop", usage=Usage(prompt_tokens=num_tokens)))
        return resident.model.name, vectors, num_tokens

    def _budget(self, requested: int | None) -> int | None:
        return requested if requested is not None else self.reasoning_budget

    def _submit(
        self, resident: Resident, plan: ThinkingPlan, tokens: list[int], sampling: SamplingParams, n: int,
        parser: ToolCallParser | None = None, images: list[PromptImage] | None = None,
        checkpoints: list[int] | None = None, *, forced: bool = False, max_tool_calls: int | None = None,
        started_ns: int | None = None,
    ) -> list[Generation]:
        """n Generations of one prompt on one lease (released after the last). Special tokens are kept in the text
        with a tool or reasoning parser (call markers and thinking tags often are special tokens). A thinking-first
        plan runs n two-phase streams (choice i with `choice_sampling(sampling, i)`; they share the prompt through
        the engine's prefix sharing); `max_tokens` 0 asks for no engine work (service/empty.py). `forced`: the
        grammar is a forced tool call's. `started_ns`: when the request began, for `Generation.load_ns` (else 0)."""
        special = parser is not None or plan.format is not None
        engine = resident.model.engine
        check_sampling(engine.info.engine, sampling)  # what the engine does not honour is refused (its SPEC)
        sampling = within_context(engine.info, len(tokens), sampling)
        self._check_grammar(resident, sampling, special=special, forced=forced)
        streams: list[GenerationStream] = []
        if sampling.max_tokens == 0 and sampling.prompt_logprobs is not None:  # the prompt's alone (service/empty.py)
            one = replace(sampling, max_tokens=1)
            streams += [PromptOnly(stream) for stream in engine.submit_many(tokens, one, n, special=special)]
        elif sampling.max_tokens == 0:  # no tokens asked for: no engine work (service/empty.py)
            streams += [EmptyReply(engine, tokens) for _ in range(n)]
        elif plan.format is not None and plan.first:
            try:
                for i in range(n):
                    streams.append(ThinkingFirst(engine, tokens, choice_sampling(sampling, i), plan.format,
                                                 plan.budget, special=True, images=images, checkpoints=checkpoints))
            except BaseException:
                for stream in streams:
                    stream.abort()
                raise
        else:
            streams += engine.submit_many(tokens, sampling, n, special=special, images=images,
                                          checkpoints=checkpoints)
            streams = [json_budget.close_in_budget(engine, stream, sampling, special=special) for stream in streams]
        remaining = [n]

        def release_after_the_last() -> None:
            remaining[0] -= 1
            if remaining[0] == 0:
                self.residency.release(resident)

        load_ns = time.perf_counter_ns() - started_ns if started_ns is not None else 0
        model = resident.model
        return [
            Generation(model=model.name, sampling=sampling, num_prompt_tokens=len(stream.prompt_tokens), stream=stream,
                       on_done=release_after_the_last, load_ns=load_ns, tool_parser=parser,
                       max_tool_calls=max_tool_calls, observers=self.observers, reasoning=plan.format,
                       thinking=plan.state, engine=model.engine, stops=[stop for stop in sampling.stop if stop],
                       counts_prompt=index == 0, forced=forced)
            for index, stream in enumerate(streams)
        ]

    def _check_grammar(self, resident: Resident, sampling: SamplingParams, *, special: bool, forced: bool) -> None:
        if sampling.grammar is not None and not resident.model.engine.info.can_constrain:
            raise InvalidRequest(f"model '{resident.model.name}' cannot constrain its output (structured output and "
                                 "forced tool calls need it)", param="tool_choice" if forced else "response_format")
        if sampling.max_tokens != 0:  # 0 asks for no tokens at all (an empty reply)
            what = "call tool_choice allows" if forced else "reply the requested format allows"
            json_budget.check_budget(resident.model.engine, sampling, special=special, what=what)

