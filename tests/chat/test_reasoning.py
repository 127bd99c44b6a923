"""Reasoning formats: the thinking split from the answer, whole and over every split into deltas; detection from
the template; earlier turns' thinking dropped; the template variables that switch thinking."""

from __future__ import annotations

import pytest

from lmserve.chat.reasoning import (
    FORMATS,
    StreamingReasoningParser,
    detect_reasoning,
    drop_thinking,
    get_reasoning_format,
    split_reasoning,
    thinking_state,
)
from lmserve.chat.template import ChatTemplate, thinking_variables
from lmserve.errors import InvalidRequest
from lmserve.types import Message

QWEN3 = FORMATS["qwen3"]
R1 = FORMATS["deepseek_r1"]

QWEN3_LIKE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{{ m.content.split('</think>')[-1].lstrip('\\n') }}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def stream(parser: StreamingReasoningParser, pieces: list[str]) -> tuple[list[str], list[str]]:
    thinking: list[str] = []
    answer: list[str] = []
    for piece in pieces:
        t, a = parser.push(piece)
        thinking.append(t)
        answer.append(a)
    t, a = parser.finish()
    return [*thinking, t], [*answer, a]


# ---- the whole text ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "inside", "expected"), [
    ("<think>\nI should greet.\n</think>\n\nHello!", None, ("I should greet.", "Hello!")),
    ("  <think>a</think>b", None, ("a", "b")),
    ("I should greet.\n</think>\n\nHello!", True, ("I should greet.", "Hello!")),
    ("Hello, no thinking here.", None, ("", "Hello, no thinking here.")),
    ("<think>cut off by max_tokens", None, ("cut off by max_tokens", "")),
    ("cut off by max_tokens", True, ("cut off by max_tokens", "")),
    ("<think>a</think>b", False, ("", "<think>a</think>b")),
    ("<thinking is a word", None, ("", "<thinking is a word")),
    ("<think></think>answer", None, ("", "answer")),
    ("", None, ("", "")),
])
def test_qwen3_splits_thinking_from_the_answer(text: str, inside: bool | None, expected: tuple[str, str]) -> None:
    assert split_reasoning(QWEN3, text, inside=inside) == expected


def test_deepseek_r1_reads_text_before_the_close_tag_as_thinking_even_without_the_open_tag() -> None:
    assert split_reasoning(R1, "hmm, 2+2\n</think>\n\n4") == ("hmm, 2+2", "4")
    assert split_reasoning(R1, "<think>hmm</think>4") == ("hmm", "4")
    assert split_reasoning(R1, "never closed") == ("never closed", "")


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_every_format_splits_its_own_tags(name: str) -> None:
    fmt = FORMATS[name]
    assert split_reasoning(fmt, f"{fmt.start}plan{fmt.end}done") == ("plan", "done")


def test_the_answer_keeps_a_second_think_block_as_text() -> None:
    assert split_reasoning(QWEN3, "<think>a</think>b <think>c</think>") == ("a", "b <think>c</think>")


# ---- streaming -----------------------------------------------------------------------------------------------

TEXTS = [
    ("<think>\nLet me see.  \n</think>\n\nThe answer is 4.", None),
    ("Let me see.\n</think>\n\n  The answer", True),
    ("Just an answer with </think> in it", None),
    ("<think>never closed </thi", None),
    ("  <thin", None),
    ("<|START_THINKING|>x<|END_THINKING|>y", None),
]


@pytest.mark.parametrize(("text", "inside"), TEXTS)
def test_any_split_into_two_deltas_gives_the_whole_split(text: str, inside: bool | None) -> None:
    fmt = FORMATS["command"] if text.startswith("<|START") else QWEN3
    whole = split_reasoning(fmt, text, inside=inside)
    for cut in range(len(text) + 1):
        thinking, answer = stream(StreamingReasoningParser(fmt, inside=inside), [text[:cut], text[cut:]])
        assert ("".join(thinking), "".join(answer)) == whole, cut


@pytest.mark.parametrize(("text", "inside"), TEXTS)
def test_one_character_at_a_time_gives_the_whole_split_and_never_shows_part_of_a_tag(
    text: str, inside: bool | None
) -> None:
    fmt = FORMATS["command"] if text.startswith("<|START") else QWEN3
    thinking, answer = stream(StreamingReasoningParser(fmt, inside=inside), list(text))
    assert ("".join(thinking), "".join(answer)) == split_reasoning(fmt, text, inside=inside)
    for piece in thinking[:-1]:  # while streaming (not the final flush), no piece of a tag leaks into the thinking
        assert "<" not in piece and "think" not in piece.lower()


def test_thinking_streams_as_it_comes() -> None:
    parser = StreamingReasoningParser(QWEN3)
    assert parser.push("<think>") == ("", "")
    assert parser.thinking
    assert parser.push("first thoughts ") == ("first thoughts", "")
    assert parser.push("and more") == (" and more", "")
    assert parser.push("</think>\n\nAns") == ("", "Ans")
    assert not parser.thinking
    assert parser.push("wer") == ("", "wer")
    assert parser.finish() == ("", "")


def test_a_tag_split_over_deltas_is_held_back_until_decided() -> None:
    parser = StreamingReasoningParser(QWEN3, inside=True)
    assert parser.push("idea </th") == ("idea", "")
    assert parser.push("ink>") == ("", "")
    assert parser.push("\nok") == ("", "ok")


# ---- the template --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("template", "name"), [
    (QWEN3_LIKE_TEMPLATE, "qwen3"),
    ("{{ '<\uff5cAssistant\uff5c><think>\\n' }}{{ c.split('</think>')[-1] }}", "deepseek_r1"),
    ("[THINK]{{ x }}[/THINK]", "mistral"),
    ("<|START_THINKING|>{{ x }}<|END_THINKING|>", "command"),
    ("<seed:think>{{ x }}</seed:think>", "seed_oss"),
    ("{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}", None),
    # LFM2.5 strips earlier thinking but never opens it (its Instruct and Thinking models share the template)
    ('{%- if "</think>" in content -%}{%- set content = content.split("</think>")[-1] | trim -%}{%- endif -%}', None),
    (None, None),
])
def test_the_format_is_detected_from_the_template(template: str | None, name: str | None) -> None:
    assert detect_reasoning(template) == name


def test_an_unknown_parser_name_is_refused_naming_the_valid_ones() -> None:
    with pytest.raises(InvalidRequest, match="qwen3"):
        get_reasoning_format("nope")


@pytest.mark.parametrize(("prompt", "state"), [
    ("<|im_start|>assistant\n<think>\n", True),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
    ("<|im_start|>assistant\n", None),
    ("<think>old</think>answer<|im_end|><|im_start|>assistant\n", None),
])
def test_the_prompt_says_where_the_output_starts(prompt: str, state: bool | None) -> None:
    assert thinking_state(QWEN3, prompt) is state


def test_earlier_thinking_is_dropped_from_an_assistant_turn() -> None:
    assert drop_thinking(QWEN3, "<think>\nplan\n</think>\n\nHello") == "Hello"
    assert drop_thinking(QWEN3, "plan</think>Hello") == "Hello"
    assert drop_thinking(QWEN3, "Hello") == "Hello"


@pytest.mark.parametrize(("think", "variables"), [
    (None, {}),
    (False, {"enable_thinking": False, "think": False}),
    (True, {"enable_thinking": True, "think": True}),
    ("high", {"enable_thinking": True, "think": True, "reasoning_effort": "high"}),
])
def test_think_becomes_template_variables(think: bool | str | None, variables: dict[str, object]) -> None:
    assert thinking_variables(think) == variables


def test_enable_thinking_false_renders_a_closed_empty_thinking() -> None:
    template = ChatTemplate(QWEN3_LIKE_TEMPLATE)
    messages = [Message("user", "hi")]
    off = template.render(messages, think=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert thinking_state(QWEN3, off) is False
    assert template.render(messages, think=True).endswith("<|im_start|>assistant\n")
