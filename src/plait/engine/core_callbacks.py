"""The trainer's own observers that attach as callbacks, before yours (Trainer._callbacks_for_run): the run-lock
check and the compile monitor. (The experts' balancing is a callback module of its own, plait.engine.expert_balance;
logging, validation and checkpointing are not callbacks: the loop calls them, plait.engine.step_metrics,
.validation and the checkpointer.)"""

from __future__ import annotations

import torch

from plait.core.errors import PlaitError
from plait.engine.callbacks import Callback, RunState
from plait.engine.compile_cache import CompileMonitor
from plait.engine.metrics import info
from plait.engine.runlock import RunLock
from plait.model.llama import TransformerBlock
from plait.parallel.compile import float8_plan


class CompileWatch(Callback):
    """The compile monitor attached to the trainer (`monitor`): caches set up before the model is built,
    each step checked for recompilation, the first evaluation's compilations expected."""

    monitor: CompileMonitor  # from on_setup on

    def on_setup(self, run: RunState) -> None:
        self.monitor = CompileMonitor.start(run.cfg, run.env.device, run.env.is_main)
        if run.env.is_main and run.cfg.compile.float8 == "auto":
            block = None
            if run.plait_model:  # plait's model: one of its blocks on meta
                with torch.device("meta"):
                    block = TransformerBlock(run.cfg.model, 0)
            on, why = float8_plan(run.cfg.compile, run.env.device, block)
            info(f"float8 (compile.float8=auto): {'on' if on else 'off'}: {why}")

    def after_step(self, run: RunState, step: int, result) -> None:
        self.monitor.check(step)  # static shapes: any compilation after the first step is a recompilation

    def after_eval(self, run: RunState, step: int, val_loss: float) -> None:
        self.monitor.phase_done("evaluation")


class LockWatch(Callback):
    """Stops the run (an error on the main rank, before its next step) if another run took its lock over:
    this process was held up past its lease, and two runs must not write one directory. lock: the run
    directory's lock, held by the main rank (None on the others: nothing to watch)."""

    def __init__(self, lock: RunLock | None):
        self.lock = lock

    def before_step(self, run: RunState, step: int) -> None:
        if self.lock is not None and self.lock.lost:
            raise PlaitError(
                f"{self.lock.lost} while this run was held up; it stops before step {step} so that two runs do not "
                f"write one directory (its checkpoints so far are kept)"
            )
