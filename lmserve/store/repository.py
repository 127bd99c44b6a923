"""A Hugging Face model repository (config.json + *.safetensors + tokenizer files): which of its files lmserve
keeps, and the facts `show` and `list` tell about it. Pure reads of a directory: no torch, no transformers.

Kept: top-level `*.json`, `*.safetensors`, `*.jinja`, `*.txt` and `*.tiktoken` files and `tokenizer.model`;
everything else (README, .gitattributes, images, `*.bin`/`*.pt`/`*.onnx`/`*.gguf` weights, remote code, folders
such as `original/`) is left out. Mistral's `consolidated*.safetensors` is left out when the repository also has
the transformers-format weights (they hold the same tensors).

The parameter count comes from the safetensors headers (8-byte little-endian length, then a JSON object of tensor
dtypes and shapes), so no weights are read.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lmserve.errors import InvalidRequest

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
CHAT_TEMPLATE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
FORMAT = "safetensors"

_KEPT_SUFFIXES = (".json", ".safetensors", ".jinja", ".txt", ".tiktoken")
_KEPT_NAMES = frozenset({"tokenizer.model"})
_MAX_HEADER = 100 * 2**20
"""A safetensors header longer than this is not believed (real ones are well under a megabyte per shard)."""
_MAX_JSON = 64 * 2**20
_DTYPES = {"bfloat16": "BF16", "float16": "F16", "half": "F16", "float32": "F32", "float": "F32",
           "float64": "F64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}  # fmt: skip


def is_repository(path: Path) -> bool:
    """True when `path` is a directory holding a config.json (a Hugging Face model repository)."""
    return path.is_dir() and (path / CONFIG).is_file()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tekken.json", "vocab.json", "vocab.txt")
"""A repository's tokenizer is one of these files (or a `*.tiktoken` file); `tokenizer_config.json` alone is not."""


def not_a_model(directory: Path, shown: str) -> str | None:
    """Why the directory `directory` (written `shown`) is not a model lmserve can serve, naming what it lacks: a
    config.json (and then whether it holds .gguf files instead), *.safetensors weights, or a tokenizer. None when it
    has all three."""
    names = sorted(entry.name for entry in _files(directory))
    if CONFIG not in names:
        ggufs = [name for name in names if name.lower().endswith(".gguf")]
        if ggufs:
            return (f"{shown} is not a model: it has no config.json (a Hugging Face repository's); serve one of its "
                    f"GGUF files: {', '.join(shown.rstrip('/') + '/' + name for name in ggufs[:3])}")
        return (f"{shown} is not a model: it has no config.json and no .gguf file (a Hugging Face repository holds "
                "config.json, *.safetensors weights and tokenizer files; a GGUF model is one .gguf file)")
    if not any(name.lower().endswith(".safetensors") for name in names):
        others = [name for name in names if name.lower().endswith((".bin", ".pt", ".pth"))]
        note = f" (not {', '.join(others[:3])}: lmserve reads safetensors weights only)" if others else ""
        return f"{shown} is not a model lmserve can serve: it has a config.json but no *.safetensors weights{note}"
    if not any(name in TOKENIZER_FILES or name.lower().endswith(".tiktoken") for name in names):
        return (f"{shown} is not a model lmserve can serve: it has config.json and weights but no tokenizer "
                f"({', '.join(TOKENIZER_FILES)} or a *.tiktoken file)")
    return None


def _files(directory: Path) -> list[Path]:
    try:
        return [entry for entry in directory.iterdir() if entry.is_file()]
    except OSError:
        return []


def check_relative_path(text: str) -> str:
    """Return `text` if it is a safe relative file path inside a repository (no `..`, not absolute, no
    backslashes or empty parts); else raise InvalidRequest. Repository file names are untrusted input."""
    parts = text.split("/")
    if not text or text.startswith("/") or "\\" in text or "\0" in text or any(p in ("", ".", "..") for p in parts):
        raise InvalidRequest(f"invalid file name in a repository: {text[:200]!r}", param="files")
    return text


def is_kept(filename: str) -> bool:
    """Whether lmserve stores this file of a repository (see the module docstring). Pure."""
    if "/" in filename or filename.startswith("."):
        return False
    name = filename.lower()
    return name in _KEPT_NAMES or name.endswith(_KEPT_SUFFIXES)


def repository_files(filenames: Iterable[str]) -> list[str]:
    """The files of a repository lmserve stores, config.json first, then by name. Pure.

    Raises InvalidRequest (param `model`, code `not_a_repository`) unless there is a config.json and at least one
    `*.safetensors` file.
    """
    kept = sorted({f for f in filenames if is_kept(f)}, key=lambda f: (f != CONFIG, f))
    weights = [f for f in kept if f.lower().endswith(".safetensors")]
    if CONFIG not in kept or not weights:
        raise InvalidRequest("not a model repository lmserve can serve: it needs a config.json and *.safetensors "
                             "weights", param="model", code="not_a_repository")
    if any(not w.lower().startswith("consolidated") for w in weights):
        kept = [f for f in kept if not f.lower().startswith("consolidated")]
    return kept


def local_files(directory: Path) -> dict[str, Path]:
    """The stored files of a repository directory: relative path → path (see `repository_files`)."""
    names = [entry.name for entry in directory.iterdir() if entry.is_file()]
    return {name: directory / name for name in repository_files(names)}


# ---- facts ----------------------------------------------------------------------------------------------------


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`; {} when the file is missing, too big, not JSON or not an object."""
    try:
        if path.stat().st_size > _MAX_JSON:
            return {}
        data = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def parameter_count(directory: Path) -> int:
    """The number of parameters in the repository's safetensors files, from their headers; 0 if none is readable."""
    return sum(safetensors_parameters(path) for path in sorted(directory.glob("*.safetensors")))


def safetensors_parameters(path: Path) -> int:
    """The number of values in one safetensors file, from its header alone; 0 when the header is unreadable."""
    try:
        with path.open("rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            if length > _MAX_HEADER:
                return 0
            header = json.loads(file.read(length))
    except (OSError, ValueError, struct.error, RecursionError):
        return 0
    if not isinstance(header, dict):
        return 0
    total = 0
    for key, tensor in header.items():
        shape = tensor.get("shape") if isinstance(tensor, dict) and key != "__metadata__" else None
        if isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape):
            total += math.prod(shape)
    return total


def parameter_size(num_params: int) -> str:
    """The count as the local runner writes it: "1.2B", "134.52M", "3.31M" (a whole number without decimals: "8B"),
    "1K" below a million, the number itself below a thousand; "" for 0."""
    if num_params >= 10**9:
        return _scaled(num_params / 10**9, 1) + "B"
    if num_params >= 10**6:
        return _scaled(num_params / 10**6, 2) + "M"
    if num_params >= 10**3:
        return f"{num_params / 10**3:.0f}K"
    return str(num_params) if num_params else ""


def _scaled(value: float, decimals: int) -> str:
    return f"{value:.0f}" if value == math.floor(value) else f"{value:.{decimals}f}"


def architecture(config: dict[str, Any]) -> str:
    """config.json's `model_type` ("llama", "lfm2"); "" when absent."""
    model_type = config.get("model_type")
    return model_type if isinstance(model_type, str) else ""


def quantization_level(config: dict[str, Any]) -> str:
    """The quantization method when the weights are quantized ("AWQ", "FP8"; MLX's packed layout by its bits,
    "Q4"), else the dtype ("BF16")."""
    packed = config.get("quantization")
    if isinstance(packed, dict) and isinstance(packed.get("bits"), int):
        return f"Q{packed['bits']}"
    quantization = config.get("quantization_config")
    if isinstance(quantization, dict) and isinstance(quantization.get("quant_method"), str):
        return str(quantization["quant_method"]).upper()
    dtype = config.get("dtype") or config.get("torch_dtype")
    if not isinstance(dtype, str):
        text_config = config.get("text_config")
        dtype = text_config.get("dtype") or text_config.get("torch_dtype") if isinstance(text_config, dict) else None
    if not isinstance(dtype, str):
        return ""
    name = dtype.removeprefix("torch.")
    return _DTYPES.get(name, name.upper())


def details(directory: Path, *, parent: str = "") -> dict[str, Any]:
    """`details` of `list` and `show`: format safetensors, family (model_type), parameter size, dtype."""
    config = read_json(directory / CONFIG)
    arch = architecture(config)
    return {
        "parent_model": parent,
        "format": FORMAT,
        "family": arch,
        "families": [arch] if arch else None,
        "parameter_size": parameter_size(parameter_count(directory)),
        "quantization_level": quantization_level(config),
    }


def model_info(directory: Path) -> dict[str, Any]:
    """`model_info` of `show`: config.json's keys under the architecture's name, as GGUF metadata names them
    (`llama.hidden_size`), with `general.architecture`, `general.parameter_count` and `<arch>.context_length`."""
    config = read_json(directory / CONFIG)
    arch = architecture(config) or "model"
    info: dict[str, Any] = {"general.architecture": arch, "general.format": FORMAT,
                            "general.parameter_count": parameter_count(directory)}
    info.update({f"{arch}.{key}": value for key, value in config.items()})
    text_config = config.get("text_config")  # a vision-language model's context is its text model's
    for source in (config, text_config if isinstance(text_config, dict) else {}):
        if isinstance(source.get("max_position_embeddings"), int):
            info[f"{arch}.context_length"] = source["max_position_embeddings"]
            break
    return info


def chat_template(directory: Path) -> str:
    """The repository's chat template: chat_template.jinja, else tokenizer_config.json's `chat_template` (a
    string, or the "default" of a list of {name, template}), else chat_template.json's; "" when none."""
    try:
        return (directory / CHAT_TEMPLATE).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        pass
    for source in (TOKENIZER_CONFIG, "chat_template.json"):
        template = _template_of(read_json(directory / source).get("chat_template"))
        if template:
            return template
    return ""


def _template_of(value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
        chosen = named.get("default", next(iter(named.values()), None))
        return chosen if isinstance(chosen, str) else ""
    return ""


def has_vision(config: dict[str, Any]) -> bool:
    """Whether the model sees images: its config.json has a `vision_config`."""
    return isinstance(config.get("vision_config"), dict)
