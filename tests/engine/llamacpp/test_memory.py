"""llama.cpp's side of the context rule: a GGUF's KV cost per token, and the context a load gets from it (auto, or
what was asked for capped at the trained length, with a warning naming both numbers)."""

from __future__ import annotations

from pathlib import Path

import llama_cpp as lc
import pytest

from lmserve.engine.llamacpp.backend import LlamaCppBackend
from lmserve.engine.llamacpp.loading import init_llama_backend
from lmserve.engine.llamacpp.memory import KV_TYPE_BYTES, gpu_free_memory, kv_bytes_per_token
from lmserve.engine.llamacpp.options import LlamaCppLaunch
from lmserve.types import AUTO_CONTEXT, LoadOptions
from tests.tiny_gguf import write_tiny_llama
from tests.tiny_lfm2 import write_tiny_lfm2

LONG_TRAINED = 65536


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny llama trained for 64k tokens and a tiny hybrid LFM2 (one attention layer of four)."""
    directory = tmp_path_factory.mktemp("context")
    return {"long": write_tiny_llama(directory / "long.gguf", n_ctx=LONG_TRAINED),
            "lfm2": write_tiny_lfm2(directory / "lfm2.gguf")}


def model_file(name: str, model_path: Path, tiny_files: dict[str, Path]) -> Path:
    return model_path if name == "smollm2" else tiny_files[name]


@pytest.mark.parametrize(
    ("name", "cache_type", "expected"),
    [
        ("smollm2", "f16", 30 * 3 * (64 + 64) * 2),  # every layer: 3 KV heads of 64
        ("smollm2", "q8_0", int(30 * 3 * (64 + 64) * KV_TYPE_BYTES["q8_0"])),  # 34 bytes per 32 values
        ("long", "f16", 2 * 2 * (16 + 16) * 2),  # 2 layers, 2 KV heads of 16
        ("lfm2", "f16", 1 * 2 * (16 + 16) * 2),  # only the attention layer keeps a KV cache
    ],
)
def test_kv_bytes_per_token_counts_the_attention_layers(name: str, cache_type: str, expected: int, model_path: Path,
                                                        tiny_files: dict[str, Path]) -> None:
    path = model_file(name, model_path, tiny_files)
    options = LlamaCppLaunch(cache_type_k=cache_type, cache_type_v=cache_type)
    init_llama_backend()
    model = lc.llama_model_load_from_file(str(path).encode(), lc.llama_model_default_params())
    try:
        assert kv_bytes_per_token(model, path, options) == expected
    finally:
        lc.llama_model_free(model)


@pytest.mark.parametrize(
    ("name", "asked", "parallel", "num_ctx"),
    [
        ("smollm2", AUTO_CONTEXT, 4, 8192),  # auto on a small model: what it was trained for
        ("smollm2", 2048, 4, 2048),
        ("smollm2", 32768, 1, 8192),  # above the trained 8192: capped (the load's log line says so)
        ("long", AUTO_CONTEXT, 4, LONG_TRAINED),  # a tiny KV trained for 64k: a 30k-token prompt fits
        ("long", 32768, 8, 32768),
    ],
)
def test_a_load_gets_the_context_the_rule_gives(name: str, asked: int, parallel: int, num_ctx: int,
                                                model_path: Path, tiny_files: dict[str, Path]) -> None:
    path = model_file(name, model_path, tiny_files)
    backend = LlamaCppBackend(path, LoadOptions(num_ctx=asked, num_parallel=parallel, num_batch=64, num_threads=1))
    try:
        trained = lc.llama_model_n_ctx_train(backend._model)
        assert (backend.info.num_ctx, backend.info.num_ctx_train) == (num_ctx, trained)
    finally:
        backend.close()


def test_a_machine_without_a_gpu_has_no_gpu_memory() -> None:
    init_llama_backend()
    if lc.llama_supports_gpu_offload():
        pytest.skip("this llama.cpp build has a GPU backend")
    assert gpu_free_memory() is None
