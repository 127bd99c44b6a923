"""The OpenAI dialect: /v1 routes, and the translators between its wire format and lmserve's records.

A request is parsed into a wire model (schemas.py), translated once into an engine-neutral record
(`to_chat_request`, `to_completion_request`, `to_options`), answered by the service, and its
chunks translated back (`chat_completion`, `chat_frames`, `text_completion`, `completion_frames`).
Errors the service raises (unknown model, bad messages, context overflow) surface before any byte of a
streamed answer is sent, so they are ordinary HTTP errors.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import struct
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, cast

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from lmserve import options as opts
from lmserve.chat.media import MediaPolicy, load_all, load_url
from lmserve.chat.structured import json_object_grammar, schema_grammar
from lmserve.dialects.openai import schemas
from lmserve.dialects.openai.chat_records import keeper
from lmserve.dialects.openai.choices import Choices, gather_all, merged, merged_frames
from lmserve.dialects.openai.completions import Prompt, completion_prompts, echo_of, first_piece, single_prompt
from lmserve.dialects.shared import logprobs as logprob_wire
from lmserve.dialects.shared.errors import INTERNAL_ERROR, openai_error
from lmserve.dialects.shared.json_body import JsonBodyRoute
from lmserve.dialects.shared.state import CompletionsDep, MediaDep, ServedDep, ServiceDep
from lmserve.dialects.shared.streaming import (
    HOLE,
    SSE_DONE,
    GenerationResponse,
    TextFrame,
    dumps,
    guarded_errors,
    sse_json,
    until_disconnect,
)
from lmserve.errors import EngineFailure, InvalidRequest, LmserveError
from lmserve.parsing import chat_role
from lmserve.service import Generation, ModelListing, Service
from lmserve.store.completions import CompletionStore
from lmserve.types import (
    EFFORTS,
    IMAGE_PLACEHOLDER,
    ChatRequest,
    Chunk,
    Infill,
    Message,
    RequestOptions,
    SamplingParams,
    TokenLogprob,
    ToolCall,
    Usage,
)
from lmserve.types import CompletionRequest as EngineCompletionRequest

log = logging.getLogger(__name__)

Head = dict[str, Any]


# ---- requests → records ---------------------------------------------------------------------------


def to_options(req: schemas.SamplingFields) -> RequestOptions:
    """The body's sampling fields (lmserve/options.py names and checks them; the service puts them over the model's
    and the server's). Fields that would change the reply but that lmserve does not do (best_of, load-time options
    …) are refused with a 400 naming them. `n` is the dialect's own (`chat_choices`, `completion_choices`)."""
    return RequestOptions(opts.from_openai(req.model_dump(exclude_unset=True, exclude={"n"})))


def to_chat_request(req: schemas.ChatCompletionRequest, images: list[list[bytes]] | None = None, *,
                    add_generation_prompt: bool = True) -> ChatRequest:
    """The engine-neutral chat request. Tools are passed as the JSON objects the template expects.

    `images[i]` are message i's images, already loaded (see `load_images`); without them, image parts are refused.
    `add_generation_prompt` false renders the chat without the assistant turn's opening (/tokenize).
    """
    if images is None:
        if has_images(req):
            raise InvalidRequest("this request's images were not loaded", param="messages")
        images = [[] for _ in req.messages]
    messages = [_to_message(i, m, images[i]) for i, m in enumerate(req.messages)]
    tools = [] if not req.tools or req.tool_choice == "none" else [t.model_dump(exclude_none=True) for t in req.tools]
    forced = _forced_tool(req.tool_choice, tools)
    sampling = SamplingParams(grammar=response_grammar(req.response_format),
                              logprobs=logprob_wire.asked(req.logprobs, req.top_logprobs))
    return ChatRequest(model=req.model, messages=messages, sampling=sampling, tools=tools, forced_tool=forced,
                       parallel_tool_calls=req.parallel_tool_calls is not False, think=to_think(req),
                       reasoning_budget=req.reasoning_budget, add_generation_prompt=add_generation_prompt,
                       options=to_options(req))


def to_think(req: schemas.ChatCompletionRequest) -> bool | str | None:
    """`reasoning_effort` as lmserve's `think` (types.EFFORTS), else
    `chat_template_kwargs.enable_thinking`; None leaves it to the model."""
    if req.reasoning_effort is not None:
        return EFFORTS[req.reasoning_effort]
    enable = (req.chat_template_kwargs or {}).get("enable_thinking")
    if enable is None:
        return None
    if not isinstance(enable, bool):
        raise InvalidRequest("chat_template_kwargs.enable_thinking must be true or false",
                             param="chat_template_kwargs")
    return enable


def response_grammar(response_format: schemas.ResponseFormat | None) -> str | None:
    """The grammar that enforces `response_format` (json_object: any object, or its `schema` (llama-server's
    extension); json_schema: its schema)."""
    if response_format is None or isinstance(response_format, schemas.TextFormat):
        return None
    if isinstance(response_format, schemas.JsonObjectFormat):
        if response_format.schema_ is not None:
            return schema_grammar(response_format.schema_, param="response_format")
        return json_object_grammar()
    if response_format.json_schema.schema_ is None:
        raise InvalidRequest("Missing required parameter: 'response_format.json_schema.schema'.",
                             param="response_format")
    return schema_grammar(response_format.json_schema.schema_, param="response_format")


def _forced_tool(choice: str | schemas.NamedToolChoice | None, tools: list[dict[str, Any]]) -> str | None:
    """tool_choice "required" → "*" (any tool); a named choice → that name, which must be among the tools."""
    if choice in (None, "auto", "none"):
        return None
    if not tools:
        raise InvalidRequest("tool_choice requires tools", param="tool_choice")
    if choice == "required":
        return "*"
    assert isinstance(choice, schemas.NamedToolChoice)
    name = choice.function.name
    if name not in {t["function"]["name"] for t in tools}:
        raise InvalidRequest(f"tool_choice names '{name}', which is not among the tools", param="tool_choice")
    return name


def _to_message(index: int, m: schemas.ChatMessage, images: list[bytes]) -> Message:
    text = _content(m.content)
    calls = [ToolCall(c.function.name, _arguments(c.function.arguments), c.id) for c in m.tool_calls or ()]
    role = chat_role(m.role)
    return Message(role=role, content=text, images=images, tool_calls=calls, tool_call_id=m.tool_call_id, name=m.name,
                   thinking=m.reasoning_content or "")


def _arguments(arguments: str | dict[str, Any]) -> str:
    return arguments if isinstance(arguments, str) else dumps(arguments)


def _content(content: str | list[schemas.ContentPart] | None) -> str:
    """Text (and refusal) parts in order, a newline between two texts; each image part is an IMAGE_PLACEHOLDER
    where it stood (its bytes are carried apart: `load_images`)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out = ""
    previous_is_text = False
    for part in content:
        if isinstance(part, schemas.ImagePart):
            out += IMAGE_PLACEHOLDER
            previous_is_text = False
            continue
        text = part.text if isinstance(part, schemas.TextPart) else part.refusal
        out += ("\n" if previous_is_text else "") + text
        previous_is_text = True
    return out


def _image_urls(req: schemas.ChatCompletionRequest) -> list[list[tuple[str, str]]]:
    """Per message, its image parts as (where, url)."""
    return [
        [(f"messages[{i}].content[{j}].image_url.url", part.image_url.url)
         for j, part in enumerate(m.content) if isinstance(part, schemas.ImagePart)]
        if isinstance(m.content, list) else []
        for i, m in enumerate(req.messages)
    ]


def has_images(req: schemas.ChatCompletionRequest) -> bool:
    return any(_image_urls(req))


async def load_images(req: schemas.ChatCompletionRequest, policy: MediaPolicy) -> list[list[bytes]]:
    """Each message's images as checked bytes: data URIs decoded, http(s) URLs fetched (concurrently) under `policy`.

    Any refusal is a 400 naming the part and saying why (see chat/media.py).
    """
    return await load_all([[(where, load_url(url, policy)) for where, url in parts] for parts in _image_urls(req)],
                          param="messages")


def to_completion_request(req: schemas.CompletionRequest, prompt: Prompt | None = None) -> EngineCompletionRequest:
    """The engine-neutral completion of `prompt` (one of the request's prompts; None: its only one); with a `suffix`,
    fill-in-the-middle (the prompt is the text before the gap)."""
    prompt = single_prompt(req.prompt) if prompt is None else prompt
    logprobs = logprob_wire.legacy_asked(req.logprobs)
    sampling = SamplingParams(logprobs=logprobs, prompt_logprobs=logprobs if req.echo else None)
    tokens = prompt if isinstance(prompt, list) else None
    text = prompt if isinstance(prompt, str) else ""
    if req.suffix and tokens is not None:
        raise InvalidRequest("a suffix (fill-in-the-middle) needs the prompt as text, not token ids", param="suffix")
    infill = Infill(text, req.suffix) if req.suffix else None
    return EngineCompletionRequest(model=req.model, prompt="" if infill else text, sampling=sampling,
                                   options=to_options(req), infill=infill, prompt_tokens=tokens)


# ---- records → responses --------------------------------------------------------------------------


def make_head(kind: str, model: str) -> Head:
    """Fields shared by a response and all its chunks: same id and created everywhere."""
    prefix = "chatcmpl" if kind.startswith("chat.") else "cmpl"
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": system_fingerprint(model),
    }


def system_fingerprint(model: str) -> str:
    return "fp_" + hashlib.sha256(model.encode()).hexdigest()[:10]


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
    }


def tool_call_body(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def chat_completion(head: Head, text: str, final: Chunk, usage: Usage, *, logprobs: bool = False) -> dict[str, Any]:
    """The whole chat completion; with `logprobs`, every token's (`final.logprobs`, gathered by `collect`)."""
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    if final.reasoning:
        message["reasoning_content"] = final.reasoning
    if final.tool_calls:
        message["tool_calls"] = [tool_call_body(call) for call in final.tool_calls]
        message["content"] = text.strip() or None
    shaped = logprob_wire.chat_logprobs(final.logprobs) if logprobs else None
    choice = {"index": 0, "message": message, "logprobs": shaped, "finish_reason": final.finish_reason}
    return {**head, "choices": [choice], "usage": usage_body(usage)}


def text_completion(head: Head, text: str, final: Chunk, usage: Usage, *, logprobs: bool = False,
                    first: str | None = None) -> dict[str, Any]:
    """The whole legacy completion; with `logprobs`, every token's in the legacy shape, after the echoed prompt's
    (`first`: the text of its first token; see `LegacyLogprobs.echoed`) when it echoes it."""
    shaped = None
    if logprobs:
        legacy = logprob_wire.LegacyLogprobs()
        shaped = legacy(final.logprobs) if first is None else \
            logprob_wire.joined(legacy.echoed(first, final.prompt_logprobs or []), legacy(final.logprobs))
    choice = {"index": 0, "text": text, "logprobs": shaped, "finish_reason": final.finish_reason}
    return {**head, "choices": [choice], "usage": usage_body(usage)}


async def collect(generation: Generation) -> tuple[str, Chunk, Usage]:
    """The whole answer of a generation (tool calls gathered on the final chunk), and its usage."""
    text, final = await generation.collect()
    return text, final, _usage(generation, final)


def _usage(generation: Generation, final: Chunk) -> Usage:
    return final.usage if final.usage is not None else Usage(prompt_tokens=generation.num_prompt_tokens)


def _frame(head: Head, choice: dict[str, Any] | None, include_usage: bool) -> dict[str, Any]:
    frame = {**head, "choices": [choice] if choice is not None else []}
    if include_usage:
        frame["usage"] = None
    return frame


def _delta(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def _text(text: str, finish_reason: str | None = None) -> dict[str, Any]:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}


async def chat_frames(
    generation: Generation, head: Head, include_usage: bool, *, logprobs: bool = False
) -> AsyncIterator[bytes]:
    """SSE frames of a chat completion: role, thinking (`reasoning_content`) and content deltas, finish, optional
    usage, [DONE]. With `logprobs`, each chunk's token logprobs ride on its first delta."""
    content = TextFrame(_frame(head, _delta({"content": HOLE}), include_usage))
    reasoning = TextFrame(_frame(head, _delta({"reasoning_content": HOLE}), include_usage))
    yield sse_json(_frame(head, _delta({"role": "assistant", "content": ""}), include_usage))
    num_calls = 0
    async for chunk in generation:
        entries = chunk.logprobs if logprobs else []
        if chunk.reasoning:
            yield _with_logprobs(head, {"reasoning_content": chunk.reasoning}, entries, include_usage) if entries \
                else reasoning(chunk.reasoning)
            entries = []
        if chunk.text:
            yield _with_logprobs(head, {"content": chunk.text}, entries, include_usage) if entries \
                else content(chunk.text)
            entries = []
        if entries:  # tokens of tool-call markup
            yield _with_logprobs(head, {}, entries, include_usage)
        for call in chunk.tool_calls:
            for delta in tool_call_deltas(num_calls, call):
                yield sse_json(_frame(head, _delta(delta), include_usage))
            num_calls += 1
        if chunk.finish_reason is not None:
            async for frame in _finish(generation, head, chunk, _delta({}, chunk.finish_reason), include_usage):
                yield frame
            return


def _with_logprobs(head: Head, delta: dict[str, Any], entries: list[TokenLogprob], include_usage: bool) -> bytes:
    choice = {**_delta(delta), "logprobs": logprob_wire.chat_logprobs(entries)}
    return sse_json(_frame(head, choice, include_usage))


def tool_call_deltas(index: int, call: ToolCall) -> list[dict[str, Any]]:
    """A call as stream deltas: index, id, type, name and empty arguments first; then the arguments."""
    head = {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
    return [{"tool_calls": [head]}, {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}]


async def completion_frames(
    generation: Generation, head: Head, include_usage: bool, echo: str = "", *, logprobs: bool = False
) -> AsyncIterator[bytes]:
    """SSE frames of a legacy completion: the echoed prompt (with `logprobs`, its tokens' once the engine gave them),
    text pieces (with `logprobs`, each with its tokens' in the legacy shape), finish, optional usage, [DONE]."""
    content = TextFrame(_frame(head, _text(HOLE), include_usage))
    legacy = logprob_wire.LegacyLogprobs()
    if echo and not logprobs:
        yield content(echo)
    async for chunk in generation:
        if chunk.prompt_logprobs is not None and echo and logprobs:
            shaped = legacy.echoed(first_piece(generation), chunk.prompt_logprobs)
            yield sse_json(_frame(head, {**_text(echo), "logprobs": shaped}, include_usage))
            continue
        if logprobs and chunk.logprobs:
            yield sse_json(_frame(head, {**_text(chunk.text), "logprobs": legacy(chunk.logprobs)}, include_usage))
        elif chunk.text:
            yield content(chunk.text)
        if chunk.finish_reason is not None:
            async for frame in _finish(generation, head, chunk, _text("", chunk.finish_reason), include_usage):
                yield frame
            return


async def _finish(
    generation: Generation, head: Head, final: Chunk, choice: dict[str, Any], include_usage: bool
) -> AsyncIterator[bytes]:
    if final.is_failed:
        yield error_frame(EngineFailure(final.error or "the generation failed"))
        return
    yield sse_json(_frame(head, choice, include_usage))
    if include_usage:
        yield sse_json({**head, "choices": [], "usage": usage_body(_usage(generation, final))})
    yield SSE_DONE


async def chat_choices(
    service: Service, record: ChatRequest, body: schemas.ChatCompletionRequest, request: Request,
    completion_store: CompletionStore | None = None,
) -> Response:
    """A chat completion of `n` > 1 choices: each answered as a one-choice reply, merged (api/choices.py); kept in
    `completion_store` when the request asks (`store: true`)."""
    choices = Choices(await service.generation.chat_choices(record, body.n or 1))
    head = make_head("chat.completion.chunk" if body.stream else "chat.completion", choices.model)
    keep = keeper(completion_store, body, head)
    if body.stream:
        streams = [chat_frames(generation, head, True, logprobs=bool(body.logprobs))
                   for generation in choices.generations]
        frames = merged_frames(streams, head, body.include_usage or keep is not None)
        if keep is not None:
            frames = keep.stream(frames)
        return GenerationResponse(choices, guarded_errors(frames, error_frame))
    work = gather_all([collect(generation) for generation in choices.generations], choices)
    results = await until_disconnect(work, request.receive)
    completion = merged([chat_completion(head, text, final, usage, logprobs=bool(body.logprobs))
                         for text, final, usage in results])
    if keep is not None:
        await keep.whole(completion)
    return JSONResponse(completion)


async def completion_choices(
    service: Service, prompts: list[Prompt], body: schemas.CompletionRequest, request: Request
) -> Response:
    """A legacy completion of several prompts or `n` > 1 choices (api/completions.py): every prompt's choices,
    in prompt order, merged as `chat_choices` (each echoing its prompt when asked)."""
    n = body.n or 1
    generations: list[Generation] = []
    echoes: list[str] = []
    try:
        for prompt in prompts:
            made = await service.generation.complete_choices(to_completion_request(body, prompt), n)
            generations += made
            echoes += [echo_of(prompt, generation) if body.echo else "" for generation in made]
    except BaseException:
        Choices(generations).abort()
        raise
    choices = Choices(generations)
    head = make_head("text_completion", choices.model)
    logprobs = body.logprobs is not None
    if body.stream:
        streams = [completion_frames(generation, head, True, echo, logprobs=logprobs)
                   for generation, echo in zip(generations, echoes, strict=True)]
        return GenerationResponse(choices, guarded_errors(merged_frames(streams, head, body.include_usage, n),
                                                          error_frame))
    work = gather_all([collect(generation) for generation in generations], choices)
    results = await until_disconnect(work, request.receive)
    return JSONResponse(merged([text_completion(head, echo + text, final, usage, logprobs=logprobs,
                                                first=first_piece(generation) if body.echo else None)
                                for (text, final, usage), echo, generation
                                in zip(results, echoes, generations, strict=True)], n))


def error_frame(exc: Exception) -> bytes:
    """An error after the stream started: one `data: {"error": …}` event, then the stream ends."""
    err = exc if isinstance(exc, LmserveError) else LmserveError(INTERNAL_ERROR)
    return sse_json(openai_error(err))


# ---- routes ---------------------------------------------------------------------------------------


def model_card(model: ModelListing) -> dict[str, Any]:
    return {"id": model.name, "object": "model", "created": model.created, "owned_by": model.owned_by}


router = APIRouter(prefix="/v1", route_class=JsonBodyRoute)



@router.post("/chat/completions", response_model=None)
async def chat_completions(service: ServiceDep, policy: MediaDep, completion_store: CompletionsDep,
                           body: schemas.ChatCompletionRequest, request: Request) -> Response:
    images = None
    if has_images(body):
        service.generation.check_images(body.model, sum(map(len, _image_urls(body))))  # before fetching anything
        images = await load_images(body, policy)
    chat_request = to_chat_request(body, images)
    if body.n is not None and body.n > 1:
        return await chat_choices(service, chat_request, body, request, completion_store)
    generation = await service.generation.chat(chat_request)
    head = make_head("chat.completion.chunk" if body.stream else "chat.completion", generation.model)
    keep = keeper(completion_store, body, head)
    if body.stream:
        frames = chat_frames(generation, head, body.include_usage or keep is not None, logprobs=bool(body.logprobs))
        if keep is not None:
            frames = keep.stream(frames)
        return GenerationResponse(generation, guarded_errors(frames, error_frame))
    text, final, usage = await until_disconnect(collect(generation), request.receive)
    completion = chat_completion(head, text, final, usage, logprobs=bool(body.logprobs))
    if keep is not None:
        await keep.whole(completion)
    return JSONResponse(completion)


@router.post("/completions", response_model=None)
async def completions(service: ServiceDep, body: schemas.CompletionRequest, request: Request) -> Response:
    prompts = completion_prompts(body.prompt)
    if len(prompts) > 1 or (body.n is not None and body.n > 1):
        return await completion_choices(service, prompts, body, request)
    generation = await service.generation.complete(to_completion_request(body, prompts[0]))
    head = make_head("text_completion", generation.model)
    echo = echo_of(prompts[0], generation) if body.echo else ""
    if body.stream:
        frames = completion_frames(generation, head, body.include_usage, echo, logprobs=body.logprobs is not None)
        return GenerationResponse(generation, guarded_errors(frames, error_frame))
    text, final, usage = await until_disconnect(collect(generation), request.receive)
    return JSONResponse(text_completion(head, echo + text, final, usage, logprobs=body.logprobs is not None,
                                        first=first_piece(generation) if body.echo else None))


@router.get("/models")
async def list_models(served: ServedDep, service: ServiceDep) -> dict[str, Any]:
    listing = sorted(service.models.listing(), key=lambda m: m.name != served)  # stable: the rest keep order
    return {"object": "list", "data": [model_card(m) for m in listing]}


@router.get("/models/{model_id:path}")
async def get_model(service: ServiceDep, model_id: str) -> dict[str, Any]:
    return model_card(service.models.get(model_id))


@router.delete("/models/{model_id:path}")
async def delete_model(service: ServiceDep, model_id: str) -> dict[str, Any]:
    """Delete a stored model (as `/api/delete`); an unknown one is a 404."""
    name = service.models.get(model_id).name
    await service.models.delete(name)
    return {"id": name, "object": "model", "deleted": True}


@router.post("/embeddings")
async def embeddings(service: ServiceDep, body: schemas.EmbeddingRequest, request: Request) -> dict[str, Any]:
    work = service.generation.embed(body.model, embedding_inputs(body.input), truncate=body.truncate,
                         dimensions=body.dimensions)
    model, vectors, num_tokens = await until_disconnect(work, request.receive)
    return embedding_list(model, vectors, num_tokens, body.encoding_format)


def embedding_inputs(raw: str | list[str] | list[int] | list[list[int]]) -> list[str] | list[list[int]]:
    """The inputs of an embeddings request, each a text or one text's token ids (OpenAI's four shapes of
    `input`: a text, texts, one list of token ids, lists of token ids)."""
    if isinstance(raw, str):
        return [raw]
    if raw and all(isinstance(item, int) for item in raw):
        return [cast("list[int]", raw)]
    return cast("list[str] | list[list[int]]", raw)


def embedding_list(model: str, vectors: list[list[float]], num_tokens: int, encoding: str) -> dict[str, Any]:
    """The OpenAI embeddings response; base64 is the vector's little-endian float32 bytes."""
    data = [
        {"object": "embedding", "index": i, "embedding": _encode_vector(vector, encoding)}
        for i, vector in enumerate(vectors)
    ]
    usage = {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}


def _encode_vector(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector
