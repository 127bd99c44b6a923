"""The MLX engine reads RoPE's settings where transformers 5 writes them (`rope_parameters`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lmserve.engine.mlx.loading import rope_from_parameters


@pytest.mark.parametrize(("config", "given"), [
    ({"rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}, {"rope_theta": 100000.0}),
    ({"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}},
     {"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}),
    ({"rope_theta": 10000.0, "rope_parameters": {"rope_theta": 1.0}}, {}),  # the config's own top level wins
    ({"rope_theta": 10000.0}, {}),
    ({}, {}),
])  # fmt: skip
def test_rope_parameters_become_the_top_level_fields_mlx_lm_reads(config: dict[str, Any],
                                                                    given: dict[str, Any]) -> None:
    assert rope_from_parameters(config) == given


def test_saved_states_are_keyed_by_the_config_lmserve_reads(tmp_path: Path) -> None:
    """A prompt cache state computed by a model built from another config (RoPE's base read otherwise) is never
    restored: it would give other replies."""
    from lmserve.engine.mlx import prompt_cache_key
    from lmserve.engine.mlx.options import MlxLaunch

    (tmp_path / "model.safetensors").write_bytes(b"")
    keys = set()
    for config in ({"rope_theta": 100000.0}, {"rope_parameters": {"rope_theta": 100000.0}},
                   {"rope_parameters": {"rope_theta": 10000.0}}):
        (tmp_path / "config.json").write_text(json.dumps(config))
        keys.add(prompt_cache_key(tmp_path, MlxLaunch(), 1024))
    assert len(keys) == 3
