"""The prompts of a legacy completion (`POST /v1/completions`): OpenAI's four shapes of `prompt` (a text, texts,
one list of token ids, lists of token ids), each prompt a completion of its own, answered as choices in prompt order
(`n` choices per prompt: choice `i * n + j` is prompt i's j-th, OpenAI's index rule)."""

from __future__ import annotations

from typing import cast

from lmserve.errors import InvalidRequest
from lmserve.service import Generation

Prompt = str | list[int]
"""One prompt: a text, or token ids of the model's own tokenizer."""
MAX_PROMPTS = 2048
"""The most prompts one request may carry (OpenAI's limit on `prompt` arrays)."""


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[Prompt]:
    """Each prompt of a request's `prompt`, in order; an empty list is one empty prompt."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        return [""]
    if all(isinstance(item, int) for item in prompt):
        return [cast("list[int]", list(prompt))]
    if len(prompt) > MAX_PROMPTS:
        raise InvalidRequest(f"{len(prompt)} prompts is more than one request may carry ({MAX_PROMPTS})",
                             param="prompt")
    return cast("list[Prompt]", list(prompt))


def single_prompt(prompt: str | list[str] | list[int] | list[list[int]]) -> Prompt:
    """The request's one prompt, where a route takes only one (a render, a batch line's legacy callers)."""
    prompts = completion_prompts(prompt)
    if len(prompts) > 1:
        raise InvalidRequest("only one prompt per request is supported here", param="prompt")
    return prompts[0]


def echo_of(prompt: Prompt, generation: Generation) -> str:
    """The prompt as `echo` returns it: a text as it was given, token ids as the model's text of them."""
    if isinstance(prompt, str):
        return prompt
    engine = generation.engine
    return engine.detokenize(list(prompt)) if engine is not None else ""


def first_piece(generation: Generation) -> str:
    """The text of the prompt's first token, which an echo with `logprobs` lists without a log-probability."""
    tokens = generation.stream.prompt_tokens
    if generation.engine is None or not tokens:
        return ""
    return generation.engine.token_bytes(tokens[0]).decode("utf-8", "replace")
