"""lmserve: serve open-weight chat models over OpenAI-compatible and native HTTP routes.

`from lmserve import LLM` gives the offline engine (lmserve/offline.py): the same service in a Python object,
without HTTP. It is imported on first use, so `import lmserve` loads no web framework and no engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmserve.offline import LLM, ChatOutput, CompletionOutput

__version__ = "0.1.0"
__all__ = ["LLM", "ChatOutput", "CompletionOutput", "__version__"]

_OFFLINE = frozenset({"LLM", "ChatOutput", "CompletionOutput"})


def __getattr__(name: str) -> Any:
    """The offline engine's names, imported when first asked for."""
    if name in _OFFLINE:
        from lmserve import offline

        return getattr(offline, name)
    raise AttributeError(f"module 'lmserve' has no attribute {name!r}")
