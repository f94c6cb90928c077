"""Progress of a long command on stderr: cases done of total, the case at hand, the time so far.

Shown only where stderr is a terminal (one line, rewritten in place and
cleared at the end); piped, redirected or under ``--json`` the command's
output is exactly what it was without it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """``qcheck: 12/45 cases, 37 s: fp8-mixtral-sparse`` on ``stream``, where it is a terminal."""

    def __init__(self, total: int, *, what: str = "cases", stream: TextIO | None = None, enabled: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        self.stream = sys.stderr if stream is None else stream
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = enabled and total > 0 and callable(isatty) and bool(isatty())
        self.total, self.what, self.clock = total, what, clock
        self.done = 0
        self.started = clock()

    def _show(self, text: str) -> None:
        if self.enabled:
            self.stream.write(f"\r\033[Kqcheck: {self.done}/{self.total} {self.what}, "
                              f"{self.clock() - self.started:.0f} s: {text}")
            self.stream.flush()

    def start(self, label: str) -> None:
        """The case now running (where cases run one at a time)."""
        self._show(f"running {label}")

    def advance(self, label: str) -> None:
        """One more case done."""
        self.done += 1
        self._show(f"done {label}")

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r\033[K")
            self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
