"""Preemption-safe by default: SIGTERM (a preemption, a time limit) or SIGINT (Ctrl-C) mid-run finishes the step,
writes a checkpoint of it and exits 75; the same command resumes, and the finished run is bitwise equal to an
uninterrupted one. One process and `plait train --nproc 2` (the elastic agent forwards the signal to its
workers); SIGINT goes to the whole process group, as a terminal's Ctrl-C does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from plait.config import load_config
from plait.core.stop import EXIT_STOPPED
from plait.engine.checkpoint import list_checkpoints
from runs import debug_run

STEPS = 40

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def command(data_dir: Path, out: Path, name: str, nproc: int, *extra: str) -> list[str]:
    args = debug_run(data_dir, out, name, STEPS, *extra)
    return [sys.executable, "-m", "plait.cli", "train", "--nproc", str(nproc), *[f"--{a}" for a in args]]


def logged_steps(run_dir: Path) -> list[int]:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line)["step"] for line in lines if line.endswith("}") and '"train/loss"' in line]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from plait.engine.checkpoint import load_model_weights
    from plait.engine.trainer import build_model

    ckpt = list_checkpoints(run_dir / "checkpoints")[-1]
    assert ckpt.name == f"step_{STEPS:08d}"
    model = build_model(load_config(None, ["model.preset=debug"]).model, torch.device("cpu"), seed=0)
    load_model_weights(model, ckpt)
    return model.state_dict()


@pytest.fixture(scope="module")
def uninterrupted(data_dir, tmp_path_factory) -> dict[int, dict]:
    """The reference runs, one per process count (FSDP over 2 ranks is not bitwise one process)."""
    out = tmp_path_factory.mktemp("straight")
    refs = {}
    for nproc in (1, 2):
        cmd = command(data_dir, out, f"n{nproc}", nproc, "sample.max_new_tokens=8")
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "OTHELLO." in done.stdout and "sample" in done.stderr, done.stdout  # a sample at any nproc
        refs[nproc] = final_weights(out / f"n{nproc}")
    return refs


# One process and two, SIGINT and SIGTERM: the two crossings that CI runs cover each; --full runs all four.
FULL = pytest.mark.full


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc,sig",
    [(1, "SIGINT"), (2, "SIGTERM"), pytest.param(1, "SIGTERM", marks=FULL), pytest.param(2, "SIGINT", marks=FULL)],
)
def test_signal_mid_run_saves_the_step_and_the_resumed_run_is_bitwise_equal(
    data_dir, uninterrupted, tmp_path, nproc, sig
):
    run_dir = tmp_path / "run"
    cmd = command(data_dir, tmp_path, "run", nproc)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 300
    while len(logged_steps(run_dir)) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before it could be signalled"
    if sig == "SIGINT":  # Ctrl-C: the terminal signals the whole foreground process group
        os.killpg(proc.pid, signal.SIGINT)
    else:  # a preemption: the launcher (or the lone process) is told to stop
        os.kill(proc.pid, signal.SIGTERM)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_STOPPED, output[-3000:]
    reached = logged_steps(run_dir)[-1]
    assert 3 <= reached < STEPS, reached
    ckpts = list_checkpoints(run_dir / "checkpoints")
    assert ckpts and ckpts[-1].name == f"step_{reached:08d}", (ckpts, reached)  # complete, at the step reached
    assert f"stopped by {sig} at step {reached}/{STEPS}; checkpoint {ckpts[-1]} written" in " ".join(output.split())
    assert "Traceback" not in output

    resumed = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {ckpts[-1]} (step {reached})" in " ".join(resumed.stderr.split())
    got, want = final_weights(run_dir), uninterrupted[nproc]
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the picture, at any nproc


def test_the_default_job_writes_periodic_checkpoints():
    """Without any checkpoint setting the default job (400 steps) saves every 100 steps and every 30 minutes,
    keeping the last 2: a preemption or a crash costs at most 100 steps, a signal none."""
    cfg = load_config(None, [])
    c = cfg.checkpoint
    assert c.every_steps == 100 and c.every_minutes == 30 and c.keep_last == 2 and c.save_final
    assert cfg.train.steps // c.every_steps >= 3


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@pytest.mark.slow
def test_a_stop_while_the_workers_start_says_no_checkpoint_was_written(data_dir, tmp_path):
    """SIGTERM to `plait train --nproc 2` while its workers are still starting (spawned, importing): exit 75
    with a line that says no checkpoint was written by this stop and what the same command will do, not that
    "the workers' checkpoint is said above"."""
    if not Path("/proc/self/task").is_dir():
        pytest.skip("needs /proc to see the launcher's workers")
    proc = subprocess.Popen(
        command(data_dir, tmp_path, "early", 2), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while len(_children(proc.pid)) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_STOPPED, err[-3000:]
    line = " ".join(err.split())
    assert "stopped by SIGTERM before the workers wrote a checkpoint" in line, err[-3000:]
    # (a worker still reading its start-up data from the agent when the agent stops it may print Python's
    # EOFError from multiprocessing's spawn, torch's process start, after this line)
    assert "said above" not in line, err[-3000:]
    assert not list_checkpoints(tmp_path / "early" / "checkpoints")
