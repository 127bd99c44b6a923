"""The engine factory: a model's format picks its engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmserve.engine.factory import EngineSettings, engine_kind, open_engine
from lmserve.engine.vllm import engine as vllm_engine
from lmserve.engine.vllm.engine import VllmOptions
from lmserve.errors import InvalidRequest
from lmserve.types import LoadOptions


def test_a_gguf_file_is_llama_cpp_and_a_safetensors_directory_is_vllm(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "config.json").write_text("{}")
    assert (engine_kind(gguf), engine_kind(repo)) == ("llamacpp", "vllm")


@pytest.mark.parametrize(("engine", "is_repo", "message"), [
    ("llamacpp", True, "llama.cpp reads GGUF files, not safetensors repositories"),
    ("vllm", False, "the vLLM engine serves safetensors repositories, not GGUF files"),
])
def test_an_engine_named_for_weights_it_cannot_read_is_a_400(tmp_path: Path, engine: str, is_repo: bool,
                                                              message: str) -> None:
    (tmp_path / "config.json").write_text("{}")
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(InvalidRequest, match=message):
        open_engine(tmp_path if is_repo else gguf, LoadOptions(), EngineSettings(engine=engine))


def test_kv_offloading_on_vllms_cpu_build_is_refused_at_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_engine, "is_cpu_build", lambda: True)  # as on this machine, without importing vLLM
    (tmp_path / "config.json").write_text("{}")
    settings = EngineSettings(vllm=VllmOptions(kv_offloading_size=2.0))
    with pytest.raises(InvalidRequest, match="--kv-offloading-size moves vLLM's KV cache from GPU memory to CPU RAM"):
        open_engine(tmp_path, LoadOptions(), settings)
