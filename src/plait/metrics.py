"""Training metrics: one JSON line per logged step, TensorBoard scalars, and a rich progress bar.

Only the rank that logs (rank 0) creates files; other ranks get a logger that does nothing.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from plait.config import LogConfig

console = Console(stderr=True, soft_wrap=True)  # paths stay on one line: copy-pasteable, greppable


class MetricsLogger:
    def __init__(self, run_dir: Path, cfg: LogConfig, total_steps: int, *, enabled: bool = True):
        self.cfg = cfg
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        self._progress: Progress | None = None
        self._task = None
        self.last: dict[str, Any] = {}
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 - closed in close()
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tb"))
        if cfg.progress and sys.stderr.isatty():
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=console,
            )
            self._task = self._progress.add_task("train", total=total_steps, status="")
            self._progress.start()

    def should_log(self, step: int, total_steps: int) -> bool:
        return step % self.cfg.every_steps == 0 or step == total_steps or step == 1

    def log(self, step: int, metrics: dict[str, Any], *, prefix: str = "train") -> None:
        """Record metrics of `step`; the progress bar shows the latest loss."""
        if not self.enabled:
            return
        record = {"step": step, "time": time.time(), **{f"{prefix}/{k}": v for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, int | float):
                    self._tb.add_scalar(f"{prefix}/{key}", value, step)
        self.last.update(record)
        if self._progress is not None:
            self._progress.update(self._task, status=_status_line(self.last))
        elif line := _status_line(record):  # records without a headline figure (guard/, checkpoint/) stay quiet
            console.print(f"step {step:>6} {line}", highlight=False)

    def advance(self, step: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._tb is not None:
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()


def _status_line(m: dict[str, Any]) -> str:
    parts = []
    if "train/loss" in m:
        parts.append(f"loss {m['train/loss']:.3f}")
    if "val/loss" in m:
        parts.append(f"val {m['val/loss']:.3f}")
    if "train/lr" in m:
        parts.append(f"lr {m['train/lr']:.2e}")
    if "train/tokens_per_s" in m:
        parts.append(f"{m['train/tokens_per_s']:,.0f} tok/s")
    if "train/mfu" in m:
        parts.append(f"mfu {100 * m['train/mfu']:.1f}%")
    return " | ".join(parts)
