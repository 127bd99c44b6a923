"""The service's own decisions, over the fake engine: where a hybrid model's system prompt ends, where images go."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest
from PIL import Image

from lmserve.chat.template import ChatTemplate
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.fake import FakeBackend
from lmserve.errors import InvalidRequest
from lmserve.service import static_service
from lmserve.service.generation_stream import stop_after
from lmserve.service.residency import LoadedModel
from lmserve.types import IMAGE_PLACEHOLDER, ChatRequest, Message, SamplingParams

STRICT = (
    "{% if messages[-1]['role'] != 'user' %}{{ raise_exception('the last message must be the user') }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture
def hybrid() -> Iterator[BatchingEngine]:
    backend = FakeBackend(num_ctx=2048, num_parallel=2)
    backend.info.can_cut_memory = False  # as a hybrid model's: shares through snapshots at checkpoints
    engine = BatchingEngine(backend)
    yield engine
    engine.close()


def request() -> ChatRequest:
    messages = [Message("system", "Be brief. " * 10), Message("user", "hi")]
    return ChatRequest("m", messages, SamplingParams(max_tokens=2))


@pytest.mark.asyncio
async def test_the_system_prompt_end_is_a_checkpoint_for_a_hybrid_model(hybrid: BatchingEngine) -> None:
    service = static_service([LoadedModel(name="m", engine=hybrid, template=ChatTemplate(None))])
    generation = await service.generation.chat(request())
    system_turn = "<|im_start|>system\n" + "Be brief. " * 10 + "<|im_end|>\n"
    assert generation.stream.seq.checkpoints == [len(system_turn.encode())]  # the fake's tokens are bytes
    await generation.collect()


@pytest.mark.asyncio
async def test_a_template_that_refuses_a_system_only_conversation_still_answers(hybrid: BatchingEngine) -> None:
    service = static_service([LoadedModel(name="m", engine=hybrid, template=ChatTemplate(STRICT))])
    generation = await service.generation.chat(request())
    assert generation.stream.seq.checkpoints == []
    text, final = await generation.collect()
    assert text and final.finish_reason == "length"


@pytest.fixture
def seer() -> Iterator[BatchingEngine]:
    engine = BatchingEngine(FakeBackend(num_ctx=2048, num_parallel=2, vision=True))
    yield engine
    engine.close()


def image(shade: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (shade, shade, shade)).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.asyncio
async def test_images_go_where_their_placeholders_stand(seer: BatchingEngine) -> None:
    service = static_service([LoadedModel(name="m", engine=seer, template=ChatTemplate("{{ messages[0].content }}"))])
    message = Message("user", f"a{IMAGE_PLACEHOLDER}b{IMAGE_PLACEHOLDER}c", images=[image(0), image(255)])
    generation = await service.generation.chat(ChatRequest("m", [message], SamplingParams(max_tokens=1)))
    prompt = generation.prompt_tokens
    await generation.collect()
    # The fake tokenizes text as bytes and gives a 16x16 image one position (a negative placeholder id).
    assert prompt[0] == ord("a") and prompt[2] == ord("b") and prompt[4] == ord("c")
    assert prompt[1] < 0 and prompt[3] < 0 and prompt[1] != prompt[3]
    without = Message("user", "ab", images=[image(0)])  # no placeholders: the image goes first
    generation = await service.generation.chat(ChatRequest("m", [without], SamplingParams(max_tokens=1)))
    assert generation.prompt_tokens[0] < 0
    await generation.collect()


@pytest.mark.asyncio
async def test_placeholders_and_images_must_agree(seer: BatchingEngine) -> None:
    service = static_service([LoadedModel(name="m", engine=seer, template=ChatTemplate(None))])
    message = Message("user", f"{IMAGE_PLACEHOLDER} and {IMAGE_PLACEHOLDER}", images=[image(0)])
    with pytest.raises(InvalidRequest, match=r"1 images but 2 placeholders \(U\+FFFC\)"):
        await service.generation.chat(ChatRequest("m", [message], SamplingParams(max_tokens=1)))


@pytest.mark.asyncio
async def test_an_engine_without_constrained_sampling_or_embeddings_refuses_them(seer: BatchingEngine) -> None:
    seer.info.can_constrain = False
    seer.info.can_embed = False
    service = static_service([LoadedModel(name="m", engine=seer, template=ChatTemplate(None))])
    structured = ChatRequest("m", [Message("user", "hi")], SamplingParams(max_tokens=1, grammar='root ::= "x"'))
    with pytest.raises(InvalidRequest, match="cannot constrain") as refused:
        await service.generation.chat(structured)
    assert refused.value.param == "response_format"
    with pytest.raises(InvalidRequest, match="cannot make embeddings"):
        await service.generation.embed("m", ["hi"])
    assert service.residency.running()[0].users == 0  # both leases were given back


def test_the_stop_that_follows_the_answer_is_the_one_that_ended_it() -> None:
    assert stop_after("a lazy fox", "a ", ["fox", "lazy"]) == "lazy"
    assert stop_after("a lazy fox", "a ", ["lazy", "la"]) == "la"  # both start there: the shorter was complete first
    assert stop_after("a lazy fox", "a lazy fox", ["lazy", "fox"]) is None  # the turn ended: nothing follows
    assert stop_after("<think>so lazy</think>ok", "ok", ["lazy"]) is None  # a stop in the thinking is no stop
    assert stop_after("<think>hm</think>Go", "", ["Go"]) == "Go"  # a stop at the start of the answer


@pytest.mark.asyncio
async def test_observers_count_the_prompt_of_n_choices_once(hybrid: BatchingEngine) -> None:
    service = static_service([LoadedModel(name="m", engine=hybrid, template=ChatTemplate(None))])
    seen: list[tuple[int, int]] = []
    service.observers.on_finish(lambda _, chunk: seen.append((chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
                                                              if chunk.usage else (-1, -1)))
    choices = await service.generation.chat_choices(request(), 3)
    finals = [(await choice.collect())[1] for choice in choices]
    prompt = finals[0].usage.prompt_tokens if finals[0].usage else 0
    assert prompt > 0 and sorted(p for p, _ in seen) == [0, 0, prompt]
    assert sum(c for _, c in seen) == 3 * 2  # every choice's completion tokens still count
