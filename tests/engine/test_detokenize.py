"""Incremental detokenization never emits a broken UTF-8 character, not even where `max_tokens` cuts one."""

from __future__ import annotations

import pytest

from lmserve.engine.detokenize import IncrementalDecoder
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.fake import FakeBackend
from lmserve.types import SamplingParams


@pytest.mark.parametrize(
    ("pieces", "emitted", "tail"),
    [
        ([b"Hello", b" world"], ["Hello", " world"], ""),
        (["é".encode()[:1], "é".encode()[1:]], ["", "é"], ""),
        ([b"\xe4\xbd", b"\xa0\xe5\xa5\xbd"], ["", "你好"], ""),
        ([b"\xf0\x9f", b"\x98", b"\x80!"], ["", "", "😀!"], ""),
        ([b"ok\xf0\x9f"], ["ok"], ""),  # a character cut at the end is dropped, not U+FFFD
        ([b"ok\xe4\xbd"], ["ok"], ""),
        ([b"ok\xc3"], ["ok"], ""),
        ([b"\xff", b"a"], ["\ufffd", "a"], ""),  # a byte that can never be text stays U+FFFD
        ([b"a\xff"], ["a\ufffd"], ""),
    ],
)
def test_pieces_decode_to_whole_characters(pieces: list[bytes], emitted: list[str], tail: str) -> None:
    decoder = IncrementalDecoder()
    assert [decoder.push(p) for p in pieces] == emitted
    assert decoder.flush() == tail


def test_flush_starts_afresh() -> None:
    decoder = IncrementalDecoder()
    decoder.push(b"\xe4\xbd")
    assert decoder.flush() == ""
    assert decoder.push("é".encode()) == "é"


@pytest.mark.parametrize(
    ("script", "max_tokens", "text"),
    [
        ("ok 😀", 3, "ok "),  # 😀 is 4 bytes (tokens) in the fake: cut after 0, 1, 2 or 3 of them
        ("ok 😀", 4, "ok "),
        ("ok 😀", 6, "ok "),
        ("ok 😀", 7, "ok 😀"),
        ("你好", 2, ""),
        ("你好", 4, "你"),
        ("你好", 6, "你好"),
        ("été", 1, ""),
        ("été", 2, "é"),
    ],
)
async def test_a_reply_cut_by_max_tokens_never_ends_in_a_broken_character(
    script: str, max_tokens: int, text: str
) -> None:
    engine = BatchingEngine(FakeBackend(num_ctx=64, num_parallel=1, script=script))
    try:
        chunks = [c async for c in engine.submit(engine.tokenize("hi"), SamplingParams(max_tokens=max_tokens))]
    finally:
        engine.close()
    assert "".join(c.text for c in chunks) == text
    assert "\ufffd" not in "".join(c.text for c in chunks)
    assert chunks[-1].finish_reason == ("length" if max_tokens <= len(script.encode()) else "stop")
