"""The service's records as OpenAI answers: a chat completion or text completion, whole or as its stream's frames
(chunks, tool call deltas, usage, log-probabilities), several choices (n, several prompts), and the frame that ends a
broken stream."""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from lmserve.dialects.openai import schemas
from lmserve.dialects.openai.chat_records import keeper
from lmserve.dialects.openai.choices import Choices, gather_all, merged, merged_frames
from lmserve.dialects.openai.completions import Prompt, echo_of, first_piece
from lmserve.dialects.openai.translate import Head, to_completion_request
from lmserve.dialects.shared import logprobs as logprob_wire
from lmserve.dialects.shared.errors import INTERNAL_ERROR, openai_error
from lmserve.dialects.shared.streaming import (
    HOLE,
    SSE_DONE,
    GenerationResponse,
    TextFrame,
    guarded_errors,
    sse_json,
    until_disconnect,
)
from lmserve.errors import EngineFailure, LmserveError
from lmserve.service import Generation, Service
from lmserve.store.completions import CompletionStore
from lmserve.types import (
    ChatRequest,
    Chunk,
    TokenLogprob,
    ToolCall,
    Usage,
)

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
    """A chat completion of `n` > 1 choices: each answered as a one-choice reply, merged (choices.py); kept in
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
    """A legacy completion of several prompts or `n` > 1 choices (completions.py): every prompt's choices,
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
