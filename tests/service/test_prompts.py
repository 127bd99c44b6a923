"""Spec for lmserve.service.prompts: tools are never dropped. A template that does not render tools (the embedded
SmolLM2's among them) gets them in the system prompt with lmserve's JSON call shape; one that does is left alone."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmserve.chat.gotemplate import GoChatTemplate
from lmserve.chat.template import ChatTemplate
from lmserve.chat.tools import tools_prompt
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.fake import FakeBackend
from lmserve.errors import InvalidRequest
from lmserve.service import prompts, static_service
from lmserve.service.residency import LoadedModel, Prompter
from lmserve.store.gguf_check import gguf_metadata
from lmserve.types import AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, ChatRequest, Message, SamplingParams, ToolCall

WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Get the weather for a city",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
}
QWEN_LIKE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n"
)
GO_WITHOUT_TOOLS = "{{ range .Messages }}<{{ .Role }}>{{ .Content }}{{ end }}<assistant>"


@pytest.fixture(scope="module")
def smollm2_template(model_path: Path) -> str:
    return str(gguf_metadata(model_path)["tokenizer.chat_template"])


@pytest.fixture
def engine() -> Iterator[BatchingEngine]:
    engine = BatchingEngine(FakeBackend(num_ctx=8192, num_parallel=2))
    yield engine
    engine.close()


def loaded(engine: BatchingEngine, template: Prompter, source: str | None = None) -> LoadedModel:
    return LoadedModel(name="m", engine=engine, template=template, template_source=source)


def ask(*messages: Message, tools: list[dict[str, object]] | None = None) -> ChatRequest:
    return ChatRequest("m", list(messages) or [Message("user", "What is the weather in Paris?")],
                       SamplingParams(max_tokens=1), tools=tools or [])


def test_smollm2s_template_does_not_render_tools_so_they_go_in_the_system_prompt(
    engine: BatchingEngine, smollm2_template: str
) -> None:
    model = loaded(engine, ChatTemplate(smollm2_template), smollm2_template)
    assert not prompts.renders_tools(model.template)
    plain = prompts.render_chat(model, ask(), 16)
    with_tools = prompts.render_chat(model, ask(tools=[WEATHER]), 16)
    assert with_tools != plain
    assert with_tools.startswith("<|im_start|>system\n" + tools_prompt([WEATHER]) + "<|im_end|>\n")
    assert with_tools.count("<|im_start|>system") == 1


@pytest.mark.asyncio
async def test_prompt_tokens_differ_with_and_without_tools(engine: BatchingEngine, smollm2_template: str) -> None:
    service = static_service([loaded(engine, ChatTemplate(smollm2_template), smollm2_template)])
    counts = [await service.generation.count_tokens(ask(tools=tools)) for tools in ([], [WEATHER])]
    assert counts[1] > counts[0] + len(json.dumps(WEATHER["function"]["parameters"]))


def test_the_tools_block_joins_an_existing_system_message(engine: BatchingEngine, smollm2_template: str) -> None:
    model = loaded(engine, ChatTemplate(smollm2_template), smollm2_template)
    request = ask(Message("system", "Be brief."), Message("user", "Weather in Paris?"), tools=[WEATHER])
    messages = prompts.conversation(model, request)
    assert [m.role for m in messages] == ["system", "user"]
    assert messages[0].content == "Be brief.\n\n" + tools_prompt([WEATHER])


def test_earlier_calls_are_written_into_their_turns_in_the_json_shape(
    engine: BatchingEngine, smollm2_template: str
) -> None:
    model = loaded(engine, ChatTemplate(smollm2_template), smollm2_template)
    call = ToolCall("get_weather", '{"city":"Paris"}', "call_1")
    request = ask(Message("user", "Weather in Paris?"), Message("assistant", "", tool_calls=[call]),
                  Message("tool", "18 degrees", tool_call_id="call_1"), tools=[WEATHER])
    prompt = prompts.render_chat(model, request, 16)
    assert '<|im_start|>assistant\n[{"name": "get_weather", "arguments": {"city": "Paris"}}]<|im_end|>' in prompt


def test_a_template_that_renders_tools_is_left_alone(engine: BatchingEngine) -> None:
    model = loaded(engine, ChatTemplate(QWEN_LIKE), QWEN_LIKE)
    assert prompts.renders_tools(model.template)
    prompt = prompts.render_chat(model, ask(tools=[WEATHER]), 16)
    assert "<tools>" in prompt and tools_prompt([WEATHER]) not in prompt


def test_a_modelfile_template_without_tools_gets_them_too(engine: BatchingEngine) -> None:
    model = loaded(engine, GoChatTemplate(GO_WITHOUT_TOOLS), GO_WITHOUT_TOOLS)
    prompt = prompts.render_chat(model, ask(tools=[WEATHER]), 16)
    assert prompt.startswith("<system>" + tools_prompt([WEATHER]))


@pytest.mark.parametrize(("template", "explicit", "expected"), [
    (None, None, "json"),  # no template (ChatML fallback): lmserve's own JSON calls
    (QWEN_LIKE + "<tool_call>", None, "hermes"),  # detected from the template
    ("{{ 'List of tools: [' }}{{ tools | tojson }}]", None, "lfm2"),  # LFM2.5: tools without list tokens
    (None, "pythonic", "pythonic"),  # --tool-call-parser wins
])
def test_the_tool_format_of_a_model(engine: BatchingEngine, template: str | None, explicit: str | None,
                                    expected: str) -> None:
    service = static_service([loaded(engine, ChatTemplate(template), template)])
    service.generation.tool_call_parser = explicit
    model = loaded(engine, ChatTemplate(template), template)
    assert service.generation.tool_parser(model).name == expected


# ---- images and audio clips: where each goes ----


IMAGE, CLIP = b"image-bytes", b"clip-bytes"


def test_media_follow_their_placeholders_in_order() -> None:
    message = Message("user", f"hear {AUDIO_PLACEHOLDER} see {IMAGE_PLACEHOLDER} hear {AUDIO_PLACEHOLDER}",
                      images=[IMAGE], audio=[CLIP, b"second clip"])
    assert prompts.media_of(message) == [CLIP, IMAGE, b"second clip"]


def test_media_without_placeholders_go_before_the_text_images_first() -> None:
    message = Message("user", "what is this?", images=[IMAGE], audio=[CLIP])
    assert prompts.placed(message, "messages[0]") == f"{IMAGE_PLACEHOLDER}{AUDIO_PLACEHOLDER}what is this?"
    assert prompts.media_of(message) == [IMAGE, CLIP]


def test_placeholders_that_do_not_match_the_clips_are_a_400() -> None:
    message = Message("user", f"{AUDIO_PLACEHOLDER} and {AUDIO_PLACEHOLDER}", audio=[CLIP])
    with pytest.raises(InvalidRequest, match=r"messages\[2\] has 1 audio clips but 2 placeholders \(U\+FFFB\)"):
        prompts.placed(message, "messages[2]")


def test_audio_to_a_model_that_cannot_hear_is_a_400_naming_it(engine: BatchingEngine) -> None:
    model = loaded(engine, ChatTemplate("{{ messages[0]['content'] }}"))
    with pytest.raises(InvalidRequest, match="has no audio encoder \\(it cannot hear audio\\)"):
        prompts.with_media_markers(model, Message("user", "hi", audio=[CLIP]), "messages[0]")
