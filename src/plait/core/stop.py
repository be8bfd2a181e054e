"""Stopping on request: SIGTERM (a preemption, a Slurm time limit, the elastic agent shutting down) or SIGINT
(Ctrl-C) asks the run to stop at the end of the step in progress. Every rank then agrees on the same step
(`CheckpointManager.maybe_save`), a checkpoint of it is written synchronously, and the process exits with
EXIT_STOPPED; the same command resumes from that checkpoint.

Repeats of a signal within REPEAT_S of the first are the same request (Ctrl-C reaches the workers of
`plait train --nproc` twice: from the terminal, and forwarded by the elastic agent). A Ctrl-C after that
aborts at once, without a checkpoint.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from plait.core.errors import PlaitError

EXIT_STOPPED = 75  # EX_TEMPFAIL (sysexits.h): stopped on request after saving; run the same command again
REPEAT_S = 3.0


class Stopped(PlaitError):
    """The run stopped on a signal after writing its checkpoint: exit EXIT_STOPPED, not a failure."""

    exit_code = EXIT_STOPPED


class StopRequest:
    """SIGTERM / SIGINT handlers (main thread only) from `install()` to `restore()`."""

    def __init__(self, announce: bool = True):
        self.signal_name: str | None = None
        self.announce = announce
        self._first = 0.0
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | signal.Handlers | None] = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def install(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if self.signal_name is None:
            self.signal_name, self._first = signal.Signals(signum).name, now
            if self.announce:
                print(
                    f"plait: {self.signal_name} received: stopping after this step with a checkpoint "
                    f"(Ctrl-C again to abort without one)",
                    file=sys.stderr,
                    flush=True,
                )
        elif signum == signal.SIGINT and now - self._first > REPEAT_S:
            raise KeyboardInterrupt
