"""A slot's MLX caches as bytes, and back: what the prompt cache keeps in RAM and on disk, and how slots are copied.

The layout is a JSON header (one entry per layer: its cache's kind, offset and arrays' dtypes and shapes) and the
arrays' raw bytes after it, in order. Attention caches (mlx-lm's KVCache) keep their first `offset` positions;
convolution and recurrent states (ArraysCache) are kept whole. A model with other caches (sliding windows, lists
of caches) saves nothing (`write_caches` gives None), so its prompts are computed again instead.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np

Caches = list[Any]
_HALF = {"bfloat16": np.uint16}
"""MLX dtypes numpy has not: their bits travel as unsigned integers of the same size."""


def write_caches(caches: Caches) -> bytes | None:
    """The caches as bytes; None when a cache is of a kind this module does not know."""
    layers: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for cache in caches:
        kind = type(cache).__name__
        if kind == "KVCache":
            arrays = [] if cache.keys is None else [cache.keys[..., : cache.offset, :],
                                                   cache.values[..., : cache.offset, :]]
            offset = int(cache.offset)
        elif kind == "ArraysCache":
            arrays, offset = list(cache.cache), 0
        else:
            return None
        entries: list[dict[str, Any] | None] = []
        for array in arrays:
            if array is None:
                entries.append(None)
                continue
            data, name = _to_numpy(array)
            entries.append({"dtype": name, "shape": list(data.shape)})
            blobs.append(data.tobytes())
        layers.append({"kind": kind, "offset": offset, "arrays": entries})
    header = json.dumps(layers).encode()
    return b"".join([len(header).to_bytes(8, "little"), header, *blobs])


def read_caches(state: bytes | bytearray | memoryview | Any, make: Callable[[], Caches]) -> Caches | None:
    """Fresh caches (from `make`) holding a state `write_caches` wrote; None when it does not fit this model."""
    import mlx.core as mx

    view = memoryview(state)
    size = int.from_bytes(view[:8], "little")
    try:
        layers = json.loads(bytes(view[8 : 8 + size]))
    except ValueError:
        return None
    caches = make()
    if not isinstance(layers, list) or len(layers) != len(caches):
        return None
    place = 8 + size
    for cache, layer in zip(caches, layers, strict=True):
        if type(cache).__name__ != layer["kind"]:
            return None
        arrays: list[Any] = []
        for entry in layer["arrays"]:
            if entry is None:
                arrays.append(None)
                continue
            numpy_type = _HALF.get(entry["dtype"], np.dtype(entry["dtype"]))
            count = int(np.prod(entry["shape"])) * np.dtype(numpy_type).itemsize
            data = np.frombuffer(view[place : place + count], dtype=numpy_type).reshape(entry["shape"])
            place += count
            array = mx.array(data)
            arrays.append(array.view(getattr(mx, entry["dtype"])) if entry["dtype"] in _HALF else array)
        mx.eval([array for array in arrays if array is not None])
        if layer["kind"] == "KVCache":
            if arrays:
                cache.keys, cache.values = arrays
            cache.offset = int(layer["offset"])
        else:
            cache.cache = arrays
    return caches


def copy_caches(caches: Caches, make: Callable[[], Caches]) -> Caches | None:
    """Fresh caches (from `make`) holding copies of these (a fork, a shared prefix, the state before a draft), array
    to array in MLX; None when a cache is of a kind this module does not know (as `write_caches`)."""
    import mlx.core as mx

    copies = make()
    for cache, copy in zip(caches, copies, strict=True):
        kind = type(cache).__name__
        if kind != type(copy).__name__ or kind not in ("KVCache", "ArraysCache"):
            return None
        if kind == "KVCache":
            if cache.keys is not None:
                copy.keys = mx.array(cache.keys[..., : cache.offset, :])
                copy.values = mx.array(cache.values[..., : cache.offset, :])
            copy.offset = cache.offset
        else:
            copy.cache = [None if array is None else mx.array(array) for array in cache.cache]
    mx.eval([array for copy in copies for array in _held(copy)])
    return copies


def _held(cache: Any) -> list[Any]:
    arrays = [cache.keys, cache.values] if type(cache).__name__ == "KVCache" else list(cache.cache)
    return [array for array in arrays if array is not None]


def cut_caches(caches: Caches, length: int) -> bool:
    """Keep the first `length` positions; False when the caches hold fewer, or cannot be cut there (a state that
    is not attention can be kept whole only, when it holds exactly `length`)."""
    sizes = [int(cache.size()) for cache in caches if cache.is_trimmable()]
    held = max(sizes) if sizes else -1
    if held < length:
        return False
    if all(cache.is_trimmable() for cache in caches):
        for cache in caches:
            cache.trim(int(cache.size()) - length)
        return True
    return held == length


def _to_numpy(array: Any) -> tuple[np.ndarray, str]:
    import mlx.core as mx

    name = str(array.dtype).removeprefix("mlx.core.")
    if name in _HALF:
        return np.array(array.view(mx.uint16)), name
    return np.array(array), name
