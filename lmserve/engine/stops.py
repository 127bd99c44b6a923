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

