"""A tiny, loadable LFM2-VL (text GGUF + vision projector GGUF) for tests that need no download.

`write_tiny_lfm2_vl(model_path, mmproj_path)` writes two files, both F32 with seeded random weights (~1.1 MB):

* `model_path` (~780 KB): `tests.tiny_lfm2.write_tiny_lfm2` (architecture `lfm2`, hidden 64, 4 layers, LFM2
  specials at LFM2's ids, the LFM2 text chat template) plus `LFM2_VL_SPECIALS` appended as control tokens after the
  360 base tokens: `<image>` 360, `<|image_start|>` 361, `<|image_end|>` 362, `<|img_thumbnail|>` 363, then
  `<|img_row_R_col_C|>` (R, C in 1..10) at 364 + 10 * (R - 1) + (C - 1). Every base id is unchanged.
* `mmproj_path` (~290 KB): a libmtmd projector of type `lfm2`: a SigLIP2-style ViT (hidden 32, 2 heads, FFN 64,
  3 layers, patch 16, GELU, LayerNorm eps 1e-6, learned 16x16 position grid that llama.cpp resizes per image) and
  the LFM2-VL projector (2x2 pixel unshuffle to 128, LayerNorm, Linear 128->64, GELU, Linear 64->64 = text hidden).

What llama.cpp (libmtmd, llama-cpp-python 0.3.36) requires of the projector, from `tools/mtmd/clip.cpp`:

* `general.architecture` = `clip` (`general.type` = `mmproj` as converted files have), `clip.has_vision_encoder`
  = true, `clip.projector_type` = `lfm2` (`lfm2a` is the audio one).
* required u32/f32 keys: `clip.vision.{embedding_length, feed_forward_length, block_count, projection_dim,
  attention.head_count, attention.layer_norm_epsilon, image_size, patch_size}` and f32 arrays
  `clip.vision.image_mean` / `image_std` (3 values each; LFM2-VL uses 0.5). `clip.vision.projector.scale_factor`
  is optional but must be 2 in practice (the LFM2 graph asserts a pixel-unshuffle factor > 1; the converter writes
  `downsample_factor`, 2). `clip.use_gelu` = true (default would be quick-GELU). `projection_dim` and the output
  rows of `mm.2.weight` must equal the text model's hidden size, or `mtmd_init_from_file` fails (n_embd mismatch).
  `image_size` only sizes the warmup for other projectors (the real converter writes 256); LFM2 warms up at 512x512.
* tensors: `v.patch_embd.weight` (a conv kernel: numpy shape (n_embd, 3, 16, 16)), `v.patch_embd.bias`,
  `v.position_embd.weight` (n_side^2 rows, bilinearly resized to the image's patch grid), per layer
  `v.blk.N.{ln1,ln2,attn_q,attn_k,attn_v,attn_out,ffn_up,ffn_down}.{weight,bias}`, `v.post_ln.{weight,bias}`, and
  projector `mm.input_norm.{weight,bias}` (optional), `mm.1.{weight,bias}`, `mm.2.{weight,bias}` (required).
* block count: libmtmd loads any number of layers (1 and 2 work too); the "at least 3" rule is a snag of building
  a tiny HF checkpoint and converting it (`vision_feature_layer` = -1 drops none). This file uses 3.

How libmtmd lays an LFM2 image out (`tools/mtmd/mtmd.cpp`, `mtmd-image.cpp`): the media marker
(`mtmd_default_marker()`, `<__media__>`) becomes `<|image_start|>` + image chunk(s) + `<|image_end|>` (text
tokens, parsed as specials). Image tokens per 512x512-ish view are between 64 and 256 by default (image_min/max_tokens
64/256; one token per 32x32 pixels after resizing to a multiple of 32). An image whose 32-rounded area exceeds
2 x 256 x 32 x 32 = 524,288 pixels (about 724x724) is tiled: 512x512 tiles (2..10 of them, grid chosen by aspect
ratio), each a separate image chunk of 256 tokens preceded by `<|img_row_R_col_C|>`, then `<|img_thumbnail|>` and
a thumbnail chunk. The text model MUST have `<|img_thumbnail|>`: libmtmd looks it up by text and, when missing,
puts token -1 in the prompt and a tiled image aborts the process in `mtmd_helper_eval_chunks`. Image chunks have
n_pos == n_tokens (no M-RoPE).

Image tokens measured with this model (default params; `+` separates the chunks of a tiled image):

    size        image tokens
    1x1, 16x16, 32x32, 64x64    64 (upscaled to the 64-token minimum)
    300x200     70
    512x512     256
    600x600     256
    724x724     256 x 4 + 256 = 1280 (2x2 tiles + thumbnail)
    1024x768    256 x 6 + 234 = 1770 (3x2 tiles + 576x416 thumbnail)
    2000x500    256 x 4 + 256 = 1280 (4x1 tiles)
    4000x4000   256 x 9 + 256 = 2560 (3x3 tiles); the most any image gets by default is 10 x 256 + 256 = 2816

`mtmd_context_params.image_min_tokens` / `image_max_tokens` bound the single view and the thumbnail, and move the
tiling threshold (2 x max): min 16 / max 64 gives 64x64 -> 16, 300x200 -> 54, 512x512 -> 4 x 256 + 64 (tiled:
MORE tokens than the default 256), 1024x768 -> 6 x 256 + 54; min 256 / max 1024 gives 64x64 -> 256,
300x200 -> 280, 600x600 -> 361, 1024x768 -> 768 (no tiling), 2000x500 -> 1008. Tiles are always 512x512 = 256 tokens.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from tests.tiny_gguf import finish_gguf
from tests.tiny_lfm2 import LFM2_VL_SPECIALS, NUM_EMBD, write_tiny_lfm2

VISION_EMBD = 32
VISION_FF = 64
VISION_HEAD = 2
VISION_LAYERS = 3
PATCH_SIZE = 16
IMAGE_SIZE = 256
SCALE_FACTOR = 2
PROJECTOR_FF = 64
LAYER_NORM_EPS = 1e-6


def write_tiny_lfm2_vl(model_path: Path, mmproj_path: Path, *, seed: int = 0) -> None:
    """Write the text model to `model_path` and the LFM2 vision projector to `mmproj_path`."""
    write_tiny_lfm2(model_path, seed=seed, name="tiny-lfm2-vl", extra_specials=LFM2_VL_SPECIALS)
    write_tiny_lfm2_mmproj(mmproj_path, seed=seed)


def write_tiny_lfm2_mmproj(path: str | Path, *, seed: int = 0) -> Path:
    """Write the tiny LFM2-VL projector (SigLIP2-style encoder + pixel-unshuffle MLP projector); return its path."""
    path = Path(path)
    writer = gguf.GGUFWriter(path, "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_name("tiny-lfm2-vl-mmproj")
    writer.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    writer.add_clip_has_vision_encoder(True)
    writer.add_clip_projector_type(gguf.VisionProjectorType.LFM2)
    writer.add_vision_projection_dim(NUM_EMBD)
    writer.add_vision_image_size(IMAGE_SIZE)
    writer.add_vision_patch_size(PATCH_SIZE)
    writer.add_vision_embedding_length(VISION_EMBD)
    writer.add_vision_feed_forward_length(VISION_FF)
    writer.add_vision_block_count(VISION_LAYERS)
    writer.add_vision_head_count(VISION_HEAD)
    writer.add_vision_image_mean([0.5, 0.5, 0.5])
    writer.add_vision_image_std([0.5, 0.5, 0.5])
    writer.add_vision_attention_layernorm_eps(LAYER_NORM_EPS)
    writer.add_vision_projector_scale_factor(SCALE_FACTOR)
    writer.add_vision_use_gelu(True)
    finish_gguf(writer, _mmproj_tensors(seed))
    return path


def _mmproj_tensors(seed: int) -> list[tuple[str, np.ndarray]]:
    """Tensor names and arrays in numpy order (GGUF stores the dimensions reversed)."""
    rng = np.random.default_rng([seed, 2])

    def weight(*shape: int, scale: float | None = None) -> np.ndarray:
        fan_in = int(np.prod(shape[1:]))
        std = scale if scale is not None else fan_in**-0.5
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def ones(size: int) -> np.ndarray:
        return np.ones(size, dtype=np.float32)

    def zeros(size: int) -> np.ndarray:
        return np.zeros(size, dtype=np.float32)

    def bias(size: int) -> np.ndarray:
        return (rng.standard_normal(size) * 0.02).astype(np.float32)

    num_positions = (IMAGE_SIZE // PATCH_SIZE) ** 2
    merged = VISION_EMBD * SCALE_FACTOR * SCALE_FACTOR
    tensors = [
        # conv kernel (out channels, in channels, kh, kw): ggml order [kw, kh, 3, n_embd]
        ("v.patch_embd.weight", weight(VISION_EMBD, 3, PATCH_SIZE, PATCH_SIZE)),
        ("v.patch_embd.bias", bias(VISION_EMBD)),
        ("v.position_embd.weight", weight(num_positions, VISION_EMBD, scale=0.1)),
    ]
    for i in range(VISION_LAYERS):
        tensors += [
            (f"v.blk.{i}.ln1.weight", ones(VISION_EMBD)),
            (f"v.blk.{i}.ln1.bias", zeros(VISION_EMBD)),
            (f"v.blk.{i}.attn_q.weight", weight(VISION_EMBD, VISION_EMBD)),
            (f"v.blk.{i}.attn_q.bias", bias(VISION_EMBD)),
            (f"v.blk.{i}.attn_k.weight", weight(VISION_EMBD, VISION_EMBD)),
            (f"v.blk.{i}.attn_k.bias", bias(VISION_EMBD)),
            (f"v.blk.{i}.attn_v.weight", weight(VISION_EMBD, VISION_EMBD)),
            (f"v.blk.{i}.attn_v.bias", bias(VISION_EMBD)),
            (f"v.blk.{i}.attn_out.weight", weight(VISION_EMBD, VISION_EMBD)),
            (f"v.blk.{i}.attn_out.bias", bias(VISION_EMBD)),
            (f"v.blk.{i}.ln2.weight", ones(VISION_EMBD)),
            (f"v.blk.{i}.ln2.bias", zeros(VISION_EMBD)),
            (f"v.blk.{i}.ffn_up.weight", weight(VISION_FF, VISION_EMBD)),
            (f"v.blk.{i}.ffn_up.bias", bias(VISION_FF)),
            (f"v.blk.{i}.ffn_down.weight", weight(VISION_EMBD, VISION_FF)),
            (f"v.blk.{i}.ffn_down.bias", bias(VISION_EMBD)),
        ]
    tensors += [
        ("v.post_ln.weight", ones(VISION_EMBD)),
        ("v.post_ln.bias", zeros(VISION_EMBD)),
        ("mm.input_norm.weight", ones(merged)),
        ("mm.input_norm.bias", zeros(merged)),
        ("mm.1.weight", weight(PROJECTOR_FF, merged)),
        ("mm.1.bias", bias(PROJECTOR_FF)),
        ("mm.2.weight", weight(NUM_EMBD, PROJECTOR_FF)),
        ("mm.2.bias", bias(NUM_EMBD)),
    ]
    return tensors
