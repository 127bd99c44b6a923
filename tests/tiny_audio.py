"""A tiny random audio chat model, made without a download (clips to send it: tests/audio_clips.py).

- `tiny_qwen2_audio_repo()`: a random Qwen2-Audio (transformers' Qwen2AudioForConditionalGeneration: a Whisper-style
  encoder of 3 layers, d_model 64, 128 mel bins, its average pooling and a linear projector into a Qwen2 text model
  of hidden 64, 2 layers) with SmolLM2's tokenizer plus Qwen2-Audio's `<|audio_bos|>`, `<|AUDIO|>` and
  `<|audio_eos|>`, saved with the tensor names of the released checkpoints (transformers 5 saves the text model one
  `model.` deeper). The encoder has 3 layers because llama.cpp's converter maps `audio_tower.conv{N}` by block
  index: with fewer than 3 blocks `conv2` has no name.
- `tiny_qwen2_audio_gguf()`: its text model and its audio projector (`clip.projector_type` qwen2a) as float32 GGUFs,
  converted by llama.cpp's own `convert_hf_to_gguf.py` (`tests.hf_repos.lfm2_gguf`, which converts any repository).

libmtmd pads every clip to 30 s (Whisper's window) and the encoder halves its 3000 mel frames twice (a strided conv,
then the pooling): each started 30 s of a clip is 750 prompt positions, between `<|audio_bos|>` and `<|audio_eos|>`.
Both are cached with the other generated models (tests/hf_repos.py: keyed by version, built once per machine).
"""

from __future__ import annotations

from pathlib import Path

from tests import hf_repos
from tests.audio_clips import RATE

AUDIO_TOKENS = ["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]
POSITIONS_PER_WINDOW = 750
"""Prompt positions a clip of up to 30 s takes (each further started 30 s takes as many again)."""


def tiny_qwen2_audio_repo() -> Path:
    return hf_repos.cached_folder(f"tiny-qwen2-audio-v{hf_repos.VERSION}", _write_tiny_qwen2_audio)


def tiny_qwen2_audio_gguf() -> tuple[Path, Path]:
    """The text model's GGUF and the audio projector's (mmproj)."""
    repo = tiny_qwen2_audio_repo()
    return hf_repos.lfm2_gguf(repo), hf_repos.lfm2_gguf(repo, projector=True)


def _write_tiny_qwen2_audio(out: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import (
        AutoTokenizer,
        Qwen2AudioConfig,
        Qwen2AudioForConditionalGeneration,
        WhisperFeatureExtractor,
    )

    tokenizer = AutoTokenizer.from_pretrained(hf_repos.smollm2_repo())
    tokenizer.add_tokens(AUDIO_TOKENS, special_tokens=True)
    tokenizer.save_pretrained(out)
    text = dict(model_type="qwen2", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                bos_token_id=1, eos_token_id=2, tie_word_embeddings=True, initializer_range=0.2)
    audio = dict(model_type="qwen2_audio_encoder", d_model=64, encoder_layers=3, encoder_attention_heads=2,
                 encoder_ffn_dim=128, num_mel_bins=128, max_source_positions=1500)
    config = Qwen2AudioConfig(audio_config=audio, text_config=text,
                              audio_token_index=tokenizer.convert_tokens_to_ids("<|AUDIO|>"))
    torch.manual_seed(0)
    Qwen2AudioForConditionalGeneration(config).save_pretrained(out)
    weights = load_file(out / "model.safetensors")
    save_file({name.replace("language_model.model.model.", "language_model.model.", 1): tensor
               for name, tensor in weights.items()}, out / "model.safetensors", metadata={"format": "pt"})
    WhisperFeatureExtractor(feature_size=128, sampling_rate=RATE).save_pretrained(out)


if __name__ == "__main__":
    print(tiny_qwen2_audio_repo(), *tiny_qwen2_audio_gguf())
