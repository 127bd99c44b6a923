"""A Hugging Face tokenizer's token text (`convert_ids_to_tokens`) as the bytes it stands for.

Byte-level BPE vocabularies (GPT-2, Llama 3, Qwen, SmolLM) spell each byte as one printable character; SentencePiece
ones write a space as `▁` and a raw byte as `<0xNN>`.
"""

from __future__ import annotations

import re


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte → character table, inverted: printable bytes are themselves, the rest are shifted past 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = chr(256 + shifted)
            shifted += 1
    return {char: byte for byte, char in chars.items()}


BYTE_LEVEL = _byte_level_alphabet()
_RAW_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def piece_bytes(piece: str) -> bytes:
    """The bytes of one token's text: a SentencePiece raw byte, a byte-level BPE piece, or SentencePiece text."""
    raw = _RAW_BYTE.fullmatch(piece)
    if raw is not None:
        return bytes([int(raw.group(1), 16)])
    if "▁" not in piece and all(char in BYTE_LEVEL for char in piece):
        return bytes(BYTE_LEVEL[char] for char in piece)
    return piece.replace("▁", " ").encode("utf-8")
