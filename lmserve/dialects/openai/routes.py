"""The OpenAI dialect's routes: /v1/chat/completions, /v1/completions, /v1/embeddings and /v1/models.

A request is parsed into a wire model (schemas.py), translated once into an engine-neutral record (translate.py:
`to_chat_request`, `to_completion_request`, `to_options`), answered by the service, and its chunks translated back
(output.py: `chat_completion`, `chat_frames`, `text_completion`, `completion_frames`).
Errors the service raises (unknown model, bad messages, context overflow) surface before any byte of a
streamed answer is sent, so they are ordinary HTTP errors.
"""

from __future__ import annotations

import base64
import struct
from typing import Any, cast

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from lmserve.dialects.openai import schemas
from lmserve.dialects.openai.chat_records import keeper
from lmserve.dialects.openai.completions import completion_prompts, echo_of, first_piece
from lmserve.dialects.openai.output import (
    chat_choices,
    chat_completion,
    chat_frames,
    collect,
    completion_choices,
    completion_frames,
    error_frame,
    make_head,
    text_completion,
)
from lmserve.dialects.openai.translate import (
    has_images,
    image_urls,
    load_images,
    to_chat_request,
    to_completion_request,
)
from lmserve.dialects.shared.json_body import JsonBodyRoute
from lmserve.dialects.shared.state import CompletionsDep, MediaDep, ServedDep, ServiceDep
from lmserve.dialects.shared.streaming import (
    GenerationResponse,
    guarded_errors,
    until_disconnect,
)
from lmserve.service import ModelListing


def model_card(model: ModelListing) -> dict[str, Any]:
    """A model as /v1/models lists it; a LoRA adapter model also names its base (`parent`, as vLLM lists them)."""
    card = {"id": model.name, "object": "model", "created": model.created, "owned_by": model.owned_by}
    return card if model.parent is None else {**card, "parent": model.parent}


router = APIRouter(prefix="/v1", route_class=JsonBodyRoute)


@router.post("/chat/completions", response_model=None)
async def chat_completions(service: ServiceDep, policy: MediaDep, completion_store: CompletionsDep,
                           body: schemas.ChatCompletionRequest, request: Request) -> Response:
    images = None
    if has_images(body):
        if count := sum(map(len, image_urls(body))):
            service.generation.check_images(body.model, count)  # before fetching anything
        images = await load_images(body, policy)
    chat_request = to_chat_request(body, images, policy=policy)
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
