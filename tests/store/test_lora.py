"""LoRA adapter files checked against their base before any engine reads them (lmserve/store/lora.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmserve.errors import InvalidRequest
from lmserve.store.lora import adapters_identity, check_lora
from lmserve.types import Adapter
from tests.tiny_gguf import write_tiny_llama
from tests.tiny_lora import tiny_llama_shapes, write_tiny_lora


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("base") / "base.gguf")


def test_a_lora_for_the_base_passes_with_its_rank_and_alpha(base: Path, tmp_path: Path) -> None:
    facts = check_lora(write_tiny_lora(tmp_path / "a.gguf", base, rank=4, alpha=8.0), base)
    assert (facts.rank, facts.alpha) == (4, 8.0)
    assert facts.size == (tmp_path / "a.gguf").stat().st_size


def test_a_rank_over_the_limit_is_refused_naming_both(base: Path, tmp_path: Path) -> None:
    lora = write_tiny_lora(tmp_path / "a.gguf", base, rank=8)
    with pytest.raises(InvalidRequest, match=r"rank 8, over this server's limit of 4 \(--max-lora-rank\)"):
        check_lora(lora, base, max_rank=4)
    assert check_lora(lora, base, max_rank=8).rank == 8


@pytest.mark.parametrize(("make", "reason"), [
    (lambda base, path: write_tiny_lora(path, base, architecture="qwen2"), "is for a qwen2 model, not this llama"),
    (lambda base, path: write_tiny_lora(path, tiny_llama_shapes(n_vocab=999)), "does not fit this model: output"),
    (lambda base, path: write_tiny_llama(path), "is not a LoRA adapter"),
    (lambda base, path: path.write_bytes(Path(write_tiny_lora(path, base)).read_bytes()[:700]) and path,
     "not a valid GGUF file"),
    (lambda base, path: path.write_bytes(b"GGUF not really") and path, "not a valid GGUF file"),
])
def test_a_wrong_or_corrupt_file_is_a_400_naming_it(base: Path, tmp_path: Path, make, reason: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "bad.gguf"
    make(base, path)
    with pytest.raises(InvalidRequest, match=reason) as caught:
        check_lora(path, base)
    assert "bad.gguf" in caught.value.message and caught.value.param == "lora"


def test_a_peft_directory_and_a_missing_file_are_named(base: Path, tmp_path: Path) -> None:
    (tmp_path / "peft").mkdir()
    (tmp_path / "peft" / "adapter_config.json").write_text("{}")
    with pytest.raises(InvalidRequest, match="peft is a PEFT adapter directory: this engine takes LoRA adapters as "
                                             "GGUF files"):
        check_lora(tmp_path / "peft", base)
    with pytest.raises(InvalidRequest, match="LoRA adapter not found"):
        check_lora(tmp_path / "none.gguf", base)


def test_a_changed_file_is_checked_again(base: Path, tmp_path: Path) -> None:
    path = write_tiny_lora(tmp_path / "a.gguf", base)
    check_lora(path, base)
    path.write_bytes(b"GGUF changed")
    with pytest.raises(InvalidRequest):
        check_lora(path, base)


def test_the_identity_of_a_set_follows_its_files_and_scales(base: Path, tmp_path: Path) -> None:
    path = write_tiny_lora(tmp_path / "a.gguf", base)
    one = adapters_identity((Adapter(str(path)),))
    assert one == adapters_identity((Adapter(str(path)),))
    assert one != adapters_identity((Adapter(str(path), 0.5),))
    write_tiny_lora(path, base, seed=2, rank=5)  # another file at the same path: states saved under the old one
    assert one != adapters_identity((Adapter(str(path)),))


# ---- PEFT directories over a safetensors repository (vLLM, MLX) ------------------------------------------------------

HIDDEN, KV = 16, 8
"""A repository with one layer's q_proj (16 -> 16) and v_proj (16 -> 8)."""


def write_repository(folder: Path) -> Path:
    import numpy as np
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    save_file({"model.layers.0.self_attn.q_proj.weight": np.zeros((HIDDEN, HIDDEN), np.float32),
               "model.layers.0.self_attn.v_proj.weight": np.zeros((KV, HIDDEN), np.float32)},
              str(folder / "model.safetensors"))
    return folder


def write_peft(folder: Path, *, rank: int = 4, out: int = KV, config: str | None = None) -> Path:
    """A PEFT directory changing q_proj and v_proj (v_proj's lora_B `out` rows: another model's when not KV)."""
    import numpy as np
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(config or f'{{"peft_type": "LORA", "r": {rank}, "lora_alpha": 8}}')
    prefix = "base_model.model.model.layers.0.self_attn"
    save_file({f"{prefix}.q_proj.lora_A.weight": np.ones((rank, HIDDEN), np.float32),
               f"{prefix}.q_proj.lora_B.weight": np.ones((HIDDEN, rank), np.float32),
               f"{prefix}.v_proj.lora_A.weight": np.ones((rank, HIDDEN), np.float32),
               f"{prefix}.v_proj.lora_B.weight": np.ones((out, rank), np.float32)},
              str(folder / "adapter_model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_repository(tmp_path_factory.mktemp("repo") / "repo")


def test_a_peft_directory_for_the_repository_passes_with_its_rank_and_alpha(repository: Path,
                                                                             tmp_path: Path) -> None:
    facts = check_lora(write_peft(tmp_path / "peft", rank=4), repository)
    assert (facts.rank, facts.alpha) == (4, 8.0)
    with pytest.raises(InvalidRequest, match=r"rank 4, over this server's limit of 2"):
        check_lora(tmp_path / "peft", repository, max_rank=2)


@pytest.mark.parametrize(("make", "reason"), [
    (lambda path: write_peft(path, out=KV * 2), "does not fit this model: model.layers.0.self_attn.v_proj"),
    (lambda path: write_peft(path, config='{"peft_type": "IA3", "r": 4}'), "is a IA3 adapter, not a LoRA"),
    (lambda path: write_peft(path, config="[1, 2"), "adapter_config.json is not a JSON object"),
    (lambda path: write_peft(path, config='{"r": 16}'), "says rank 16, its weights 4"),
    (lambda path: (write_peft(path) / "adapter_model.safetensors").write_bytes(b"\xff" * 12) and path,
     "adapter_model.safetensors is missing or unreadable"),
    (lambda path: path.mkdir() or path, "bad is no PEFT adapter directory"),
])
def test_a_wrong_peft_directory_is_a_400_naming_it(repository: Path, tmp_path: Path, make,  # type: ignore[no-untyped-def]
                                                   reason: str) -> None:
    make(tmp_path / "bad")
    with pytest.raises(InvalidRequest, match=reason) as caught:
        check_lora(tmp_path / "bad", repository)
    assert "bad" in caught.value.message and caught.value.param == "lora"


def test_a_gguf_lora_over_a_repository_is_refused(base: Path, repository: Path, tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match=r"a\.gguf is no PEFT adapter directory"):
        check_lora(write_tiny_lora(tmp_path / "a.gguf", base), repository)
