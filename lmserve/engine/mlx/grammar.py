"""Structured output on the MLX engine: GBNF grammars (chat/structured.py writes them) compiled and matched by
xgrammar, the constrained-decoding library vLLM uses too, so a grammar means the same on both engines.

The compiler knows the model's vocabulary; compiled grammars are cached by their text, so checking a request's
grammar when it is submitted (any thread) makes starting its sequence (the engine thread) cheap. Each sequence
gets a matcher that says which tokens may come next, as a boolean mask over the vocabulary; an end token is
allowed exactly where the grammar is complete.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lmserve.errors import InvalidRequest


class Grammars:
    """Compiles GBNF grammars for one model's vocabulary (`num_vocab` logits; `end_tokens` end generation)."""

    def __init__(self, tokenizer: Any, num_vocab: int, end_tokens: frozenset[int]) -> None:
        import xgrammar

        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=num_vocab,
                                                       stop_token_ids=sorted(end_tokens))
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        self.num_vocab = num_vocab

    def compile(self, grammar: str) -> Any:
        """The compiled grammar; InvalidRequest when it is not valid GBNF with a `root` rule."""
        try:
            return self._compiler.compile_grammar(grammar, root_rule_name="root")
        except (RuntimeError, ValueError) as exc:
            raise InvalidRequest(f"the output grammar is invalid: {str(exc).splitlines()[0][:300]}") from None

    def matcher(self, grammar: str) -> GrammarMatch:
        return GrammarMatch(self._xgr.GrammarMatcher(self.compile(grammar)), self.num_vocab)


class GrammarMatch:
    """One sequence's place in its grammar (the sampler's `Constraint`)."""

    def __init__(self, matcher: Any, num_vocab: int) -> None:
        self._matcher = matcher
        self._bits = np.zeros((1, (num_vocab + 31) // 32), dtype=np.int32)
        self._num_vocab = num_vocab

    def allowed(self) -> np.ndarray:
        self._matcher.fill_next_token_bitmask(self._bits)
        mask = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
        return mask[: self._num_vocab].astype(bool)

    def accept(self, token: int) -> None:
        if not self._matcher.is_terminated():
            self._matcher.accept_token(token)
