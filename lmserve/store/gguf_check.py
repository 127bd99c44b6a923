"""Structural validation of a GGUF file before llama.cpp opens it.

`check_gguf` walks the header (key/values and tensor infos) with every length checked against the file size
before it is used: nothing is allocated or read by a length taken from the file. It rejects what llama.cpp
would choke on or, for crafted files, what could make it read past the end: bad magic, unsupported versions,
absurd counts, truncated sections, unknown value or tensor types, and tensors whose data lies past the end of
the file or overlaps another tensor.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

import gguf

from lmserve.errors import InvalidRequest

SUPPORTED_VERSIONS = (2, 3)
MAX_KEY_LENGTH = 65_535
MAX_TENSOR_NAME = 64  # GGML_MAX_NAME, terminating NUL included
MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32

_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_UINT32 = 4
_MIN_KV = 8 + 4 + 1  # an empty key, the value type, the smallest value
_MIN_TENSOR_INFO = 8 + 4 + 8 + 4 + 8  # an empty name, n_dims, one dimension, the type, the offset
_QUANT_SIZES: dict[int, tuple[int, int]] = {int(k): v for k, v in gguf.GGML_QUANT_SIZES.items()}


class _Reader:
    """Reads from `f` with each length checked against the file size first."""

    def __init__(self, f: BinaryIO, size: int, name: str) -> None:
        self.f = f
        self.size = size
        self.name = name
        self.pos = 0

    def fail(self, reason: str) -> InvalidRequest:
        return InvalidRequest(f"{self.name} is not a valid GGUF file: {reason}", param="from")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"{what} runs past the end of the file (truncated or corrupt)")

    def read(self, n: int, what: str) -> bytes:
        self.need(n, what)
        data = self.f.read(n)
        if len(data) != n:
            raise self.fail(f"{what} runs past the end of the file (truncated or corrupt)")
        self.pos += n
        return data

    def skip(self, n: int, what: str) -> None:
        self.need(n, what)
        self.pos += n
        self.f.seek(self.pos)

    def u32(self, what: str) -> int:
        return int(struct.unpack("<I", self.read(4, what))[0])

    def u64(self, what: str) -> int:
        return int(struct.unpack("<Q", self.read(8, what))[0])

    def string(self, what: str, limit: int) -> bytes:
        length = self.u64(f"the length of {what}")
        if length > limit:
            raise self.fail(f"{what} is {length} bytes long (at most {limit})")
        return self.read(length, what)

    def skip_string(self, what: str) -> None:
        length = self.u64(f"the length of {what}")
        self.skip(length, what)


def check_gguf(path: Path) -> None:
    """Raise InvalidRequest (param "from") with the reason when `path` is not a well-formed GGUF file."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            _check(_Reader(f, size, path.name))
    except OSError as exc:
        raise InvalidRequest(f"cannot read {path.name}: {exc.strerror or exc}", param="from") from exc


def _check(r: _Reader) -> None:
    if r.size < 4 or r.read(4, "the magic") != b"GGUF":
        raise r.fail("bad magic (expected 'GGUF')")
    version = r.u32("the version")
    if version not in SUPPORTED_VERSIONS:
        raise r.fail(f"unsupported version {version} (supported: {', '.join(map(str, SUPPORTED_VERSIONS))})")
    tensor_count = r.u64("the tensor count")
    kv_count = r.u64("the key/value count")
    remaining = r.size - r.pos
    if kv_count > remaining // _MIN_KV:
        raise r.fail(f"kv_count {kv_count} is more than a file of {r.size} bytes can hold")
    if tensor_count > remaining // _MIN_TENSOR_INFO:
        raise r.fail(f"tensor_count {tensor_count} is more than a file of {r.size} bytes can hold")
    alignment = DEFAULT_ALIGNMENT
    for i in range(kv_count):
        key = r.string(f"key #{i}", MAX_KEY_LENGTH).decode("utf-8", "replace")
        kind = r.u32(f"the value type of {key!r}")
        if key == "general.alignment":
            if kind != _UINT32:
                raise r.fail("general.alignment must be a uint32")
            alignment = r.u32("general.alignment")
            if alignment == 0 or alignment & (alignment - 1):
                raise r.fail(f"general.alignment {alignment} is not a power of two")
        else:
            _skip_value(r, kind, key)
    _check_tensors(r, tensor_count, alignment)


def _skip_value(r: _Reader, kind: int, key: str) -> None:
    if kind == _STRING:
        r.skip_string(f"the value of {key!r}")
    elif kind in _SCALAR_SIZES:
        r.skip(_SCALAR_SIZES[kind], f"the value of {key!r}")
    elif kind == _ARRAY:
        item_kind = r.u32(f"the item type of {key!r}")
        length = r.u64(f"the length of {key!r}")
        if item_kind in _SCALAR_SIZES:
            item_size = _SCALAR_SIZES[item_kind]
            if length > (r.size - r.pos) // item_size:
                raise r.fail(f"array {key!r} of {length} items runs past the end of the file")
            r.skip(item_size * length, f"array {key!r}")
        elif item_kind == _STRING:
            if length > (r.size - r.pos) // 8:
                raise r.fail(f"array {key!r} of {length} strings runs past the end of the file")
            for _ in range(length):
                r.skip_string(f"an item of {key!r}")
        elif item_kind == _ARRAY:
            raise r.fail(f"array {key!r} holds arrays, which GGUF readers do not support")
        else:
            raise r.fail(f"unknown value type {item_kind} in array {key!r}")
    else:
        raise r.fail(f"unknown value type {kind} for {key!r}")


def _check_tensors(r: _Reader, tensor_count: int, alignment: int) -> None:
    tensors: list[tuple[int, int, str]] = []  # (offset, size, name)
    names: set[str] = set()
    for i in range(tensor_count):
        name = r.string(f"the name of tensor #{i}", MAX_TENSOR_NAME - 1).decode("utf-8", "replace")
        if name in names:
            raise r.fail(f"tensor {name!r} appears twice")
        names.add(name)
        n_dims = r.u32(f"the dimension count of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise r.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
        dims = [r.u64(f"the dimensions of tensor {name!r}") for _ in range(n_dims)]
        type_id = r.u32(f"the type of tensor {name!r}")
        offset = r.u64(f"the offset of tensor {name!r}")
        if type_id not in _QUANT_SIZES:
            raise r.fail(f"tensor {name!r} has unknown ggml type {type_id}")
        block_size, type_size = _QUANT_SIZES[type_id]
        elements = 1
        for d in dims:
            if d == 0 or d >= 2**62:
                raise r.fail(f"tensor {name!r} has an invalid dimension {d}")
            elements *= d
            if elements > r.size * block_size:  # Python ints never overflow, but keep the numbers small
                raise r.fail(f"tensor {name!r} ({'x'.join(map(str, dims))}) is larger than the file")
        if dims[0] % block_size:
            raise r.fail(f"tensor {name!r}: first dimension {dims[0]} is not a multiple of the block size "
                         f"{block_size} of its type")
        if offset % alignment:
            raise r.fail(f"tensor {name!r} offset {offset} is not a multiple of the alignment {alignment}")
        tensors.append((offset, elements // block_size * type_size, name))
    data_start = -(-r.pos // alignment) * alignment
    end_of_previous, previous = 0, ""
    for offset, nbytes, name in sorted(tensors):
        if offset < end_of_previous:
            raise r.fail(f"tensor {name!r} overlaps tensor {previous!r}")
        end = data_start + offset + nbytes
        if end > r.size:
            raise r.fail(f"tensor {name!r} data (offset {offset}, {nbytes} bytes) runs past the end of the file "
                         f"({r.size} bytes)")
        end_of_previous, previous = offset + nbytes, name
