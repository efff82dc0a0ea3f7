"""Incremental detokenization and stop strings, per choice.

Text is produced from token bytes through an incremental UTF-8 decoder, so a character split
across tokens is emitted once it is complete. Text that could be the start of a stop string is
held back until it is known not to be one; a stop string itself is never emitted.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable


class IncrementalDetokenizer:
    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        return self._decoder.decode(self._token_bytes(token_id))

    def flush(self) -> str:
        """Whatever is left; an incomplete character at the very end becomes U+FFFD."""
        return self._decoder.decode(b"", final=True)


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.matched: str | None = None  # the stop string found, once found

    def feed(self, text: str) -> tuple[str, bool]:
        """-> (text safe to emit, whether a stop string was found). After True, stop feeding."""
        buf = self._held + text
        cut = -1
        for stop in self.stops:
            i = buf.find(stop)
            if i >= 0 and (cut < 0 or i < cut):
                cut, self.matched = i, stop
        if cut >= 0:
            self._held = ""
            return buf[:cut], True
        hold = self._partial_len(buf)
        self._held = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:k]):
                    best = k
                    break
        return best


class TextStream:
    """Token ids in, text out, for one choice."""

    def __init__(
        self,
        token_bytes: Callable[[int], bytes],
        stops: list[str],
        skip_ids: frozenset[int] = frozenset(),
    ) -> None:
        self._detok = IncrementalDetokenizer(token_bytes)
        self._stops = StopMatcher(stops)
        self._skip_ids = skip_ids
        self.stopped = False

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the text (None: none did)."""
        return self._stops.matched

    def add(self, token_id: int) -> str:
        """Text to emit for this token ('' while held back); sets `stopped` on a stop string."""
        if self.stopped or token_id in self._skip_ids:
            return ""
        text, self.stopped = self._stops.feed(self._detok.add(token_id))
        return text

    def finish(self) -> str:
        """The held-back tail, at the end of the choice (nothing after a stop string)."""
        if self.stopped:
            return ""
        text, self.stopped = self._stops.feed(self._detok.flush())
        return text if self.stopped else text + self._stops.flush()
