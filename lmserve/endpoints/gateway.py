"""The routes HTTP gateways read from a model server, so SMG (the SGLang model gateway), llm-d's endpoint picker and
KServe can front lmserve replicas as they front SGLang and vLLM (the vLLM-named gauges they scrape are on /metrics,
http/metrics.py):

- GET /v1/loads?include=…: SGLang's load report, which SMG polls (`include=core,disagg,queues,memory`) to balance
  by load. `include` is a comma-separated list of core, memory, spec, lora, disagg, queues, all (default all); any
  other is a 400. lmserve is one data-parallel rank (`dp_rank_count` 1): with several models loaded, rank 0 sums them
  (requests, tokens held, KV capacity and slots), since a gateway balances whole servers. `num_used_tokens` is the
  tokens the KV caches hold, idle slots' kept prefixes included (as vllm:kv_cache_usage_perc counts them), and
  `num_total_tokens` the same (lmserve keeps no evictable cache apart from the slots); `gen_throughput` and
  `num_waiting_uncached_tokens` are not measured (0). Sections lmserve has no numbers for (spec, lora, disagg) are
  left out, as SGLang leaves out those that do not apply.
- POST /v1/chat/completions/render, /v1/completions/render: vLLM's render endpoints (llm-d's precise prefix-cache
  routing tokenizes through them): the body of the normal route, answered with the token ids the engine would
  prefill for it (rendered and tokenized by the same service path) and the sampling in force, without generating;
  completions answer a list (one per prompt), as vLLM does. Images are refused (their placeholder ids are no tokens).
- GET /server_info: SGLang's (SMG reads model_path, served_model_name, tp_size, dp_size): every server and engine
  option by its name (but the API key), the served model, lmserve's version.
- GET /model_info: SGLang's model_path, tokenizer_path, is_generation, model_type for the served model.
- GET /version: vLLM's `{"version"}` (lmserve's).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter

from lmserve import __version__
from lmserve.config import OPTIONS, ServerConfig
from lmserve.dialects.openai import schemas
from lmserve.dialects.openai.translate import has_images, to_chat_request, to_completion_request
from lmserve.dialects.shared.json_body import JsonBodyRoute
from lmserve.dialects.shared.state import ConfigDep, ServedDep, ServiceDep
from lmserve.errors import InvalidRequest
from lmserve.service import Service
from lmserve.service.generation import RenderedPrompt
from lmserve.service.residency import LoadedModel

SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")
"""What `include` of GET /v1/loads may name (SGLang's)."""
HIDDEN_OPTIONS = frozenset({"api_key"})
"""Options /server_info never shows."""
_GIB = 2**30


@dataclass(slots=True)
class Load:
    """The engines' numbers summed: one SGLang data-parallel rank."""

    running: int = 0
    waiting: int = 0
    used_tokens: int = 0
    capacity: int = 0
    slots: int = 0
    cache_queries: int = 0
    cache_hits: int = 0
    preemptions: int = 0
    weight_bytes: int = 0
    kv_bytes: int = 0
    compute_bytes: int = 0

    @property
    def token_usage(self) -> float:
        return self.used_tokens / self.capacity if self.capacity else 0.0

    @property
    def utilization(self) -> float:
        return self.running / self.slots if self.slots else 0.0


def current_load(service: Service) -> Load:
    """The resident engines' load (an engine shared by several names counted once)."""
    load = Load()
    seen: set[int] = set()
    for resident in service.models.running():
        engine = resident.model.engine
        if id(engine) in seen:
            continue
        seen.add(id(engine))
        stats = engine.stats
        capacity = stats.kv_block_size * stats.kv_num_blocks
        load.running += engine.num_running
        load.waiting += engine.num_waiting
        load.capacity += capacity
        load.used_tokens += round((stats.kv_cache_usage or 0.0) * capacity)
        load.slots += engine.info.num_parallel
        load.cache_queries += stats.prefix_cache_queries
        load.cache_hits += stats.prefix_cache_hits
        memory = resident.memory
        load.weight_bytes += memory.weights_bytes if memory is not None else engine.info.size_bytes
        load.kv_bytes += memory.kv_bytes if memory is not None else 0
        load.compute_bytes += memory.compute_bytes if memory is not None else 0
    return load


def included(include: str | None) -> set[str]:
    """The sections `include` names (all of them when absent); InvalidRequest naming any other."""
    if not include:
        return {"all"}
    names = {name.strip() for name in include.split(",")}
    unknown = sorted(names - set(SECTIONS))
    if unknown:
        raise InvalidRequest(f"include names unknown sections {unknown}; valid: {', '.join(SECTIONS)}",
                             param="include")
    return names


def loads_body(load: Load, sections: set[str]) -> dict[str, Any]:
    """GET /v1/loads's answer: SGLang's shape, with rank 0 holding `load`."""
    rank: dict[str, Any] = {
        "dp_rank": 0,
        "num_running_reqs": load.running,
        "num_waiting_reqs": load.waiting,
        "num_total_reqs": load.running + load.waiting,
        "num_waiting_uncached_tokens": 0,
        "num_used_tokens": load.used_tokens,
        "num_total_tokens": load.used_tokens,
        "max_total_num_tokens": load.capacity,
        "max_running_requests": load.slots,
        "token_usage": round(load.token_usage, 4),
        "gen_throughput": 0.0,
        "cache_hit_rate": round(load.cache_hits / load.cache_queries, 4) if load.cache_queries else 0.0,
        "utilization": round(load.utilization, 4),
    }
    every = "all" in sections
    if every or "memory" in sections:
        rank["memory"] = {"weight_gb": round(load.weight_bytes / _GIB, 3),
                          "kv_cache_gb": round(load.kv_bytes / _GIB, 3),
                          "graph_gb": round(load.compute_bytes / _GIB, 3), "token_capacity": load.capacity}
    if every or "queues" in sections:
        rank["queues"] = {"waiting": load.waiting, "grammar": 0, "paused": 0, "retracted": 0}
    aggregate = {
        "total_running_reqs": load.running,
        "total_waiting_reqs": load.waiting,
        "total_reqs": load.running + load.waiting,
        "total_used_tokens": load.used_tokens,
        "total_tokens": load.used_tokens,
        "avg_token_usage": rank["token_usage"],
        "avg_throughput": 0.0,
        "avg_utilization": rank["utilization"],
    }
    return {"timestamp": datetime.now(UTC).isoformat(), "version": __version__, "dp_rank_count": 1,
            "loads": [rank], "aggregate": aggregate}


def rendered(prompt: RenderedPrompt, prefix: str, stream: bool) -> dict[str, Any]:
    """A render endpoint's answer (vLLM's GenerateRequest: the ids to prefill and the sampling in force)."""
    sampling = prompt.sampling
    return {
        "request_id": f"{prefix}-{uuid.uuid4().hex}",
        "token_ids": prompt.tokens,
        "model": prompt.model,
        "stream": stream,
        "sampling_params": {
            "max_tokens": sampling.max_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
            "top_k": sampling.top_k, "min_p": sampling.min_p, "seed": sampling.seed, "stop": list(sampling.stop),
            "presence_penalty": sampling.presence_penalty, "frequency_penalty": sampling.frequency_penalty,
            "repetition_penalty": sampling.repeat_penalty,
        },
    }


def server_info(config: ServerConfig, served: str | None, model: LoadedModel | None) -> dict[str, Any]:
    """GET /server_info's answer: the options in force, the served model and the version."""
    info: dict[str, Any] = {name: _plain(config.value(name)) for name in OPTIONS if name not in HIDDEN_OPTIONS}
    info.update({
        "model_path": model.engine.info.path if model is not None else config.model,
        "served_model_name": served or config.model,
        "tp_size": config.value("tensor_parallel_size"),
        "dp_size": 1,
        "max_running_requests": model.engine.info.num_parallel if model is not None else config.parallel,
        "version": __version__,
    })
    return info


def model_info(config: ServerConfig, model: LoadedModel | None) -> dict[str, Any]:
    """GET /model_info's answer (SGLang's), for the served model."""
    path = model.engine.info.path if model is not None else config.model
    info: dict[str, Any] = {"model_path": path, "tokenizer_path": path, "is_generation": True}
    if model is not None:
        info["model_type"] = model.engine.info.architecture
        info["has_image_understanding"] = model.engine.info.has_vision
    return info


def _plain(value: Any) -> Any:
    """An option's value as JSON (a tuple as a list; anything not JSON as its text)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple | list):
        return [_plain(item) for item in value]
    return str(value)


def served_model(service: Service, served: str | None) -> LoadedModel | None:
    """The served model when it is loaded, else any loaded model, else None."""
    residents = service.models.running()
    for resident in residents:
        if resident.model.name == served:
            return resident.model
    return residents[0].model if residents else None


router = APIRouter(route_class=JsonBodyRoute)


@router.get("/v1/loads")
async def loads(service: ServiceDep, include: str | None = None) -> dict[str, Any]:
    return loads_body(current_load(service), included(include))


@router.post("/v1/chat/completions/render")
async def render_chat(service: ServiceDep, body: schemas.ChatCompletionRequest) -> dict[str, Any]:
    if has_images(body):
        raise InvalidRequest("render takes no images or audio URLs: their placeholders in the prompt are not token ids",
                             param="messages")
    prompt = await service.generation.render_chat_tokens(to_chat_request(body))
    return rendered(prompt, "chatcmpl", bool(body.stream))


@router.post("/v1/completions/render")
async def render_completion(service: ServiceDep, body: schemas.CompletionRequest) -> list[dict[str, Any]]:
    prompt = await service.generation.render_completion_tokens(to_completion_request(body))
    return [rendered(prompt, "cmpl", bool(body.stream))]


@router.get("/server_info")
async def get_server_info(config: ConfigDep, served: ServedDep, service: ServiceDep) -> dict[str, Any]:
    return server_info(config, served, served_model(service, served))


@router.get("/model_info")
async def get_model_info(config: ConfigDep, served: ServedDep, service: ServiceDep) -> dict[str, Any]:
    return model_info(config, served_model(service, served))


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}
