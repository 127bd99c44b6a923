"""The native (local-runner) dialect's routes: /api/generate, /api/chat, /api/embed, the model store's routes.

Same pipeline as the OpenAI dialect: the body is parsed into a wire model (schemas.py), translated once into
lmserve's records (translate.py: `to_options`, `to_sampling_params`, `to_messages`), answered by the service, and its
chunks written back as NDJSON lines with durations in nanoseconds (output.py).
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from lmserve import __version__
from lmserve.chat.audio import is_audio_base64
from lmserve.dialects.native import schemas as wire
from lmserve.dialects.native.modelfiles import parameters_text, to_modelfile
from lmserve.dialects.native.ndjson import NDJSON, error_line, line
from lmserve.dialects.native.output import (
    Reply,
    ndjson_lines,
    now_iso,
    past_the_manifest,
    pull_line,
    tag,
    until_the_end,
)
from lmserve.dialects.native.translate import (
    decode_image,
    parse_keep_alive,
    split_reasoning,
    to_messages,
    to_options,
    to_sampling_params,
    to_think,
)
from lmserve.dialects.shared import logprobs as logprob_wire
from lmserve.dialects.shared.json_body import JsonBodyRoute
from lmserve.dialects.shared.state import MediaDep, ServiceDep
from lmserve.dialects.shared.streaming import GenerationResponse, guarded_errors, until_disconnect
from lmserve.errors import InvalidRequest
from lmserve.service import Service
from lmserve.service.models import model_memory
from lmserve.store.manifest import check_digest
from lmserve.types import (
    ChatRequest,
    CompletionRequest,
    Infill,
    RequestOptions,
)

LOCAL_RUNNER_VERSION = "0.12.11"
"""The local runner's release whose /api routes and fields these follow (the first with `logprobs` on chat and
generate, the newest field lmserve's native routes take). /api/version reports it as `version`, because its
clients read that field as the runner's release and refuse old ones (VS Code's provider wants 0.6.4 or later)."""
VERSION_HEADER = "X-Lmserve-Version"
BLOB_BODY = {
    "description": "The blob's bytes; their SHA-256 must be the digest in the path.",
    "required": True,
    "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
}
"""POST /api/blobs/{digest}'s body in the OpenAPI document (the route reads it as a stream, not as a parameter)."""


# ---- routes ---------------------------------------------------------------------------------------


router = APIRouter(route_class=JsonBodyRoute)


@router.api_route("/api/version", methods=["GET", "HEAD"])
async def version() -> JSONResponse:
    """The local runner's release these routes follow, lmserve's own beside it (and in a header)."""
    return JSONResponse({"version": LOCAL_RUNNER_VERSION, "lmserve_version": __version__},
                        headers={VERSION_HEADER: __version__})


@router.post("/api/generate", response_model=None)
async def generate(service: ServiceDep, media: MediaDep, body: wire.GenerateBody, request: Request) -> Response:
    started = time.perf_counter_ns()
    keep_alive = parse_keep_alive(body.keep_alive)
    body.options, budget, think = split_reasoning(body.options, to_think(body.think))
    options = to_options(body.options)
    if body.suffix and (body.images or body.context):
        raise InvalidRequest("suffix (insert) cannot be combined with images or context", param="suffix")
    if pictures := sum(not is_audio_base64(img) for img in body.images or ()):  # clips are checked once decoded
        service.generation.check_images(body.model, pictures, param="images")
    images = [decode_image(img, f"images[{j}]", media) for j, img in enumerate(body.images or ())]
    if not body.prompt and not body.context and not body.suffix:
        return JSONResponse(await _load_or_unload(service, body.model, options, keep_alive, response=""))
    sampling = to_sampling_params(body.format, logprob_wire.asked(body.logprobs, body.top_logprobs))
    infill = Infill(body.prompt, body.suffix) if body.suffix else None  # insert: the model writes the middle
    record = CompletionRequest(body.model, "" if infill else body.prompt, sampling,
                               context=list(body.context or ()), images=images, options=options,
                               keep_alive=keep_alive, infill=infill)
    generation = await service.generation.generate(record, system=body.system, template=body.template, raw=body.raw,
                                                   think=think, reasoning_budget=budget)
    # image positions hold placeholders, no tokens: such a context could not be sent back
    reply = Reply(body.model, generation, sampling, started, chat=False, context=not images)
    return await _answer(reply, body.stream, request)


@router.post("/api/chat", response_model=None)
async def chat(service: ServiceDep, media: MediaDep, body: wire.ChatBody, request: Request) -> Response:
    started = time.perf_counter_ns()
    keep_alive = parse_keep_alive(body.keep_alive)
    body.options, budget, think = split_reasoning(body.options, to_think(body.think))
    options = to_options(body.options)
    if not body.messages:
        message = {"role": "assistant", "content": ""}
        return JSONResponse(await _load_or_unload(service, body.model, options, keep_alive, message=message))
    sampling = to_sampling_params(body.format, logprob_wire.asked(body.logprobs, body.top_logprobs))
    if pictures := sum(not is_audio_base64(img) for m in body.messages for img in m.images or ()):
        service.generation.check_images(body.model, pictures)
    record = ChatRequest(body.model, to_messages(body.messages, media), sampling,
                         tools=list(body.tools or ()), options=options, keep_alive=keep_alive, think=think,
                         reasoning_budget=budget)
    generation = await service.generation.chat(record)
    return await _answer(Reply(body.model, generation, sampling, started, chat=True), body.stream, request)


async def _answer(reply: Reply, stream: bool, request: Request) -> Response:
    """The reply as NDJSON lines (`stream`, the default), or as one object."""
    if stream:
        frames = ndjson_lines(reply.generation, reply.piece, reply.last)
        return GenerationResponse(reply.generation, guarded_errors(frames, error_line), media_type=NDJSON, headers={})
    text, final = await until_disconnect(reply.generation.collect(), request.receive)
    return JSONResponse(reply.whole(text, final))


@router.post("/api/create", response_model=None)
async def create(service: ServiceDep, body: wire.CreateBody) -> Response:
    if body.target is None:
        raise InvalidRequest("model is required", param="model")
    modelfile = to_modelfile(body)
    statuses = ["parsing modelfile"]
    if body.quantize:
        statuses.append(f"quantizing to {body.quantize.upper()}")
    await asyncio.to_thread(service.models.create, body.target, modelfile, quantize=body.quantize)
    statuses += ["writing manifest", "success"]
    if not body.stream:
        return JSONResponse({"status": "success"})
    return Response(b"".join(line({"status": s}) for s in statuses), media_type=NDJSON)


@router.head("/api/blobs/{digest}")
async def has_blob(service: ServiceDep, digest: str) -> Response:
    return Response(status_code=200 if service.models.store.has_blob(check_digest(digest)) else 404)


@router.post("/api/blobs/{digest}", openapi_extra={"requestBody": BLOB_BODY})
async def push_blob(service: ServiceDep, digest: str, request: Request) -> Response:
    store = service.models.store
    check_digest(digest)
    with tempfile.TemporaryFile() as spool:
        async for part in request.stream():
            spool.write(part)
        spool.seek(0)
        await asyncio.to_thread(store.add_blob, spool, digest)
    return Response(status_code=201)


@router.post("/api/pull", response_model=None)
async def pull(service: ServiceDep, body: wire.PullBody, request: Request) -> Response:
    if body.target is None:
        raise InvalidRequest("model is required", param="model")
    pulling = service.models.pull(body.target)
    records = aiter(pulling)
    try:
        if not body.stream:
            await until_disconnect(until_the_end(records), request.receive)
            return JSONResponse({"status": "success"})
        head = await past_the_manifest(records)  # a bad name or an unknown repo fails here, as a 400/404 status
    except BaseException:  # the pull failed, or the client went: stop it (a no-op once it ended)
        pulling.abort()
        raise

    async def frames() -> AsyncIterator[bytes]:
        for record in head:
            yield line(pull_line(record))
        async for record in records:
            yield line(pull_line(record))

    return GenerationResponse(pulling, guarded_errors(frames(), error_line), media_type=NDJSON, headers={})


@router.get("/api/tags")
async def tags(service: ServiceDep) -> dict[str, Any]:
    return {"models": [tag(m) for m in service.models.listing()]}


@router.post("/api/show")
async def show(service: ServiceDep, body: wire.ModelBody) -> dict[str, Any]:
    if body.target is None:
        raise InvalidRequest("model is required", param="model")
    d = service.models.describe(body.target)
    shown = {
        "license": d.license, "modelfile": d.modelfile, "parameters": parameters_text(d.parameters),
        "template": d.template, "system": d.system, "details": d.listing.details, "model_info": d.model_info,
        "capabilities": d.capabilities,
        "modified_at": datetime.fromtimestamp(d.listing.created, UTC).isoformat().replace("+00:00", "Z"),
    }
    if d.signature:  # lmserve's: who signed the weights and when the signature was verified
        shown["signature"] = d.signature
    return shown


@router.post("/api/copy")
async def copy(service: ServiceDep, body: wire.CopyBody) -> Response:
    service.models.copy(body.source, body.destination)
    return Response(status_code=200)


@router.delete("/api/delete")
async def delete(service: ServiceDep, body: wire.ModelBody) -> Response:
    if body.target is None:
        raise InvalidRequest("model is required", param="model")
    await service.models.delete(body.target)
    return Response(status_code=200)


@router.get("/api/ps")
async def ps(service: ServiceDep) -> dict[str, Any]:
    models = []
    for resident in service.models.running():
        listing = service.models.get(resident.model.name)
        expires = resident.expires_at
        until = datetime.fromtimestamp(expires, UTC) if expires is not None else datetime(9999, 1, 1, tzinfo=UTC)
        stats = resident.model.engine.stats
        memory = model_memory(stats)
        held = {"size": memory["weights"] + memory["kv_cache"] + memory["adapters"]} if stats.weights_bytes else {}
        models.append({**tag(listing), **held, "expires_at": until.isoformat().replace("+00:00", "Z"), "size_vram": 0,
                       "context_length": resident.model.engine.info.num_ctx, "memory": memory,
                       "prompt_cache_bytes": stats.cache_bytes, "adapter_bytes": stats.adapter_bytes})
    body: dict[str, Any] = {"models": models}
    cache = service.prompt_cache
    if cache is not None:  # an lmserve addition: the prompt cache beyond the slots, all models together
        body["prompt_cache"] = {"ram_bytes": cache.num_bytes, "ram_budget_bytes": cache.ram_budget,
                                "disk_bytes": cache.disk_bytes, "entries": cache.num_entries()}
    return body


@router.post("/api/embed")
async def embed(service: ServiceDep, body: wire.EmbedBody, request: Request) -> dict[str, Any]:
    started = time.perf_counter_ns()
    keep_alive = parse_keep_alive(body.keep_alive)
    load = to_options(body.options)
    await service.models.load(body.model, load, keep_alive)
    load_ns = time.perf_counter_ns() - started
    vectors: list[list[float]] = []
    num_tokens = 0
    if body.input != "":  # an empty string only loads the model; an empty list is an error
        texts = [body.input] if isinstance(body.input, str) else body.input
        work = service.generation.embed(body.model, texts, truncate=body.truncate, options=load,
                                        keep_alive=keep_alive, dimensions=body.dimensions)
        _, vectors, num_tokens = await until_disconnect(work, request.receive)
    return {"model": body.model, "embeddings": vectors, "total_duration": time.perf_counter_ns() - started,
            "load_duration": load_ns, "prompt_eval_count": num_tokens}


@router.post("/api/embeddings")
async def embeddings(service: ServiceDep, body: wire.EmbeddingsBody, request: Request) -> dict[str, Any]:
    """The legacy route: one prompt, its vector not normalized (as the local runner's)."""
    keep_alive = parse_keep_alive(body.keep_alive)
    load = to_options(body.options)
    if not body.prompt:
        await service.models.load(body.model, load, keep_alive)
        return {"embedding": []}
    work = service.generation.embed(body.model, [body.prompt], options=load, keep_alive=keep_alive, normalize=False)
    _, vectors, _ = await until_disconnect(work, request.receive)
    return {"embedding": vectors[0]}


async def _load_or_unload(
    service: Service, model: str, load: RequestOptions, keep_alive: float | None, **empty: Any
) -> dict[str, Any]:
    """An empty prompt loads the model; with keep_alive 0 it unloads it."""
    if keep_alive == 0:
        name = service.models.get(model).name
        await service.models.unload(model)
        return {"model": name, "created_at": now_iso(), **empty, "done": True, "done_reason": "unload"}
    name = await service.models.load(model, load, keep_alive)
    return {"model": name, "created_at": now_iso(), **empty, "done": True, "done_reason": "load"}
