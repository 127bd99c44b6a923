"""A submitted generation request checked against the model and made into the scheduler's sequences.

`check_request` refuses what the model could never run (InvalidRequest, ContextOverflow) before anything is queued;
`make_sequences` makes the request's `n` choices, the first one prefilling the prompt for the others (forks), with
the prompt positions worth a snapshot marked.
"""

from __future__ import annotations

from dataclasses import replace

from lmserve.engine.protocol import ModelInfo, PromptImage, check_choices, check_score_tokens, choice_sampling
from lmserve.engine.slots.backend import Backend
from lmserve.engine.slots.sequence import Sequence
from lmserve.errors import ContextOverflow, InvalidRequest
from lmserve.types import SamplingParams


def check_request(backend: Backend, prompt: list[int], sampling: SamplingParams, n: int, images: list[PromptImage],
                  max_queue: int) -> None:
    """Raise unless the model can run `n` choices of `prompt` with `sampling`: a reranker runs none, the prompt must
    fit in one sequence's context, and every token id, bias and grammar must be the model's."""
    info = backend.info
    if info.can_rank:
        raise InvalidRequest("model is a reranker: it scores documents against a query (rerank) and generates "
                             "no text", param="model")
    num_ctx = info.num_ctx
    check_choices(n, info, max_queue)
    if not prompt:
        raise InvalidRequest("the prompt is empty", param="prompt")
    if len(prompt) >= num_ctx:
        raise ContextOverflow(len(prompt), num_ctx, info.num_ctx_train)
    num_vocab = info.num_vocab
    _check_prompt(prompt, images, num_vocab)
    if any(not 0 <= token < num_vocab for token in sampling.logit_bias):
        raise InvalidRequest(f"logit_bias token ids must be in [0, {num_vocab}) for this model", param="logit_bias")
    check_score_tokens(sampling, num_vocab)
    backend.check_adapters(sampling.adapters)
    if sampling.grammar is not None:
        if sampling.ignore_eos:  # the grammar ends the output; with the end token banned it could not
            raise InvalidRequest("ignore_eos cannot be combined with structured output", param="ignore_eos")
        backend.check_grammar(sampling.grammar)


def _check_prompt(prompt: list[int], images: list[PromptImage], num_vocab: int) -> None:
    """Every position outside `images` holds a vocabulary id; images lie in order inside, before the end."""
    text = prompt
    if images:
        text, previous_end = [], 0
        for image in images:
            if image.start < previous_end or image.length < 1 or image.end >= len(prompt):
                raise InvalidRequest("an image must be followed by text in the prompt", param="images")
            text += prompt[previous_end : image.start]
            previous_end = image.end
        text += prompt[previous_end:]
    if text and (min(text) < 0 or max(text) >= num_vocab):
        raise InvalidRequest(f"token ids must be in [0, {num_vocab}) for this model", param="context")


def make_sequences(info: ModelInfo, prompt: list[int], sampling: SamplingParams, n: int, *, special: bool,
                   images: list[PromptImage], checkpoints: list[int] | None, snapshots: bool) -> list[Sequence]:
    """The `n` choices of a checked request (see `BatchingEngine.submit_many`); `snapshots`: the model saves its
    state at checkpoints (its memory cannot be cut)."""
    room = info.num_ctx - len(prompt)
    max_new = room if sampling.max_tokens is None else min(sampling.max_tokens, room)
    scored = sampling.prompt_logprobs is not None  # each choice computes its whole prompt, for its logprobs
    if scored:
        sampling = replace(sampling, reuse_limit=0)
    seqs = [Sequence(prompt=list(prompt), sampling=choice_sampling(sampling, i), max_new_tokens=max_new,
                     special=special, images=list(images)) for i in range(n)]
    leader = seqs[0]
    for seq in seqs[1:]:
        seq.fork_of = None if scored else leader
    if checkpoints and (snapshots or sampling.reuse_limit is not None):  # snapshots, or stretches to
        # compute in one piece (SamplingParams.reuse_limit)
        inside = [c for c in checkpoints if 0 < c < len(prompt) - 1 and leader.cut_outside_images(c) == c]
        leader.checkpoints = sorted(set(inside))
    if snapshots and n > info.num_parallel:
        # Some choices must wait for a slot: the state before the prompt's last token lets them skip the prompt.
        leader.checkpoints = sorted({*leader.checkpoints, leader.cut_outside_images(len(prompt) - 1)} - {0})
    return seqs
