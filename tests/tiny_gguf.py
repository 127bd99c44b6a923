"""A tiny, loadable llama-architecture GGUF for tests that need real llama.cpp weights but no download.

`write_tiny_llama(path)` writes ~200 KB: hidden 64, 2 layers, 4 heads (2 KV heads), FFN 128, and a SentencePiece
("llama") vocab of byte tokens plus single letters and `▁`-words, so llama.cpp can tokenize any text. The
weights are seeded random numbers: the model loads, tokenizes and decodes, and generates gibberish. Rows are 64
or 128 wide, so Q4_0/Q5_x/Q8_0 quantize as such; K-quants need rows divisible by 256 and llama.cpp falls back to
a legacy type for these tensors (the file type it records is still the one asked for).
"""

from __future__ import annotations

import string
from pathlib import Path

import gguf
import numpy as np

F32 = gguf.LlamaFileType.ALL_F32
F16 = gguf.LlamaFileType.MOSTLY_F16

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""A ChatML template; pass it as `chat_template=` for tests that render chats."""

NUM_EMBD = 64
NUM_FF = 128
NUM_HEAD = 4
NUM_HEAD_KV = 2
NUM_LAYER = 2
NUM_CTX = 256
_SPECIAL = [("<unk>", gguf.TokenType.UNKNOWN), ("<s>", gguf.TokenType.CONTROL), ("</s>", gguf.TokenType.CONTROL)]


def tiny_vocab(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and token types of an SPM vocab: specials, the 256 byte tokens, then pieces up to `n_vocab`.

    `<|im_start|>` and `<|im_end|>` are control tokens 3 and 4, so ChatML prompts tokenize to single special tokens.
    """
    specials = [*_SPECIAL, ("<|im_start|>", gguf.TokenType.CONTROL), ("<|im_end|>", gguf.TokenType.CONTROL)]
    tokens = [text for text, _ in specials] + [f"<0x{byte:02X}>" for byte in range(256)]
    types = [int(kind) for _, kind in specials] + [int(gguf.TokenType.BYTE)] * 256
    pieces = ["▁", *string.ascii_lowercase, *string.ascii_uppercase, *string.digits, *string.punctuation]
    pieces += [f"▁{c}" for c in string.ascii_letters] + [f"▁{a}{b}" for a in string.ascii_lowercase for b in "aeiou"]
    num_pieces = n_vocab - len(tokens)
    if num_pieces < 1 or num_pieces > len(pieces):
        raise ValueError(f"n_vocab must be between {len(tokens) + 1} and {len(tokens) + len(pieces)}")
    tokens += pieces[:num_pieces]
    types += [int(gguf.TokenType.NORMAL)] * num_pieces
    scores = [0.0] * len(specials) + [0.0] * 256 + [-float(i) for i in range(num_pieces)]
    return tokens, scores, types


def write_tiny_llama(
    path: str | Path,
    *,
    n_vocab: int = 320,
    ftype: gguf.LlamaFileType = F32,
    seed: int = 0,
    chat_template: str | None = None,
    name: str = "tiny-llama",
    fim: bool = False,
    n_ctx: int = NUM_CTX,
) -> Path:
    """Write a tiny llama GGUF with F32 (or F16 for 2-D weights when `ftype=F16`) tensors; return its path.

    With `fim`, the last three tokens are FIM_TOKENS, named by the `tokenizer.ggml.fim_*_token_id` keys; `n_ctx` is
    the trained context length it records."""
    if ftype not in (F32, F16):
        raise ValueError("write_tiny_llama writes F32 or F16; quantize the result for anything else")
    path = Path(path)
    writer = gguf.GGUFWriter(path, "llama")
    write_llama_metadata(writer, n_vocab, ftype, name, chat_template, fim, n_ctx)
    if fim:
        _add_fim_tokens(writer, n_vocab)
    tensors = _tensors(n_vocab, seed)
    if ftype == F16:
        tensors = [(name, array.astype(np.float16) if array.ndim == 2 else array) for name, array in tensors]
    finish_gguf(writer, tensors)
    return path


def write_crashing_llama(path: str | Path) -> Path:
    """Write a tiny llama whose 4 query heads do not share out over its 3 KV heads; return its path. The file is
    well formed (store/gguf_check.py passes it), but llama.cpp aborts the process (GGML_ASSERT in its attention
    graph) while it creates the model's context, that is, at load."""
    path = Path(path)
    writer = gguf.GGUFWriter(path, "llama")
    write_llama_metadata(writer, 320, F32, "crashing-llama", CHATML_TEMPLATE, n_head_kv=3)
    finish_gguf(writer, _tensors(320, 0, n_head_kv=3))
    return path


def finish_gguf(writer: gguf.GGUFWriter, tensors: list[tuple[str, np.ndarray]]) -> None:
    """Add `tensors` and write the file `writer` was opened on."""
    for tensor_name, array in tensors:
        writer.add_tensor(tensor_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


FIM_TOKENS = ("<fim_pre>", "<fim_suf>", "<fim_mid>")
"""Texts of the fill-in-the-middle tokens (unknown to llama.cpp's guesses: found only through the metadata keys)."""


def fim_token_ids(n_vocab: int = 320) -> tuple[int, int, int]:
    """The ids of the prefix, suffix and middle tokens of `write_tiny_llama(..., fim=True)`."""
    return n_vocab - 3, n_vocab - 2, n_vocab - 1


def _add_fim_tokens(writer: gguf.GGUFWriter, n_vocab: int) -> None:
    for key, token in zip(("fim_pre", "fim_suf", "fim_mid"), fim_token_ids(n_vocab), strict=True):
        writer.add_uint32(f"tokenizer.ggml.{key}_token_id", token)


def write_llama_metadata(
    writer: gguf.GGUFWriter, n_vocab: int, ftype: gguf.LlamaFileType, name: str, chat_template: str | None,
    fim: bool = False, n_ctx: int = NUM_CTX, n_head_kv: int = NUM_HEAD_KV,
) -> None:
    writer.add_name(name)
    writer.add_file_type(int(ftype))
    writer.add_context_length(n_ctx)
    writer.add_embedding_length(NUM_EMBD)
    writer.add_feed_forward_length(NUM_FF)
    writer.add_block_count(NUM_LAYER)
    writer.add_head_count(NUM_HEAD)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(NUM_EMBD // NUM_HEAD)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    tokens, scores, types = tiny_vocab(n_vocab)
    if fim:
        tokens[-3:], types[-3:] = list(FIM_TOKENS), [int(gguf.TokenType.CONTROL)] * 3
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


def _tensors(n_vocab: int, seed: int, n_head_kv: int = NUM_HEAD_KV) -> list[tuple[str, np.ndarray]]:
    """Tensor names and arrays in numpy order (rows, cols): GGUF stores the dimensions reversed."""
    rng = np.random.default_rng(seed)
    head_dim = NUM_EMBD // NUM_HEAD

    def weight(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)

    def norm() -> np.ndarray:
        return np.ones(NUM_EMBD, dtype=np.float32)

    tensors = [("token_embd.weight", weight(n_vocab, NUM_EMBD))]
    for i in range(NUM_LAYER):
        tensors += [
            (f"blk.{i}.attn_norm.weight", norm()),
            (f"blk.{i}.attn_q.weight", weight(NUM_HEAD * head_dim, NUM_EMBD)),
            (f"blk.{i}.attn_k.weight", weight(n_head_kv * head_dim, NUM_EMBD)),
            (f"blk.{i}.attn_v.weight", weight(n_head_kv * head_dim, NUM_EMBD)),
            (f"blk.{i}.attn_output.weight", weight(NUM_EMBD, NUM_HEAD * head_dim)),
            (f"blk.{i}.ffn_norm.weight", norm()),
            (f"blk.{i}.ffn_gate.weight", weight(NUM_FF, NUM_EMBD)),
            (f"blk.{i}.ffn_up.weight", weight(NUM_FF, NUM_EMBD)),
            (f"blk.{i}.ffn_down.weight", weight(NUM_EMBD, NUM_FF)),
        ]
    tensors += [("output_norm.weight", norm()), ("output.weight", weight(n_vocab, NUM_EMBD))]
    return tensors
