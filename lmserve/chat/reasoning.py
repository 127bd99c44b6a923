"""Reasoning (thinking) in a model's output text → the thinking apart from the answer, whole or while streaming.

One format per way of marking the thinking, in a registry by name (`--reasoning-parser NAME`; otherwise
`detect_reasoning()` reads the chat template):

    qwen3        `<think>…</think>` when the output opens it (or the prompt already did); else all answer
    deepseek_r1  `<think>…</think>`, the opening tag optional: everything before `</think>` is thinking
    mistral      `[THINK]…[/THINK]` (Magistral)
    kimi         `◁think▷…◁/think▷`
    command      `<|START_THINKING|>…<|END_THINKING|>` (Command R7B, Command A)
    seed_oss     `<seed:think>…</seed:think>`

A missing close tag leaves everything after the opening as thinking (vLLM's parsers do this while streaming, and
its DeepSeek-R1 parser for whole texts too): a thought cut off by `max_tokens` is still a thought, never an
answer. Whitespace around the thinking is trimmed, and so is the whitespace that separates it from the answer.
`StreamingReasoningParser` gives the same split as `split_reasoning()` for any split of the text into deltas; text
that could be the start of a tag is held back until it is decided.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lmserve.errors import InvalidRequest

__all__ = [
    "FORMATS",
    "ReasoningFormat",
    "StreamingReasoningParser",
    "detect_reasoning",
    "drop_thinking",
    "get_reasoning_format",
    "split_reasoning",
    "thinking_state",
]


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """How a model marks its thinking: the tags around it, and whether the opening tag may be left out."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    implicit_start: bool = False
    """True: the output starts in the thinking even without `start` (text before `end` is thinking)."""


FORMATS: dict[str, ReasoningFormat] = {
    "qwen3": ReasoningFormat("qwen3"),
    "deepseek_r1": ReasoningFormat("deepseek_r1", implicit_start=True),
    "mistral": ReasoningFormat("mistral", "[THINK]", "[/THINK]"),
    "kimi": ReasoningFormat("kimi", "◁think▷", "◁/think▷"),
    "command": ReasoningFormat("command", "<|START_THINKING|>", "<|END_THINKING|>"),
    "seed_oss": ReasoningFormat("seed_oss", "<seed:think>", "</seed:think>"),
}


def get_reasoning_format(name: str) -> ReasoningFormat:
    """The format registered under `name`; `InvalidRequest` naming the valid ones otherwise."""
    try:
        return FORMATS[name]
    except KeyError:
        valid = ", ".join(sorted(FORMATS))
        raise InvalidRequest(f"unknown reasoning parser {name!r}; valid parsers: {valid}",
                             param="reasoning_parser") from None


_DEEPSEEK_ASSISTANT = "<\uff5cAssistant\uff5c>"
"""DeepSeek's assistant marker (with FULLWIDTH VERTICAL LINEs)."""


def detect_reasoning(chat_template: str | None) -> str | None:
    """The thinking format a chat template teaches its model, from its tags; None when it has none (cannot think).

    A template that only cuts `</think>` out of earlier assistant turns and never writes `<think>` (LFM2.5's, shipped
    alike with its Instruct and Thinking models) does not say that the model thinks: None, so that a forced tool
    call or a schema constrains the reply from its first token instead of after a thinking the model never closes
    (`--reasoning-parser qwen3` for the Thinking model)."""
    if not chat_template:
        return None
    t = chat_template
    if "</seed:think>" in t:
        return "seed_oss"
    if "[/THINK]" in t:
        return "mistral"
    if "◁/think▷" in t:
        return "kimi"
    if "<|END_THINKING|>" in t:
        return "command"
    if _DEEPSEEK_ASSISTANT in t and ("</think>" in t or "<think>" in t):
        return "deepseek_r1"
    if "<think>" in t:
        return "qwen3"
    return None


def thinking_state(fmt: ReasoningFormat, prompt: str) -> bool | None:
    """Where output after the rendered `prompt` starts: inside the thinking (True: the generation prompt opened
    it), in the answer (False: the prompt ends with a closed, usually empty, thinking: thinking switched off), or
    undecided (None: the output says)."""
    opened = prompt.rfind(fmt.start)
    if opened >= 0 and prompt.find(fmt.end, opened) < 0:
        return True
    if prompt.rstrip().endswith(fmt.end):
        return False
    return None


def drop_thinking(fmt: ReasoningFormat, text: str) -> str:
    """`text` (an earlier assistant turn) without its thinking blocks."""
    pattern = re.escape(fmt.start) + ".*?" + re.escape(fmt.end)
    kept = re.sub(pattern, "", text, flags=re.DOTALL)
    if fmt.end in kept:  # the thinking had no opening tag (its prompt opened it): it runs to the close
        kept = kept.split(fmt.end)[-1]
    return kept.lstrip() if kept != text else text


def split_reasoning(fmt: ReasoningFormat, text: str, *, inside: bool | None = None) -> tuple[str, str]:
    """The whole output → (thinking, answer). `inside`: where the output starts (see `thinking_state`)."""
    parser = StreamingReasoningParser(fmt, inside=inside)
    thinking, answer = parser.push(text)
    more_thinking, more_answer = parser.finish()
    return thinking + more_thinking, answer + more_answer


_START, _THINK, _ANSWER = 0, 1, 2


def _tag_prefix_len(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class StreamingReasoningParser:
    """Feeds output deltas through a reasoning format; for any split, the results add up to `split_reasoning`.

    Before the first visible text it waits to see whether the output opens the thinking; inside it, a possible
    start of the close tag and trailing whitespace are held back; after it, everything is answer.
    """

    __slots__ = ("_buf", "_fmt", "_state", "_trim")

    def __init__(self, fmt: ReasoningFormat, *, inside: bool | None = None) -> None:
        self._fmt = fmt
        self._buf = ""
        self._state = _START if inside is None else _THINK if inside else _ANSWER
        self._trim = inside is not False
        """Leading whitespace of the current part (thinking, or the answer after it) is still to be dropped."""

    @property
    def thinking(self) -> bool:
        """True while the output is (or may yet be) inside the thinking."""
        return self._state != _ANSWER

    def push(self, delta: str) -> tuple[str, str]:
        """(thinking, answer) safe to show now."""
        self._buf += delta
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        """At the end of the output: what was held back."""
        return self._drain(final=True)

    def _drain(self, *, final: bool) -> tuple[str, str]:
        start, end = self._fmt.start, self._fmt.end
        thinking: list[str] = []
        answer: list[str] = []
        while True:
            if self._state == _START:
                head = self._buf.lstrip()
                if head.startswith(start):
                    self._buf, self._state = head[len(start):], _THINK
                    continue
                if not final and (not head or start.startswith(head)):
                    break
                if self._fmt.implicit_start:
                    self._state = _THINK
                    continue
                self._state, self._trim = _ANSWER, False
            elif self._state == _THINK:
                if self._trim:
                    self._buf = self._buf.lstrip()
                    self._trim = not self._buf
                i = self._buf.find(end)
                if i >= 0:
                    thinking.append(self._buf[:i].rstrip())
                    self._buf, self._state, self._trim = self._buf[i + len(end):], _ANSWER, True
                    continue
                if final:
                    thinking.append(self._buf.rstrip())
                    self._buf = ""
                    break
                cut = len(self._buf) - _tag_prefix_len(self._buf, end)
                cut = len(self._buf[:cut].rstrip())
                thinking.append(self._buf[:cut])
                self._buf = self._buf[cut:]
                break
            else:
                if self._trim:
                    self._buf = self._buf.lstrip()
                    self._trim = not self._buf
                answer.append(self._buf)
                self._buf = ""
                break
        return "".join(thinking), "".join(answer)
