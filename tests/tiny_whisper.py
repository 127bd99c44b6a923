"""A tiny random Whisper (transformers' WhisperForConditionalGeneration), made without a download: the suite's
speech-to-text model for vLLM.

- Tokenizer: transformers' WhisperTokenizer (byte-level BPE) over SmolLM2's vocabulary and merges (its
  `<|endoftext|>`, id 0, is Whisper's too), then Whisper's special tokens in OpenAI's order: `<|startoftranscript|>`,
  the 100 language tokens (chat/whisper.py LANGUAGES), `<|translate|>`, `<|transcribe|>`, `<|startoflm|>`,
  `<|startofprev|>`, `<|nospeech|>`, `<|notimestamps|>`, and the 1501 timestamps `<|0.00|>` … `<|30.00|>` (plain
  added tokens, as in the released checkpoints).
- Model: d_model 64, 2 encoder and 2 decoder layers, 2 heads (32 wide: vLLM's CPU attention takes no narrower), FFN
  128, 80 mel bins, 1500 source and 448 target positions, float32, seeded.
- The feature extractor (80 mel bins, 16 kHz, 30 s windows) in preprocessor_config.json, and a generation_config.json
  with Whisper's keys.

Cached with the other generated models (tests/hf_repos.py), built once per machine (~15 s).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lmserve.chat.whisper import LANGUAGES
from tests import hf_repos

RATE = 16_000
SPECIALS = ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
            "<|notimestamps|>"]


def tiny_whisper_repo() -> Path:
    return hf_repos.cached_folder(f"tiny-whisper-v{hf_repos.VERSION}", _write_tiny_whisper)


def _tokenizer() -> Any:
    from transformers import WhisperTokenizer

    model = json.loads((hf_repos.smollm2_repo() / "tokenizer.json").read_text())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in model["merges"]]
    tokenizer = WhisperTokenizer(vocab=dict(model["vocab"]), merges=merges, model_max_length=448)
    languages = [f"<|{code}|>" for code in LANGUAGES]
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|startoftranscript|>", *languages, *SPECIALS]})
    tokenizer.add_tokens([f"<|{i * 0.02:.2f}|>" for i in range(1501)], special_tokens=False)
    tokenizer.set_prefix_tokens(predict_timestamps=False)  # its prefix was made before <|startoftranscript|> existed
    return tokenizer


def _write_tiny_whisper(out: Path) -> None:
    import torch
    from transformers import (
        GenerationConfig,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
    )

    tokenizer = _tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    eot, sot = ids("<|endoftext|>"), ids("<|startoftranscript|>")
    features = WhisperFeatureExtractor(feature_size=80, sampling_rate=RATE, hop_length=160, chunk_length=30,
                                       n_fft=400, padding_value=0.0, return_attention_mask=False)
    WhisperProcessor(feature_extractor=features, tokenizer=tokenizer).save_pretrained(out)
    features.save_pretrained(out)  # preprocessor_config.json, as released checkpoints have it
    config = WhisperConfig(
        vocab_size=len(tokenizer), num_mel_bins=80, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=128,
        max_source_positions=1500, max_target_positions=448, decoder_start_token_id=sot, bos_token_id=eot,
        eos_token_id=eot, pad_token_id=eot, suppress_tokens=[], begin_suppress_tokens=[eot],
        tie_word_embeddings=True, init_std=0.2)
    config.architectures = ["WhisperForConditionalGeneration"]
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        decoder_start_token_id=sot, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, max_length=448,
        begin_suppress_tokens=[eot], suppress_tokens=[], is_multilingual=True,
        lang_to_id={f"<|{code}|>": ids(f"<|{code}|>") for code in LANGUAGES},
        task_to_id={"transcribe": ids("<|transcribe|>"), "translate": ids("<|translate|>")},
        no_timestamps_token_id=ids("<|notimestamps|>"), prev_sot_token_id=ids("<|startofprev|>"),
        return_timestamps=False)
    model.save_pretrained(out)
