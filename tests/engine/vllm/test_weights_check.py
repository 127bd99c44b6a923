"""A repository whose config.json contradicts its weights is refused before vLLM sees it (engine/vllm/weights_check.py):
the message names the tensor and both sizes. Repositories here are a config.json and a safetensors file of small
zero tensors, written without transformers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from lmserve.engine.vllm.weights_check import check_weights, lfm2_ffn_width, safetensors_shapes
from lmserve.errors import InvalidRequest

LFM2 = {"model_type": "lfm2", "hidden_size": 8, "intermediate_size": 16, "block_ff_dim": 16,
        "block_auto_adjust_ff_dim": False, "block_multiple_of": 32, "block_ffn_dim_multiplier": 1.0}
"""An LFM2 text config whose FFN is 16 wide (no rounding)."""


def lfm2_weights(width: int, prefix: str = "model.") -> dict[str, np.ndarray]:
    """Two layers of an LFM2 FFN `width` wide (hidden 8)."""
    weights = {f"{prefix}embed_tokens.weight": np.zeros((32, 8), np.float32)}
    for layer in range(2):
        base = f"{prefix}layers.{layer}.feed_forward."
        weights |= {base + "w1.weight": np.zeros((width, 8), np.float32),
                    base + "w3.weight": np.zeros((width, 8), np.float32),
                    base + "w2.weight": np.zeros((8, width), np.float32)}
    return weights


def repository(folder: Path, config: dict[str, object], weights: dict[str, np.ndarray]) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(weights, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize(("config", "width"), [
    (LFM2, 16),
    ({**LFM2, "block_auto_adjust_ff_dim": True}, 32),  # 2/3 of 16 = 10, rounded up to 32
    ({**LFM2, "block_auto_adjust_ff_dim": True, "block_multiple_of": 4, "block_ffn_dim_multiplier": 1.5}, 16),
    ({"model_type": "lfm2", "intermediate_size": 12288}, 8192),  # transformers' defaults: 2/3, multiple of 256
])
def test_the_lfm2_ffn_width_follows_the_config_as_every_runtime_derives_it(config: dict[str, object],
                                                                           width: int) -> None:
    assert lfm2_ffn_width(config) == width


def test_a_consistent_lfm2_repository_passes(tmp_path: Path) -> None:
    repo = repository(tmp_path / "ok", LFM2, lfm2_weights(16))
    check_weights(repo, LFM2)
    assert safetensors_shapes(repo / "model.safetensors")["model.layers.1.feed_forward.w2.weight"] == [8, 16]


def test_an_lfm2_whose_config_says_a_narrower_ffn_than_its_weights_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    # The fixture bug of issue 17: weights saved with transformers' rounding (wider), config.json saying less.
    repo = repository(tmp_path / "wide", LFM2, lfm2_weights(32))
    with pytest.raises(InvalidRequest, match=r"wide's config.json does not describe its weights: it means a width of "
                                             r"16 \(block_ff_dim 16, .*\) but model.layers.0.feed_forward.w1.weight "
                                             r"in model.safetensors has 32 along dimension 0") as caught:
        check_weights(repo, LFM2)
    assert caught.value.param == "model"
    down_only = lfm2_weights(16) | {"model.layers.1.feed_forward.w2.weight": np.zeros((8, 32), np.float32)}
    with pytest.raises(InvalidRequest, match=r"model.layers.1.feed_forward.w2.weight in model.safetensors has 32 "
                                             r"along dimension 1 \(shape \[8, 32\]\)"):
        check_weights(repository(tmp_path / "down", LFM2, down_only), LFM2)


def test_the_vision_models_text_config_is_checked_too(tmp_path: Path) -> None:
    config = {"model_type": "lfm2_vl", "text_config": LFM2}
    repo = repository(tmp_path / "vl", config, lfm2_weights(16, prefix="model.language_model."))
    check_weights(repo, config)
    broken = repository(tmp_path / "vl-broken", config, lfm2_weights(24, prefix="model.language_model."))
    with pytest.raises(InvalidRequest, match=r"model.language_model.layers.0.feed_forward.w1.weight .* has 24"):
        check_weights(broken, config)


MOE = {"model_type": "lfm2_moe", "hidden_size": 8, "intermediate_size": 16, "moe_intermediate_size": 4,
       "num_dense_layers": 1, "num_experts": 2}


def moe_weights(dense: int, expert: int) -> dict[str, np.ndarray]:
    weights = {"model.layers.0.feed_forward.w1.weight": np.zeros((dense, 8), np.float32),
               "model.layers.0.feed_forward.w2.weight": np.zeros((8, dense), np.float32)}
    for e in range(2):
        weights |= {f"model.layers.1.feed_forward.experts.{e}.w1.weight": np.zeros((expert, 8), np.float32),
                    f"model.layers.1.feed_forward.experts.{e}.w2.weight": np.zeros((8, expert), np.float32)}
    return weights


def test_an_moe_is_checked_for_its_dense_layers_and_its_experts(tmp_path: Path) -> None:
    check_weights(repository(tmp_path / "ok", MOE, moe_weights(16, 4)), MOE)
    with pytest.raises(InvalidRequest, match=r"a width of 4 \(moe_intermediate_size 4\) but "
                                             r"model.layers.1.feed_forward.experts.0.w1.weight .* has 6 along "
                                             r"dimension 0"):
        check_weights(repository(tmp_path / "experts", MOE, moe_weights(16, 6)), MOE)
    with pytest.raises(InvalidRequest, match=r"a width of 16 \(intermediate_size 16\) but "
                                             r"model.layers.0.feed_forward.w1.weight"):
        check_weights(repository(tmp_path / "dense", MOE, moe_weights(8, 4)), MOE)


def test_other_model_types_and_unreadable_headers_are_left_to_vllm(tmp_path: Path) -> None:
    llama = {"model_type": "llama", "intermediate_size": 16}
    check_weights(repository(tmp_path / "llama", llama, lfm2_weights(32)), llama)
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "model.safetensors").write_bytes(b"\xff" * 16)
    check_weights(garbage, LFM2)
    assert safetensors_shapes(garbage / "model.safetensors") == {}
