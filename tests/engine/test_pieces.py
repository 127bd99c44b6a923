"""Spec for lmserve.engine.pieces: a Hugging Face token's text as its bytes."""

from __future__ import annotations

import pytest

from lmserve.engine.pieces import piece_bytes


@pytest.mark.parametrize(("piece", "expected"), [
    ("hello", b"hello"),
    ("Ġworld", b" world"),  # byte-level BPE: Ġ is the space
    ("Ċ", b"\n"),
    ("Ã", b"\xc3"),  # half of a UTF-8 character
    ("<|im_end|>", b"<|im_end|>"),
    ("▁hello", b" hello"),  # SentencePiece
    ("<0xC3>", b"\xc3"),  # SentencePiece raw byte
])  # fmt: skip
def test_piece_bytes(piece: str, expected: bytes) -> None:
    assert piece_bytes(piece) == expected
