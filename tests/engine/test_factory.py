"""The engine factory: a model's format picks its engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmserve.engine.factory import EngineSettings, engine_kind, open_engine
from lmserve.errors import InvalidRequest
from lmserve.types import LoadOptions


def test_a_gguf_file_is_llama_cpp_and_a_safetensors_directory_is_vllm(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "config.json").write_text("{}")
    assert (engine_kind(gguf), engine_kind(repo)) == ("llamacpp", "vllm")


def test_a_safetensors_directory_is_refused_with_the_engine_it_needs(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(InvalidRequest, match="vLLM engine"):
        open_engine(tmp_path, LoadOptions(), EngineSettings())
