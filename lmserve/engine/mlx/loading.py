"""Loading a repository with mlx-lm: its config.json (RoPE's base where transformers 5 moved it), the dtype it
computes in, a probe that it runs at all, and how `show` describes the weights."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmserve.engine.mlx import VISION_MISSING, vision_missing
from lmserve.engine.mlx.memory import Caches
from lmserve.errors import InvalidRequest


def load_model(mx: Any, path: Path, asked_dtype: str) -> tuple[Any, Any, dict[str, Any], Any]:
    """mlx-lm's model, tokenizer and config of the repository at `path`, the model in the dtype it computes in
    (`compute_dtype`; None: as loaded), and that dtype. InvalidRequest (param "model") when mlx-lm cannot build it."""
    from mlx_lm.utils import load

    try:
        model, tokenizer, config = load(str(path), return_config=True,
                                        model_config=rope_from_parameters(read_config(path)))
    except Exception as exc:  # mlx-lm raises what its model code raises on a config it cannot build
        why = f"MLX cannot load {path.name}: {type(exc).__name__}: {exc}"
        if vision_missing(read_config(path)):
            why += f" ({VISION_MISSING})"
        raise InvalidRequest(why, param="model") from None
    dtype = compute_dtype(mx, asked_dtype, config)
    if dtype is not None:
        model.set_dtype(dtype)
        mx.eval(model.parameters())  # here: arrays left lazy would be computed on this thread's stream
    return model, tokenizer, config, dtype


def probe_model(mx: Any, model: Any, make_cache: Callable[[Any], Caches], name: str, config: dict[str, Any]) -> None:
    """Decode two tokens, one after the other, so a model mlx-lm builds but cannot run (e.g. its LFM2 without
    convolution layers; a mixture of experts in half precision on MLX's CPU build) is refused at load, naming why,
    instead of failing every request."""
    try:
        caches = make_cache(model)
        mx.eval(model(mx.array([[0]], dtype=mx.int32), cache=caches))
        mx.eval(model(mx.array([[0]], dtype=mx.int32), cache=caches))
    except Exception as exc:
        kind = config.get("model_type", "?")
        raise InvalidRequest(f"MLX cannot run {name}: mlx-lm's {kind} model fails on its first tokens "
                             f"({type(exc).__name__}: {exc})", param="model") from None


def compute_dtype(mx: Any, asked: str, config: dict[str, Any]) -> Any:
    """The dtype to compute in: asked, or on a CPU float32 (MLX converts half precision there); None: as loaded."""
    if asked == "auto":
        return mx.float32 if mx.default_device() == mx.cpu else None
    return getattr(mx, asked)


def dtype_name(model: Any) -> str:
    from mlx.utils import tree_flatten

    for name, value in tree_flatten(model.parameters()):
        if name.endswith("weight") and "norm" not in name:
            return str(value.dtype).removeprefix("mlx.core.")
    return ""


def stored_as(config: dict[str, Any]) -> str:
    """How the repository stores its weights, as `show` reports a quantization level: MLX's packed bits (Q4, Q8)
    or the dtype of config.json."""
    quantization = config.get("quantization") or config.get("quantization_config") or {}
    if isinstance(quantization, dict) and quantization.get("bits"):
        return f"Q{quantization['bits']}"
    return str(config.get("torch_dtype") or config.get("dtype") or "").upper() or "unknown"


def device_name(mx: Any) -> str:
    return "GPU" if mx.default_device() == mx.gpu else "CPU"


def num_params(model: Any) -> int:
    from mlx.utils import tree_flatten

    return int(sum(value.size for _, value in tree_flatten(model.parameters())))


def rope_from_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """The top-level `rope_theta` (and `rope_scaling`) mlx-lm's models read, where config.json has them only in
    `rope_parameters` (as transformers 5 writes it): without them mlx-lm took RoPE's default base of 10,000, and a
    SmolLM2 saved so (base 100,000) scored its prompts up to 5 nats away from transformers (bench/eval.py)."""
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_theta" in config or "rope_theta" not in rope:
        return {}
    out: dict[str, Any] = {"rope_theta": rope["rope_theta"]}
    if rope.get("rope_type", "default") != "default" and "rope_scaling" not in config:
        out["rope_scaling"] = {key: value for key, value in rope.items() if key != "rope_theta"}
    return out


def read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}
