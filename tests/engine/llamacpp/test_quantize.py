"""Spec for lmserve.engine.llamacpp.quantize: level names, and real llama.cpp quantization of a tiny generated model."""

from __future__ import annotations

from pathlib import Path

import llama_cpp as lc
import pytest

from lmserve.engine.llamacpp.quantize import QUANT_TYPES, file_type, file_type_name, parse_quant, quantize
from lmserve.errors import EngineFailure, InvalidRequest
from tests.tiny_gguf import F16, write_tiny_llama


@pytest.mark.parametrize(
    ("level", "ftype"),
    [
        ("Q4_0", lc.LLAMA_FTYPE_MOSTLY_Q4_0),
        ("q4_0", lc.LLAMA_FTYPE_MOSTLY_Q4_0),
        ("q4_K_M", lc.LLAMA_FTYPE_MOSTLY_Q4_K_M),
        ("Q4_K_S", lc.LLAMA_FTYPE_MOSTLY_Q4_K_S),
        ("q8_0", lc.LLAMA_FTYPE_MOSTLY_Q8_0),
        ("Q6_K", lc.LLAMA_FTYPE_MOSTLY_Q6_K),
        ("f16", lc.LLAMA_FTYPE_MOSTLY_F16),
        ("F32", lc.LLAMA_FTYPE_ALL_F32),
        (" Q5_K_M ", lc.LLAMA_FTYPE_MOSTLY_Q5_K_M),
    ],
)
def test_parse_quant(level: str, ftype: int) -> None:
    assert parse_quant(level) == ftype


@pytest.mark.parametrize("level", ["", "q4", "Q4_K", "q4_k_m_x", "IQ2_XXS", "bf16", "latest", "Q4_0;rm"])
def test_parse_quant_refuses_unknown_levels(level: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_quant(level)
    assert info.value.status == 400
    assert info.value.param == "quantize"
    assert "Q4_K_M" in info.value.message and "Q8_0" in info.value.message


def test_quant_types_are_distinct_upper_case_names() -> None:
    assert all(name == name.upper() for name in QUANT_TYPES)
    assert len(set(QUANT_TYPES.values())) == len(QUANT_TYPES)


@pytest.fixture(scope="module")
def tiny_f32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-f32.gguf")


def decodes(path: Path) -> bool:
    """Load the model in llama.cpp and decode a few tokens of text."""
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(str(path).encode(), lc.llama_model_default_params())
    assert model, f"llama.cpp could not load {path}"
    try:
        vocab = lc.llama_model_get_vocab(model)
        text = b"Hello tiny world"
        tokens = (lc.llama_token * 32)()
        num_tokens = lc.llama_tokenize(vocab, text, len(text), tokens, 32, True, False)
        assert num_tokens > 3
        cparams = lc.llama_context_default_params()
        cparams.n_ctx, cparams.n_batch, cparams.n_threads, cparams.n_threads_batch = 64, 64, 1, 1
        ctx = lc.llama_init_from_model(model, cparams)
        assert ctx
        try:
            return bool(lc.llama_decode(ctx, lc.llama_batch_get_one(tokens, num_tokens)) == 0)
        finally:
            lc.llama_free(ctx)
    finally:
        lc.llama_model_free(model)


def test_the_tiny_model_itself_loads_and_decodes(tiny_f32: Path) -> None:
    assert file_type(tiny_f32) == lc.LLAMA_FTYPE_ALL_F32
    assert decodes(tiny_f32)


@pytest.mark.parametrize("level", ["Q8_0", "q4_0", "Q4_K_M"])
def test_quantize_writes_a_loadable_model_of_the_requested_type(tiny_f32: Path, tmp_path: Path, level: str) -> None:
    destination = tmp_path / "out" / f"tiny-{level}.gguf"
    quantize(tiny_f32, destination, level, threads=1)
    assert file_type(destination) == parse_quant(level)
    assert destination.stat().st_size < tiny_f32.stat().st_size / 2
    assert decodes(destination)
    assert sorted(p.name for p in destination.parent.iterdir()) == [destination.name]  # no temp file left


def test_quantize_from_f16(tmp_path: Path) -> None:
    source = write_tiny_llama(tmp_path / "tiny-f16.gguf", ftype=F16)
    quantize(source, tmp_path / "tiny-q8.gguf", "Q8_0", threads=1)
    assert file_type(tmp_path / "tiny-q8.gguf") == lc.LLAMA_FTYPE_MOSTLY_Q8_0


@pytest.mark.parametrize(("source_level", "level"), [("Q8_0", "Q4_0"), ("Q4_0", "q4_K_M"), ("Q4_1", "Q8_0")])
def test_requantizing_is_a_400_that_says_why_and_leaves_no_file(
    tiny_f32: Path, tmp_path: Path, source_level: str, level: str
) -> None:
    quantized = tmp_path / "quantized.gguf"
    quantize(tiny_f32, quantized, source_level, threads=1)
    with pytest.raises(InvalidRequest) as info:
        quantize(quantized, tmp_path / "out.gguf", level, threads=1, label="tiny:latest")
    assert (info.value.status, info.value.param, info.value.code) == (400, "quantize", "already_quantized")
    assert info.value.message == (
        f"cannot quantize tiny:latest to {level.upper()}: its weights are already quantized ({source_level}); "
        "quantize from an F32, F16 or BF16 GGUF"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quantized.gguf"]


def test_the_embedded_q4_1_model_cannot_be_requantized(model_path: Path, tmp_path: Path) -> None:
    assert file_type(model_path) == lc.LLAMA_FTYPE_MOSTLY_Q4_1
    with pytest.raises(InvalidRequest) as info:
        quantize(model_path, tmp_path / "out.gguf", "q4_K_M", label="smollm2:135m")
    assert "cannot quantize smollm2:135m to Q4_K_M: its weights are already quantized (Q4_1)" in info.value.message
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("ftype", "name"),
    [(lc.LLAMA_FTYPE_ALL_F32, "F32"), (lc.LLAMA_FTYPE_MOSTLY_BF16, "BF16"), (lc.LLAMA_FTYPE_MOSTLY_Q4_K_M, "Q4_K_M"),
     (lc.LLAMA_FTYPE_MOSTLY_IQ2_XXS, "IQ2_XXS"), (9999, "9999")],
)  # fmt: skip
def test_file_type_names(ftype: int, name: str) -> None:
    assert file_type_name(ftype) == name


def test_file_type_reads_the_header(tiny_f32: Path, tmp_path: Path) -> None:
    assert file_type(tiny_f32) == lc.LLAMA_FTYPE_ALL_F32
    assert file_type(write_tiny_llama(tmp_path / "f16.gguf", ftype=F16)) == lc.LLAMA_FTYPE_MOSTLY_F16
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    assert file_type(tmp_path / "junk.gguf") is None


def test_a_missing_source_is_an_engine_failure(tmp_path: Path) -> None:
    with pytest.raises(EngineFailure):
        quantize(tmp_path / "source.gguf", tmp_path / "out.gguf", "Q4_0", threads=1)
    assert list(tmp_path.iterdir()) == []


def test_a_refusal_by_llama_cpp_carries_its_reason(tmp_path: Path) -> None:
    source = tmp_path / "source.gguf"
    source.write_bytes(b"not a gguf at all")
    with pytest.raises(InvalidRequest) as info:
        quantize(source, tmp_path / "out.gguf", "Q4_0", threads=1)
    assert (info.value.status, info.value.code) == (400, "quantize_failed")
    assert info.value.message.startswith("llama.cpp could not quantize source.gguf to Q4_0: ")
    assert "status" not in info.value.message  # llama.cpp's own words, caught from its log
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source.gguf"]


def test_quantize_checks_the_level_first(tiny_f32: Path, tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest):
        quantize(tiny_f32, tmp_path / "out.gguf", "Q9_9")
    assert list(tmp_path.iterdir()) == []
