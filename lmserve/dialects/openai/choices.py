"""Several choices of one OpenAI request (`n`): each choice is answered as a one-choice reply, then merged.

The service gives one Generation per choice. A whole reply lists the choices' bodies' choice, indexed 0..n-1; a
stream interleaves the choices' frames as they come, each frame re-indexed to its choice, each choice with its own
finish frame, and ends with one usage frame (when asked) and [DONE]. Usage counts the prompt once and sums the
completions.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, TypeVar, cast

from lmserve.dialects.shared.streaming import SSE_DONE, sse_json
from lmserve.service import Generation

T = TypeVar("T")
Body = dict[str, Any]

_DATA = b"data: "


class Choices:
    """The generations of one request's choices, aborted together (a `streaming.Abortable`)."""

    def __init__(self, generations: list[Generation]) -> None:
        self.generations = generations

    @property
    def model(self) -> str:
        return self.generations[0].model

    def abort(self) -> None:
        for generation in self.generations:
            generation.abort()


def summed_usage(usages: list[Body]) -> Body:
    """Usage bodies of the choices of one prompt (in index order) as one: the prompt and its details as the first
    choice counted them (it prefilled the prompt; the others copied it), completions summed."""
    total = dict(usages[0])
    total["completion_tokens"] = sum(usage["completion_tokens"] for usage in usages)
    total["total_tokens"] = total["prompt_tokens"] + total["completion_tokens"]
    details = [usage.get("completion_tokens_details") or {} for usage in usages]
    if details[0]:
        total["completion_tokens_details"] = {key: sum(d.get(key) or 0 for d in details) for key in details[0]}
    return total


def prompts_usage(usages: list[Body], n: int) -> Body:
    """Usage bodies of every choice of several prompts (n choices each, in index order) as one: each prompt's as
    `summed_usage` counts it, added up."""
    groups = [summed_usage(usages[start:start + n]) for start in range(0, len(usages), n)]
    if len(groups) == 1:
        return groups[0]
    total = dict(groups[0])
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        total[key] = sum(group[key] for group in groups)
    for key in ("prompt_tokens_details", "completion_tokens_details"):
        details = [group.get(key) or {} for group in groups]
        if details[0]:
            total[key] = {name: sum(d.get(name) or 0 for d in details) for name in details[0]}
    return total


def merged(bodies: list[Body], n: int | None = None) -> Body:
    """One-choice reply bodies (same head) as one reply, indexed in order, usage summed: of one prompt's choices,
    or with `n` of several prompts' n choices each."""
    choices = [{**body["choices"][0], "index": index} for index, body in enumerate(bodies)]
    return {**bodies[0], "choices": choices, "usage": prompts_usage([body["usage"] for body in bodies],
                                                                      n or len(bodies))}


async def gather_all(work: list[Awaitable[T]], choices: Choices) -> list[T]:
    """Await every choice's work (each collecting a whole answer); when one fails, or this is cancelled, every
    choice is aborted before the error goes on."""
    try:
        return list(await asyncio.gather(*work))
    except BaseException:
        choices.abort()
        raise


async def merged_frames(streams: list[AsyncIterator[bytes]], head: Body, include_usage: bool,
                        n: int | None = None) -> AsyncIterator[bytes]:
    """Interleave one-choice SSE streams (made with usage on, to read each choice's usage) as one stream of their
    choices (of one prompt, or with `n` of several prompts' n each). An error frame of any choice ends it."""
    usages: dict[int, Body] = {}
    frames = interleave([_indexed(index, stream) for index, stream in enumerate(streams)])
    async with contextlib.aclosing(frames):
        async for index, frame in frames:
            if frame == SSE_DONE:
                continue
            data = json.loads(frame.removeprefix(_DATA))
            if "error" in data:
                yield frame
                return
            if not data.get("choices"):
                usages[index] = data["usage"]
                continue
            data["choices"][0]["index"] = index
            if not include_usage:
                data.pop("usage", None)
            yield sse_json(data)
    if include_usage:
        yield sse_json({**head, "choices": [], "usage": prompts_usage([usages[i] for i in sorted(usages)],
                                                                      n or len(usages))})
    yield SSE_DONE


async def _indexed(index: int, stream: AsyncIterator[bytes]) -> AsyncIterator[tuple[int, bytes]]:
    async for frame in stream:
        yield index, frame


async def interleave(iterators: list[AsyncIterator[T]]) -> AsyncGenerator[T, None]:
    """The items of all `iterators`, each as soon as it comes (each iterator's own order kept).

    The first error of any iterator is raised; ending early (a break, a cancel, an error) stops them all.
    """
    queue: asyncio.Queue[tuple[bool, T | BaseException | None]] = asyncio.Queue()

    async def pump(iterator: AsyncIterator[T]) -> None:
        try:
            async for item in iterator:
                queue.put_nowait((True, item))
        except Exception as exc:
            queue.put_nowait((False, exc))
        else:
            queue.put_nowait((False, None))

    tasks = [asyncio.ensure_future(pump(iterator)) for iterator in iterators]
    try:
        remaining = len(tasks)
        while remaining:
            is_item, value = await queue.get()
            if is_item:
                yield cast(T, value)
            elif isinstance(value, BaseException):
                raise value
            else:
                remaining -= 1
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
