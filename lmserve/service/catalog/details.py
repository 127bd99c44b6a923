"""The `details` of a GGUF model as `show` and `list` print them: architecture, parameter count and file type."""

from __future__ import annotations

from typing import Any

from lmserve.store import repository

_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
               12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
               32: "BF16"}  # fmt: skip


def gguf_details(metadata: dict[str, Any], *, parent: str = "") -> dict[str, Any]:
    """`details` of a GGUF's metadata: its architecture, its parameter count as the local runner writes it (the
    values in its tensors, gguf_metadata's `general.parameter_count`; the `general.size_label` only without it, a
    label such as "4x3.3M" for experts) and its file type."""
    arch = str(metadata.get("general.architecture", ""))
    file_type = metadata.get("general.file_type")
    count = metadata.get("general.parameter_count")
    return {
        "parent_model": parent,
        "format": "gguf",
        "family": arch,
        "families": [arch] if arch else None,
        "parameter_size": repository.parameter_size(count) if isinstance(count, int) and count > 0
        else str(metadata.get("general.size_label", "")),
        "quantization_level": _FILE_TYPES.get(file_type, str(file_type or "")) if isinstance(file_type, int) else "",
    }
