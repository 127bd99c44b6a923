"""A reply's thinking, planned and run: split off only, or first in a phase of its own.

A thinking budget, or a grammar (structured output, a forced tool call) on a model that thinks, runs in two
phases (`ThinkingFirst`): the thinking, unconstrained, until the close tag or the budget; then the answer, from the
prompt plus the thinking plus the close tag, under the request's grammar. Both engines take token prompts, so
neither needs to know.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from lmserve.chat.reasoning import ReasoningFormat, thinking_state
from lmserve.engine.protocol import Engine, PromptImage
from lmserve.errors import ContextOverflow, LmserveError
from lmserve.service.json_budget import close_in_budget, thinking_cap
from lmserve.types import Chunk, SamplingParams, Timings, Usage


@dataclass(slots=True)
class ThinkingPlan:
    """A reply's thinking: the prompt to submit, the model's format (None: it does not think), where the output
    starts (see `thinking_state`), and whether the thinking runs first in a phase of its own, up to `budget`."""

    prompt: str
    format: ReasoningFormat | None = None
    state: bool | None = None
    first: bool = False
    budget: int | None = None


def open_thinking(
    fmt: ReasoningFormat, prompt: str, state: bool | None, budget: int | None
) -> tuple[str, bool | None]:
    """`prompt` made to end inside the thinking (so the first phase is thinking, whatever the model would open
    with); with a budget of 0, made to end after an empty, closed thinking. Returns the prompt and its state."""
    if budget == 0:
        closing = ("\n" if state is True else fmt.start + "\n\n") + fmt.end + "\n\n"
        return prompt + closing, False
    if state is True:
        return prompt, True
    return prompt + fmt.start + "\n", True


def plan_thinking(
    fmt: ReasoningFormat | None, prompt: str, think: bool | str | None, budget: int | None, sampling: SamplingParams
) -> ThinkingPlan:
    """How the reply's thinking is run: split off only, or first in a phase of its own (a budget, or a grammar
    that must constrain the answer alone), the prompt then made to end inside the thinking. `budget` is the
    request's or the server's (None: no limit)."""
    if fmt is None:
        return ThinkingPlan(prompt)
    state = thinking_state(fmt, prompt)
    thinks = state is True or (state is None and think is not False)
    if not thinks or (budget is None and sampling.grammar is None):
        return ThinkingPlan(prompt, fmt, state)
    prompt, state = open_thinking(fmt, prompt, state, budget)
    return ThinkingPlan(prompt, fmt, state, first=state is True, budget=budget)


class ThinkingFirst:
    """A generation stream in two phases: the thinking, then the answer.

    The thinking is generated without the request's grammar and stops (user stops aside), until the close tag or
    `budget` tokens; then the answer continues from the prompt, the thinking and the close tag (shown in the
    stream as text, so the reasoning parser sees the thinking end), under the request's own sampling. The
    request's `max_tokens` bounds both phases together. The prompt must end inside the thinking.
    """

    def __init__(
        self, engine: Engine, prompt: list[int], sampling: SamplingParams, fmt: ReasoningFormat, budget: int | None,
        *, special: bool, images: list[PromptImage] | None, checkpoints: list[int] | None,
    ) -> None:
        self._engine = engine
        self._prompt = prompt
        self._sampling = sampling
        self._fmt = fmt
        self._special = special
        self._images = images
        limit = sampling.max_tokens
        cap = thinking_cap(engine, sampling, "\n" + fmt.end + "\n\n", special=special)  # room for the shortest answer
        if budget is not None and (cap is None or budget < cap):
            cap = budget
        self._at_budget = cap is not None and (limit is None or cap < limit)
        thinking = replace(sampling, grammar=None, stop=[fmt.end], logit_bias=dict(sampling.logit_bias),
                           max_tokens=cap)
        self._current = engine.submit(prompt, thinking, special=special, images=images, checkpoints=checkpoints)
        self._before: list[int] = []
        """Output tokens of the thinking phase, close tag included, once the answer phase runs."""
        self._is_aborted = False

    @property
    def prompt_tokens(self) -> list[int]:
        return self._prompt

    @property
    def output_tokens(self) -> list[int]:
        return self._before + self._current.output_tokens

    def abort(self) -> None:
        self._is_aborted = True
        self._current.abort()

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        first = self._current
        parts: list[str] = []
        final: Chunk | None = None
        async for chunk in first:
            if chunk.finish_reason is not None:
                final = chunk
                break
            parts.append(chunk.text)
            yield chunk
        if final is None:
            return
        parts.append(final.text)
        ended = final.finish_reason == "stop" or (final.finish_reason == "length" and self._at_budget)
        if self._is_aborted or not ended:
            yield final
            return
        if final.text:
            yield replace(final, finish_reason=None, usage=None, timings=None)
        thought = "".join(parts)
        close = ("" if thought.endswith("\n") else "\n") + self._fmt.end + "\n\n"
        yield Chunk(text=close)
        before = self._tokens(thought + close)
        rest = None if self._sampling.max_tokens is None else self._sampling.max_tokens - len(before)
        first_usage = final.usage or Usage(prompt_tokens=len(self._prompt))
        cut_short = Chunk(finish_reason="length", usage=_usage(first_usage, len(before), None), timings=final.timings)
        if rest is not None and rest <= 0:
            yield cut_short
            return
        try:
            second = self._engine.submit(self._prompt + before, replace(self._sampling, max_tokens=rest),
                                         special=self._special, images=self._images)
        except ContextOverflow:
            yield cut_short
            return
        except LmserveError as exc:
            yield Chunk(finish_reason="error", error=exc.message, usage=_usage(first_usage, len(before), None))
            return
        second = close_in_budget(self._engine, second, replace(self._sampling, max_tokens=rest),  # closed in time
                                 special=self._special)
        self._before, self._current = before, second
        if self._is_aborted:
            second.abort()
        async for chunk in second:
            if chunk.finish_reason is not None:
                chunk = replace(chunk, usage=_usage(first_usage, len(before), chunk.usage),
                                timings=_add_timings(final.timings, chunk.timings))
            yield chunk

    def _tokens(self, text: str) -> list[int]:
        return self._engine.tokenize(text, add_special=False, parse_special=True)


def _usage(first: Usage, num_thought: int, second: Usage | None) -> Usage:
    """The prompt as the first phase counted it; thinking (with its close tag) and answer as the completion."""
    answer = second.completion_tokens if second is not None else 0
    return Usage(prompt_tokens=first.prompt_tokens, completion_tokens=num_thought + answer,
                 cached_tokens=first.cached_tokens)


def _add_timings(first: Timings | None, second: Timings | None) -> Timings | None:
    if first is None or second is None:
        return second or first
    return Timings(load_ns=first.load_ns, prompt_eval_ns=first.prompt_eval_ns + second.prompt_eval_ns,
                   eval_ns=first.eval_ns + second.eval_ns, total_ns=first.total_ns + second.total_ns)
