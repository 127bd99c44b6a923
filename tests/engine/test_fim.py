"""Spec for lmserve.engine.fim: a vocabulary's FIM tokens, by their ids or by the texts of the formats in use."""

from __future__ import annotations

import pytest

from lmserve.engine import fim
from lmserve.engine.protocol import FimTokens


@pytest.mark.parametrize(("vocab", "expected"), [
    ({"<|fim_prefix|>": 5, "<|fim_suffix|>": 6, "<|fim_middle|>": 7, "<|repo_name|>": 8, "<|file_sep|>": 9},
     FimTokens(5, 6, 7, 8, 9)),
    ({"<fim_prefix>": 1, "<fim_middle>": 2, "<fim_suffix>": 3}, FimTokens(1, 3, 2)),
    ({"▁<PRE>": 1, "▁<SUF>": 2, "▁<MID>": 3}, FimTokens(1, 2, 3)),
    ({"<fim_prefix>": 1, "<fim_suffix>": 3}, None),
    ({"hello": 1}, None),
])  # fmt: skip
def test_find_by_text(vocab: dict[str, int], expected: FimTokens | None) -> None:
    assert fim.find_by_text(vocab) == expected


def test_from_ids_needs_prefix_suffix_and_middle() -> None:
    assert fim.from_ids(1, 2, 3) == FimTokens(1, 2, 3)
    assert fim.from_ids(1, 2, 3, 4, -1) == FimTokens(1, 2, 3, 4, None)
    assert fim.from_ids(1, -1, 3) is None
