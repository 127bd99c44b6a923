"""Stop strings: end generation when one appears, and never let any part of it reach the client."""

from __future__ import annotations


class StopMatcher:
    """Filters streamed text against stop strings.

    `push` returns the text that is safe to emit and whether a stop string was completed. Text that could
    still be the start of a stop string is held back until it is decided; `flush` releases it when the
    generation ends for another reason.
    """

    __slots__ = ("_pending", "_stops")

    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        if not self._stops:
            return text, False
        pending = self._pending + text
        cut = -1
        for stop in self._stops:
            index = pending.find(stop)
            if index != -1 and (cut == -1 or index < cut):
                cut = index
        if cut != -1:
            self._pending = ""
            return pending[:cut], True
        hold = self._held_length(pending)
        self._pending = pending[len(pending) - hold :]
        return pending[: len(pending) - hold], False

    def flush(self) -> str:
        text, self._pending = self._pending, ""
        return text

    def _held_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest


STOP_SLACK = 32
"""Most characters of the stop's last token that may follow the stop string in the generated text."""


def stop_after(generated: str, answer: str, stops: list[str]) -> str | None:
    """Which stop string ended a reply: the one that follows `answer`'s end near the end of `generated` (the reply's
    tokens read back: the engines cut a stop string from the text but keep the tokens that made it). None: none
    does (the end-of-turn token ended it). Of several that start there the shortest wins: it was complete first
    (thinking before the answer is never searched)."""
    tail = answer[-STOP_SLACK:]
    found: list[tuple[int, str]] = []
    for stop in stops:
        if not stop:
            continue
        at = generated.rfind(tail + stop)
        if at >= 0 and at + len(tail) + len(stop) >= len(generated) - STOP_SLACK:
            found.append((len(stop), stop))
    return min(found)[1] if found else None
