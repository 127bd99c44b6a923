"""transformers' float32 forward pass as the reference for the LFM2 members (tests/hf_repos.py), and the comparison
of an engine's greedy reply with it.

`reference(repo, prompt)`: for a prompt (token ids) and STEPS greedy steps, the likeliest TOP tokens and their
log-probabilities at each step (step 0 reads the whole prompt; step i the prompt and the reference's first i tokens),
each step a full forward pass (no cache: the plainest computation there is).

`compare(expected, tokens, logprobs, tolerance)`: the engine's reply (tokens, and per token `{id: logprob}` of its
likeliest alternatives) against it. A logprob may differ by `tolerance`; a greedy token must be the reference's
only where the reference's top-2 margin exceeds `tolerance` (a near-tie may go either way within the tolerance),
and once the reply takes the other branch of such a tie the steps after it are not compared (their contexts
differ). Returns the largest |Δ| seen.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STEPS = 8
TOP = 5

PROMPTS = {
    "chat": "<|startoftext|><|im_start|>user\nHello there, how are rivers made?<|im_end|>\n<|im_start|>assistant\n",
    "long": "".join(f"Fact {i}: river {i} flows {i * 7 % 13} miles to sea {i * 3 % 11}. " for i in range(12)),
}
"""Multi-token prompts: a chat turn (~20 tokens) and ~200 tokens of text (several conv/attention blocks)."""


@dataclass(frozen=True)
class Step:
    """One greedy step of the reference: its likeliest tokens, best first, as (id, logprob)."""

    top: list[tuple[int, float]]

    @property
    def token(self) -> int:
        return self.top[0][0]

    @property
    def margin(self) -> float:
        return self.top[0][1] - self.top[1][1]


@functools.cache
def _model(repo: Path) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    vision = "vision_config" in (repo / "config.json").read_text()
    loader = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    model = loader.from_pretrained(repo, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(repo)


def prompt_ids(repo: Path, name: str) -> list[int]:
    """PROMPTS[name] as the repository's token ids (specials parsed, nothing added)."""
    return list(_model(repo)[1](PROMPTS[name], add_special_tokens=False)["input_ids"])


def reference(repo: Path, prompt: list[int]) -> list[Step]:
    """transformers' float32 greedy steps for `prompt` (module docstring)."""
    import torch

    model = _model(repo)[0]
    sequence, steps = list(prompt), []
    with torch.no_grad():
        for _ in range(STEPS):
            logits = model(input_ids=torch.tensor([sequence])).logits[0, -1].double()
            values, ids = torch.topk(torch.log_softmax(logits, -1), TOP)
            steps.append(Step([(int(i), float(v)) for v, i in zip(values, ids, strict=True)]))
            sequence.append(steps[-1].token)
    return steps


def compare(expected: list[Step], tokens: list[int], logprobs: list[dict[int, float]], tolerance: float) -> float:
    """The largest |Δ logprob| between the reply and the reference (module docstring); AssertionError beyond
    `tolerance`, for a token the reply's alternatives lack, or a greedy token that differs where it must not."""
    assert len(tokens) == len(logprobs) == len(expected), (len(tokens), len(logprobs), len(expected))
    worst = 0.0
    for step, (want, token, got) in enumerate(zip(expected, tokens, logprobs, strict=True)):
        for candidate, value in want.top:
            assert candidate in got, f"step {step}: token {candidate} ({value:.4f}) is not among {got}"
            worst = max(worst, abs(got[candidate] - value))
        assert worst <= tolerance, f"step {step}: |Δ logprob| {worst:.2e} > {tolerance:.0e}: {want.top} vs {got}"
        if want.margin > tolerance:
            assert token == want.token, f"step {step}: greedy {token}, the reference's {want.token} ({want.top})"
        elif token != want.token:
            break  # a near-tie taken the other way: the contexts differ from here on
    return worst
