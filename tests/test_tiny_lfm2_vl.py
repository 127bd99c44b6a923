"""The tiny LFM2-VL pair loads in llama.cpp + libmtmd, tokenizes images into chunks and evaluates them.

The calling pattern here (ctypes through `llama_cpp.mtmd_cpp`) is the one an engine can copy.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp as lc
import numpy as np
import pytest
from llama_cpp import mtmd_cpp as mt
from PIL import Image, ImageDraw

from tests.tiny_lfm2 import LFM2_VL_SPECIALS, write_tiny_lfm2
from tests.tiny_lfm2_vl import write_tiny_lfm2_vl

TEXT, IMAGE = mt.MTMD_INPUT_CHUNK_TYPE_TEXT, mt.MTMD_INPUT_CHUNK_TYPE_IMAGE
N_CTX, N_BATCH = 4096, 512


@dataclass
class Loaded:
    model: Any
    ctx: Any
    mtmd: Any
    vocab: Any
    paths: tuple[Path, Path]


@dataclass
class Chunk:
    kind: int
    n_tokens: int
    n_pos: int
    tokens: list[int]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Loaded]:
    directory = tmp_path_factory.mktemp("lfm2vl")
    model_path, mmproj_path = directory / "tiny-lfm2-vl.gguf", directory / "mmproj-tiny-lfm2-vl.gguf"
    write_tiny_lfm2_vl(model_path, mmproj_path)
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(str(model_path).encode(), lc.llama_model_default_params())
    assert model
    cparams = lc.llama_context_default_params()
    cparams.n_ctx = N_CTX
    cparams.n_batch = N_BATCH
    cparams.n_ubatch = N_BATCH
    cparams.n_threads = cparams.n_threads_batch = 4
    ctx = lc.llama_init_from_model(model, cparams)
    assert ctx
    mtmd = _mtmd_init(mmproj_path, model)
    yield Loaded(model, ctx, mtmd, lc.llama_model_get_vocab(model), (model_path, mmproj_path))
    # the mtmd context keeps the model's vocab pointer: free it before the model
    mt.mtmd_free(mtmd)
    lc.llama_free(ctx)
    lc.llama_model_free(model)


def _mtmd_init(mmproj_path: Path, model: Any, *, min_tokens: int = -1, max_tokens: int = -1) -> Any:
    params = mt.mtmd_context_params_default()
    params.n_threads = 4
    params.print_timings = False
    params.image_min_tokens = min_tokens  # -1: the projector's default (64 for LFM2)
    params.image_max_tokens = max_tokens  # -1: the projector's default (256 for LFM2)
    mtmd = mt.mtmd_init_from_file(str(mmproj_path).encode(), model, params)
    assert mtmd, "mtmd_init_from_file returned NULL"
    return mtmd


def _prompt() -> str:
    marker = mt.mtmd_default_marker().decode()
    return "<|im_start|>user\n" + marker + "What is this?<|im_end|>\n<|im_start|>assistant\n"


def _bitmap(image: Image.Image) -> Any:
    rgb = np.ascontiguousarray(np.asarray(image.convert("RGB"), dtype=np.uint8))
    height, width, _ = rgb.shape
    data = (ctypes.c_uint8 * rgb.size).from_buffer_copy(rgb.tobytes())
    bitmap = mt.mtmd_bitmap_init(width, height, data)  # copies the pixels
    assert bitmap
    return bitmap


def _tokenize(mtmd: Any, image: Image.Image, *, prompt: str | None = None, add_special: bool = True) -> Any:
    """Return an `mtmd_input_chunks` pointer (free it with `mtmd_input_chunks_free`)."""
    data = (prompt if prompt is not None else _prompt()).encode()
    text = mt.mtmd_input_text(data, len(data), add_special, True)  # text, text_len, add_special, parse_special
    bitmap = _bitmap(image)
    try:
        chunks = mt.mtmd_input_chunks_init()
        bitmaps = (mt.mtmd_bitmap_p_ctypes * 1)(bitmap)
        rc = mt.mtmd_tokenize(mtmd, chunks, ctypes.byref(text), bitmaps, 1)
        assert rc == 0, f"mtmd_tokenize returned {rc}"
    finally:
        mt.mtmd_bitmap_free(bitmap)  # the chunks hold their own preprocessed copy
    return chunks


def _chunks(chunks: Any) -> list[Chunk]:
    out = []
    for i in range(mt.mtmd_input_chunks_size(chunks)):
        chunk = mt.mtmd_input_chunks_get(chunks, i)
        kind = mt.mtmd_input_chunk_get_type(chunk)
        tokens: list[int] = []
        if kind == TEXT:
            n = ctypes.c_size_t()
            array = mt.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
            tokens = list(array[: n.value])
        out.append(Chunk(kind, mt.mtmd_input_chunk_get_n_tokens(chunk), mt.mtmd_input_chunk_get_n_pos(chunk), tokens))
    return out


def _image_tokens(mtmd: Any, size: tuple[int, int]) -> list[int]:
    chunks = _tokenize(mtmd, _noise(size))
    try:
        return [c.n_tokens for c in _chunks(chunks) if c.kind == IMAGE]
    finally:
        mt.mtmd_input_chunks_free(chunks)


def _eval(loaded: Loaded, image: Image.Image) -> tuple[np.ndarray, int, list[Chunk]]:
    """Evaluate prompt + image from position 0 of sequence 0; return the last logits, n_past and the chunks."""
    lc.llama_memory_clear(lc.llama_get_memory(loaded.ctx), True)
    chunks = _tokenize(loaded.mtmd, image)
    try:
        new_n_past = lc.llama_pos(0)
        rc = mt.mtmd_helper_eval_chunks(
            loaded.mtmd, loaded.ctx, chunks, 0, 0, N_BATCH, True, ctypes.byref(new_n_past)
        )  # mtmd ctx, llama ctx, chunks, n_past, seq_id, n_batch, logits_last, out new_n_past
        assert rc == 0, f"mtmd_helper_eval_chunks returned {rc}"
        n_vocab = lc.llama_vocab_n_tokens(loaded.vocab)
        logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(loaded.ctx, -1), shape=(n_vocab,)).copy()
        return logits, new_n_past.value, _chunks(chunks)
    finally:
        mt.mtmd_input_chunks_free(chunks)


def _token_id(vocab: Any, text: str) -> int:
    data = text.encode()
    buf = (lc.llama_token * 8)()
    n = lc.llama_tokenize(vocab, data, len(data), buf, 8, False, True)
    assert n == 1, f"{text} is not a single token"
    return int(buf[0])


def _noise(size: tuple[int, int], seed: int = 0) -> Image.Image:
    width, height = size
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _drawn(size: tuple[int, int]) -> Image.Image:
    image = Image.new("RGB", size, (30, 90, 200))
    draw = ImageDraw.Draw(image)
    draw.ellipse((size[0] // 4, size[1] // 4, 3 * size[0] // 4, 3 * size[1] // 4), fill=(250, 200, 0))
    return image


def test_files_small(loaded: Loaded) -> None:
    model_path, mmproj_path = loaded.paths
    assert model_path.stat().st_size < 5_000_000
    assert mmproj_path.stat().st_size < 5_000_000


def test_loads_with_vision(loaded: Loaded) -> None:
    assert mt.mtmd_support_vision(loaded.mtmd)
    assert not mt.mtmd_support_audio(loaded.mtmd)
    assert not mt.mtmd_decode_use_mrope(loaded.mtmd)
    assert mt.mtmd_default_marker() == b"<__media__>"


def test_vision_specials_keep_base_ids(loaded: Loaded) -> None:
    assert lc.llama_vocab_n_tokens(loaded.vocab) == 360 + len(LFM2_VL_SPECIALS)
    assert _token_id(loaded.vocab, "<|im_start|>") == 6
    assert _token_id(loaded.vocab, "<|im_end|>") == 7
    for offset, text in enumerate(LFM2_VL_SPECIALS[:5]):
        assert _token_id(loaded.vocab, text) == 360 + offset


def test_write_tiny_lfm2_unchanged_without_extras(tmp_path: Path) -> None:
    plain = write_tiny_lfm2(tmp_path / "a.gguf").read_bytes()
    assert write_tiny_lfm2(tmp_path / "b.gguf", extra_specials=()).read_bytes() == plain


@pytest.mark.parametrize("size", [(64, 64), (300, 200)])
def test_prompt_with_image_evaluates(loaded: Loaded, size: tuple[int, int]) -> None:
    logits, n_past, chunks = _eval(loaded, _drawn(size))
    assert [c.kind for c in chunks] == [TEXT, IMAGE, TEXT]
    before, image, after = chunks
    assert image.n_tokens > 0
    assert image.n_pos == image.n_tokens
    image_start = _token_id(loaded.vocab, "<|image_start|>")
    image_end = _token_id(loaded.vocab, "<|image_end|>")
    # add_special=True put BOS first; the marker became <|image_start|> (image) <|image_end|>
    assert before.tokens[:2] == [lc.llama_vocab_bos(loaded.vocab), 6]
    assert before.tokens[-1] == image_start
    assert after.tokens[0] == image_end
    assert n_past == sum(c.n_pos for c in chunks)
    assert np.isfinite(logits).all()
    token = int(logits.argmax())  # greedy next token
    assert 0 <= token < lc.llama_vocab_n_tokens(loaded.vocab)


def test_template_bos_and_add_special(loaded: Loaded) -> None:
    bos = lc.llama_vocab_bos(loaded.vocab)
    prompt = "<|startoftext|>" + _prompt()  # what the LFM2 chat template renders
    for add_special, expected in ((True, [bos, bos]), (False, [bos, 6])):
        chunks = _tokenize(loaded.mtmd, _drawn((64, 64)), prompt=prompt, add_special=add_special)
        try:
            assert _chunks(chunks)[0].tokens[:2] == expected
        finally:
            mt.mtmd_input_chunks_free(chunks)


def test_output_depends_on_image(loaded: Loaded) -> None:
    red, _, _ = _eval(loaded, Image.new("RGB", (64, 64), (255, 0, 0)))
    noise, _, _ = _eval(loaded, _noise((64, 64)))
    red_again, _, _ = _eval(loaded, Image.new("RGB", (64, 64), (255, 0, 0)))
    assert not np.allclose(red, noise, atol=1e-3)
    np.testing.assert_allclose(red, red_again, atol=1e-4)


DEFAULT_COUNTS = {
    (32, 32): [64],
    (64, 64): [64],
    (300, 200): [70],
    (512, 512): [256],
    (1024, 768): [256] * 6 + [234],
}


def test_image_token_counts_default(loaded: Loaded) -> None:
    counts = {size: _image_tokens(loaded.mtmd, size) for size in DEFAULT_COUNTS}
    assert counts == DEFAULT_COUNTS
    totals = [sum(counts[size]) for size in DEFAULT_COUNTS]  # sizes in increasing area
    assert totals == sorted(totals)


def test_tiled_image_layout(loaded: Loaded) -> None:
    chunks = _tokenize(loaded.mtmd, _noise((1024, 768)))
    try:
        parts = _chunks(chunks)
    finally:
        mt.mtmd_input_chunks_free(chunks)
    kinds = [c.kind for c in parts]
    assert kinds == [TEXT, IMAGE] * 7 + [TEXT]
    row_col = [f"<|img_row_{r}_col_{c}|>" for r in (1, 2) for c in (1, 2, 3)]
    markers = [parts[0].tokens[-1]] + [parts[i].tokens[0] for i in range(2, 13, 2)]
    expected = [_token_id(loaded.vocab, text) for text in [*row_col, "<|img_thumbnail|>"]]
    assert markers == expected
    assert parts[0].tokens[-2] == _token_id(loaded.vocab, "<|image_start|>")
    assert parts[-1].tokens[0] == _token_id(loaded.vocab, "<|image_end|>")


def test_image_token_limits(loaded: Loaded) -> None:
    mmproj_path = loaded.paths[1]
    small = _mtmd_init(mmproj_path, loaded.model, min_tokens=16, max_tokens=64)
    try:
        assert _image_tokens(small, (64, 64)) == [16]
        assert _image_tokens(small, (300, 200)) == [54]
        assert _image_tokens(small, (512, 512)) == [256] * 4 + [64]  # tiling starts sooner: more tokens
    finally:
        mt.mtmd_free(small)
    large = _mtmd_init(mmproj_path, loaded.model, min_tokens=256, max_tokens=1024)
    try:
        assert _image_tokens(large, (64, 64)) == [256]
        assert _image_tokens(large, (300, 200)) == [280]
        assert _image_tokens(large, (1024, 768)) == [768]  # no tiling below 2 x 1024 tokens
    finally:
        mt.mtmd_free(large)
