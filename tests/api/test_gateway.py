"""The gateways' routes over the fake engine: /v1/loads in SGLang's shape, vLLM's render endpoints, /server_info,
/model_info and /version (the real model behind real servers: tests/test_gateway_e2e.py, tests/test_smg.py)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from api_wire import API_KEY, assert_openai_error
from prometheus_client.parser import text_string_to_metric_families

from lmserve import __version__

CHAT = {"model": "fake", "messages": [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "hello there"}], "max_tokens": 5}
CORE_FIELDS = {"dp_rank", "num_running_reqs", "num_waiting_reqs", "num_total_reqs", "num_waiting_uncached_tokens",
               "num_used_tokens", "num_total_tokens", "max_total_num_tokens", "max_running_requests", "token_usage",
               "gen_throughput", "cache_hit_rate", "utilization"}


async def loads(client: httpx.AsyncClient, include: str | None = "core,disagg,queues,memory") -> dict[str, Any]:
    response = await client.get("/v1/loads", params={"include": include} if include is not None else None)
    assert response.status_code == 200, response.text
    return dict(response.json())


# ---- /v1/loads ------------------------------------------------------------------------------------------------


async def test_loads_has_sglangs_shape_with_one_rank(client: httpx.AsyncClient) -> None:
    assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
    body = await loads(client)  # what SMG asks for
    assert set(body) == {"timestamp", "version", "dp_rank_count", "loads", "aggregate"}
    assert isinstance(body["timestamp"], str) and body["dp_rank_count"] == 1
    [rank] = body["loads"]
    assert set(rank) == CORE_FIELDS | {"memory", "queues"}
    integers = CORE_FIELDS - {"token_usage", "gen_throughput", "cache_hit_rate", "utilization"}
    assert all(type(rank[name]) is int for name in integers), rank  # SMG reads them as integers
    assert (rank["num_running_reqs"], rank["num_waiting_reqs"], rank["max_running_requests"]) == (0, 0, 4)
    assert rank["max_total_num_tokens"] == 2048 * 4 == rank["memory"]["token_capacity"]
    assert rank["num_used_tokens"] > 0  # the finished chat's prompt and reply stay in its slot
    assert rank["token_usage"] == pytest.approx(rank["num_used_tokens"] / rank["max_total_num_tokens"], abs=1e-4)
    assert rank["queues"] == {"waiting": 0, "grammar": 0, "paused": 0, "retracted": 0}
    assert body["aggregate"]["total_used_tokens"] == rank["num_used_tokens"]


async def test_loads_used_tokens_match_the_kv_cache_gauge(client: httpx.AsyncClient) -> None:
    assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
    [rank] = (await loads(client))["loads"]
    metrics = (await client.get("/metrics")).text
    [line] = [line for line in metrics.splitlines() if line.startswith("vllm:kv_cache_usage_perc{")]
    assert float(line.rsplit(" ", 1)[1]) * rank["max_total_num_tokens"] == pytest.approx(rank["num_used_tokens"])


@pytest.mark.parametrize(("include", "sections"), [
    ("core", set()), ("core,queues", {"queues"}), ("memory", {"memory"}), (None, {"memory", "queues"}),
    ("all", {"memory", "queues"}),
])
async def test_include_picks_the_sections(client: httpx.AsyncClient, include: str | None, sections: set[str]) -> None:
    [rank] = (await loads(client, include))["loads"]
    assert set(rank) - CORE_FIELDS == sections


async def test_an_unknown_section_is_a_400_in_openai_shape(client: httpx.AsyncClient) -> None:
    response = await client.get("/v1/loads", params={"include": "core,bogus"})
    assert response.status_code == 400
    error = assert_openai_error(response.json(), error_type="invalid_request_error")
    assert error["param"] == "include" and "bogus" in error["message"]


# ---- render ---------------------------------------------------------------------------------------------------


async def test_chat_render_gives_the_ids_the_request_prefills(client: httpx.AsyncClient) -> None:
    render = await client.post("/v1/chat/completions/render", json=CHAT)
    assert render.status_code == 200, render.text
    body = render.json()
    assert body["model"] == "fake" and body["request_id"].startswith("chatcmpl-") and body["stream"] is False
    assert body["sampling_params"]["max_tokens"] == 5
    tokenized = await client.post("/tokenize", json={"model": "fake", "messages": CHAT["messages"]})
    assert body["token_ids"] == tokenized.json()["tokens"]
    reply = await client.post("/v1/chat/completions", json=CHAT)
    assert len(body["token_ids"]) == reply.json()["usage"]["prompt_tokens"]


async def test_completion_render_answers_a_list(client: httpx.AsyncClient) -> None:
    request = {"model": "fake", "prompt": "Once upon a time", "max_tokens": 3, "temperature": 0.5}
    render = await client.post("/v1/completions/render", json=request)
    assert render.status_code == 200, render.text
    [body] = render.json()
    assert body["request_id"].startswith("cmpl-") and body["sampling_params"]["temperature"] == 0.5
    reply = await client.post("/v1/completions", json=request)
    assert len(body["token_ids"]) == reply.json()["usage"]["prompt_tokens"]


async def test_render_generates_nothing(client: httpx.AsyncClient) -> None:
    assert (await client.post("/v1/chat/completions/render", json=CHAT)).status_code == 200
    families = text_string_to_metric_families((await client.get("/metrics")).text)
    assert not [s for family in families for s in family.samples if s.name == "lmserve_prompt_tokens_total"]


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/v1/chat/completions/render", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404, None),
    ("/v1/chat/completions/render", {"model": "fake"}, 400, "messages"),
    ("/v1/chat/completions/render", {"model": "fake", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, 400, "messages"),
    ("/v1/completions/render", {"model": "fake", "prompt": ["a", "b"]}, 400, "prompt"),
])
async def test_bad_render_requests_get_openai_errors(client: httpx.AsyncClient, path: str, body: dict[str, Any],
                                                     status: int, param: str | None) -> None:
    response = await client.post(path, json=body)
    assert response.status_code == status, response.text
    error = assert_openai_error(response.json())
    if param is not None:
        assert error["param"] == param


# ---- /server_info, /model_info, /version ---------------------------------------------------------------------


async def test_server_info_names_the_options_and_the_model(client: httpx.AsyncClient) -> None:
    assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
    info = (await client.get("/server_info")).json()
    assert info["version"] == __version__ and info["model_path"] == "fake.gguf"
    assert (info["tp_size"], info["dp_size"], info["max_running_requests"]) == (1, 1, 4)
    assert info["parallel"] == 4 and info["port"] == 11434 and info["kv_unified"] is False  # server and engine
    assert "api_key" not in info


async def test_server_info_never_shows_the_api_key(secured_client: httpx.AsyncClient) -> None:
    response = await secured_client.get("/server_info", headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 200
    assert API_KEY not in response.text


async def test_model_info_and_version(client: httpx.AsyncClient) -> None:
    assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
    assert (await client.get("/model_info")).json() == {
        "model_path": "fake.gguf", "tokenizer_path": "fake.gguf", "is_generation": True, "model_type": "fake",
        "has_image_understanding": False,
    }
    assert (await client.get("/version")).json() == {"version": __version__}
