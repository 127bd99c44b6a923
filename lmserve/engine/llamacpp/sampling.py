"""llama.cpp's sampler chain for a slot, built from lmserve's sampling settings, and sampling with the candidates kept.

A slot's chain is: logit bias, penalties (primed with the prompt), grammar, then the filters and the pick (greedy,
Mirostat, or top-k/typical/top-p/min-p, the temperature and a seeded draw). `Candidates` samples as
`llama_sampler_sample` does while keeping what the chain left, for a request that asked for log-probabilities.
"""

from __future__ import annotations

import ctypes
import random
from collections.abc import Collection

import llama_cpp as lc
import numpy as np

from lmserve.engine.logprobs import Ranked, rank_candidates
from lmserve.errors import EngineFailure, InvalidRequest
from lmserve.types import SamplingParams

_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
"""llama_token_data as a numpy record: the candidates the sampler chain works on."""


def build_chain(s: SamplingParams, prompt: list[int], *, vocab: lc.llama_vocab_p, eog: Collection[int],
                num_ctx: int) -> lc.llama_sampler_p:
    """The slot's chain: logit bias, penalties (primed with the prompt), grammar, then the filters and the pick.

    Only the penalty sampler sees the prompt: a grammar accepts nothing but generated tokens. With a grammar,
    an end-of-generation token is allowed exactly when the grammar is complete, so generation ends there.
    """
    num_vocab = lc.llama_vocab_n_tokens(vocab)
    params = lc.llama_sampler_chain_default_params()
    params.no_perf = True
    chain = lc.llama_sampler_chain_init(params)
    _add_bias(chain, s, eog, num_vocab)
    _add_penalties(chain, s, prompt, num_vocab, num_ctx)
    if s.grammar is not None:
        grammar = lc.llama_sampler_init_grammar(vocab, s.grammar.encode("utf-8"), b"root")
        if not grammar:
            lc.llama_sampler_free(chain)
            raise EngineFailure("llama.cpp could not parse the output grammar")
        lc.llama_sampler_chain_add(chain, grammar)
    _add_pick(chain, s, num_vocab)
    return chain  # type: ignore[no-any-return]


def _add_bias(chain: lc.llama_sampler_p, s: SamplingParams, eog: Collection[int],
              num_vocab: int) -> None:
    """The request's logit bias, and with `ignore_eos` every end-of-generation token banned."""
    bias = dict(s.logit_bias)
    if s.ignore_eos:
        bias.update({token: float("-inf") for token in eog})
    if not bias:
        return
    array = (lc.llama_logit_bias * len(bias))()
    for i, (token, value) in enumerate(bias.items()):
        array[i].token = token  # type: ignore[assignment]
        array[i].bias = value
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_logit_bias(num_vocab, len(bias), array))


def _add_penalties(chain: lc.llama_sampler_p, s: SamplingParams, prompt: list[int], num_vocab: int,
                   num_ctx: int) -> None:
    """The repeat, frequency and presence penalties over the last `repeat_last_n` tokens (-1: the context), primed
    with the prompt's."""
    if s.repeat_last_n == 0 or not (s.repeat_penalty != 1.0 or s.presence_penalty or s.frequency_penalty):
        return
    last_n = num_ctx if s.repeat_last_n < 0 else min(s.repeat_last_n, num_ctx)
    penalties = lc.llama_sampler_init_penalties(
        num_vocab, last_n, s.repeat_penalty, s.frequency_penalty, s.presence_penalty
    )
    for token in prompt if s.repeat_last_n < 0 else prompt[-s.repeat_last_n :]:
        if token >= 0:  # image placeholders are no tokens
            lc.llama_sampler_accept(penalties, token)
    lc.llama_sampler_chain_add(chain, penalties)


def _add_pick(chain: lc.llama_sampler_p, s: SamplingParams, num_vocab: int) -> None:
    """The end of the chain: greedy, Mirostat, or the filters, the temperature and a seeded draw."""
    if s.is_greedy:
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
        return
    seed = (s.seed if s.seed is not None else random.getrandbits(32)) & 0xFFFFFFFF
    if s.mirostat:  # Mirostat picks the token itself, in place of the filters and the distribution
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(s.temperature))
        mirostat = (lc.llama_sampler_init_mirostat(num_vocab, seed, s.mirostat_tau, s.mirostat_eta, 100)
                    if s.mirostat == 1 else lc.llama_sampler_init_mirostat_v2(seed, s.mirostat_tau, s.mirostat_eta))
        lc.llama_sampler_chain_add(chain, mirostat)
        return
    if s.top_k > 0:
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_k(s.top_k))
    if s.typical_p < 1.0:
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_typical(s.typical_p, 1))
    if s.top_p < 1.0:
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_p(s.top_p, 1))
    if s.min_p > 0.0:
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_min_p(s.min_p, 1))
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(s.temperature))
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_dist(seed))


def check_grammar(grammar: str) -> None:
    """Raise InvalidRequest unless llama.cpp parses `grammar` (GBNF, root rule `root`).

    The grammar is parsed without the vocabulary: this touches no model state, so any thread may call it.
    """
    sampler = lc.llama_sampler_init_grammar(None, grammar.encode("utf-8"), b"root")
    if not sampler:
        raise InvalidRequest("the output grammar is invalid: llama.cpp could not parse it (see the server log)")
    lc.llama_sampler_free(sampler)


class Candidates:
    """One buffer of the whole vocabulary's candidates, reused by every ranked sample of the context."""

    def __init__(self, num_vocab: int) -> None:
        self.num_vocab = num_vocab
        self._cells = np.zeros(num_vocab, dtype=_TOKEN_DATA)
        self._vocab_ids = np.arange(num_vocab, dtype=np.int32)

    def sample(self, sampler: lc.llama_sampler_p, ctx: lc.llama_context_p, output: int, k: int) -> Ranked:
        """What `llama_sampler_sample` does (the chain applied to row `output`'s logits, the pick accepted), keeping
        the candidates the chain leaves for their log-probabilities (engine/logprobs.py says which distribution)."""
        logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, output), shape=(self.num_vocab,))
        cells = self._cells
        cells["id"] = self._vocab_ids
        cells["logit"] = logits
        cells["p"] = 0.0
        array = lc.llama_token_data_array(
            data=cells.ctypes.data_as(ctypes.POINTER(lc.llama_token_data)), size=self.num_vocab, selected=-1,
            sorted=False,
        )
        lc.llama_sampler_apply(sampler, ctypes.byref(array))
        size, selected = int(array.size), int(array.selected)
        if not 0 <= selected < size:
            raise EngineFailure("the sampler selected no token")
        # the chain may leave its candidates in a buffer of its own: read them where `data` points now
        kept = np.ctypeslib.as_array(array.data, shape=(size,)) if size else cells[:0]
        ranked = rank_candidates(kept["id"], kept["logit"], selected, k)
        lc.llama_sampler_accept(sampler, ranked[0])
        return ranked
