"""Tiny, loadable reranker GGUFs (llama.cpp's rank pooling) for tests that need real llama.cpp scores but no download.

`write_tiny_reranker(path)` writes a BERT cross-encoder of ~500 KB (F32), laid out as llama.cpp's converter writes
bge-reranker (XLM-RoBERTa): hidden 64, 2 layers, 4 heads, FFN 128, a classification head (`cls`, then
`cls.output` to one logit), `bert.pooling_type` = 4 (rank), and tests/tiny_gguf.py's SentencePiece vocab with
BOS/EOS/SEP added, so a pair reads `<s> query </s></s> document </s>`. `arch="qwen3"` writes a causal Qwen3
reranker as llama.cpp converts Qwen3-Reranker: a `cls.output` head of two labels ("yes", "no") whose softmax llama.cpp
takes, and a `tokenizer.chat_template.rerank` prompt with `{query}` and `{document}`. Weights are seeded random
numbers: the scores are real llama.cpp output, relevant to nothing. Both load in `llama-server --rerank` too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Literal

import gguf
import numpy as np

from tests.tiny_gguf import finish_gguf, tiny_vocab

NUM_EMBD = 64
NUM_FF = 128
NUM_HEAD = 4
NUM_LAYER = 2
NUM_CTX = 512
NUM_VOCAB = 320
RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query. Note that the answer "
    "can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
"""The tiny Qwen3 reranker's `tokenizer.chat_template.rerank` (Qwen3-Reranker's, shortened)."""

Weights = Callable[..., np.ndarray]


def write_tiny_reranker(path: str | Path, *, arch: Literal["bert", "qwen3"] = "bert", seed: int = 0,
                        n_ctx: int = NUM_CTX) -> Path:
    """Write a tiny reranker GGUF (F32) of architecture `arch`; return its path. `n_ctx`: its trained context."""
    path = Path(path)
    writer = gguf.GGUFWriter(path, arch)
    _write_common(writer, n_ctx)
    rng = np.random.default_rng(seed)

    def weight(*shape: int) -> np.ndarray:
        """Numpy order (rows, cols): GGUF stores the dimensions reversed."""
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    if arch == "bert":
        _write_bert_metadata(writer)
        tensors = _bert_tensors(weight, n_ctx)
    else:
        _write_qwen3_metadata(writer)
        tensors = _qwen3_tensors(weight)
    finish_gguf(writer, tensors)
    return path


def _write_common(writer: gguf.GGUFWriter, n_ctx: int) -> None:
    writer.add_name(f"tiny-reranker-{writer.arch}")
    writer.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    writer.add_context_length(n_ctx)
    writer.add_embedding_length(NUM_EMBD)
    writer.add_feed_forward_length(NUM_FF)
    writer.add_block_count(NUM_LAYER)
    writer.add_head_count(NUM_HEAD)
    writer.add_pooling_type(gguf.PoolingType.RANK)
    tokens, scores, types = tiny_vocab(NUM_VOCAB)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)


def _write_bert_metadata(writer: gguf.GGUFWriter) -> None:
    writer.add_layer_norm_eps(1e-12)
    writer.add_causal_attention(False)
    writer.add_token_type_count(2)
    writer.add_classifier_output_labels(["LABEL_0"])
    writer.add_sep_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(True)
    writer.add_add_sep_token(True)


def _write_qwen3_metadata(writer: gguf.GGUFWriter) -> None:
    writer.add_head_count_kv(NUM_HEAD // 2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_classifier_output_labels(["yes", "no"])
    writer.add_add_bos_token(False)
    writer.add_chat_template([{"name": "rerank", "template": RERANK_TEMPLATE}])


def _bert_tensors(weight: Weights, n_ctx: int) -> list[tuple[str, np.ndarray]]:
    def linear(name: str, rows: int, cols: int) -> list[tuple[str, np.ndarray]]:
        return [(f"{name}.weight", weight(rows, cols)), (f"{name}.bias", weight(rows))]

    def norm(name: str) -> list[tuple[str, np.ndarray]]:
        return [(f"{name}.weight", np.ones(NUM_EMBD, dtype=np.float32)),
                (f"{name}.bias", np.zeros(NUM_EMBD, dtype=np.float32))]

    tensors = [("token_embd.weight", weight(NUM_VOCAB, NUM_EMBD)), ("token_types.weight", weight(2, NUM_EMBD)),
               ("position_embd.weight", weight(n_ctx, NUM_EMBD)), *norm("token_embd_norm")]
    for i in range(NUM_LAYER):
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            tensors += linear(f"blk.{i}.{name}", NUM_EMBD, NUM_EMBD)
        tensors += [*norm(f"blk.{i}.attn_output_norm"), *linear(f"blk.{i}.ffn_up", NUM_FF, NUM_EMBD),
                    *linear(f"blk.{i}.ffn_down", NUM_EMBD, NUM_FF), *norm(f"blk.{i}.layer_output_norm")]
    return [*tensors, *linear("cls", NUM_EMBD, NUM_EMBD), *linear("cls.output", 1, NUM_EMBD)]


def _qwen3_tensors(weight: Weights) -> list[tuple[str, np.ndarray]]:
    head_dim = NUM_EMBD // NUM_HEAD
    num_kv = NUM_HEAD // 2 * head_dim
    tensors = [("token_embd.weight", weight(NUM_VOCAB, NUM_EMBD))]
    for i in range(NUM_LAYER):
        tensors += [
            (f"blk.{i}.attn_norm.weight", np.ones(NUM_EMBD, dtype=np.float32)),
            (f"blk.{i}.attn_q.weight", weight(NUM_EMBD, NUM_EMBD)),
            (f"blk.{i}.attn_k.weight", weight(num_kv, NUM_EMBD)),
            (f"blk.{i}.attn_v.weight", weight(num_kv, NUM_EMBD)),
            (f"blk.{i}.attn_output.weight", weight(NUM_EMBD, NUM_EMBD)),
            (f"blk.{i}.attn_q_norm.weight", np.ones(head_dim, dtype=np.float32)),
            (f"blk.{i}.attn_k_norm.weight", np.ones(head_dim, dtype=np.float32)),
            (f"blk.{i}.ffn_norm.weight", np.ones(NUM_EMBD, dtype=np.float32)),
            (f"blk.{i}.ffn_gate.weight", weight(NUM_FF, NUM_EMBD)),
            (f"blk.{i}.ffn_up.weight", weight(NUM_FF, NUM_EMBD)),
            (f"blk.{i}.ffn_down.weight", weight(NUM_EMBD, NUM_FF)),
        ]
    return [*tensors, ("output_norm.weight", np.ones(NUM_EMBD, dtype=np.float32)),
            ("cls.output.weight", weight(2, NUM_EMBD))]
