"""The trainer's one extension point: features of a run (guards, the hang watchdog, lineage, evaluation
monitors, fine-tuning, health checks, fault injection, your own code) are callbacks.

Every hook is optional and receives the running `plait.engine.trainer.Trainer` (its `cfg`, `env`, `meshes`, `t` (model
parts, optimizers, schedules), `loader`, `state`, `checkpointer`, `metrics`, `compiler`, `callbacks`, `final`).
Hooks run in the order the callbacks were given, `close` in reverse order (like context managers), each even if
another fails. The trainer's own features are callbacks too, around yours: plait.engine.runlock.LockWatch and
plait.engine.compile_cache.CompileWatch first; then yours; then plait.engine.step_metrics.StepMetrics (logging),
plait.engine.validation.Validation and plait.engine.checkpoint.Checkpointing, whose after_step hooks log,
evaluate and save a step that counts.

    on_setup        the process group and meshes exist; the model does not yet (health checks)
    on_model        the model parts are built and initialised; optimizers not yet (load weights, add adapters:
                    what stays trainable is what the optimizers get)
    on_start        resumed (or not), before the first step
    before_step     a step is about to run (its batch is drawn)
    should_step     the step's global loss and gradient norm are known: False withholds the update
    after_step      the step is applied and counted (run.state.step == step); True means the callback rolled
                    the run back (run.state is a checkpoint's): the callbacks after it do not see this step
    after_eval      a validation loss was measured
    after_checkpoint  after each step's save decision: saved is the report of a save completed at this step
                    (an asynchronous one reports when it is published), empty when none
    close           the loop ended (also by a failure, from on_start on), before the final save is waited for
    on_end          training finished and its checkpoint is safe (final: the last metrics); not after a failure
                    or a stop
"""

from __future__ import annotations

from typing import Any


class Callback:
    def on_setup(self, run) -> None:
        pass

    def on_model(self, run, parts: list) -> None:
        pass

    def on_start(self, run) -> None:
        pass

    def before_step(self, run, step: int) -> None:
        pass

    def should_step(self, run, loss, grad_norm) -> bool:
        return True

    def after_step(self, run, step: int, result) -> bool:
        return False

    def after_eval(self, run, step: int, val_loss: float) -> None:
        pass

    def after_checkpoint(self, run, step: int, saved: dict[str, Any]) -> None:
        pass

    def on_end(self, run, final: dict[str, Any]) -> None:
        pass

    def close(self, run) -> None:
        pass


class Callbacks(Callback):
    """Several callbacks as one: each hook in turn (close in reverse order, every one even if one fails)."""

    def __init__(self, callbacks=()):
        self.items: list[Callback] = list(callbacks)
        for c in self.items:
            if not isinstance(c, Callback):
                raise TypeError(f"{c!r} is not a plait.Callback: subclass plait.Callback and override its hooks")

    def on_setup(self, run) -> None:
        for c in self.items:
            c.on_setup(run)

    def on_model(self, run, parts: list) -> None:
        for c in self.items:
            c.on_model(run, parts)

    def on_start(self, run) -> None:
        for c in self.items:
            c.on_start(run)

    def before_step(self, run, step: int) -> None:
        for c in self.items:
            c.before_step(run, step)

    def should_step(self, run, loss, grad_norm) -> bool:
        verdicts = [c.should_step(run, loss, grad_norm) for c in self.items]  # every one sees the step
        return all(verdicts)

    def after_step(self, run, step: int, result) -> bool:
        # any() stops at the first True: a rolled-back step does not count, and the callbacks after it never see it
        return any(c.after_step(run, step, result) for c in self.items)

    def after_eval(self, run, step: int, val_loss: float) -> None:
        for c in self.items:
            c.after_eval(run, step, val_loss)

    def after_checkpoint(self, run, step: int, saved: dict[str, Any]) -> None:
        for c in self.items:
            c.after_checkpoint(run, step, saved)

    def on_end(self, run, final: dict[str, Any]) -> None:
        for c in self.items:
            c.on_end(run, final)

    def close(self, run) -> None:
        errors = []
        for c in reversed(self.items):
            try:
                c.close(run)
            except Exception as e:  # the others still close; the first error is raised after them
                errors.append(e)
        if errors:
            raise errors[0]
