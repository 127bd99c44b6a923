"""The test repositories of tests/hf_repos.py are what they claim: transformers loads each LFM2 member with every
tensor matched (none missing, unexpected or of another size), config.json describes the weights (lmserve's own
check, engine/vllm/weights_check.py, agrees), and each text member's GGUF, converted by llama.cpp's converter, has the
architecture and FFN width of its repository."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import pytest

from lmserve.engine.vllm.weights_check import check_weights, lfm2_ffn_width
from tests.hf_repos import (
    ConverterMissing,
    lfm2_gguf,
    tiny_lfm2_attention_repo,
    tiny_lfm2_moe_repo,
    tiny_lfm2_repo,
    tiny_lfm2_vl_repo,
)

MEMBERS: dict[str, tuple[Callable[[], Path], str]] = {
    "lfm2": (tiny_lfm2_repo, "lfm2"), "lfm2-attention": (tiny_lfm2_attention_repo, "lfm2"),
    "lfm2moe": (tiny_lfm2_moe_repo, "lfm2moe"), "lfm2-vl": (tiny_lfm2_vl_repo, "lfm2"),
}
"""Each member's repository and the architecture its GGUF (the text model) must have."""


@pytest.mark.parametrize("member", list(MEMBERS))
def test_transformers_loads_every_tensor_of_each_member_at_its_size(member: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    repo = MEMBERS[member][0]()
    config = json.loads((repo / "config.json").read_text())
    loader = AutoModelForImageTextToText if "vision_config" in config else AutoModelForCausalLM
    model, info = loader.from_pretrained(repo, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    text = config.get("text_config") or config
    assert model.config.get_text_config().intermediate_size == text["intermediate_size"] == 128
    check_weights(repo, config)


@pytest.mark.parametrize("member", [m for m in MEMBERS if m != "lfm2moe"])
def test_each_dense_members_ffn_is_as_wide_as_its_config_says(member: str) -> None:
    repo = MEMBERS[member][0]()
    config = json.loads((repo / "config.json").read_text())
    assert lfm2_ffn_width(config.get("text_config") or config) == 128  # no rounding up to 256 (the old recipe's)


@pytest.mark.parametrize("member", list(MEMBERS))
def test_each_members_gguf_is_its_text_model(member: str) -> None:
    make, architecture = MEMBERS[member]
    repo = make()
    try:
        path = lfm2_gguf(repo)
    except ConverterMissing as exc:
        pytest.skip(str(exc))
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.architecture"].contents() == architecture
    shapes = {tensor.name: [int(n) for n in tensor.shape] for tensor in reader.tensors}
    assert shapes["blk.0.ffn_gate.weight"] == [64, 128]  # GGUF lists dimensions innermost first
    assert {tensor.tensor_type for tensor in reader.tensors} == {gguf.GGMLQuantizationType.F32}
    assert not any(name.startswith(("v.", "mm.")) for name in shapes)  # a vision member's projector is apart


def test_the_vision_members_projector_converts_on_its_own() -> None:
    try:
        path = lfm2_gguf(tiny_lfm2_vl_repo(), projector=True)
    except ConverterMissing as exc:
        pytest.skip(str(exc))
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.architecture"].contents() == "clip"
    names = {tensor.name for tensor in reader.tensors}
    assert any(name.startswith("v.blk.2.") for name in names) and any(name.startswith("mm.") for name in names)
