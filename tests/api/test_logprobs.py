"""The dialects' log-probability fields (dialects/shared/logprobs.py): what is asked, and the shapes returned."""

from __future__ import annotations

import pytest

from lmserve.dialects.shared.logprobs import LegacyLogprobs, asked, chat_logprobs, joined, legacy_asked, token_entries
from lmserve.errors import InvalidRequest
from lmserve.types import TokenLogprob


def entry(text: str, value: float, *top: tuple[str, float]) -> TokenLogprob:
    return TokenLogprob(0, text, text.encode(), value, [TokenLogprob(1, t, t.encode(), v) for t, v in top])


def test_what_is_asked() -> None:
    assert asked(None, None) is None and asked(False, None) is None and asked(False, 0) is None
    assert asked(True, None) == 0 and asked(True, 20) == 20
    assert legacy_asked(None) is None and legacy_asked(3) == 3


@pytest.mark.parametrize(("call", "param"), [
    (lambda: asked(True, 21), "top_logprobs"),
    (lambda: asked(None, 2), "top_logprobs"),
    (lambda: legacy_asked(6), "logprobs"),
    (lambda: legacy_asked(-1), "logprobs"),
])  # fmt: skip
def test_bad_values_are_refused(call: object, param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        call()  # type: ignore[operator]
    assert caught.value.param == param


def test_chat_shape() -> None:
    shaped = chat_logprobs([entry("Hé", -0.1, ("Hé", -0.1), ("Hi", -2.5))])
    assert shaped == {"refusal": None, "content": [{
        "token": "Hé", "logprob": -0.1, "bytes": [72, 195, 169],
        "top_logprobs": [{"token": "Hé", "logprob": -0.1, "bytes": [72, 195, 169]},
                         {"token": "Hi", "logprob": -2.5, "bytes": [72, 105]}],
    }]}
    assert token_entries([]) == []


def test_legacy_shape_counts_offsets_across_chunks() -> None:
    legacy = LegacyLogprobs(start=3)
    first = legacy([entry("The", -0.5, ("A", -0.4)), entry(" cat", -1.0)])
    assert first == {"tokens": ["The", " cat"], "token_logprobs": [-0.5, -1.0],
                     "top_logprobs": [{"A": -0.4, "The": -0.5}, {" cat": -1.0}], "text_offset": [3, 6]}
    assert legacy([entry(" sat", -0.2)])["text_offset"] == [10]


def test_an_echoed_prompt_comes_first_its_first_token_without_a_logprob() -> None:
    legacy = LegacyLogprobs()
    prompt = legacy.echoed("<s>", [entry("The", -0.5, ("A", -0.4))])
    shaped = joined(prompt, legacy([entry(" cat", -1.0)]))
    assert shaped == {"tokens": ["<s>", "The", " cat"], "token_logprobs": [None, -0.5, -1.0],
                      "top_logprobs": [None, {"A": -0.4, "The": -0.5}, {" cat": -1.0}], "text_offset": [0, 3, 6]}
