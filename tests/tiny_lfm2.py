"""A tiny, loadable LFM2 (hybrid: short convolutions + attention) GGUF for tests that need no download.

`write_tiny_lfm2(path)` writes architecture `lfm2` with hidden 64, 4 layers typed conv, conv, full_attention,
conv (llama.cpp reads the layer types from the per-layer `lfm2.attention.head_count_kv` array: 0 marks a conv
layer), 4 query heads and 2 KV heads on the attention layer, FFN 128 and a conv cache length of 3. The vocab is
a SentencePiece ("llama") one, not LFM2's byte-level BPE, but it has LFM2's special tokens at LFM2's ids as
control tokens (`<|startoftext|>` 1 is BOS, `<|im_end|>` 7 is EOS, `<|endoftext|>` 2 also ends generation),
then the byte tokens and single-letter pieces of `tests.tiny_gguf`, so any text tokenizes. The file carries
`LFM2_TEMPLATE`, a faithful copy of the LFM2 text chat template (pass `chat_template=None` to leave it out). The
F32 weights (~750 KB) are seeded random numbers scaled so that greedy output depends on the prompt: it loads,
decodes with hybrid memory (`llama_model_is_hybrid`) and produces varied gibberish.

`extra_specials=[...]` appends more control tokens after the `n_vocab` base tokens (ids `n_vocab`, `n_vocab + 1`,
…; every base id is unchanged) with short embedding rows drawn from a separate seeded stream, so the base weights
are the same as without them. `tests.tiny_lfm2_vl` uses it for LFM2-VL's image tokens (`LFM2_VL_SPECIALS`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from tests.tiny_gguf import finish_gguf, tiny_vocab

LFM2_SPECIALS = [
    "<|pad|>",
    "<|startoftext|>",
    "<|endoftext|>",
    "<|fim_pre|>",
    "<|fim_mid|>",
    "<|fim_suf|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|tool_list_start|>",
    "<|tool_list_end|>",
    "<|tool_call_start|>",
    "<|tool_call_end|>",
    "<|tool_response_start|>",
    "<|tool_response_end|>",
]
"""LFM2's special tokens; a token's id is its index."""

PAD_ID, BOS_ID, EOT_ID, EOS_ID = 0, 1, 2, 7

LFM2_VL_SPECIALS = [
    "<image>",
    "<|image_start|>",
    "<|image_end|>",
    "<|img_thumbnail|>",
    *(f"<|img_row_{row}_col_{col}|>" for row in range(1, 11) for col in range(1, 11)),
]
"""LFM2-VL's image tokens: the chat template's `<image>` placeholder, the markers libmtmd wraps an image in, and
the tile markers (a tiled image has at most 10 tiles, so rows and columns run 1..10). Pass as `extra_specials`."""

LFM2_TEMPLATE = (
    "{{- bos_token -}}\n"
    '{%- set ns = namespace(system_prompt="") -%}\n'
    '{%- if messages[0]["role"] == "system" -%}\n'
    '    {%- set ns.system_prompt = messages[0]["content"] -%}\n'
    "    {%- set messages = messages[1:] -%}\n"
    "{%- endif -%}\n"
    "{%- if tools -%}\n"
    '    {%- set ns.system_prompt = ns.system_prompt + ("\\n" if ns.system_prompt else "")'
    ' + "List of tools: <|tool_list_start|>[" -%}\n'
    "    {%- for tool in tools -%}\n"
    "        {%- if tool is not string -%}\n"
    "            {%- set tool = tool | tojson -%}\n"
    "        {%- endif -%}\n"
    "        {%- set ns.system_prompt = ns.system_prompt + tool -%}\n"
    "        {%- if not loop.last -%}\n"
    '            {%- set ns.system_prompt = ns.system_prompt + ", " -%}\n'
    "        {%- endif -%}\n"
    "    {%- endfor -%}\n"
    '    {%- set ns.system_prompt = ns.system_prompt + "]<|tool_list_end|>" -%}\n'
    "{%- endif -%}\n"
    "{%- if ns.system_prompt -%}\n"
    '    {{- "<|im_start|>system\\n" + ns.system_prompt + "<|im_end|>\\n" -}}\n'
    "{%- endif -%}\n"
    "{%- for message in messages -%}\n"
    '    {{- "<|im_start|>" + message["role"] + "\\n" -}}\n'
    '    {%- set content = message["content"] -%}\n'
    "    {%- if content is not string -%}\n"
    "        {%- set content = content | tojson -%}\n"
    "    {%- endif -%}\n"
    '    {%- if message["role"] == "tool" -%}\n'
    '        {%- set content = "<|tool_response_start|>" + content + "<|tool_response_end|>" -%}\n'
    "    {%- endif -%}\n"
    '    {{- content + "<|im_end|>\\n" -}}\n'
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    '    {{- "<|im_start|>assistant\\n" -}}\n'
    "{%- endif -%}\n"
)
"""The LFM2 text chat template (as shipped in LFM2 GGUFs): tools in the system turn between list tokens, tool
results between response tokens, non-string content (`None` included) printed as JSON."""

NUM_EMBD = 64
NUM_FF = 128
NUM_HEAD = 4
NUM_HEAD_KV = 2
LAYER_TYPES = ("conv", "conv", "full_attention", "conv")
CONV_L_CACHE = 3
NUM_CTX = 4096


@dataclass(frozen=True)
class Lfm2Shape:
    """The sizes of a generated LFM2 (the vocab aside)."""

    embd: int = NUM_EMBD
    ff: int = NUM_FF
    heads: int = NUM_HEAD
    kv_heads: int = NUM_HEAD_KV
    layer_types: tuple[str, ...] = LAYER_TYPES


TINY = Lfm2Shape()
_C, _A = "conv", "full_attention"
SMALL = Lfm2Shape(embd=1024, ff=2560, heads=16, kv_heads=8,
                  layer_types=(_C, _C, _A, _C, _C, _A, _C, _C, _A, _C, _A, _C, _A, _C, _A, _C))
"""LFM2-350M's body (hidden 1024, 16 layers: 10 conv + 6 attention) on the tiny vocab: ~170M parameters, for
benchmarks that need prefill to cost what it costs on a real small model (quantize it: ~100 MB at Q4_0)."""


def lfm2_vocab(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    """LFM2's specials (control tokens, at their ids), then the byte tokens and pieces of `tiny_vocab`."""
    num_tiny_specials = 5  # tiny_vocab's <unk> <s> </s> <|im_start|> <|im_end|>
    tokens, scores, types = tiny_vocab(n_vocab - len(LFM2_SPECIALS) + num_tiny_specials)
    control = int(gguf.TokenType.CONTROL)
    return (
        LFM2_SPECIALS + tokens[num_tiny_specials:],
        [0.0] * len(LFM2_SPECIALS) + scores[num_tiny_specials:],
        [control] * len(LFM2_SPECIALS) + types[num_tiny_specials:],
    )


def write_tiny_lfm2(
    path: str | Path,
    *,
    seed: int = 0,
    chat_template: str | None = LFM2_TEMPLATE,
    n_vocab: int = 360,
    name: str = "tiny-lfm2",
    extra_specials: Sequence[str] = (),
    shape: Lfm2Shape = TINY,
) -> Path:
    """Write a tiny random LFM2 GGUF with F32 tensors; return its path.

    `extra_specials` are control tokens appended after the `n_vocab` base tokens (the vocab then has
    `n_vocab + len(extra_specials)` tokens; base ids and base weights are unchanged).
    """
    path = Path(path)
    extra = list(extra_specials)
    total_vocab = n_vocab + len(extra)
    writer = gguf.GGUFWriter(path, "lfm2")
    writer.add_name(name)
    writer.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    writer.add_context_length(NUM_CTX)
    writer.add_embedding_length(shape.embd)
    writer.add_feed_forward_length(shape.ff)
    writer.add_block_count(len(shape.layer_types))
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv([shape.kv_heads if kind == "full_attention" else 0 for kind in shape.layer_types])
    writer.add_rope_freq_base(1000000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_shortconv_l_cache(CONV_L_CACHE)
    writer.add_vocab_size(total_vocab)
    tokens, scores, types = lfm2_vocab(n_vocab)
    tokens += extra
    scores += [0.0] * len(extra)
    types += [int(gguf.TokenType.CONTROL)] * len(extra)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_pad_token_id(PAD_ID)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    finish_gguf(writer, _tensors(n_vocab, seed, len(extra), shape))
    return path


def _tensors(n_vocab: int, seed: int, n_extra: int = 0, shape: Lfm2Shape = TINY) -> list[tuple[str, np.ndarray]]:
    """Tensor names and arrays in numpy order (rows, cols): GGUF stores the dimensions reversed.

    `n_extra` more embedding rows (for `extra_specials`) come from their own stream, after the `n_vocab` rows.
    """
    rng = np.random.default_rng(seed)
    head_dim = shape.embd // shape.heads

    def weight(rows: int, cols: int, scale: float | None = None) -> np.ndarray:
        # 1/sqrt(fan-in) by default: every layer moves the residual stream, so the output depends on the context
        std = scale if scale is not None else cols**-0.5
        return (rng.standard_normal((rows, cols)) * std).astype(np.float32)

    def ones(size: int) -> np.ndarray:
        return np.ones(size, dtype=np.float32)

    # LFM2 ties the output to the embedding; its final norm is stored as `token_embd_norm`. Specials and byte tokens
    # get short rows, so the (tied) output favours text pieces: gibberish, but mostly valid UTF-8 and seldom EOS.
    embedding = weight(n_vocab, shape.embd, scale=0.3)
    embedding[: len(LFM2_SPECIALS) + 256] *= 0.3
    if n_extra:
        extra_rng = np.random.default_rng([seed, 1])
        extra_rows = (extra_rng.standard_normal((n_extra, shape.embd)) * 0.09).astype(np.float32)
        embedding = np.concatenate([embedding, extra_rows])
    tensors = [("token_embd.weight", embedding), ("token_embd_norm.weight", ones(shape.embd))]
    for i, kind in enumerate(shape.layer_types):
        tensors.append((f"blk.{i}.attn_norm.weight", ones(shape.embd)))
        if kind == "full_attention":
            tensors += [
                (f"blk.{i}.attn_q.weight", weight(shape.heads * head_dim, shape.embd)),
                (f"blk.{i}.attn_k.weight", weight(shape.kv_heads * head_dim, shape.embd)),
                (f"blk.{i}.attn_v.weight", weight(shape.kv_heads * head_dim, shape.embd)),
                (f"blk.{i}.attn_output.weight", weight(shape.embd, shape.heads * head_dim)),
                (f"blk.{i}.attn_q_norm.weight", ones(head_dim)),
                (f"blk.{i}.attn_k_norm.weight", ones(head_dim)),
            ]
        else:
            tensors += [
                (f"blk.{i}.shortconv.conv.weight", weight(shape.embd, CONV_L_CACHE, scale=0.5)),
                (f"blk.{i}.shortconv.in_proj.weight", weight(3 * shape.embd, shape.embd)),
                (f"blk.{i}.shortconv.out_proj.weight", weight(shape.embd, shape.embd)),
            ]
        tensors += [
            (f"blk.{i}.ffn_norm.weight", ones(shape.embd)),
            (f"blk.{i}.ffn_gate.weight", weight(shape.ff, shape.embd)),
            (f"blk.{i}.ffn_up.weight", weight(shape.ff, shape.embd)),
            (f"blk.{i}.ffn_down.weight", weight(shape.embd, shape.ff)),
        ]
    return tensors
