"""Progress of a long command on stderr, the same way for every command that can run past 10 s.

``Progress(label, total)`` counts work done: on a terminal it redraws one line in place, elsewhere (a log, CI,
a pipe) it prints a line at most every ``every`` seconds, each with the count, the rate and, where the total is
known, an ETA. ``phase(label)`` covers work that cannot be counted (a compile, a model build): a line every
``every`` seconds saying how long it has run, from a daemon thread, so a silent phase never looks hung. Both
print a closing line with the time taken when the work took longer than ``every``.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class Progress:
    """Counted progress; use as a context manager and call ``advance(n)`` (or ``update(done)``)."""

    def __init__(
        self, label: str, total: int | None = None, *, unit: str = "", every: float = 5.0, stream: TextIO | None = None
    ):
        self.label, self.total, self.unit, self.every = label, total, unit, every
        self.stream = stream if stream is not None else sys.stderr
        self.done, self._closed = 0, False
        self._start = self._last = time.monotonic()
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def __enter__(self) -> Progress:
        self._start = self._last = time.monotonic()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()

    def close(self) -> None:
        """The closing line (once): the count and the time taken, if that was longer than `every`."""
        if self._closed:
            return
        self._closed = True
        elapsed = time.monotonic() - self._start
        if self._tty:
            self.stream.write("\r\x1b[2K")
        if elapsed >= self.every:
            self.stream.write(f"{self.label}: {self._count()} in {_duration(elapsed)}\n")
        self.stream.flush()

    def advance(self, n: int = 1) -> None:
        self.update(self.done + n)

    def update(self, done: int) -> None:
        self.done = done
        if self._closed:
            return
        now = time.monotonic()
        if now - self._last < (0.2 if self._tty else self.every):
            return
        self._last = now
        line = self.line(now - self._start)
        self.stream.write(f"\r\x1b[2K{line}" if self._tty else f"{line}\n")
        self.stream.flush()

    def _count(self) -> str:
        unit = f" {self.unit}" if self.unit else ""
        if self.total:
            return f"{self.done:,}/{self.total:,}{unit}"
        return f"{self.done:,}{unit}"

    def line(self, elapsed: float) -> str:
        """The status line after `elapsed` seconds: count, percent, rate and ETA where they can be known."""
        parts = [f"{self.label}: {self._count()}"]
        if self.total:
            parts.append(f"{100 * self.done / self.total:.0f}%")
        rate = self.done / elapsed if elapsed > 0 else 0.0
        if rate > 0:
            parts.append(f"{rate:,.1f}{' ' + self.unit if self.unit else ''}/s")
            if self.total and self.done < self.total:
                parts.append(f"ETA {_duration((self.total - self.done) / rate)}")
        parts.append(f"{_duration(elapsed)} so far")
        return ", ".join(parts)


@contextmanager
def phase(label: str, *, every: float = 5.0, stream: TextIO | None = None) -> Iterator[None]:
    """Say every `every` seconds that `label` is still running, and how long it took once done (if that
    was longer than `every`)."""
    out = stream if stream is not None else sys.stderr
    start, done = time.monotonic(), threading.Event()

    def beat() -> None:
        while not done.wait(every):
            out.write(f"{label}: still running, {_duration(time.monotonic() - start)} so far\n")
            out.flush()

    thread = threading.Thread(target=beat, name=f"progress: {label}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        elapsed = time.monotonic() - start
        if elapsed >= every:
            out.write(f"{label}: done in {_duration(elapsed)}\n")
            out.flush()
