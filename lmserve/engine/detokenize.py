"""Incremental detokenization: token bytes in, text out, never a broken UTF-8 character."""

from __future__ import annotations

import codecs


class IncrementalDecoder:
    """Turns a stream of token byte pieces into text.

    A multi-byte character split across tokens is held back until its last byte arrives; bytes that can
    never form a character become U+FFFD. `flush` ends the stream: a character still incomplete there (a reply
    cut by `max_tokens` in the middle of one) is dropped, so no reply ends in U+FFFD.
    """

    __slots__ = ("_decoder",)

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, piece: bytes) -> str:
        """The text `piece` completes; the bytes of a character not yet complete are held back."""
        return self._decoder.decode(piece)

    @property
    def is_holding(self) -> bool:
        """Whether the first bytes of a character are held back, waiting for the rest."""
        return bool(self._decoder.getstate()[0])

    def flush(self) -> str:
        """End of the stream: drop the bytes of an incomplete last character (always ""), and start afresh.

        The UTF-8 decoder only ever holds the first bytes of one character that could still become valid, so
        what is held here is never text: it is a character cut in half.
        """
        self._decoder.reset()
        return ""
