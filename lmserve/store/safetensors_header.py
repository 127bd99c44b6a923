"""The tensor shapes a safetensors file declares, read from its header alone (8-byte little-endian length, then a
JSON object of tensor dtypes and shapes): checked before an engine loads the file."""

from __future__ import annotations

import json
import struct
from pathlib import Path

MAX_HEADER = 100 * 2**20
"""A safetensors header longer than this is not believed (real ones are well under a megabyte per shard)."""


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Each tensor's shape in one safetensors file; {} when the header is unreadable."""
    try:
        with path.open("rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            if length > MAX_HEADER:
                return {}
            header = json.loads(file.read(length))
    except (OSError, ValueError, struct.error, RecursionError):
        return {}
    if not isinstance(header, dict):
        return {}
    shapes: dict[str, list[int]] = {}
    for name, tensor in header.items():
        shape = tensor.get("shape") if isinstance(tensor, dict) and name != "__metadata__" else None
        if isinstance(shape, list) and all(isinstance(n, int) for n in shape):
            shapes[name] = shape
    return shapes
