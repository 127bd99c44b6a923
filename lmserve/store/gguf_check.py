"""Structural validation of a GGUF file before llama.cpp opens it, and the one reader of its metadata.

`check_gguf` walks the header (key/values and tensor infos) with every length checked against the file size
before it is used: nothing is allocated or read by a length taken from the file. It rejects what llama.cpp
would choke on or, for crafted files, what could make it read past the end: bad magic, unsupported versions,
absurd counts, truncated sections, unknown value or tensor types, and tensors whose data lies past the end of
the file or overlaps another tensor. `gguf_metadata` reads the header's key/values with the same checks.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

import gguf

from lmserve.errors import InvalidRequest

SUPPORTED_VERSIONS = (2, 3)
MAX_KEY_LENGTH = 65_535
MAX_TENSOR_NAME = 64  # GGML_MAX_NAME, terminating NUL included
MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32

_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_SCALAR_SIZES = {kind: struct.calcsize(fmt) for kind, fmt in _SCALAR_FORMATS.items()}
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
    """Raise InvalidRequest (param "from") with the reason when `path` is not a well-formed GGUF file, or one this
    llama.cpp would abort the process on (`unrunnable`)."""
    with _open(path) as r:
        tensor_count, alignment, _ = _header(r, max_array=-1)
        _check_tensors(r, tensor_count, alignment)
    reason = unrunnable(gguf_metadata(path, max_array=1024))
    if reason is not None:
        raise InvalidRequest(f"{path.name} cannot be served: {reason}", param="from")


def unrunnable(metadata: dict[str, Any]) -> str | None:
    """Why llama.cpp (0c1e570) would abort the whole process on a model with this metadata, or None."""
    arch = metadata.get("general.architecture")
    if arch in ("lfm2", "lfm2moe"):
        # An LFM2's convolution layers are those with no KV heads. Without any, llama.cpp still builds a hybrid
        # memory whose recurrent part has no layers and no buffer, and its first decode fails GGML_ASSERT(buffer).
        heads = metadata.get(f"{arch}.attention.head_count_kv")
        if isinstance(heads, list) and heads and 0 not in heads:
            return ("an LFM2 without convolution layers (every layer attention), which llama.cpp aborts on at its "
                    "first decode (its hybrid memory needs a recurrent layer)")
    return None


def gguf_metadata(path: Path, *, max_array: int = 64) -> dict[str, Any]:
    """The key/values of a GGUF file's header, read with `check_gguf`'s checks; arrays of more than `max_array`
    items (the vocabulary) are left out. InvalidRequest (param "from") when the header is malformed.

    `general.parameter_count`, when the file does not say it, is the number of values in its tensors (as the local
    runner counts them: every expert of a mixture of experts, whatever the quantization)."""
    with _open(path) as r:
        tensor_count, alignment, values = _header(r, max_array=max_array)
        parameters = _check_tensors(r, tensor_count, alignment)
    values.setdefault("general.parameter_count", parameters)
    return values


class _open:
    """A checked reader over `path`; an OSError becomes InvalidRequest."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.f: BinaryIO | None = None

    def __enter__(self) -> _Reader:
        try:
            size = self.path.stat().st_size
            self.f = self.path.open("rb")
        except OSError as exc:
            raise InvalidRequest(f"cannot read {self.path.name}: {exc.strerror or exc}", param="from") from exc
        return _Reader(self.f, size, self.path.name)

    def __exit__(self, *exc: object) -> None:
        if self.f is not None:
            self.f.close()


def _header(r: _Reader, *, max_array: int) -> tuple[int, int, dict[str, Any]]:
    """Walk the header: (tensor count, alignment, the values kept). `max_array` < 0 keeps no value."""
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
    values: dict[str, Any] = {}
    for i in range(kv_count):
        key = r.string(f"key #{i}", MAX_KEY_LENGTH).decode("utf-8", "replace")
        kind = r.u32(f"the value type of {key!r}")
        if key == "general.alignment":
            if kind != _UINT32:
                raise r.fail("general.alignment must be a uint32")
            alignment = values[key] = r.u32("general.alignment")
            if alignment == 0 or alignment & (alignment - 1):
                raise r.fail(f"general.alignment {alignment} is not a power of two")
            continue
        value = _value(r, kind, key, max_array)
        if value is not _SKIPPED:
            values[key] = value
    return tensor_count, alignment, values


_SKIPPED: Any = object()


def _value(r: _Reader, kind: int, key: str, max_array: int) -> Any:
    """Read (or, with `max_array` < 0 or a longer array, skip) one value; every length checked first."""
    keep = max_array >= 0
    if kind == _STRING:
        if keep:
            return r.string(f"the value of {key!r}", r.size).decode("utf-8", "replace")
        r.skip_string(f"the value of {key!r}")
        return _SKIPPED
    if kind in _SCALAR_SIZES:
        if keep:
            return struct.unpack(_SCALAR_FORMATS[kind], r.read(_SCALAR_SIZES[kind], f"the value of {key!r}"))[0]
        r.skip(_SCALAR_SIZES[kind], f"the value of {key!r}")
        return _SKIPPED
    if kind != _ARRAY:
        raise r.fail(f"unknown value type {kind} for {key!r}")
    item_kind = r.u32(f"the item type of {key!r}")
    length = r.u64(f"the length of {key!r}")
    if item_kind == _ARRAY:
        raise r.fail(f"array {key!r} holds arrays, which GGUF readers do not support")
    if item_kind != _STRING and item_kind not in _SCALAR_SIZES:
        raise r.fail(f"unknown value type {item_kind} in array {key!r}")
    smallest = _SCALAR_SIZES.get(item_kind, 8)
    if length > (r.size - r.pos) // smallest:
        raise r.fail(f"array {key!r} of {length} items runs past the end of the file")
    if keep and length <= max_array:
        return [_value(r, item_kind, key, max_array) for _ in range(length)]
    if item_kind in _SCALAR_SIZES:
        r.skip(smallest * length, f"array {key!r}")
    else:
        for _ in range(length):
            r.skip_string(f"an item of {key!r}")
    return _SKIPPED


def gguf_tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's dimensions (ggml's order: the first is a row's length), read with `check_gguf`'s checks."""
    shapes: dict[str, tuple[int, ...]] = {}
    with _open(path) as r:
        tensor_count, alignment, _ = _header(r, max_array=-1)
        _check_tensors(r, tensor_count, alignment, shapes)
    return shapes


def _check_tensors(r: _Reader, tensor_count: int, alignment: int,
                   shapes: dict[str, tuple[int, ...]] | None = None) -> int:
    """Check the tensor infos (each one's dimensions into `shapes`, if given); the number of values in all the
    tensors."""
    tensors: list[tuple[int, int, str]] = []  # (offset, size, name)
    total = 0
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
        total += elements
        if shapes is not None:
            shapes[name] = tuple(dims)
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
    return total
