"""The service's own decisions, over the fake engine: where a hybrid model's system prompt ends."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lmserve.catalog import static_service
from lmserve.chat.template import ChatTemplate
from lmserve.engine.fake import FakeBackend
from lmserve.engine.loop import Engine
from lmserve.loaded import LoadedModel
from lmserve.types import ChatRequest, Message, SamplingParams

STRICT = (
    "{% if messages[-1]['role'] != 'user' %}{{ raise_exception('the last message must be the user') }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture
def hybrid() -> Iterator[Engine]:
    backend = FakeBackend(num_ctx=2048, num_parallel=2)
    backend.info.can_cut_memory = False  # as a hybrid model's: shares through snapshots at checkpoints
    engine = Engine(backend)
    yield engine
    engine.close()


def request() -> ChatRequest:
    messages = [Message("system", "Be brief. " * 10), Message("user", "hi")]
    return ChatRequest("m", messages, SamplingParams(max_tokens=2))


@pytest.mark.asyncio
async def test_the_system_prompt_end_is_a_checkpoint_for_a_hybrid_model(hybrid: Engine) -> None:
    service = static_service([LoadedModel(name="m", engine=hybrid, template=ChatTemplate(None))])
    generation = await service.chat(request())
    system_turn = "<|im_start|>system\n" + "Be brief. " * 10 + "<|im_end|>\n"
    assert generation.stream.seq.checkpoints == [len(system_turn.encode())]  # the fake's tokens are bytes
    await generation.collect()


@pytest.mark.asyncio
async def test_a_template_that_refuses_a_system_only_conversation_still_answers(hybrid: Engine) -> None:
    service = static_service([LoadedModel(name="m", engine=hybrid, template=ChatTemplate(STRICT))])
    generation = await service.chat(request())
    assert generation.stream.seq.checkpoints == []
    text, final = await generation.collect()
    assert text and final.finish_reason == "length"
