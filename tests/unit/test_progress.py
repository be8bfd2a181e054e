"""The progress display fits the terminal: at 60 and 80 columns (rich's console width) the step count and the
ETA are always whole, fields are added as they fit, and no line is wider than the console."""

from __future__ import annotations

import io
import re
import sys
import time

import pytest
from rich.console import Console

import plait.engine.metrics as metrics
from plait.config import LogConfig


@pytest.mark.parametrize("width", [60, 80])
def test_progress_display_fits_and_shows_step_count_and_eta(width, tmp_path, monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(metrics, "console", Console(width=width, force_terminal=True, file=out, color_system=None))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    logger = metrics.MetricsLogger(tmp_path, LogConfig(tensorboard=False), total_steps=400)
    logger.advance(0)
    for step in range(1, 121):
        time.sleep(0.001)
        logger.log(step, {"loss": 5.1234, "lr": 2.3e-3, "tokens_per_s": 19022.0, "mfu": 0.401})
        logger.advance(step)
    logger.close()
    frames = [re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", line) for line in re.split(r"[\r\n]", out.getvalue())]
    last = [f for f in frames if "120/400" in f][-1].rstrip()
    assert re.search(r"120/400 .*eta \d+:\d\d:\d\d", last), last
    assert "loss 5.123" in last and len(last) <= width, last
    if width == 80:
        assert "━" in last  # room for the bar too
    assert all(len(f.rstrip()) <= width for f in frames)


def test_a_resumed_run_shows_its_step_from_the_start(tmp_path, monkeypatch):
    """Resumed at step 250 of 400: the display says 250/400 before the first new step, never 0/400."""
    out = io.StringIO()
    monkeypatch.setattr(metrics, "console", Console(width=80, force_terminal=True, file=out, color_system=None))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    logger = metrics.MetricsLogger(tmp_path, LogConfig(tensorboard=False), total_steps=400, start_step=250)
    assert logger._progress is not None and "250/400" in logger._progress.render(80).plain
    logger.close()
    assert "0/400" not in out.getvalue().replace("250/400", "")


def test_a_long_command_off_a_terminal_prints_a_line_every_few_seconds_with_an_eta():
    """core.progress: counted work in a log (not a terminal) gets a line per interval with count, percent, rate
    and ETA, and a closing line with the time taken; an uncountable phase gets a heartbeat and its duration."""
    from plait.core.progress import Progress, phase

    out = io.StringIO()
    with Progress("data retrieve: train", 100, unit="chunks", every=0.01, stream=out) as p:
        for i in range(1, 101):
            time.sleep(0.001)
            p.update(i)
    lines = out.getvalue().splitlines()
    assert len(lines) >= 3 and "\x1b" not in out.getvalue(), lines  # plain lines: a log holds no escapes
    assert re.match(r"data retrieve: train: \d+/100 chunks, \d+%, [\d,.]+ chunks/s, ETA \d+ s, \d+ s so far", lines[0])
    assert lines[-1].startswith("data retrieve: train: 100/100 chunks in "), lines[-1]
    beat = io.StringIO()
    with phase("compiling", every=0.02, stream=beat):
        time.sleep(0.1)
    said = beat.getvalue().splitlines()
    assert said[0] == "compiling: still running, 0 s so far" and said[-1] == "compiling: done in 0 s", said
