"""The offline engine (`from lmserve import LLM`) on vLLM: the embedded SmolLM2 as a safetensors repository
(tests/hf_repos.py), float32 so a greedy reply does not depend on its batch. One engine for the module (vLLM's CPU
build takes about a minute to start); the checks are those of tests/test_offline.py that differ by engine.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from lmserve import LLM
from tests.hf_repos import smollm2_repo

pytestmark = [pytest.mark.filterwarnings(f"ignore::{warning}") for warning in (
    "DeprecationWarning:torch.*", "FutureWarning:torch.*", "FutureWarning:vllm.*", "DeprecationWarning:vllm.*",
    "UserWarning:vllm.*", "ResourceWarning")]
"""pyproject.toml's allowances for vLLM's stack, again as marks: a command line's `-W error` outranks the ini's."""

GREEDY = {"temperature": 0, "max_tokens": 24}
QUESTIONS = ["What is 10 times 3?", "Name three animals.", "What is the capital of France?", "Say hello."]
PERSON: dict[str, Any] = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    """The repository on vLLM with 2 slots and a queue of 1, in a fresh store; the environment is put back after
    (vLLM's platform check writes os.environ)."""
    saved = dict(os.environ)
    os.environ.update(LMSERVE_MODELS=str(tmp_path_factory.mktemp("store")))
    for name in [name for name in os.environ if name.startswith("LMSERVE_") and name != "LMSERVE_MODELS"]:
        del os.environ[name]
    try:
        with LLM(Path(smollm2_repo()), engine="vllm", dtype="float32", ctx_size=1024, parallel=2,
                 max_queue=1) as opened:
            yield opened
    finally:
        os.environ.clear()
        os.environ.update(saved)


def ask(question: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": question}]


def test_a_batch_of_chats_equals_each_chat_alone(llm: LLM) -> None:
    together = llm.chat([ask(q) for q in QUESTIONS], GREEDY)  # 4 > 2 slots + a queue of 1
    alone = [llm.chat(ask(q), GREEDY) for q in QUESTIONS]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert together[2].text == "The capital of France is Paris." and together[2].finish_reason == "stop"
    assert together[2].usage.completion_tokens == len(together[2].token_ids)


def test_generate_continues_raw_prompts(llm: LLM) -> None:
    [one, two] = llm.generate(["The capital of France is", "One, two, three,"], {"temperature": 0, "max_tokens": 2})
    assert one.text == " Paris." and one.finish_reason == "length" and two.text.strip().startswith("four")


def test_json_schema_output_parses(llm: LLM) -> None:
    form = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for reply in llm.chat([ask("Invent a person."), ask("Describe a famous scientist.")],
                          {"temperature": 0, "max_tokens": 40, "response_format": form}):
        jsonschema.validate(json.loads(reply.text), PERSON)
