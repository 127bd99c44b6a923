"""check_gguf: a valid tiny GGUF passes; each kind of corruption fails with InvalidRequest and its reason."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from lmserve.errors import InvalidRequest
from lmserve.store.gguf_check import check_gguf
from tests.tiny_gguf import write_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny.gguf").read_bytes()


def _header_end(data: bytes) -> int:
    """Offset just past the key/values: where the first tensor info starts (parsed with the gguf package)."""
    import gguf

    reader = gguf.GGUFReader(_write(data))
    return min(int(t.field.offset) for t in reader.tensors)


_TMP: list[Path] = []


def _write(data: bytes) -> Path:
    path = _TMP[0] / f"f{len(list(_TMP[0].iterdir()))}.gguf"
    path.write_bytes(data)
    return path


@pytest.fixture(autouse=True)
def _tmpdir(tmp_path: Path) -> None:
    _TMP[:] = [tmp_path]


def _set_u32(data: bytes, offset: int, value: int) -> bytes:
    return data[:offset] + struct.pack("<I", value) + data[offset + 4:]


def _set_u64(data: bytes, offset: int, value: int) -> bytes:
    return data[:offset] + struct.pack("<Q", value) + data[offset + 8:]


def _first_kv(data: bytes) -> int:
    return 4 + 4 + 8 + 8


def _first_tensor_offset_field(data: bytes) -> int:
    """Where the offset of the first tensor info lies (name, n_dims, dims, type, offset)."""
    pos = _header_end(data)
    (name_len,) = struct.unpack_from("<Q", data, pos)
    pos += 8 + name_len
    (n_dims,) = struct.unpack_from("<I", data, pos)
    return pos + 4 + 8 * n_dims + 4


def _first_tensor_type_field(data: bytes) -> int:
    return _first_tensor_offset_field(data) - 4


def _first_tensor_ndims_field(data: bytes) -> int:
    pos = _header_end(data)
    (name_len,) = struct.unpack_from("<Q", data, pos)
    return pos + 8 + name_len


CASES: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    "bad magic": (lambda d: b"GGUX" + d[4:], "bad magic"),
    "empty file": (lambda d: b"", "bad magic"),
    "version 99": (lambda d: _set_u32(d, 4, 99), "unsupported version 99"),
    "version 1": (lambda d: _set_u32(d, 4, 1), "unsupported version 1"),
    "kv_count huge": (lambda d: _set_u64(d, 16, 2**62), "kv_count"),
    "tensor_count huge": (lambda d: _set_u64(d, 8, 2**40), "tensor_count"),
    "truncated in the header": (lambda d: d[:12], "past the end"),
    "truncated in the key/values": (lambda d: d[:_header_end(d) // 2], "past the end"),
    "truncated in the tensor infos": (lambda d: d[:_header_end(d) + 20], "past the end"),
    "truncated in the tensor data": (lambda d: d[:-100], "runs past the end of the file"),
    "key length huge": (lambda d: _set_u64(d, _first_kv(d), 2**60), "key #0"),
    "string length huge": (
        lambda d: _set_u64(d, _first_kv(d) + 8 + struct.unpack_from("<Q", d, _first_kv(d))[0] + 4, 2**60),
        "past the end",
    ),
    "unknown value type": (
        lambda d: _set_u32(d, _first_kv(d) + 8 + struct.unpack_from("<Q", d, _first_kv(d))[0], 77),
        "unknown value type 77",
    ),
    "tensor offset past EOF": (lambda d: _set_u64(d, _first_tensor_offset_field(d), 2**40), "past the end"),
    "tensor offset unaligned": (lambda d: _set_u64(d, _first_tensor_offset_field(d), 3), "alignment"),
    "tensors overlap": (lambda d: _set_u64(d, _first_tensor_offset_field(d), 32), "overlaps"),
    "unknown tensor type": (lambda d: _set_u32(d, _first_tensor_type_field(d), 999), "unknown ggml type 999"),
    "too many dimensions": (lambda d: _set_u32(d, _first_tensor_ndims_field(d), 9), "9 dimensions"),
}


def test_a_valid_tiny_gguf_passes(tiny: bytes) -> None:
    check_gguf(_write(tiny))


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_corrupt_gguf_is_rejected_with_the_reason(tiny: bytes, case: str) -> None:
    corrupt, reason = CASES[case]
    with pytest.raises(InvalidRequest) as info:
        check_gguf(_write(corrupt(tiny)))
    assert reason in info.value.message
    assert info.value.param == "from"
    assert info.value.status == 400


def test_a_truncated_file_fails_at_every_cut(tiny: bytes) -> None:
    for cut in (1, 4, 8, 23, 24, 100, 1000, len(tiny) // 2, len(tiny) - 1):
        with pytest.raises(InvalidRequest):
            check_gguf(_write(tiny[:cut]))


def test_a_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="cannot read"):
        check_gguf(tmp_path / "absent.gguf")
