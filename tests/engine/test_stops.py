"""Stop strings end generation and never leak, also when a stop string spans several pieces."""

from __future__ import annotations

import pytest

from lmserve.engine.stops import StopMatcher


def run(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    matcher = StopMatcher(stops)
    out = []
    for piece in pieces:
        text, is_stopped = matcher.push(piece)
        out.append(text)
        if is_stopped:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


@pytest.mark.parametrize(
    ("stops", "pieces", "expected", "is_stopped"),
    [
        ([], ["Hello", " world"], "Hello world", False),
        (["END"], ["Hello", " world"], "Hello world", False),
        (["END"], ["Hello END there"], "Hello ", True),
        (["END"], ["Hello E", "N", "D there"], "Hello ", True),
        (["END"], ["Hello E", "N", "O"], "Hello ENO", False),
        (["END"], ["Hello EN"], "Hello EN", False),
        (["\n\n"], ["a\n", "\nb"], "a", True),
        (["<|im_end|>"], ["Hi", "<|im", "_end|>", "more"], "Hi", True),
        (["stop", "op"], ["sto", "p"], "", True),
        (["abc", "b"], ["ab"], "a", True),
        (["xyz"], ["xx", "xy", "z"], "xx", True),
        ([""], ["anything"], "anything", False),
        (["é!"], ["caf", "é", "!"], "caf", True),
    ],
)
def test_stop_strings(stops: list[str], pieces: list[str], expected: str, is_stopped: bool) -> None:
    assert run(stops, pieces) == (expected, is_stopped)


def test_held_text_is_released_as_soon_as_it_cannot_be_a_stop() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.push("go ST") == ("go ", False)
    assert matcher.push("ay") == ("STay", False)
