"""Grammar-constrained sampling with the real embedded model: the output parses and validates, and ends."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from lmserve.chat.structured import json_object_grammar, schema_grammar
from lmserve.engine.llamacpp.backend import LlamaCppBackend
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.errors import InvalidRequest
from lmserve.types import Chunk, LoadOptions, SamplingParams

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
PROMPTS = [
    "Describe Ada Lovelace as JSON.",
    "Give me a JSON object for a 30 year old named Bob.",
    "Who is the oldest person you know? Answer in JSON.",
    "Write a haiku about the sea.",
]


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def engine(model_path: Path) -> Iterator[BatchingEngine]:
    eng = BatchingEngine(LlamaCppBackend(model_path, LoadOptions(num_ctx=512, num_parallel=4, num_batch=256)))
    yield eng
    eng.close()


pytestmark = pytest.mark.asyncio(loop_scope="module")


async def generate(engine: BatchingEngine, prompt: str, **sampling: Any) -> tuple[list[Chunk], str]:
    stream = engine.submit(engine.tokenize(chat(prompt)), SamplingParams(**sampling))
    chunks = [c async for c in stream]
    return chunks, "".join(c.text for c in chunks)


async def test_greedy_output_under_a_schema_parses_validates_and_stops(engine: BatchingEngine) -> None:
    grammar = schema_grammar(PERSON)
    runs = await asyncio.gather(*(generate(engine, p, temperature=0, max_tokens=200, grammar=grammar)
                                  for p in PROMPTS))
    for chunks, text in runs:
        assert chunks[-1].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), PERSON)


async def test_sampled_output_with_penalties_is_still_valid(engine: BatchingEngine) -> None:
    schema = {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
        "mood": {"type": "string", "maxLength": 12}, "score": {"type": "number", "minimum": 0, "maximum": 10},
    }, "required": ["colors", "mood", "score"], "additionalProperties": False}
    grammar = schema_grammar(schema)
    for seed in (1, 2, 3):
        chunks, text = await generate(engine, "Describe your day as JSON.", temperature=1.0, seed=seed,
                                      repeat_penalty=1.3, presence_penalty=0.5, max_tokens=200, grammar=grammar)
        assert chunks[-1].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)


async def test_any_json_object(engine: BatchingEngine) -> None:
    chunks, text = await generate(engine, PROMPTS[3], temperature=0, max_tokens=200, grammar=json_object_grammar())
    assert chunks[-1].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict)


async def test_the_grammar_ends_a_closed_choice_at_once(engine: BatchingEngine) -> None:
    grammar = schema_grammar({"enum": ["yes", "no"]})
    chunks, text = await generate(engine, "Is the sky blue?", temperature=0, max_tokens=50, grammar=grammar)
    assert json.loads(text) in ("yes", "no")
    assert chunks[-1].finish_reason == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 6


async def test_max_tokens_still_caps_a_constrained_answer(engine: BatchingEngine) -> None:
    chunks, text = await generate(engine, PROMPTS[0], temperature=0, max_tokens=3, grammar=schema_grammar(PERSON))
    assert chunks[-1].finish_reason == "length"
    assert text.startswith("{")


async def test_an_invalid_grammar_or_ignore_eos_is_refused_at_submit(engine: BatchingEngine) -> None:
    tokens = engine.tokenize(chat("hi"))
    with pytest.raises(InvalidRequest, match="grammar is invalid"):
        engine.submit(tokens, SamplingParams(grammar='root ::= "a" ('))
    with pytest.raises(InvalidRequest, match="ignore_eos"):
        engine.submit(tokens, SamplingParams(grammar=json_object_grammar(), ignore_eos=True))
    # the engine still serves afterwards
    chunks, _ = await generate(engine, "Say hi.", temperature=0, max_tokens=5)
    assert chunks[-1].finish_reason in ("stop", "length")
