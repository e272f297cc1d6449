"""Progress on long builds: files and bytes, redrawn at most a few times a second on stderr."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


class Progress:
    """Counts files and bytes; prints a status line when stderr is a terminal (or ``force``)."""

    def __init__(self, label: str, stream: TextIO | None = None, force: bool = False) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = force or self.stream.isatty()
        self.files = 0
        self.bytes = 0
        self.started = time.monotonic()
        self._last_draw = 0.0
        self.warnings: list[str] = []

    def add_file(self, n: int = 1) -> None:
        self.files += n
        self._maybe_draw()

    def add_bytes(self, n: int) -> None:
        self.bytes += n
        self._maybe_draw()

    def warn(self, message: str) -> None:
        """A warning: always printed (on its own line, the status line redrawn after it)
        and kept in ``warnings``."""
        self.warnings.append(message)
        clear = "\r\x1b[K" if self.enabled else ""
        self.stream.write(f"{clear}warning: {message}\n")
        self.stream.flush()
        self._maybe_draw(force=True)

    def phase(self, label: str) -> None:
        self.label = label
        self._maybe_draw(force=True)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def _maybe_draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last_draw < 0.25:
            return
        self._last_draw = now
        self.stream.write(
            f"\r\x1b[K{self.label}: {self.files} files, {human_bytes(self.bytes)}"
            f" ({self.elapsed():.1f} s)"
        )
        self.stream.flush()

    def done(self) -> None:
        if self.enabled:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
