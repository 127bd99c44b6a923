"""The service's records as native answers: NDJSON lines of a generation or a pull, the final line's durations and
counts, the assistant message with its tool calls, a model's tag."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from lmserve.dialects.native.ndjson import line
from lmserve.dialects.shared import logprobs as logprob_wire
from lmserve.service import Generation, ModelListing
from lmserve.types import (
    Chunk,
    SamplingParams,
)

# ---- records → NDJSON -----------------------------------------------------------------------------

if TYPE_CHECKING:
    from lmserve.store.pull import PullProgress


def now_iso() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def pull_line(record: PullProgress) -> dict[str, Any]:
    """A pull's progress as a line of /api/pull: `{status, digest, total, completed}` without empty fields."""
    fields = {"status": record.status, "digest": record.digest, "total": record.total, "completed": record.completed}
    return {key: value for key, value in fields.items() if value is not None}


async def past_the_manifest(records: AsyncIterator[PullProgress]) -> list[PullProgress]:
    """The records up to the first one past "pulling manifest" (the repository was found and its files chosen);
    the pull's error if it ended before that."""
    head: list[PullProgress] = []
    async for record in records:
        head.append(record)
        if record.status != "pulling manifest":
            break
    return head


async def until_the_end(records: AsyncIterator[PullProgress]) -> None:
    async for _ in records:
        pass


def final_fields(generation: Generation, final: Chunk, started_ns: int) -> dict[str, Any]:
    usage, timings = final.usage, final.timings
    fields: dict[str, Any] = {
        "done": True,
        "done_reason": "stop" if final.finish_reason == "tool_calls" else final.finish_reason,
        "total_duration": time.perf_counter_ns() - started_ns,
        "load_duration": generation.load_ns,
        "prompt_eval_count": (usage.prompt_tokens - usage.cached_tokens) if usage else generation.num_prompt_tokens,
        "prompt_eval_duration": timings.prompt_eval_ns if timings else 0,
        "eval_count": usage.completion_tokens if usage else 0,
        "eval_duration": timings.eval_ns if timings else 0,
    }
    if usage is not None and usage.draft_tokens:  # speculative decoding (lmserve's own fields)
        fields.update(draft_count=usage.draft_tokens, draft_accepted_count=usage.draft_accepted_tokens)
    return fields


def logprobs_field(sampling: SamplingParams, chunk: Chunk) -> dict[str, Any]:
    """`{"logprobs": [...]}` of a chunk (the whole reply's on a collected final chunk) when the request asked."""
    return {"logprobs": logprob_wire.token_entries(chunk.logprobs)} if sampling.logprobs is not None else {}


async def ndjson_lines(
    generation: Generation, piece: Callable[[Chunk], dict[str, Any]], last: Callable[[Chunk], dict[str, Any]]
) -> AsyncIterator[bytes]:
    async for chunk in generation:
        if chunk.is_failed:
            yield line({"error": chunk.error or "the generation failed"})
            return
        if chunk.text or chunk.reasoning or chunk.tool_calls or chunk.logprobs:
            yield line(piece(chunk))
        if chunk.finish_reason is not None:
            yield line(last(chunk))
            return


def assistant_message(text: str, chunk: Chunk) -> dict[str, Any]:
    """The native assistant message (its `thinking` apart); tool calls carry `arguments` as an object, whole, in
    one chunk."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if chunk.reasoning:
        message["thinking"] = chunk.reasoning
    if chunk.tool_calls:
        message["content"] = text.strip()
        message["tool_calls"] = [
            {"function": {"name": call.name, "arguments": _arguments_object(call.arguments)}}
            for call in chunk.tool_calls
        ]
    return message


def _arguments_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return {}


def tag(listing: ModelListing) -> dict[str, Any]:
    return {
        "name": listing.name,
        "model": listing.name,
        "modified_at": datetime.fromtimestamp(listing.created, UTC).isoformat().replace("+00:00", "Z"),
        "size": listing.size,
        "digest": listing.digest,
        "details": listing.details,
    }


@dataclass(frozen=True, slots=True)
class Reply:
    """The lines of one /api/generate or /api/chat answer: a line per piece, the last line with the durations and
    counts, or the whole answer as one object. `context`: /api/generate's (the prompt's and the reply's tokens,
    which a later request may send back); None for chat, and where images made positions without tokens."""

    model: str
    generation: Generation
    sampling: SamplingParams
    started_ns: int
    chat: bool
    context: bool = False

    def head(self) -> dict[str, Any]:
        return {"model": self.model, "created_at": now_iso()}

    def piece(self, chunk: Chunk) -> dict[str, Any]:
        return {**self.head(), **self._output(chunk.text, chunk), **logprobs_field(self.sampling, chunk),
                "done": False}

    def last(self, final: Chunk) -> dict[str, Any]:
        empty = {"message": {"role": "assistant", "content": ""}} if self.chat else {"response": ""}
        done = {**self.head(), **empty, **final_fields(self.generation, final, self.started_ns)}
        if not self.context:
            return done
        return {**done, "context": self.generation.prompt_tokens + self.generation.output_tokens}

    def whole(self, text: str, final: Chunk) -> dict[str, Any]:
        return {**self.last(final), **self._output(text, final), **logprobs_field(self.sampling, final)}

    def _output(self, text: str, chunk: Chunk) -> dict[str, Any]:
        if self.chat:
            return {"message": assistant_message(text, chunk)}
        return {"response": text, **({"thinking": chunk.reasoning} if chunk.reasoning else {})}
