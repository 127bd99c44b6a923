"""The gateways' contract on a real `lmserve serve` (llama.cpp, the embedded model): the vllm: gauges and /v1/loads
follow what the engine does (a long streamed reply runs, requests beyond --parallel wait, an idle slot's prefix still
holds cells), and the render endpoints give the ids the request prefills."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.test_server import MODEL, Server

SLOTS = 2
CONTEXT = 1024
LONG = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 400, "ignore_eos": True, "stream": True}
"""A streamed completion that runs until it is closed (400 tokens take far longer than the test reads it)."""
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
          "vllm:cache_config_info", "vllm:lora_requests_info")

Gauges = dict[str, dict[frozenset[tuple[str, str]], float]]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server("-c", str(CONTEXT), "-np", str(SLOTS))
    yield srv
    srv.stop()


async def gauges(http: httpx.AsyncClient) -> Gauges:
    """The vllm: samples of a scrape, by name then labels; every family must be a gauge."""
    text = (await http.get("/metrics")).text
    found: Gauges = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("vllm:"):
            assert family.type == "gauge", family
            for sample in family.samples:
                found.setdefault(sample.name, {})[frozenset(sample.labels.items())] = sample.value
    return found


def one(found: Gauges, name: str) -> float:
    """The value of `name`'s only series (one model is loaded)."""
    [value] = found[name].values()
    return value


async def until(http: httpx.AsyncClient, done: Callable[[Gauges], bool], timeout: float = 60.0) -> Gauges:
    """Scrape until `done` holds (or `timeout` passes): the last scrape."""
    deadline = asyncio.get_running_loop().time() + timeout
    found = await gauges(http)
    while not done(found) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.1)
        found = await gauges(http)
    return found


async def test_a_long_streamed_reply_runs_and_its_slot_keeps_its_cells(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
        idle = await gauges(http)
        assert set(GAUGES) <= set(idle)
        labels = frozenset({"model_name": MODEL, "engine": "0"}.items())
        assert set(idle["vllm:num_requests_running"]) == {labels}
        [config] = idle["vllm:cache_config_info"]
        assert {"block_size": "1", "num_gpu_blocks": str(CONTEXT * SLOTS)}.items() <= dict(config).items()
        async with http.stream("POST", "/v1/completions", json=LONG) as response:
            lines = response.aiter_lines()
            for _ in range(10):  # a few tokens out: the reply is being generated
                await anext(lines)
            running = await gauges(http)
            loads = (await http.get("/v1/loads", params={"include": "core,disagg,queues,memory"})).json()
        assert (one(running, "vllm:num_requests_running"), one(running, "vllm:num_requests_waiting")) == (1, 0)
        usage = one(running, "vllm:kv_cache_usage_perc")
        assert 0 < usage < 1
        [rank] = loads["loads"]
        assert (rank["num_running_reqs"], rank["num_waiting_reqs"]) == (1, 0)
        assert rank["max_total_num_tokens"] == CONTEXT * SLOTS
        assert rank["num_used_tokens"] >= 10  # at least the prompt and the tokens read
        after = await until(http, lambda g: one(g, "vllm:num_requests_running") == 0)
        assert one(after, "vllm:num_requests_running") == 0
        assert one(after, "vllm:kv_cache_usage_perc") >= usage  # the closed reply's slot still holds its tokens


async def test_requests_beyond_the_slots_wait(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:

        async def stream() -> None:
            async with http.stream("POST", "/v1/completions", json=LONG) as response:
                async for _ in response.aiter_lines():
                    pass

        tasks = [asyncio.create_task(stream()) for _ in range(SLOTS + 2)]
        try:
            found = await until(http, lambda g: one(g, "vllm:num_requests_running") == SLOTS
                                and one(g, "vllm:num_requests_waiting") == 2)
            loads = (await http.get("/v1/loads")).json()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        assert (one(found, "vllm:num_requests_running"), one(found, "vllm:num_requests_waiting")) == (SLOTS, 2)
        assert loads["loads"][0]["num_waiting_reqs"] >= 1 and loads["loads"][0]["queues"]["waiting"] >= 1


def test_render_gives_the_ids_the_request_prefills(server: Server) -> None:
    chat: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "What is the capital of France?"}]}
    rendered = httpx.post(server.base_url + "/v1/chat/completions/render", json=chat, timeout=120).json()
    reply = httpx.post(server.base_url + "/v1/chat/completions", json=chat, timeout=120).json()
    assert len(rendered["token_ids"]) == reply["usage"]["prompt_tokens"]
    tokenized = httpx.post(server.base_url + "/tokenize", json={"model": MODEL, "messages": chat["messages"]},
                           timeout=120).json()
    assert rendered["token_ids"] == tokenized["tokens"]
    completion = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    [rendered_completion] = httpx.post(server.base_url + "/v1/completions/render", json=completion,
                                       timeout=120).json()
    reply = httpx.post(server.base_url + "/v1/completions", json=completion, timeout=120).json()
    assert len(rendered_completion["token_ids"]) == reply["usage"]["prompt_tokens"]
