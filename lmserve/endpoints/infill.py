"""POST /infill: llama-server's fill-in-the-middle route, for code models whose vocabulary has FIM tokens.

The body: `input_prefix`, `input_suffix`, `input_extra` ([{filename, text}], other files as context), `prompt`
(written after the middle token), `model` (else the only one loaded), `stream`, and the sampling options of
llama-server's /completion by the names lmserve's options table shares with it (`temperature`, `top_k`, `top_p`,
`min_p`, `seed`, `stop`, `repeat_penalty`, …; `n_predict` is the most tokens). The prompt is built by
service/fim.py. The answer is /completion's: `{content, stop: true, stop_type, tokens_predicted, …}`, or streamed
as SSE events `{content, stop: false}` … ending with one that has `stop: true` and the counts.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from lmserve import options as opts
from lmserve.dialects.openai.output import error_frame
from lmserve.dialects.shared.json_body import JsonBodyRoute
from lmserve.dialects.shared.state import ServiceDep
from lmserve.dialects.shared.streaming import GenerationResponse, guarded_errors, sse_json, until_disconnect
from lmserve.endpoints.tokens import default_model
from lmserve.errors import EngineFailure
from lmserve.service import Generation
from lmserve.types import Chunk, CompletionRequest, Infill, RequestOptions, SamplingParams

_WIRE = ConfigDict(extra="allow")
_RENAMED = {"n_predict": "num_predict", "max_tokens": "num_predict"}
"""llama-server names that lmserve's options table spells otherwise."""


class ExtraFile(BaseModel):
    """Another file given as context."""

    model_config = _WIRE
    filename: str = ""
    text: str = ""


class InfillBody(BaseModel):
    """Body of POST /infill (llama-server's); other /completion options are read from the extra fields."""

    model_config = _WIRE
    model: str | None = None
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraFile] = Field(default_factory=list)
    prompt: str = ""
    stream: bool = False


def to_options(extra: dict[str, Any]) -> RequestOptions:
    """The body's sampling options (by llama-server's names where the table has them); a value out of range is a
    400 naming it; names lmserve does not know are ignored, as llama-server does."""
    options = {_RENAMED.get(name, name): value for name, value in extra.items()}
    known = {name: value for name, value in options.items() if name in opts.PARAMETERS}
    return RequestOptions(opts.from_native(known), "native")


def stop_type(final: Chunk) -> str:
    """llama-server's `stop_type`: "limit" (the token budget), "word" (a stop string) or "eos" (the model ended)."""
    if final.finish_reason == "length":
        return "limit"
    return "word" if final.stop_string else "eos"


def final_fields(generation: Generation, final: Chunk) -> dict[str, Any]:
    usage = final.usage
    return {
        "model": generation.model, "stop": True, "stop_type": stop_type(final),
        "stopping_word": final.stop_string or "", "truncated": False,
        "tokens_predicted": usage.completion_tokens if usage else 0,
        "tokens_evaluated": usage.prompt_tokens if usage else generation.num_prompt_tokens,
        "tokens_cached": usage.cached_tokens if usage else 0,
    }  # fmt: skip


async def infill_frames(generation: Generation) -> AsyncIterator[bytes]:
    """SSE events: each piece `{index, content, stop: false}`, then the last with `stop: true` and the counts."""
    async for chunk in generation:
        if chunk.is_failed:
            yield error_frame(EngineFailure(chunk.error or "the generation failed"))
            return
        if chunk.text:
            yield sse_json({"index": 0, "content": chunk.text, "stop": False})
        if chunk.finish_reason is not None:
            yield sse_json({"index": 0, "content": "", **final_fields(generation, chunk)})
            return


router = APIRouter(route_class=JsonBodyRoute)


@router.post("/infill", response_model=None)
async def infill(service: ServiceDep, body: InfillBody, request: Request) -> Response:
    started = time.perf_counter_ns()
    model = default_model(service, body.model)
    extra = [(file.filename, file.text) for file in body.input_extra]
    options = to_options(dict(body.model_extra or {}))
    record = CompletionRequest(model, body.prompt, SamplingParams(), options=options,
                               infill=Infill(body.input_prefix, body.input_suffix, extra))
    generation = await service.generation.complete(record)
    if body.stream:
        return GenerationResponse(generation, guarded_errors(infill_frames(generation), error_frame))
    text, final = await until_disconnect(generation.collect(), request.receive)
    took_ms = (time.perf_counter_ns() - started) / 1e6
    return JSONResponse({"index": 0, "content": text, **final_fields(generation, final),
                         "timings": {"total_ms": took_ms}})
