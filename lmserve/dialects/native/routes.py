"""The native (local-runner) dialect: /api routes, NDJSON streaming, and its translators.

Same pipeline as the OpenAI dialect: the body is parsed into a wire model (native_schemas.py), translated
once into lmserve's records (`to_options`, `to_sampling_params`, `to_messages`), answered by the
service, and its chunks written back as NDJSON lines with durations in nanoseconds.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from lmserve import __version__
from lmserve import options as opts
from lmserve.chat.media import MediaPolicy, decode_base64
from lmserve.chat.structured import json_object_grammar, schema_grammar
from lmserve.dialects.native import schemas as wire
from lmserve.dialects.native.ndjson import NDJSON, error_line, line
from lmserve.dialects.shared import logprobs as logprob_wire
from lmserve.dialects.shared.json_body import JsonBodyRoute
from lmserve.dialects.shared.state import MediaDep, ServiceDep
from lmserve.dialects.shared.streaming import GenerationResponse, guarded_errors, until_disconnect
from lmserve.errors import InvalidRequest
from lmserve.parsing import ParseError, chat_role, parse_duration
from lmserve.service import Generation, ModelListing, Service
from lmserve.store.manifest import check_digest
from lmserve.store.modelfile import Modelfile
from lmserve.store.modelfile import parse as parse_modelfile
from lmserve.types import (
    EFFORTS,
    ChatRequest,
    Chunk,
    CompletionRequest,
    Infill,
    Message,
    RequestOptions,
    SamplingParams,
    ToolCall,
)

if TYPE_CHECKING:
    from lmserve.store.pull import PullProgress

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


# ---- requests → records ---------------------------------------------------------------------------


def parse_keep_alive(value: wire.KeepAlive) -> float | None:
    """Seconds from "5m", "1h30m", "300", 300 or -1 (negative: forever); None when not given."""
    if value is None or value == "":
        return None
    try:
        return parse_duration(value)
    except ParseError:
        raise InvalidRequest(f"keep_alive {value!r} is not a duration like '5m' or '1h30m' or a number of seconds",
                             param="keep_alive") from None


def to_options(options: wire.Options | None) -> RequestOptions:
    """The request's `options` (lmserve/options.py checks them), sampling and load-time, over the native routes'
    server defaults (the service puts them over the model's)."""
    return RequestOptions(opts.from_native(options), "native")


def to_sampling_params(format: str | dict[str, Any] | None, logprobs: int | None) -> SamplingParams:
    """What the request asks beyond its options: `format` → grammar, and the log-probabilities."""
    return SamplingParams(grammar=format_grammar(format), logprobs=logprobs)


def format_grammar(format: str | dict[str, Any] | None) -> str | None:
    """The grammar enforcing a request's `format`: "json" (any JSON object) or a JSON schema."""
    if format is None or format == "":
        return None
    if format == "json":
        return json_object_grammar()
    if isinstance(format, dict):
        return schema_grammar(format, param="format")
    raise InvalidRequest(f"format {format!r} is not supported: use \"json\" or a JSON schema", param="format")


def to_think(think: bool | str | None) -> bool | str | None:
    """`think`: true/false, or an effort "low" | "medium" | "high" (on); None leaves it to the model."""
    if think is None or isinstance(think, bool):
        return think
    level = think.strip().lower()
    if level in ("true", "false"):
        return level == "true"
    if level not in ("low", "medium", "high"):
        raise InvalidRequest(f"think {think!r} is not true, false, \"low\", \"medium\" or \"high\"", param="think")
    return level


def split_reasoning(options: wire.Options | None, think: bool | str | None
                    ) -> tuple[wire.Options | None, int | None, bool | str | None]:
    """The request's `options` without the two reasoning options the local runner's clients put there, and what
    they ask: `reasoning_budget` (most thinking tokens, lmserve's own) and `reasoning_effort` (Open WebUI's
    "Reasoning Effort", an OpenAI effort name read as `think` where the request's own `think` is absent)."""
    if not options:
        return options, None, think
    rest = {name: value for name, value in options.items() if name not in ("reasoning_budget", "reasoning_effort")}
    budget = options.get("reasoning_budget")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
        raise InvalidRequest("option 'reasoning_budget' must be a whole number of tokens, 0 or more",
                             param="reasoning_budget")
    effort = options.get("reasoning_effort")
    if effort is not None and not (isinstance(effort, str) and effort.strip().lower() in EFFORTS):
        raise InvalidRequest(f"option 'reasoning_effort' must be one of {', '.join(EFFORTS)}",
                             param="reasoning_effort")
    if think is None and isinstance(effort, str):
        think = EFFORTS[effort.strip().lower()]
    return rest, budget, think


def to_messages(messages: list[wire.ChatMessage], media: MediaPolicy | None = None) -> list[Message]:
    """The engine-neutral messages; their base64 `images` are decoded and checked under `media`."""
    policy = media or MediaPolicy()
    out = []
    for i, m in enumerate(messages):
        calls = [ToolCall(c.function.name, json.dumps(c.function.arguments)) for c in m.tool_calls or ()]
        images = [decode_image(img, f"messages[{i}].images[{j}]", policy) for j, img in enumerate(m.images or ())]
        role = chat_role(m.role)
        out.append(Message(role=role, content=m.content or "", images=images, tool_calls=calls, name=m.tool_name,
                           thinking=m.thinking or ""))
    return out


def decode_image(data: str, where: str, policy: MediaPolicy) -> bytes:
    """Checked image bytes from base64, with or without a data: prefix (size, format and pixel caps)."""
    try:
        return decode_base64(data, policy).data
    except InvalidRequest as exc:
        raise InvalidRequest(f"{where}: {exc.message}", param="images") from None


# ---- records → NDJSON -----------------------------------------------------------------------------


def now_iso() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def pull_line(record: PullProgress) -> dict[str, Any]:
    """A pull's progress as a line of /api/pull: `{status, digest, total, completed}` without empty fields."""
    fields = {"status": record.status, "digest": record.digest, "total": record.total, "completed": record.completed}
    return {key: value for key, value in fields.items() if value is not None}


async def _past_the_manifest(records: AsyncIterator[PullProgress]) -> list[PullProgress]:
    """The records up to the first one past "pulling manifest" (the repository was found and its files chosen);
    the pull's error if it ended before that."""
    head: list[PullProgress] = []
    async for record in records:
        head.append(record)
        if record.status != "pulling manifest":
            break
    return head


async def _until_the_end(records: AsyncIterator[PullProgress]) -> None:
    async for _ in records:
        pass


def final_fields(generation: Generation, final: Chunk, started_ns: int) -> dict[str, Any]:
    usage, timings = final.usage, final.timings
    fields: dict[str, Any] = {
        "done": True,
        "done_reason": "stop" if final.finish_reason == "tool_calls" else final.finish_reason,
        "total_duration": time.perf_counter_ns() - started_ns,
        "load_duration": generation.load_ns,
        "prompt_eval_count": (usage.prompt_tokens - usage.cached_tokens) if usage else generation.num_prompt_tokens,
        "prompt_eval_duration": timings.prompt_eval_ns if timings else 0,
        "eval_count": usage.completion_tokens if usage else 0,
        "eval_duration": timings.eval_ns if timings else 0,
    }
    if usage is not None and usage.draft_tokens:  # speculative decoding (lmserve's own fields)
        fields.update(draft_count=usage.draft_tokens, draft_accepted_count=usage.draft_accepted_tokens)
    return fields


def logprobs_field(sampling: SamplingParams, chunk: Chunk) -> dict[str, Any]:
    """`{"logprobs": [...]}` of a chunk (the whole reply's on a collected final chunk) when the request asked."""
    return {"logprobs": logprob_wire.token_entries(chunk.logprobs)} if sampling.logprobs is not None else {}


async def ndjson_lines(
    generation: Generation, piece: Callable[[Chunk], dict[str, Any]], last: Callable[[Chunk], dict[str, Any]]
) -> AsyncIterator[bytes]:
    async for chunk in generation:
        if chunk.is_failed:
            yield line({"error": chunk.error or "the generation failed"})
            return
        if chunk.text or chunk.reasoning or chunk.tool_calls or chunk.logprobs:
            yield line(piece(chunk))
        if chunk.finish_reason is not None:
            yield line(last(chunk))
            return


def assistant_message(text: str, chunk: Chunk) -> dict[str, Any]:
    """The native assistant message (its `thinking` apart); tool calls carry `arguments` as an object, whole, in
    one chunk."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if chunk.reasoning:
        message["thinking"] = chunk.reasoning
    if chunk.tool_calls:
        message["content"] = text.strip()
        message["tool_calls"] = [
            {"function": {"name": call.name, "arguments": _arguments_object(call.arguments)}}
            for call in chunk.tool_calls
        ]
    return message


def _arguments_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return {}


def tag(listing: ModelListing) -> dict[str, Any]:
    return {
        "name": listing.name,
        "model": listing.name,
        "modified_at": datetime.fromtimestamp(listing.created, UTC).isoformat().replace("+00:00", "Z"),
        "size": listing.size,
        "digest": listing.digest,
        "details": listing.details,
    }


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
    images: list[bytes] = []
    if body.images:
        service.generation.check_images(body.model, len(body.images), param="images")
        images = [decode_image(img, f"images[{j}]", media) for j, img in enumerate(body.images)]
    if not body.prompt and not body.context and not body.suffix:
        return JSONResponse(await _load_or_unload(service, body.model, options, keep_alive, response=""))
    sampling = to_sampling_params(body.format, logprob_wire.asked(body.logprobs, body.top_logprobs))
    infill = Infill(body.prompt, body.suffix) if body.suffix else None  # insert: the model writes the middle
    record = CompletionRequest(body.model, "" if infill else body.prompt, sampling,
                               context=list(body.context or ()), images=images, options=options,
                               keep_alive=keep_alive, infill=infill)
    generation = await service.generation.generate(record, system=body.system, template=body.template, raw=body.raw,
                                                   think=think, reasoning_budget=budget)

    def head() -> dict[str, Any]:
        return {"model": body.model, "created_at": now_iso()}

    def last(final: Chunk) -> dict[str, Any]:
        done = {**head(), "response": "", **final_fields(generation, final, started)}
        if images:  # image positions hold placeholders, no tokens: such a context could not be sent back
            return done
        return {**done, "context": generation.prompt_tokens + generation.output_tokens}

    def piece(chunk: Chunk) -> dict[str, Any]:
        thinking = {"thinking": chunk.reasoning} if chunk.reasoning else {}
        logprobs = logprobs_field(record.sampling, chunk)
        return {**head(), "response": chunk.text, **thinking, **logprobs, "done": False}

    if body.stream:
        frames = ndjson_lines(generation, piece, last)
        return GenerationResponse(generation, guarded_errors(frames, error_line), media_type=NDJSON, headers={})
    text, final = await until_disconnect(generation.collect(), request.receive)
    thought = {"thinking": final.reasoning} if final.reasoning else {}
    return JSONResponse({**last(final), "response": text, **thought, **logprobs_field(record.sampling, final)})


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
    if any(m.images for m in body.messages):
        service.generation.check_images(body.model, sum(len(m.images or ()) for m in body.messages))
    record = ChatRequest(body.model, to_messages(body.messages, media), sampling,
                         tools=list(body.tools or ()), options=options, keep_alive=keep_alive, think=think,
                         reasoning_budget=budget)
    generation = await service.generation.chat(record)

    def head() -> dict[str, Any]:
        return {"model": body.model, "created_at": now_iso()}

    def last(final: Chunk) -> dict[str, Any]:
        empty = {"role": "assistant", "content": ""}
        return {**head(), "message": empty, **final_fields(generation, final, started)}

    if body.stream:
        frames = ndjson_lines(
            generation, lambda chunk: {**head(), "message": assistant_message(chunk.text, chunk),
                                       **logprobs_field(sampling, chunk), "done": False},
            last,
        )
        return GenerationResponse(generation, guarded_errors(frames, error_line), media_type=NDJSON, headers={})
    text, final = await until_disconnect(generation.collect(), request.receive)
    message = assistant_message(text, final)
    return JSONResponse({**last(final), "message": message, **logprobs_field(sampling, final)})


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
            await until_disconnect(_until_the_end(records), request.receive)
            return JSONResponse({"status": "success"})
        head = await _past_the_manifest(records)  # a bad name or an unknown repo fails here, as a 400/404 status
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
    return {
        "license": d.license, "modelfile": d.modelfile, "parameters": _parameters_text(d.parameters),
        "template": d.template, "system": d.system, "details": d.listing.details, "model_info": d.model_info,
        "capabilities": d.capabilities,
        "modified_at": datetime.fromtimestamp(d.listing.created, UTC).isoformat().replace("+00:00", "Z"),
    }


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
        models.append({**tag(listing), "expires_at": until.isoformat().replace("+00:00", "Z"), "size_vram": 0,
                       "context_length": resident.model.engine.info.num_ctx,
                       "prompt_cache_bytes": resident.model.engine.stats.cache_bytes})
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


def to_modelfile(body: wire.CreateBody) -> Modelfile:
    """A Modelfile from /api/create: its `modelfile` text, or the `from`/`files` fields and the rest."""
    if body.modelfile:
        base = parse_modelfile(body.modelfile)
    else:
        source, projector = body.from_, None
        if source is None and body.files:
            ggufs = [digest for name, digest in body.files.items() if not name.lower().startswith("mmproj")]
            projectors = [digest for name, digest in body.files.items() if name.lower().startswith("mmproj")]
            if len(ggufs) != 1 or len(projectors) > 1:
                raise InvalidRequest("files must name exactly one model GGUF (and at most one mmproj* projector)",
                                     param="files")
            source = "@" + check_digest(ggufs[0])
            projector = "@" + check_digest(projectors[0]) if projectors else None
        if source is None:
            raise InvalidRequest("one of modelfile, from or files is required", param="from")
        base = Modelfile(from_=source, projector=projector)
    license = base.license if body.license is None else (
        [body.license] if isinstance(body.license, str) else list(body.license))
    return replace(
        base,
        adapters=[*base.adapters, *("@" + check_digest(digest) for digest in (body.adapters or {}).values())],
        template=base.template if body.template is None else body.template,
        system=base.system if body.system is None else body.system,
        parameters={**base.parameters, **{name: opts.parameter_from_json(name, value)
                                          for name, value in (body.parameters or {}).items()}},
        messages=[*base.messages, *((m.role, m.content or "") for m in body.messages or ())],
        license=license,
    )


def _parameters_text(parameters: dict[str, Any]) -> str:
    rows = []
    for name, value in parameters.items():
        for item in value if isinstance(value, list) else [value]:
            text = json.dumps(item) if isinstance(item, str) else str(item).lower() if isinstance(item, bool) else item
            rows.append(f"{name:<30} {text}")
    return "\n".join(rows)
