"""The typed errors' messages that give advice: a prompt longer than the context says its size, the context in force,
the model's trained length, and what can work."""

from __future__ import annotations

import pytest

from lmserve.errors import ContextOverflow, InvalidRequest

SAID = "The prompt has {n} tokens, but this model's context is {ctx} tokens per sequence (the prompt must leave room " \
       "for a token to generate)."


@pytest.mark.parametrize(
    ("num_prompt", "num_ctx", "trained", "advice"),
    [
        # a larger context is possible: the smallest power of two above the prompt, within the trained length
        (3000, 2048, 8192, " This model was trained for up to 8192 tokens: start the server with -c 4096 (--ctx-size), "
         "or set num_ctx 4096 in the request's options or a Modelfile PARAMETER; or shorten the prompt."),
        (8000, 4096, 8192, " This model was trained for up to 8192 tokens: start the server with -c 8192 (--ctx-size), "
         "or set num_ctx 8192 in the request's options or a Modelfile PARAMETER; or shorten the prompt."),
        # the prompt is past what the model was trained for: no context can take it
        (29000, 8192, 8192, " This model was trained for at most 8192 tokens, so it cannot take this prompt: shorten "
         "it, or use a model with a longer context."),
        (8192, 8192, 8192, " This model was trained for at most 8192 tokens, so it cannot take this prompt: shorten "
         "it, or use a model with a longer context."),
        # the trained length is not known
        (3000, 2048, 0, " Start the server with a larger context (e.g. -c 4096), or set num_ctx 4096 in the request's "
         "options or a Modelfile PARAMETER; or shorten the prompt."),
    ],
)
def test_a_prompt_over_the_context_is_told_what_can_work(num_prompt: int, num_ctx: int, trained: int,
                                                         advice: str) -> None:
    error = ContextOverflow(num_prompt, num_ctx, trained)
    assert error.message == SAID.format(n=num_prompt, ctx=num_ctx) + advice
    assert isinstance(error, InvalidRequest) and error.status == 400
    assert (error.code, error.param) == ("context_length_exceeded", "messages")
    assert (error.num_prompt_tokens, error.num_ctx, error.num_ctx_train) == (num_prompt, num_ctx, trained)
