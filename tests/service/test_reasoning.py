"""The service's thinking, over the fake engine (it echoes a known sentence): the thinking kept apart, a budget
that closes it, a grammar applied to the answer only, think switched off, a model that cannot think."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lmserve.chat.template import ChatTemplate
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.fake import FakeBackend
from lmserve.service import static_service
from lmserve.service.residency import LoadedModel
from lmserve.types import ChatRequest, Message, SamplingParams

OPENS_THINKING = (  # a generation prompt that opens the thinking unless enable_thinking is false
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}"
)
LETS_MODEL_OPEN = (  # Qwen3's original style: the model writes <think> itself
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n{# the model opens <think> itself #}"
)


class RecordingBackend(FakeBackend):
    """The fake, remembering each sequence's sampling and prompt."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.started: list[tuple[SamplingParams, list[int]]] = []

    def start(self, slot: int, sampling: SamplingParams, prompt: list[int], num_reused: int,
              generated: list[int] | None = None) -> int:
        self.started.append((sampling, list(prompt)))
        return super().start(slot, sampling, prompt, num_reused, generated)


@pytest.fixture
def backend() -> RecordingBackend:
    return RecordingBackend(num_ctx=2048, num_parallel=2)


@pytest.fixture
def engine(backend: RecordingBackend) -> Iterator[BatchingEngine]:
    engine = BatchingEngine(backend)
    yield engine
    engine.close()


def service_with(engine: BatchingEngine, template: str | None):  # type: ignore[no-untyped-def]
    model = LoadedModel(name="m", engine=engine, template=ChatTemplate(template), template_source=template)
    return static_service([model])


def ask(**kwargs: object) -> ChatRequest:
    sampling = SamplingParams(temperature=0, max_tokens=kwargs.pop("max_tokens", 12))  # type: ignore[arg-type]
    return ChatRequest("m", [Message("user", "hi")], sampling, **kwargs)  # type: ignore[arg-type]


async def collect(service, request: ChatRequest) -> tuple[str, str, str | None]:  # type: ignore[no-untyped-def]
    generation = await service.generation.chat(request)
    text, final = await generation.collect()
    return final.reasoning, text, final.finish_reason


@pytest.mark.asyncio
async def test_a_prompt_that_opens_the_thinking_gives_all_reasoning(engine: BatchingEngine) -> None:
    service = service_with(engine, OPENS_THINKING)
    reasoning, text, finish = await collect(service, ask(max_tokens=10))
    assert reasoning and text == "" and finish == "length"


@pytest.mark.asyncio
async def test_the_stream_carries_thinking_apart_from_text(engine: BatchingEngine) -> None:
    service = service_with(engine, OPENS_THINKING)
    generation = await service.generation.chat(ask(max_tokens=10))
    chunks = [chunk async for chunk in generation]
    assert any(c.reasoning for c in chunks) and not any(c.text for c in chunks)


@pytest.mark.asyncio
async def test_usage_counts_the_thinking_tokens_within_the_completion(engine: BatchingEngine) -> None:
    service = service_with(engine, OPENS_THINKING)
    generation = await service.generation.chat(ask(max_tokens=20, reasoning_budget=5))
    _, final = await generation.collect()
    assert final.usage is not None
    assert final.usage.reasoning_tokens == len(final.reasoning.encode())  # the fake's tokens are bytes
    assert 0 < final.usage.reasoning_tokens < final.usage.completion_tokens
    plain = await service.generation.chat(ask(max_tokens=10, think=False))
    _, answer = await plain.collect()
    assert answer.usage is not None and answer.usage.reasoning_tokens == 0


@pytest.mark.asyncio
async def test_a_budget_closes_the_thinking_and_the_answer_follows(
    engine: BatchingEngine, backend: RecordingBackend
) -> None:
    service = service_with(engine, OPENS_THINKING)
    generation = await service.generation.chat(ask(max_tokens=20, reasoning_budget=5))
    text, final = await generation.collect()
    (first, prompt), (second, continued) = backend.started
    assert first.max_tokens == 5 and first.stop == ["</think>"]
    thought = FakeBackend.expected(len(prompt), 5)
    assert continued == prompt + list((thought + "\n</think>\n\n").encode())
    assert second.max_tokens == 20 - 5 - len("\n</think>\n\n")
    assert final.reasoning == thought.strip()
    assert second.max_tokens is not None
    assert text == FakeBackend.expected(len(continued), second.max_tokens).lstrip()
    assert final.usage is not None and final.usage.completion_tokens == 20
    assert final.usage.prompt_tokens == len(prompt)
    answer = FakeBackend.expected(len(continued), second.max_tokens)
    assert generation.output_tokens == continued[len(prompt):] + list(answer.encode())


@pytest.mark.asyncio
async def test_the_server_budget_applies_when_the_request_has_none(backend: RecordingBackend) -> None:
    engine = BatchingEngine(backend)
    try:
        service = service_with(engine, OPENS_THINKING)
        service.generation.reasoning_budget = 3
        await collect(service, ask(max_tokens=30))
        assert [s.max_tokens for s, _ in backend.started] == [3, 30 - 3 - len("\n</think>\n\n")]
    finally:
        engine.close()


@pytest.mark.asyncio
async def test_when_the_close_uses_up_max_tokens_the_reply_ends_at_length(
    engine: BatchingEngine, backend: RecordingBackend
) -> None:
    service = service_with(engine, OPENS_THINKING)
    reasoning, text, finish = await collect(service, ask(max_tokens=12, reasoning_budget=3))
    assert len(backend.started) == 1 and reasoning and text == "" and finish == "length"


@pytest.mark.asyncio
async def test_a_grammar_constrains_the_answer_not_the_thinking() -> None:
    backend = RecordingBackend(script="my plan</think>")  # the fake ignores grammars: it says this every time
    engine = BatchingEngine(backend)
    try:
        service = service_with(engine, LETS_MODEL_OPEN)
        request = ask(max_tokens=40)
        request.sampling.grammar = 'root ::= "x"'
        reasoning, _, finish = await collect(service, request)
        (first, prompt), (second, continued) = backend.started
        assert first.grammar is None and first.stop == ["</think>"] and second.grammar == 'root ::= "x"'
        assert bytes(prompt).decode().endswith("<|im_start|>assistant\n<think>\n")  # opened for the thinking
        assert bytes(continued).decode().endswith("<think>\nmy plan\n</think>\n\n")
        assert reasoning == "my plan" and finish == "stop"
    finally:
        engine.close()


@pytest.mark.asyncio
async def test_think_false_renders_thinking_off_and_the_reply_is_all_answer(
    engine: BatchingEngine, backend: RecordingBackend
) -> None:
    service = service_with(engine, OPENS_THINKING)
    reasoning, text, _ = await collect(service, ask(think=False, reasoning_budget=2))
    [(sampling, prompt)] = backend.started
    assert bytes(prompt).decode().endswith("<think>\n\n</think>\n\n")
    assert reasoning == "" and text and sampling.max_tokens == 12


@pytest.mark.asyncio
async def test_a_budget_of_zero_closes_the_thinking_before_it_starts(
    engine: BatchingEngine, backend: RecordingBackend
) -> None:
    service = service_with(engine, OPENS_THINKING)
    reasoning, text, _ = await collect(service, ask(reasoning_budget=0))
    [(_, prompt)] = backend.started
    assert bytes(prompt).decode().endswith("<think>\n\n</think>\n\n") and reasoning == "" and text


@pytest.mark.asyncio
async def test_a_model_that_cannot_think_answers_normally(engine: BatchingEngine, backend: RecordingBackend) -> None:
    service = service_with(engine, None)
    reasoning, text, _ = await collect(service, ask(think="high", reasoning_budget=2))
    assert reasoning == "" and len(text) == 12 and len(backend.started) == 1


@pytest.mark.asyncio
async def test_earlier_thinking_is_dropped_from_the_prompt(engine: BatchingEngine, backend: RecordingBackend) -> None:
    service = service_with(engine, LETS_MODEL_OPEN)
    messages = [Message("user", "hi"), Message("assistant", "<think>secret plan</think>Hello"),
                Message("user", "again")]
    await collect(service, ChatRequest("m", messages, SamplingParams(max_tokens=2)))
    [(_, prompt)] = backend.started
    assert "secret plan" not in bytes(prompt).decode()


KEEPS_THINKING = (  # a template that shows earlier thinking kept (it reads reasoning_content)
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)


@pytest.mark.asyncio
@pytest.mark.parametrize(("template", "shown"), [(KEEPS_THINKING, True), (LETS_MODEL_OPEN, False)])
async def test_thinking_sent_back_reaches_only_a_template_that_keeps_it(
    engine: BatchingEngine, backend: RecordingBackend, template: str, shown: bool
) -> None:
    service = service_with(engine, template)
    messages = [Message("user", "hi"), Message("assistant", "Hello", thinking="a kept plan"), Message("user", "again")]
    await collect(service, ChatRequest("m", messages, SamplingParams(max_tokens=2)))
    [(_, prompt)] = backend.started
    assert ("<think>\na kept plan\n</think>" in bytes(prompt).decode()) is shown


def test_show_lists_thinking_only_for_a_model_that_can_think(engine: BatchingEngine) -> None:
    assert "thinking" in service_with(engine, OPENS_THINKING).catalog.describe("m").capabilities
    assert "thinking" not in service_with(engine, None).catalog.describe("m").capabilities
