"""Dedicated rerankers on vLLM: cross-encoder repositories, served by vLLM's pooling runner (its score task).

A repository is a reranker when config.json names a sequence-classification architecture with one label
(`BertForSequenceClassification`, `XLMRobertaForSequenceClassification`, `Qwen3ForSequenceClassification`…): vLLM
runs it with `runner="pooling"`, and each (query, document) pair is one request of the `classify` task, whose
pooled output is the head's one value. vLLM's score API would put a sigmoid on it; lmserve asks for none
(`use_activation=False`) and returns the raw logit, to which the service applies its own sigmoid.

A pair is formed as vLLM's cross-encoder scoring forms it (vllm/entrypoints/pooling/scoring/io_processor.py
`get_score_prompt`), so a pair reads the same tokens here as at vLLM's /score: the model's own score template where
it has one, else the tokenizer's pair encoding (`[CLS] query [SEP] document [SEP]`, with token types) unless
config.json says `use_sep_token: false`, where query and document are joined. A Qwen3-Reranker as released (a
causal LM that answers "yes" or "no", architectures `Qwen3ForCausalLM`) is not recognised: vLLM needs its
conversion overrides and prompt template, and lmserve reranks with it by judging instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lmserve.errors import ContextOverflow, InvalidRequest

CLASSIFICATION_SUFFIX = "ForSequenceClassification"


def num_labels(config: dict[str, Any]) -> int:
    """The labels of a classification head config.json describes (transformers' rule: `num_labels`, else the size of
    `id2label`, else 2)."""
    if isinstance(config.get("num_labels"), int):
        return int(config["num_labels"])
    labels = config.get("id2label")
    return len(labels) if isinstance(labels, dict) and labels else 2


def is_reranker(config: dict[str, Any]) -> bool:
    """Whether config.json describes a cross-encoder: a sequence-classification architecture with one label."""
    architectures = [str(name) for name in config.get("architectures") or []]
    return any(name.endswith(CLASSIFICATION_SUFFIX) for name in architectures) and num_labels(config) == 1


@dataclass(frozen=True, slots=True)
class RankPair:
    """A (query, document) pair as the reranker reads it."""

    tokens: list[int]
    second_from: int | None = None
    """Where the second segment's token type (1) begins, for a model with token types (vLLM's
    `compressed_token_type_ids`); None: the tokenizer gave none."""


def pair_tokens(tokenizer: Any, query: str, document: str, *, limit: int, truncate: bool, trained: int = 0,
                score_template: str | None = None, use_sep_token: bool = True) -> RankPair:
    """The pair of `query` and `document` as the reranker reads it (see the module's docstring), at most `limit`
    tokens: a longer one has its document cut when `truncate` (its end, once the document is gone), else it is a
    ContextOverflow (param "documents"; `trained`: the model's trained length). `score_template`: the text the
    model's own template makes of the pair, where it has one."""
    if score_template is not None:
        encoded = tokenizer(score_template)
    elif use_sep_token:
        encoded = tokenizer(text=query, text_pair=document)
        if len(encoded["input_ids"]) > limit and truncate:
            with contextlib.suppress(Exception):  # the query alone is longer than the limit: cut below
                encoded = tokenizer(text=query, text_pair=document, truncation="only_second", max_length=limit)
    else:
        encoded = tokenizer(text=query + document)
    tokens = [int(t) for t in encoded["input_ids"]]
    types = encoded.get("token_type_ids")
    if len(tokens) > limit:
        if not truncate:
            error = ContextOverflow(len(tokens), limit, trained)
            error.param = "documents"
            raise error
        tokens = tokens[:limit]
        types = types[:limit] if types is not None else None
    if not tokens:
        raise InvalidRequest("a query and document make no tokens to rank", param="documents")
    return RankPair(tokens, second_segment(list(types)) if types is not None else None)


def second_segment(types: list[int]) -> int:
    """Where the token types turn from 0 to 1 (their length when they never do), as vLLM compresses them."""
    return next((i for i, kind in enumerate(types) if kind == 1), len(types))


def score_template(model_config: Any) -> Callable[[str, str], str | None] | None:
    """The model's own score template (vLLM's `get_score_template(query, document)`), or None where the tokenizer
    pairs the texts."""
    from vllm.model_executor.model_loader.utils import get_model_cls
    from vllm.model_executor.models.interfaces import supports_score_template

    model: Any = get_model_cls(model_config)
    return model.get_score_template if supports_score_template(model) else None
