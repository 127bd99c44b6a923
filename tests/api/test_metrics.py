"""GET /metrics: request counts by route template, token counters, latency histograms, scrape-time gauges."""

from __future__ import annotations

import httpx
import pytest
from api_wire import API_KEY
from prometheus_client.parser import text_string_to_metric_families

from lmserve.http.metrics import Metrics
from lmserve.service import Service
from lmserve.types import Chunk, Timings, Usage

CHAT = "/v1/chat/completions"
GENERATE = "/api/generate"


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of an exposition, keyed by (sample name, labels)."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(parsed: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float | None:
    return parsed.get((name, frozenset(labels.items())))


async def scrape(client: httpx.AsyncClient) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return samples(response.text)


async def test_metrics_after_chat_and_generate(client: httpx.AsyncClient) -> None:
    chat = await client.post(CHAT, json={"model": "fake", "messages": [{"role": "user", "content": "hi"}],
                                         "max_tokens": 7})
    assert chat.status_code == 200
    chat_usage = chat.json()["usage"]
    generate = await client.post(GENERATE, json={"model": "fake", "prompt": "hello", "raw": True, "stream": False,
                                                  "options": {"num_predict": 6}})
    assert generate.status_code == 200
    native = generate.json()
    assert (await client.get("/no/such/route")).status_code == 404

    parsed = await scrape(client)
    assert value(parsed, "lmserve_requests_total", route=CHAT, status="200") == 1
    assert value(parsed, "lmserve_requests_total", route=GENERATE, status="200") == 1
    assert value(parsed, "lmserve_requests_total", route="other", status="404") == 1
    assert value(parsed, "lmserve_prompt_tokens_total", model="fake") == (
        chat_usage["prompt_tokens"] + native["prompt_eval_count"]
    )
    assert value(parsed, "lmserve_generated_tokens_total", model="fake") == (
        chat_usage["completion_tokens"] + native["eval_count"]
    ) == 13
    ttft = value(parsed, "lmserve_time_to_first_token_seconds_count", model="fake")
    tpot = value(parsed, "lmserve_time_per_output_token_seconds_count", model="fake")
    assert ttft is not None and ttft >= 1
    assert tpot is not None and tpot >= 1
    assert value(parsed, "lmserve_queue_depth", model="fake") == 0
    assert value(parsed, "lmserve_running_sequences", model="fake") == 0
    assert value(parsed, "lmserve_loaded_models") == 1
    assert value(parsed, "lmserve_model_loads_total", model="fake") == 1

    again = await scrape(client)  # the first scrape is itself counted
    assert value(again, "lmserve_requests_total", route="/metrics", status="200") == 1


async def test_streamed_chat_is_counted(client: httpx.AsyncClient) -> None:
    response = await client.post(CHAT, json={"model": "fake", "messages": [{"role": "user", "content": "hi"}],
                                             "max_tokens": 4, "stream": True})
    assert response.status_code == 200
    parsed = await scrape(client)
    assert value(parsed, "lmserve_requests_total", route=CHAT, status="200") == 1
    assert value(parsed, "lmserve_generated_tokens_total", model="fake") == 4


async def test_route_label_is_the_template_and_errors_keep_their_status(client: httpx.AsyncClient) -> None:
    assert (await client.get("/v1/models/nope")).status_code == 404
    assert (await client.post(CHAT, json={"model": "fake"})).status_code == 400
    parsed = await scrape(client)
    assert value(parsed, "lmserve_requests_total", route="/v1/models/{model_id:path}", status="404") == 1
    assert not any(("route", "/v1/models/nope") in labels for _, labels in parsed)
    assert value(parsed, "lmserve_requests_total", route=CHAT, status="400") == 1


async def test_metrics_needs_the_api_key_when_one_is_set(secured_client: httpx.AsyncClient) -> None:
    assert (await secured_client.get("/metrics")).status_code == 401
    response = await secured_client.get("/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 200
    parsed = samples(response.text)
    assert value(parsed, "lmserve_requests_total", route="/metrics", status="401") == 1


def test_each_app_has_its_own_registry(service: Service) -> None:
    first, second = Metrics(service), Metrics(service)
    first.observe_request("/health", 200)
    assert first.registry.get_sample_value("lmserve_requests_total", {"route": "/health", "status": "200"}) == 1
    assert second.registry.get_sample_value("lmserve_requests_total", {"route": "/health", "status": "200"}) is None


def test_latencies_from_final_timings(service: Service) -> None:
    metrics = Metrics(service)
    final = Chunk(finish_reason="stop", usage=Usage(prompt_tokens=3, completion_tokens=5),
                  timings=Timings(prompt_eval_ns=100_000_000, eval_ns=400_000_000, total_ns=600_000_000))
    metrics.observe_finish("m", final)
    metrics.observe_finish("m", Chunk(finish_reason="abort", usage=Usage(prompt_tokens=2), timings=Timings()))
    get = metrics.registry.get_sample_value
    assert get("lmserve_time_to_first_token_seconds_sum", {"model": "m"}) == 0.2
    assert get("lmserve_time_to_first_token_seconds_count", {"model": "m"}) == 1  # no tokens: no latency
    assert get("lmserve_time_per_output_token_seconds_sum", {"model": "m"}) == 0.1
    assert get("lmserve_prompt_tokens_total", {"model": "m"}) == 5


async def test_engine_time_splits_into_decode_and_overhead(client: httpx.AsyncClient) -> None:
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    parsed = await scrape(client)
    step = value(parsed, "lmserve_engine_step_seconds_total", model="fake")
    decode = value(parsed, "lmserve_engine_decode_seconds_total", model="fake")
    assert step is not None and decode is not None
    assert 0 < decode <= step


async def test_building_the_app_keeps_the_observers_already_registered(service: Service) -> None:
    from lmserve.config import ServerConfig
    from lmserve.http.app import create_app

    seen: list[str] = []
    service.observers.on_finish(lambda model, chunk: seen.append(model))
    app = create_app(service, ServerConfig())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        reply = await client.post(CHAT, json={"model": "fake", "messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 3})
        assert reply.status_code == 200
        assert value(await scrape(client), "lmserve_generated_tokens_total", model="fake") == 3
    assert seen == ["fake"]


async def test_the_gateways_gauges_have_vllms_names_types_and_labels(client: httpx.AsyncClient) -> None:
    """What SMG and llm-d read: vLLM's gauges per model (labels model_name and engine), whatever the engine."""
    chat = await client.post(CHAT, json={"model": "fake", "messages": [{"role": "user", "content": "hi"}],
                                         "max_tokens": 7})
    usage = chat.json()["usage"]
    response = await client.get("/metrics")
    types = {family.name: family.type for family in text_string_to_metric_families(response.text)}
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
             "vllm:cache_config_info", "vllm:lora_requests_info")
    assert {name: types.get(name) for name in names} == dict.fromkeys(names, "gauge")
    parsed = samples(response.text)
    engine = {"model_name": "fake", "engine": "0"}
    assert value(parsed, "vllm:num_requests_running", **engine) == 0
    assert value(parsed, "vllm:num_requests_waiting", **engine) == 0
    held = usage["prompt_tokens"] + usage["completion_tokens"] - 1  # its slot keeps them; the last was never decoded
    assert value(parsed, "vllm:kv_cache_usage_perc", **engine) == pytest.approx(held / (2048 * 4))
    assert value(parsed, "vllm:cache_config_info", **engine, block_size="1", num_gpu_blocks=str(2048 * 4)) == 1
    stamp = value(parsed, "vllm:lora_requests_info", **engine, max_lora="4", running_lora_adapters="",
                  waiting_lora_adapters="")
    assert stamp is not None and stamp > 1.7e9  # a time, as vLLM's
