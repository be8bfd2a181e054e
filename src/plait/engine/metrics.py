"""Training metrics: one JSON line per logged step, TensorBoard scalars, and a rich progress bar.

Only the rank that logs (rank 0) creates files; other ranks get a logger that does nothing.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.text import Text

from plait.config import LogConfig
from plait.core.publish import LockLost, check_fence

console = Console(stderr=True, soft_wrap=True)  # paths stay on one line: copy-pasteable, greppable
log = logging.getLogger("plait")
"""plait's messages (what a run does, warnings). A run (and every `plait` command) sends them to plait's console
on stderr (use_console); give the logger handlers of your own (`logging.getLogger("plait").addHandler(...)`)
or a level to take them over."""


class ConsoleHandler(logging.Handler):
    """A record as one console line, as written (no markup read from it); warnings and errors prefixed in colour."""

    _lock = threading.Lock()  # whole lines, also from background threads (a checkpoint save)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = Text(record.getMessage())
            if record.levelno >= logging.WARNING:
                text = Text.assemble((f"{record.levelname.lower()}: ", "yellow"), text)
            with self._lock:
                console.print(text, highlight=False)
        except Exception:
            self.handleError(record)


log.addHandler(logging.NullHandler())  # a library's logger: the application decides where messages go


def use_console() -> None:
    """plait's messages (INFO and up) to its console on stderr, unless the application gave the 'plait' logger
    handlers of its own: the `plait` commands and Trainer.fit() call it; importing plait configures nothing."""
    if any(not isinstance(h, logging.NullHandler) for h in log.handlers):
        return
    log.addHandler(ConsoleHandler())
    log.setLevel(logging.INFO)
    log.propagate = False  # the console handler prints it; a root handler would print it twice


def info(message: str) -> None:
    log.info(message)


def warn(message: str) -> None:
    """A warning line for the user (also from background threads, e.g. a checkpoint save)."""
    log.warning(message)


FENCE_EVERY_S = 2.0
"""How often the metrics writer re-reads the run lock's fence (a step's metrics are written only while this run
holds the directory; a takeover is seen within this many seconds, and at the latest by the lock's heartbeat)."""


class MetricsLogger:
    def __init__(
        self,
        run_dir: Path,
        cfg: LogConfig,
        total_steps: int,
        *,
        enabled: bool = True,
        name: str = "",
        config: dict[str, Any] | None = None,
        run_id: str = "",
        start_step: int = 0,
    ):
        self.cfg = cfg
        self.run_id = run_id  # in every record: a file appended by two runs (or by a resumed one) can be told apart
        self.enabled = enabled
        self._jsonl = None
        self._trackers: list = []
        self._progress: ProgressLine | None = None
        self._live: Live | None = None
        self.last: dict[str, Any] = {}
        self.run_dir, self._fenced_at = run_dir, -math.inf
        self._reading: threading.Thread | None = None
        self._lost: LockLost | None = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 - closed in close()
        from plait.engine.trackers import open_trackers

        self._trackers = open_trackers(run_dir, cfg, name or run_dir.name, config)  # TensorBoard, W&B, MLflow
        if cfg.progress and sys.stderr.isatty():
            progress = self._progress = ProgressLine(total_steps)
            progress.completed = start_step  # a resumed run's bar starts where it resumed, not at 0
            self._live = Live(
                get_renderable=lambda: progress.render(console.width),
                console=console,
                refresh_per_second=4,
                transient=False,
            )
            self._live.start()

    def should_log(self, step: int, total_steps: int) -> bool:
        return step % self.cfg.every_steps == 0 or step == total_steps or step == 1

    def log(self, step: int, metrics: dict[str, Any], *, prefix: str = "train") -> None:
        """Record metrics of `step`; the progress bar shows the latest loss."""
        if not self.enabled or self._jsonl is None:
            return
        record = {"step": step, "time": time.time(), **({"run_id": self.run_id} if self.run_id else {})}
        record.update({f"{prefix}/{k}": v for k, v in metrics.items()})
        self._fence()
        self._jsonl.write(json.dumps(record) + "\n")
        scalars = {f"{prefix}/{k}": v for k, v in metrics.items() if isinstance(v, int | float)}
        for tracker in self._trackers:
            tracker.log(step, scalars)
        self.last.update(record)
        if self._progress is not None:
            self._progress.status = _status_parts(self.last)
        elif line := _status_line(_with_scored(record, self.last)):  # records without a headline figure stay quiet
            console.print(f"step {step:>6} {line}", highlight=False)

    def _fence(self) -> None:
        """A run whose lock was taken over writes no more metrics into the directory (core.publish.check_fence).
        The lock is re-read at most every FENCE_EVERY_S seconds, in a thread of its own: on S3 each read is a
        request, and a request to a store that is down retries for seconds, which would hold the loop."""
        if self._lost is not None:
            raise self._lost
        now = time.monotonic()
        if now - self._fenced_at >= FENCE_EVERY_S and (self._reading is None or not self._reading.is_alive()):
            self._fenced_at = now
            self._reading = threading.Thread(target=self._read_fence, name="plait-metrics-fence", daemon=True)
            self._reading.start()

    def _read_fence(self) -> None:
        try:
            check_fence(self.run_dir, "metrics")
        except LockLost as e:
            self._lost = e  # the next record raises it in the loop
        except Exception:  # the lock unreadable (its store down): not a lock taken over; the next check reads it
            pass  # again, and a checkpoint is published only after its own check reads the lock

    def advance(self, step: int) -> None:
        if self._progress is not None:
            self._progress.advance(step)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
        for tracker in self._trackers:
            tracker.close()
        self._trackers = []
        if self._jsonl is not None:
            self._jsonl.close()


class ProgressLine:
    """The progress display: one line laid out for the console's width. The step count and the ETA always
    show; then, in order and as far as they fit, the latest loss, validation loss, LR, throughput and MFU;
    the bar takes what is left and is dropped below 8 columns. The ETA is the remaining steps at the rate
    measured since the first step this process ran (a resumed run does not count the steps it skipped)."""

    MIN_BAR = 8

    def __init__(self, total: int):
        self.total = total
        self.completed = 0
        self.status: list[str] = []
        self._start: tuple[float, int] | None = None

    def advance(self, completed: int) -> None:
        if self._start is None:
            self._start = (time.monotonic(), completed)
        self.completed = completed

    def eta(self) -> str:
        if self._start is None or self.completed <= self._start[1]:
            return "-:--:--"
        t0, c0 = self._start
        seconds = (self.total - self.completed) * (time.monotonic() - t0) / (self.completed - c0)
        return f"{int(seconds // 3600)}:{int(seconds % 3600 // 60):02d}:{int(seconds % 60):02d}"

    def render(self, width: int) -> Text:
        count = f"{self.completed}/{self.total}"
        eta = f"eta {self.eta()}"
        label = "train "
        used = len(count) + 1 + len(eta)
        if used + len(label) + self.MIN_BAR + 1 <= width:
            used += len(label)
        else:
            label = ""
        shown = []
        for part in self.status:
            if used + 3 + len(part) + self.MIN_BAR + 1 > width:
                break
            shown.append(part)
            used += 3 + len(part)
        bar = width - used - 2  # two separating spaces around the bar
        text = Text(label, style="bold")
        text.append(count)
        if bar >= self.MIN_BAR:
            done = round(bar * self.completed / max(1, self.total))
            text.append(" ")
            text.append("━" * done, style="magenta")
            text.append("━" * (bar - done), style="grey37")
        text.append(" " + eta)
        for part in shown:
            text.append(" | " + part)
        return text


def _with_scored(record: dict[str, Any], last: dict[str, Any]) -> dict[str, Any]:
    """A validation loss's record with the token counts logged just before it at the same step."""
    if "val/loss" not in record or last.get("step") != record["step"] or "val/heldout_tokens" not in last:
        return record
    return {**record, "val/scored_tokens": last["val/scored_tokens"], "val/heldout_tokens": last["val/heldout_tokens"]}


def _status_line(m: dict[str, Any]) -> str:
    return " | ".join(_status_parts(m))


def _status_parts(m: dict[str, Any]) -> list[str]:
    parts = []
    if "train/loss" in m:
        parts.append(f"loss {m['train/loss']:.3f}")
    if "val/loss" in m:
        part = f"val {m['val/loss']:.3f}"
        if m.get("val/heldout_tokens"):  # how much of the held-out split it scored (plait.engine.validation)
            part += f" ({m['val/scored_tokens']:,} of {m['val/heldout_tokens']:,} held-out tokens)"
        parts.append(part)
    if "train/lr" in m:
        parts.append(f"lr {m['train/lr']:.2e}")
    if "train/tokens_per_s" in m:
        parts.append(f"{m['train/tokens_per_s']:,.0f} tok/s")
    if "train/mfu" in m:
        parts.append(f"mfu {100 * m['train/mfu']:.1f}%")
    return parts
