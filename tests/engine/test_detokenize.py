"""Incremental detokenization never emits a broken UTF-8 character."""

from __future__ import annotations

import pytest

from lmserve.engine.detokenize import IncrementalDecoder


@pytest.mark.parametrize(
    ("pieces", "emitted", "tail"),
    [
        ([b"Hello", b" world"], ["Hello", " world"], ""),
        (["é".encode()[:1], "é".encode()[1:]], ["", "é"], ""),
        ([b"\xe4\xbd", b"\xa0\xe5\xa5\xbd"], ["", "你好"], ""),
        ([b"\xf0\x9f", b"\x98", b"\x80!"], ["", "", "😀!"], ""),
        ([b"ok\xf0\x9f"], ["ok"], "\ufffd"),
        ([b"\xff", b"a"], ["\ufffd", "a"], ""),
    ],
)
def test_pieces_decode_to_whole_characters(pieces: list[bytes], emitted: list[str], tail: str) -> None:
    decoder = IncrementalDecoder()
    assert [decoder.push(p) for p in pieces] == emitted
    assert decoder.flush() == tail
