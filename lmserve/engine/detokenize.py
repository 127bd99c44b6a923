"""Incremental detokenization: token bytes in, text out, never a broken UTF-8 character."""

from __future__ import annotations

import codecs


class IncrementalDecoder:
    """Turns a stream of token byte pieces into text.

    A multi-byte character split across tokens is held back until its last byte arrives; bytes that can
    never form a character become U+FFFD. `flush` returns whatever is still held at the end.
    """

    __slots__ = ("_decoder",)

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, piece: bytes) -> str:
        return self._decoder.decode(piece)

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)
