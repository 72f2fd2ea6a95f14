"""Output text of a request: incremental detokenization plus stop-string matching across token boundaries.

Text that could still be the beginning of a stop string is held back until it is disambiguated; a match
withholds the matched text and everything after it.
"""

from __future__ import annotations

from typing import Protocol, Sequence


class Detokenizer(Protocol):
    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class StopStringMatcher:
    """Finds the earliest occurrence of any stop string in a text stream fed piece by piece."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._held = ""
        self.matched: str | None = None

    def push(self, text: str) -> str:
        """Feed text; return what is safe to emit. After a match, :attr:`matched` is set and nothing more is emitted."""
        if self.matched is not None:
            return ""
        if not self._stops:
            return text
        buffer = self._held + text
        match_at, match = -1, None
        for stop in self._stops:
            index = buffer.find(stop)
            if index >= 0 and (match_at < 0 or index < match_at or (index == match_at and len(stop) > len(match))):
                match_at, match = index, stop
        if match is not None:
            self.matched = match
            self._held = ""
            return buffer[:match_at]
        hold = self._longest_stop_prefix_suffix(buffer)
        self._held = buffer[len(buffer) - hold :]
        return buffer[: len(buffer) - hold]

    def flush(self) -> str:
        """Emit the held-back text (the stream ended without completing a stop string)."""
        text, self._held = self._held, ""
        return "" if self.matched is not None else text

    def _longest_stop_prefix_suffix(self, buffer: str) -> int:
        longest = max(len(stop) for stop in self._stops) - 1
        for size in range(min(longest, len(buffer)), 0, -1):
            tail = buffer[-size:]
            if any(stop.startswith(tail) for stop in self._stops):
                return size
        return 0


class OutputText:
    """Token ids in, emittable text out: detokenizer followed by the stop-string matcher."""

    def __init__(self, detokenizer: Detokenizer | None, stops: Sequence[str]) -> None:
        self._detokenizer = detokenizer
        self._matcher = StopStringMatcher(stops)

    @property
    def matched_stop(self) -> str | None:
        return self._matcher.matched

    def push(self, token_id: int) -> str:
        if self._detokenizer is None:
            return ""
        return self._matcher.push(self._detokenizer.push(token_id))

    def flush(self) -> str:
        """Everything still held back, at the end of a request that did not end on a stop string."""
        if self._detokenizer is None:
            return ""
        return self._matcher.push(self._detokenizer.flush()) + self._matcher.flush()
