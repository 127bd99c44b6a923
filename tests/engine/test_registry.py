"""The engine table: each engine claims the models of its kind, `--engine` must name one that does, and the rest
of lmserve reaches engines only through their specs (factory.py)."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from lmserve.engine import mlx as mlx_package
from lmserve.engine import registry
from lmserve.engine.factory import EngineSettings, engine_of, open_engine
from lmserve.engine.llamacpp.options import LlamaCppLaunch
from lmserve.engine.mlx.options import MlxLaunch
from lmserve.engine.spec import EngineSpec
from lmserve.engine.vllm import args as vllm_args
from lmserve.engine.vllm.options import VllmLaunch
from lmserve.errors import InvalidRequest
from lmserve.types import LoadOptions


def files(tmp_path: Path) -> tuple[Path, Path]:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "config.json").write_text("{}")
    return gguf, repo


def test_a_gguf_file_is_llama_cpp_and_a_safetensors_directory_is_vllm(tmp_path: Path) -> None:
    gguf, repo = files(tmp_path)
    assert (engine_of(gguf).name, engine_of(repo).name) == ("llamacpp", "vllm")
    assert (engine_of(gguf).label, engine_of(repo).label) == ("llama.cpp", "vLLM")


@pytest.mark.parametrize(("engine", "is_repo", "message"), [
    ("llamacpp", True, "--engine llamacpp cannot serve repo: llama.cpp serves GGUF files; repo is one of the "
                       "safetensors repositories"),
    ("vllm", False, "--engine vllm cannot serve model.gguf: vLLM serves safetensors repositories .*; model.gguf is "
                    "one of the GGUF files that llama.cpp serves"),
])
def test_an_engine_named_for_weights_it_cannot_read_is_a_400(tmp_path: Path, engine: str, is_repo: bool,
                                                              message: str) -> None:
    gguf, repo = files(tmp_path)
    with pytest.raises(InvalidRequest, match=message) as raised:
        open_engine(repo if is_repo else gguf, LoadOptions(), EngineSettings(engine=engine))
    assert raised.value.param == "model"


def test_auto_passes_over_an_engine_this_machine_cannot_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two engines claiming the same models (as MLX and vLLM will for repositories): auto takes the first that has
    what it needs here, and the first claimant when none has (its load then says what is missing)."""
    _, repo = files(tmp_path)
    vllm = registry.engine_named("vllm")
    absent = EngineSpec(name="absent", label="Absent", serves="repositories", launch=VllmLaunch,
                        claims=vllm.claims, open=vllm.open, estimate=vllm.estimate, missing=lambda: "not here")
    monkeypatch.setattr(registry, "ENGINES", (registry.ENGINES[0], absent, vllm))
    assert engine_of(repo).name == "vllm"
    monkeypatch.setattr(registry, "ENGINES", (registry.ENGINES[0], absent))
    assert engine_of(repo).name == "absent"


def test_a_repository_goes_to_mlx_on_apple_silicon_and_to_vllm_elsewhere(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MLX comes before vLLM in the table: auto gives it repositories where it has Apple's GPU; elsewhere it says
    what it lacks, so vLLM gets them, unless vLLM is not installed either (then the first claimant, MLX's CPU
    build)."""
    _, repo = files(tmp_path)
    mlx = registry.engine_named("mlx")
    assert mlx.claims(repo)
    monkeypatch.setattr(mlx_package, "on_apple_silicon", lambda: False)
    assert engine_of(repo).name == "vllm"
    assert "Apple silicon's GPU" in (mlx.missing() or "")
    monkeypatch.setattr(mlx_package, "on_apple_silicon", lambda: True)
    assert engine_of(repo).name == "mlx"
    monkeypatch.setattr(mlx_package, "on_apple_silicon", lambda: False)
    vllm = registry.engine_named("vllm")
    no_vllm = EngineSpec(name="vllm", label="vLLM", serves=vllm.serves, launch=VllmLaunch, claims=vllm.claims,
                         open=vllm.open, estimate=vllm.estimate, missing=lambda: "vLLM is not installed")
    monkeypatch.setattr(registry, "ENGINES", (*registry.ENGINES[:2], no_vllm))
    assert engine_of(repo).name == "mlx"
    assert MlxLaunch in {spec.launch for spec in registry.ENGINES}


def test_every_engine_declares_its_options_and_capabilities() -> None:
    names = [spec.name for spec in registry.ENGINES]
    assert names == ["llamacpp", "mlx", "vllm"] and len(set(names)) == len(names)
    assert {f.name for f in fields(LlamaCppLaunch)} >= {"cache_type_k", "kv_unified", "model_draft", "mmproj"}
    assert {f.name for f in fields(VllmLaunch)} >= {"dtype", "tensor_parallel_size", "headless"}
    assert registry.engine_named("llamacpp").takes == {"adapters", "projector", "quantize"}
    assert registry.engine_named("vllm").takes == registry.engine_named("mlx").takes == {"adapters"}  # PEFT LoRAs
    assert all(spec.adapters_per_request for spec in registry.ENGINES)  # every engine runs adapters per request
    assert registry.engine_named("mlx").in_process
    assert registry.engine_named("vllm").serve_headless is not None
    assert registry.engine_named("llamacpp").serve_headless is None


def test_kv_offloading_on_vllms_cpu_build_is_refused_at_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_args, "is_cpu_build", lambda: True)  # as on this machine, without importing vLLM
    (tmp_path / "config.json").write_text("{}")
    settings = EngineSettings(launch=(VllmLaunch(kv_offloading_size=2.0),))
    with pytest.raises(InvalidRequest, match="--kv-offloading-size moves vLLM's KV cache from GPU memory to CPU RAM"):
        open_engine(tmp_path, LoadOptions(), settings)
