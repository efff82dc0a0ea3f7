"""llama.cpp's code-completion stops for /infill (tools/server, process_token): `n_indent`
ends the middle at a new line indented less than n_indent (cut before its first non-blank
character); `t_max_predict_ms` ends it at a newline once generation has run that long."""

from __future__ import annotations

import time
from collections.abc import Callable


class LineLimits:
    def __init__(
        self,
        n_indent: int,
        t_max_predict_ms: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.n_indent = n_indent
        self.t_max = t_max_predict_ms / 1000.0
        self.clock = clock
        self.text = ""
        self.start: float | None = None  # the first generated text's time

    @property
    def active(self) -> bool:
        return self.n_indent > 0 or self.t_max > 0

    def feed(self, text: str) -> tuple[str, bool]:
        """-> (the part of `text` to keep, whether the middle ends here)."""
        if self.start is None:
            self.start = self.clock()
        old = len(self.text)
        self.text += text
        cut = self._indent_cut(old) if self.n_indent > 0 else None
        if cut is not None:
            self.text = self.text[:cut]
            return self.text[old:], True
        late = self.t_max > 0 and self.clock() - self.start > self.t_max
        return text, late and "\n" in text

    def _indent_cut(self, old: int) -> int | None:
        """Where a line that starts after a newline and is under-indented gets cut: its first
        character that is not a space or a tab (an empty line counts, as in llama.cpp)."""
        nl = self.text.rfind("\n", 0, old)
        nl = self.text.find("\n", old) if nl < 0 else nl
        while nl >= 0:
            first = nl + 1
            while first < len(self.text) and self.text[first] in " \t":
                first += 1
            if first >= len(self.text):
                return None  # the line's indentation is not known yet
            if first >= old and first - (nl + 1) < self.n_indent:
                return first
            nl = self.text.find("\n", nl + 1)
        return None
