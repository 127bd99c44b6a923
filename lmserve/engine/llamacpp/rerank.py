"""Dedicated rerankers on llama.cpp: GGUFs whose `<arch>.pooling_type` is rank (4), a relevance head over a pair.

llama.cpp pools the hidden state of one token of each sequence (the first, CLS, of a bidirectional model; the last
of a causal one) through the model's classification head (`cls`, `cls.output`) and returns `n_cls_out` values per
sequence. A (query, document) pair is formatted as llama-server's `format_prompt_rerank` formats it (tools/server/
server-common.cpp): the GGUF's `tokenizer.chat_template.rerank` prompt with `{query}` and `{document}` replaced, or
else BOS query EOS SEP document EOS (each special only where the vocabulary adds it), so a pair reads the same tokens
here as there.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import llama_cpp as lc

from lmserve.engine.llamacpp import batch_rows
from lmserve.errors import EngineFailure

AUTO_PAIR_TOKENS = 2048
"""A reranker's context when none is asked (at most what it was trained for): a pair is decoded in one micro-batch of
the context's size (a bidirectional model's pooling needs the whole sequence in it), and the attention scores of a
bidirectional one take (tokens² x heads) floats there."""
SOFTMAX_ARCHITECTURES = frozenset({"qwen3", "qwen3vl"})
"""Architectures whose rank pooling ends in a softmax over the labels (llama-graph.cpp `build_pooling`): Qwen3
rerankers' "yes"/"no" head, which llama-server reports as P(yes)."""
LOGIT_LIMIT = 100.0
"""The largest magnitude a score from softmaxed labels takes (where a probability underflows to 0)."""

MAX_BYTES_PER_TOKEN = 64
"""The most bytes a token is taken to cover where a templated pair's document is cut (longer ones: a shorter cut)."""

Tokenize = Callable[[str, bool, bool], list[int]]
"""(text, add_special, parse_special) → token ids."""


def meta_string(model: lc.llama_model_p, key: str) -> str | None:
    """A GGUF metadata value of the model as text; None when the key is absent."""
    buf = ctypes.create_string_buffer(256)
    n = lc.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    if n < 0:
        return None
    if n >= len(buf):
        buf = ctypes.create_string_buffer(n + 1)
        lc.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", "replace")


def is_reranker(model: lc.llama_model_p) -> bool:
    """Whether the GGUF asks for rank pooling (`<arch>.pooling_type` = LLAMA_POOLING_TYPE_RANK): a reranker."""
    arch = meta_string(model, "general.architecture") or ""
    return meta_string(model, f"{arch}.pooling_type") == str(lc.LLAMA_POOLING_TYPE_RANK)


def is_bidirectional(model: lc.llama_model_p) -> bool:
    """Whether the model's attention sees the whole sequence (`<arch>.attention.causal` false: BERT and kin)."""
    arch = meta_string(model, "general.architecture") or ""
    return meta_string(model, f"{arch}.attention.causal") == "false"


def context_size(chosen: int, *, auto: bool) -> int:
    """A reranker's context per pair: the one chosen, at most AUTO_PAIR_TOKENS when it was chosen automatically."""
    return min(chosen, AUTO_PAIR_TOKENS) if auto else chosen


def configure(cparams: lc.llama_context_params, num_ctx: int, *, bidirectional: bool, flash_attn: str) -> None:
    """Make `cparams` a reranker's context: rank pooling, up to `n_seq_max` pairs of `num_ctx` tokens in all per
    decode, in one micro-batch and one KV pool (a causal reranker's; a bidirectional one keeps no memory).

    A bidirectional reranker computes attention without flash attention unless it is asked for (`flash_attn` "on"):
    with no KV cache to read, it only saves the scores' scratch memory, and it rounds keys and values to F16 in
    tiles that depend on the batch, so a pair's score would change (by ~1e-3) with the pairs decoded beside it."""
    cparams.embeddings = True
    cparams.pooling_type = lc.LLAMA_POOLING_TYPE_RANK
    cparams.kv_unified = True
    cparams.n_ctx = num_ctx
    cparams.n_batch = num_ctx
    cparams.n_ubatch = num_ctx
    if bidirectional and flash_attn != "on":
        cparams.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED


@dataclass(frozen=True, slots=True)
class PairFormat:
    """How a reranker reads a (query, document) pair: its rerank template, or the vocabulary's specials."""

    template: str | None
    bos: int | None
    """The token before the query; None where the vocabulary adds no BOS."""
    end: int | None
    """The token after the query and after the document (EOS, else SEP); None where the vocabulary adds no EOS."""
    sep: int | None
    """The token between the query's end and the document; None where the vocabulary adds no SEP."""


def pair_format(model: lc.llama_model_p, vocab: lc.llama_vocab_p) -> PairFormat:
    """The model's pair format, read as llama-server reads it."""
    template = lc.llama_model_chat_template(model, b"rerank")
    eos = lc.llama_vocab_eos(vocab)
    end = eos if eos != lc.LLAMA_TOKEN_NULL else lc.llama_vocab_sep(vocab)
    return PairFormat(
        template=template.decode("utf-8", "replace") if template else None,
        bos=lc.llama_vocab_bos(vocab) if lc.llama_vocab_get_add_bos(vocab) else None,
        end=end if lc.llama_vocab_get_add_eos(vocab) else None,
        sep=lc.llama_vocab_sep(vocab) if lc.llama_vocab_get_add_sep(vocab) else None,
    )


def pair_tokens(fmt: PairFormat, tokenize: Tokenize, query: str, document: str, limit: int | None) -> list[int]:
    """The pair's tokens as llama-server forms them; when they are more than `limit`, the document is cut so they
    fit (when they can: the query and the format alone may be longer). `limit` None: never cut."""
    if fmt.template is None:
        head = [t for t in (fmt.bos,) if t is not None] + tokenize(query, False, False)
        head += [t for t in (fmt.end, fmt.sep) if t is not None]
        tail = [fmt.end] if fmt.end is not None else []
        body = tokenize(document, False, False)
        if limit is not None and len(head) + len(body) + len(tail) > limit:
            body = body[: max(limit - len(head) - len(tail), 0)]
        return head + body + tail
    template = fmt.template
    whole = tokenize(template.replace("{query}", query).replace("{document}", document), False, True)
    if limit is None or len(whole) <= limit or "{document}" not in template:
        return whole
    return _cut_templated(template, tokenize, query, document, limit)


def _cut_templated(template: str, tokenize: Tokenize, query: str, document: str, limit: int) -> list[int]:
    """The template's prompt with the longest beginning of `document` (in bytes, whole characters, up to
    MAX_BYTES_PER_TOKEN a token) whose tokens fit in `limit`: the tokens llama-server reads for that shorter document
    (the prompt is tokenized whole, as there). Longer than `limit` when even an empty document does not fit."""
    data = document.encode("utf-8")
    best = tokenize(template.replace("{query}", query).replace("{document}", ""), False, True)
    lo, hi = 0, min(len(data), limit * MAX_BYTES_PER_TOKEN)
    while lo < hi:  # the token count grows with the document's length (up to a token at the seams)
        mid = (lo + hi + 1) // 2
        text = data[:mid].decode("utf-8", "ignore")
        tokens = tokenize(template.replace("{query}", query).replace("{document}", text), False, True)
        if len(tokens) <= limit:
            lo, best = mid, tokens
        else:
            hi = mid - 1
    return best


def groups(lengths: Sequence[int], max_tokens: int, max_pairs: int) -> Iterator[list[int]]:
    """Indices of pairs of `lengths` tokens, in order, in runs of at most `max_pairs` pairs and `max_tokens` tokens
    (a pair longer than `max_tokens` alone): the pairs decoded together."""
    group: list[int] = []
    total = 0
    for i, length in enumerate(lengths):
        if group and (len(group) == max_pairs or total + length > max_tokens):
            yield group
            group, total = [], 0
        group.append(i)
        total += length
    if group:
        yield group


def score(values: Sequence[float], softmaxed: bool) -> float:
    """The relevance logit of a pair from its head's `values`: the first one, or where llama.cpp took a softmax over
    the labels, the first label's log-odds against the others (llama-server's P(yes) is its sigmoid)."""
    if not softmaxed or len(values) < 2:
        return float(values[0])
    first, rest = float(values[0]), math.fsum(float(v) for v in values[1:])
    if first <= 0.0 or rest <= 0.0:
        return LOGIT_LIMIT if rest <= 0.0 < first else -LOGIT_LIMIT
    return max(-LOGIT_LIMIT, min(LOGIT_LIMIT, math.log(first) - math.log(rest)))


def rank_pairs(pairs: list[list[int]], capacity: int, max_pairs: int,
               decode: Callable[[list[list[int]]], list[float]]) -> list[float]:
    """Each pair's score, the pairs decoded together by `decode`, in order, as many at a time as `max_pairs`
    sequences and a micro-batch of `capacity` tokens take."""
    for pair in pairs:
        if not pair or len(pair) > capacity:  # llama.cpp would abort on a bidirectional pair beyond its micro-batch
            raise EngineFailure(f"cannot rank a pair of {len(pair)} tokens in a micro-batch of {capacity}")
    scores = [0.0] * len(pairs)
    for group in groups([len(pair) for pair in pairs], capacity, max_pairs):
        for i, value in zip(group, decode([pairs[i] for i in group]), strict=True):
            scores[i] = value
    return scores


def decode_pairs(ctx: lc.llama_context_p, batch: Any, pairs: list[list[int]], softmaxed: bool) -> list[float]:
    """Decode `pairs` in one batch (a llama_batch with room for them), one sequence each, and read each one's pooled
    head output as its score."""
    memory = lc.llama_get_memory(ctx)
    if memory:  # a causal reranker's KV cache; a bidirectional one has none
        lc.llama_memory_clear(memory, True)
    batch_rows.fill(batch, [(seq, pos, token, True) for seq, pair in enumerate(pairs)
                            for pos, token in enumerate(pair)])
    rc = lc.llama_decode(ctx, batch)
    if rc != 0:
        raise EngineFailure(f"llama_decode failed with code {rc} while ranking")
    num_values = lc.llama_model_n_cls_out(lc.llama_get_model(ctx))
    scores = []
    for seq in range(len(pairs)):
        values = lc.llama_get_embeddings_seq(ctx, seq)
        if not values:
            raise EngineFailure("llama.cpp returned no rank score")
        scores.append(score(values[:num_values], softmaxed))
    return scores
