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
