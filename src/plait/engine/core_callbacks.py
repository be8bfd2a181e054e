"""The trainer's own features that attach as callbacks (Trainer.core_callbacks): the run-lock check, the
compile monitor and the checkpointer. (Logging, validation and the experts' balancing are callback modules of
their own: plait.engine.step_metrics, .validation, .moe.)"""

from __future__ import annotations

import torch

from plait.core.errors import PlaitError
from plait.engine.callbacks import Callback, RunState
from plait.engine.compile_cache import CompileMonitor
from plait.engine.metrics import info
from plait.model.llama import TransformerBlock
from plait.parallel.compile import float8_plan


class Checkpointing(Callback):
    """run.checkpointer attached to the trainer: after each counted step, a save when one is due (or when a
    stop was requested: then the loop ends at this step), and every callback's after_checkpoint."""

    def after_step(self, run: RunState, step: int, result) -> None:
        stop = run.stop.requested
        saved = run.checkpointer.maybe_save(step, run.t, loader=run.loader, state=run.state, stop_requested=stop)
        run.callbacks.after_checkpoint(run, step, saved)


class CompileWatch(Callback):
    """The compile monitor attached to the trainer (run.compiler): caches set up before the model is built,
    each step checked for recompilation, the first evaluation's compilations expected."""

    def on_setup(self, run) -> None:
        run.compiler = CompileMonitor.start(run.cfg, run.env.device, run.env.is_main)
        if run.env.is_main and run.cfg.compile.float8 == "auto":
            block = None
            if run.model_fn is None:  # plait's model: one of its blocks on meta
                with torch.device("meta"):
                    block = TransformerBlock(run.cfg.model, 0)
            on, why = float8_plan(run.cfg.compile, run.env.device, block)
            info(f"float8 (compile.float8=auto): {'on' if on else 'off'}: {why}")

    def after_step(self, run: RunState, step: int, result) -> None:
        run.compiler.check(step)  # static shapes: any compilation after the first step is a recompilation

    def after_eval(self, run, step: int, val_loss: float) -> None:
        run.compiler.phase_done("evaluation")


class LockWatch(Callback):
    """Stops the run (an error on the main rank, before its next step) if another run took its lock over:
    this process was held up past its lease, and two runs must not write one directory."""

    def before_step(self, run, step: int) -> None:
        if run.lock is not None and run.lock.lost:
            raise PlaitError(
                f"{run.lock.lost} while this run was held up; it stops before step {step} so that two runs do not "
                f"write one directory (its checkpoints so far are kept)"
            )
