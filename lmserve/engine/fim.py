"""The fill-in-the-middle (FIM) tokens of a vocabulary: what a code model reads around the gap it fills.

llama.cpp reads them from a GGUF's metadata (`tokenizer.ggml.fim_pre_token_id`, `…fim_suf…`, `…fim_mid…`, the
older `tokenizer.ggml.prefix_token_id` / `suffix_token_id` / `middle_token_id`) or recognizes them by their text;
a Hugging Face tokenizer has them as added tokens, found here by their text (`find_by_text`).
"""

from __future__ import annotations

from collections.abc import Mapping

from lmserve.engine.protocol import FimTokens

KNOWN_TEXTS: tuple[tuple[str, str, str, str, str], ...] = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>"),  # Qwen2.5-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<reponame>", "<file_sep>"),  # StarCoder, SmolLM
    ("<fim-prefix>", "<fim-suffix>", "<fim-middle>", "", ""),  # Refact
    # DeepSeek-Coder (fullwidth bars)
    ("<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>", "<\uff5cfim\u2581end\uff5c>", "", ""),
    ("<PRE>", "<SUF>", "<MID>", "", ""),  # CodeLlama
    ("▁<PRE>", "▁<SUF>", "▁<MID>", "", ""),  # CodeLlama (SentencePiece)
    ("<|fim▁begin|>", "<|fim▁hole|>", "<|fim▁end|>", "", ""),
)
"""(prefix, suffix, middle, repository, file separator) texts of the FIM formats in use, as llama.cpp knows them."""


def find_by_text(vocab: Mapping[str, int]) -> FimTokens | None:
    """The FIM tokens of a vocabulary (token text → id) whose prefix, suffix and middle texts it all has."""
    for prefix, suffix, middle, repo, separator in KNOWN_TEXTS:
        if prefix in vocab and suffix in vocab and middle in vocab:
            return FimTokens(vocab[prefix], vocab[suffix], vocab[middle], vocab.get(repo), vocab.get(separator))
    return None


def from_ids(prefix: int, suffix: int, middle: int, repo: int = -1, separator: int = -1) -> FimTokens | None:
    """FIM tokens from ids where -1 means absent (llama.cpp's LLAMA_TOKEN_NULL); None without all three of
    prefix, suffix and middle."""
    if min(prefix, suffix, middle) < 0:
        return None
    return FimTokens(prefix, suffix, middle, repo if repo >= 0 else None, separator if separator >= 0 else None)
