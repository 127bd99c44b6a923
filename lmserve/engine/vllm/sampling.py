"""lmserve's sampling settings as vLLM's `SamplingParams` keywords, and the checks of what vLLM can sample: scoring
tokens from the raw distribution, grammars its structured-output backend reads.
"""

from __future__ import annotations

from typing import Any

from lmserve.errors import InvalidRequest
from lmserve.types import SamplingParams


def to_vllm_sampling(sampling: SamplingParams, *, special: bool, room: int) -> dict[str, Any]:
    """vLLM `SamplingParams` keywords for lmserve's `sampling` (the options table already resolved the layers).

    vLLM has no Mirostat, no locally typical sampling and no per-request draft_max: the service refused them before
    (its SPEC's `sampling`, engine/sampling_support.py), and they are not passed on. `repeat_penalty` is vLLM's
    `repetition_penalty` (over the whole text; `repeat_last_n` has no counterpart). Top-k 0 means off (-1 to vLLM).
    """
    kwargs: dict[str, Any] = {
        "temperature": max(sampling.temperature, 0.0),
        "top_p": min(max(sampling.top_p, 1e-6), 1.0) if sampling.top_p > 0 else 1.0,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "min_p": max(sampling.min_p, 0.0),
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "repetition_penalty": sampling.repeat_penalty if sampling.repeat_penalty > 0 else 1.0,
        "seed": sampling.seed,
        "max_tokens": room if sampling.max_tokens is None else min(sampling.max_tokens, room),
        "stop": list(sampling.stop) or None,
        "ignore_eos": sampling.ignore_eos,
        "skip_special_tokens": not special,
        "spaces_between_special_tokens": False,
    }
    if sampling.logit_bias:
        kwargs["logit_bias"] = dict(sampling.logit_bias)
    if sampling.logprobs is not None:
        kwargs["logprobs"] = sampling.logprobs
    if sampling.prompt_logprobs is not None:
        kwargs["prompt_logprobs"] = sampling.prompt_logprobs
    if sampling.score_tokens:
        check_scoring(sampling)
        kwargs["logprob_token_ids"] = list(sampling.score_tokens)
    return kwargs


def check_scoring(sampling: SamplingParams) -> None:
    """InvalidRequest unless vLLM's logprobs of `sampling.score_tokens` are the raw distribution's.

    vLLM gathers them from its processed logprobs (logprobs_mode "processed_logprobs"): greedy decoding with no
    penalty, logit bias or grammar leaves the raw log-softmax unchanged, any of those would change it. Its
    `logprob_token_ids` also replace the request's own `logprobs` alternatives, so the two do not combine.
    """
    transforms = {
        "temperature": sampling.temperature > 0,
        "repeat_penalty": sampling.repeat_penalty > 0 and sampling.repeat_penalty != 1.0,
        "presence_penalty": sampling.presence_penalty != 0,
        "frequency_penalty": sampling.frequency_penalty != 0,
        "logit_bias": bool(sampling.logit_bias),
        "grammar": sampling.grammar is not None,
        "logprobs": sampling.logprobs is not None,
    }
    named = [name for name, present in transforms.items() if present]
    if named:
        raise InvalidRequest(f"on the vLLM engine, scoring tokens (score_tokens) needs greedy decoding of the raw "
                             f"distribution: leave {', '.join(named)} out", param="score_tokens")


def check_grammar(grammar: str) -> None:
    """InvalidRequest unless vLLM's structured-output backend (xgrammar) reads the GBNF `grammar`."""
    import xgrammar

    try:
        xgrammar.Grammar.from_ebnf(grammar)
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError with its parser's message
        raise InvalidRequest(f"the grammar is not valid: {str(exc).splitlines()[0][:300]}",
                             param="response_format") from None
