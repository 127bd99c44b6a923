"""One submitted request as the service hands it to a dialect (Generation): its stream of chunks with the thinking split
off and tool calls parsed out of the answer, where a stop string ended it, its usage, and the model lease it holds
until it ends."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from lmserve.chat.reasoning import (
    ReasoningFormat,
    StreamingReasoningParser,
)
from lmserve.chat.tools import StreamingToolParser, ToolCallParser
from lmserve.engine.protocol import Engine, GenerationStream
from lmserve.errors import EngineFailure
from lmserve.service.healing import stopped
from lmserve.service.observers import Observers
from lmserve.types import (
    Chunk,
    SamplingParams,
    TokenLogprob,
    ToolCall,
)


@dataclass(slots=True)
class Generation:
    """A submitted request: its prompt size, its stream of chunks, and the model lease it holds.

    With a reasoning format, the thinking is split off first into `Chunk.reasoning` (`thinking` says where the
    output starts: inside the thinking (True), in the answer (False), or undecided (None)). With a tool parser, the
    answer text is filtered through it: call markup never reaches `Chunk.text`, parsed calls arrive in
    `Chunk.tool_calls`, and a reply that made calls finishes with "tool_calls".
    """

    model: str
    num_prompt_tokens: int
    stream: GenerationStream
    on_done: Callable[[], None] = lambda: None
    load_ns: int = 0
    tool_parser: ToolCallParser | None = None
    max_tool_calls: int | None = None
    observers: Observers | None = None
    reasoning: ReasoningFormat | None = None
    thinking: bool | None = None
    engine: Engine | None = None
    """The model's engine, to read the output tokens back (thinking counted, stop strings found)."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """What it samples with: the request's options over the model's and the server's."""
    stops: list[str] = field(default_factory=list)
    """The request's stop strings: the last chunk of a reply one of them ended names it (`Chunk.stop_string`)."""
    counts_prompt: bool = True
    """False for the second and later choices of one request (`n`): observers count their shared prompt once."""
    forced: bool = False
    """The reply is a forced tool call: cut at the limit, it was closed into a complete call (service/json_budget.py)
    and finishes "tool_calls", as one the model ended does."""
    _is_released: bool = field(default=False, repr=False)

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        parsing = StreamingToolParser(self.tool_parser) if self.tool_parser is not None else None
        splitting = StreamingReasoningParser(self.reasoning, inside=self.thinking) if self.reasoning else None
        num_calls = 0
        thoughts: list[str] = []
        answer: list[str] = []
        try:
            async for chunk in self.stream:
                if chunk.finish_reason == "error":
                    chunk = self._say_why(chunk)
                if splitting is not None:
                    chunk = _split_reasoning(splitting, chunk)
                    thoughts.append(chunk.reasoning)
                if parsing is not None:
                    chunk, added = _parse_tools(parsing, chunk, num_calls, self.max_tool_calls, self.forced)
                    num_calls += added
                answer.append(chunk.text)
                if chunk.finish_reason is not None:
                    chunk = self._count_thinking(chunk, "".join(thoughts))
                    if chunk.finish_reason == "stop" and self.stops:
                        chunk = replace(chunk, stop_string=self._stop_string("".join(answer)))
                    if self.observers is not None:
                        self.observers.finished(self.model, chunk if self.counts_prompt else _without_prompt(chunk))
                yield chunk
        finally:
            self._release()

    async def collect(self) -> tuple[str, Chunk]:
        """The whole answer: all its text, and the final chunk carrying every tool call, all the thinking (in
        `reasoning`), every token's logprobs and the prompt's; aborts if this stops early."""
        parts: list[str] = []
        thoughts: list[str] = []
        calls: list[ToolCall] = []
        logprobs: list[TokenLogprob] = []
        prompt_logprobs: list[TokenLogprob] | None = None
        try:
            async for chunk in self:
                parts.append(chunk.text)
                thoughts.append(chunk.reasoning)
                calls += chunk.tool_calls
                logprobs += chunk.logprobs
                prompt_logprobs = chunk.prompt_logprobs if chunk.prompt_logprobs is not None else prompt_logprobs
                if chunk.finish_reason is not None:
                    if chunk.is_failed:
                        if self.engine is not None and self.engine.failure is not None:
                            raise stopped(self.model, self.engine.failure)
                        raise EngineFailure(chunk.error or "the generation failed")
                    return "".join(parts), replace(chunk, tool_calls=calls, reasoning="".join(thoughts),
                                                   logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        finally:
            self.abort()
        raise EngineFailure("the generation ended without a result")

    def _say_why(self, failed: Chunk) -> Chunk:
        """An error chunk, its message the engine's failure when the engine stopped under it (service/healing.py)."""
        if self.engine is None or self.engine.failure is None:
            return failed
        return replace(failed, error=stopped(self.model, self.engine.failure).message)

    def _stop_string(self, answer: str) -> str | None:
        """Which of `stops` ended this reply (finished "stop", answer text `answer`); None when the model ended its
        turn."""
        if self.engine is None:
            return None
        return stop_after(self.engine.detokenize(self.output_tokens), answer, self.stops)

    def _count_thinking(self, final: Chunk, thinking: str) -> Chunk:
        """`final` with its usage's reasoning tokens: the thinking's text tokenized again (within the completion)."""
        if not thinking or final.usage is None or self.engine is None:
            return final
        count = len(self.engine.tokenize(thinking, add_special=False, parse_special=True))
        usage = replace(final.usage, reasoning_tokens=min(count, final.usage.completion_tokens))
        return replace(final, usage=usage)

    @property
    def output_tokens(self) -> list[int]:
        return self.stream.output_tokens

    @property
    def prompt_tokens(self) -> list[int]:
        return self.stream.prompt_tokens

    def abort(self) -> None:
        self.stream.abort()
        self._release()

    def _release(self) -> None:
        if not self._is_released:
            self._is_released = True
            self.on_done()


STOP_SLACK = 32
"""Most characters of the stop's last token that may follow the stop string in the generated text."""


def stop_after(generated: str, answer: str, stops: list[str]) -> str | None:
    """Which stop string ended a reply: the one that follows `answer`'s end near the end of `generated` (the reply's
    tokens read back: the engines cut a stop string from the text but keep the tokens that made it). None: none
    does (the end-of-turn token ended it). Of several that start there the shortest wins: it was complete first
    (thinking before the answer is never searched)."""
    tail = answer[-STOP_SLACK:]
    found: list[tuple[int, str]] = []
    for stop in stops:
        if not stop:
            continue
        at = generated.rfind(tail + stop)
        if at >= 0 and at + len(tail) + len(stop) >= len(generated) - STOP_SLACK:
            found.append((len(stop), stop))
    return min(found)[1] if found else None


def _without_prompt(final: Chunk) -> Chunk:
    """`final` with no prompt tokens in its usage (a later choice's, whose prompt the first choice counted)."""
    if final.usage is None:
        return final
    return replace(final, usage=replace(final.usage, prompt_tokens=0, cached_tokens=0))


def _split_reasoning(splitting: StreamingReasoningParser, chunk: Chunk) -> Chunk:
    thinking, text = splitting.push(chunk.text)
    if chunk.finish_reason is not None:
        more_thinking, more_text = splitting.finish()
        thinking, text = thinking + more_thinking, text + more_text
    return replace(chunk, text=text, reasoning=chunk.reasoning + thinking)


def _parse_tools(
    parsing: StreamingToolParser, chunk: Chunk, num_calls_before: int, max_calls: int | None, forced: bool
) -> tuple[Chunk, int]:
    text, calls = parsing.push(chunk.text)
    if chunk.finish_reason is not None:
        tail, more = parsing.finish()
        text, calls = text + tail, calls + more
    if max_calls is not None:
        calls = calls[: max(0, max_calls - num_calls_before)]
    finish = chunk.finish_reason
    if num_calls_before + len(calls) > 0 and (finish == "stop" or (finish == "length" and forced)):
        finish = "tool_calls"  # a forced call cut at the limit was closed: complete, as the model would end it
    tool_calls = [ToolCall(call.name, call.arguments, call.id) for call in calls]
    return replace(chunk, text=text, tool_calls=tool_calls, finish_reason=finish), len(calls)
