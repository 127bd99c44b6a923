"""The Batch API on the vLLM engine (the shared vLLM server): batch lines reach vLLM with their priority (vLLM runs
its priority scheduling), and a line's reply is the reply the same request gets alone."""

from __future__ import annotations

import json
import time
from typing import Any

import openai
import pytest


def test_a_chat_batch_runs_on_vllm_at_the_lowest_priority(vllm_client: openai.OpenAI, vllm_model: str) -> None:
    questions = ["What is the capital of France?", "Name a colour.", "Say hello."]
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": vllm_model, "messages": [{"role": "user", "content": q}], "max_tokens": 8,
                       "temperature": 0}} for i, q in enumerate(questions)]
    upload = vllm_client.files.create(file=("in.jsonl", b"".join(json.dumps(line).encode() + b"\n" for line in lines)),
                                      purpose="batch")
    batch = vllm_client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                       completion_window="24h")
    deadline = time.monotonic() + 120
    while (batch := vllm_client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.1)
    assert batch.status == "completed" and batch.request_counts is not None
    assert batch.request_counts.completed == 3
    assert batch.output_file_id is not None
    out = {json.loads(line)["custom_id"]: json.loads(line)
           for line in vllm_client.files.content(batch.output_file_id).text.splitlines()}
    alone = vllm_client.chat.completions.create(model=vllm_model, messages=[{"role": "user", "content": questions[0]}],
                                                max_tokens=8, temperature=0, extra_body={"priority": -5})
    assert out["q0"]["response"]["body"]["choices"][0]["message"]["content"] == alone.choices[0].message.content


@pytest.mark.parametrize("priority", [1001, -1001, "high"])
def test_a_priority_out_of_range_is_a_400_naming_it(vllm_client: openai.OpenAI, vllm_model: str,
                                                    priority: Any) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        vllm_client.chat.completions.create(model=vllm_model, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=2, extra_body={"priority": priority})
    assert caught.value.response.json()["error"]["param"] == "priority"
