"""The trainer's one extension point: features of a run (guards, the hang watchdog, lineage, evaluation
monitors, fine-tuning, health checks, fault injection, your own code) are callbacks.

Every hook is optional, returns nothing, and receives the running trainer as a `RunState`: the only part of
the trainer a callback may read or call (the config, the process group and meshes, the model parts with their
optimizers and schedules, the counters, the checkpointer, the metrics, the last metrics). A callback that
withholds a step's update calls `run.withhold_step(why)`; one that rolls the run back calls `run.roll_back()`.
Hooks run in the order the callbacks were given, `close` in reverse order (like context managers), each even
if another fails. Callbacks observe moments; none calls another's hooks, and their order is not a contract
between them. The loop itself logs, evaluates and saves, in that order, after the callbacks' after_step, and
fires after_eval and after_checkpoint (plait.engine.trainer.Trainer._log_evaluate_save). The trainer's own observers are
callbacks too, before yours: plait.engine.core_callbacks' LockWatch and CompileWatch and
plait.engine.expert_balance's ExpertBalance.

    on_setup        the process group and meshes exist; the model does not yet (health checks)
    on_model        the model parts are built and initialised; optimizers not yet (load weights, add adapters:
                    what stays trainable is what the optimizers get)
    on_start        resumed (or not), before the first step
    before_step     a step is about to run (its batch is drawn)
    should_step     the step's global loss and gradient norm are known: run.withhold_step(why) keeps the
                    optimizer and the LR schedule where they are (every callback still sees the step)
    after_step      the step is applied and counted (run.state.step == step); a callback that calls
                    run.roll_back() (run.state is then a checkpoint's) ends the hook: the callbacks after it do
                    not see this step, and the loop neither logs, evaluates nor saves it
    after_eval      a validation loss was measured (after the step's log line)
    after_checkpoint  after each counted step's save decision: saved is the report of a save completed at this
                    step (an asynchronous one reports when it is published), empty when none
    close           the loop ended (also by a failure, from on_start on), before the final save is waited for
    on_end          training finished and its checkpoint is safe (final: the last metrics); not after a failure
                    or a stop
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from plait.config import Config
from plait.core.storage import Location
from plait.engine.checkpoint.manager import CheckpointManager, TrainState
from plait.engine.metrics import MetricsLogger
from plait.engine.replicas import Replicas
from plait.engine.trainable import Trainable
from plait.parallel.dims import Meshes
from plait.parallel.env import DistEnv


class RunState(Protocol):
    """What a callback sees of the running trainer (plait.engine.trainer.Trainer is one). `cfg`, `state`,
    `final`, `plait_model` and `data_dir` are there from on_setup on; the others are filled in as the run goes,
    each from the hook named beside it (read earlier, an attribute is missing: AttributeError)."""

    cfg: Config
    env: DistEnv  # the process group (rank, world size, device): from on_setup on
    meshes: Meshes  # this rank's share of the layout: from on_setup on
    t: Trainable  # the model parts, their optimizers and LR schedules, the loss: from on_start on
    # (on_model, earlier, is given the parts as its argument)
    checkpointer: CheckpointManager  # from on_start on
    metrics: MetricsLogger  # metrics.jsonl, the trackers and the console: from on_start on
    resumed_from: Location | None  # the checkpoint the run resumed (None: a fresh run): from on_start on
    state: TrainState  # the step and token counters
    final: dict[str, float]  # the last logged metrics and validation loss
    data_dir: Path | None  # the prepared corpus, a mixture's first source (None: data given to the Trainer)
    replicas: Replicas  # the replica groups (plait.engine.replicas; one alone unless fault-tolerant): from on_start on

    @property
    def plait_model(self) -> bool:
        """plait's model, built from cfg.model (False: your own, Trainer(model=...))."""
        ...

    def withhold_step(self, why: str) -> None:
        """In should_step: this step's update is not applied (the gradients are dropped)."""
        ...

    def roll_back(self) -> Location | None:
        """In after_step: load the newest checkpoint into the model, optimizers, loader and counters (the
        same one on every rank); the callbacks after this one do not see the step. None: there is none yet,
        nothing changed."""
        ...


class Callback:
    def on_setup(self, run: RunState) -> None:
        pass

    def on_model(self, run: RunState, parts: list[nn.Module]) -> None:
        pass

    def on_start(self, run: RunState) -> None:
        pass

    def before_step(self, run: RunState, step: int) -> None:
        pass

    def should_step(self, run: RunState, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        pass

    def after_step(self, run: RunState, step: int, result: Any) -> None:
        pass

    def after_eval(self, run: RunState, step: int, val_loss: float) -> None:
        pass

    def after_checkpoint(self, run: RunState, step: int, saved: dict[str, Any]) -> None:
        pass

    def on_end(self, run: RunState, final: dict[str, Any]) -> None:
        pass

    def close(self, run: RunState) -> None:
        pass


class Callbacks(Callback):
    """Several callbacks as one: each hook in turn (close in reverse order, every one even if one fails). A hook
    returns nothing: one that returns a value (plait's older protocol: False to withhold a step, True after a
    rollback) is refused, naming what to call instead. rolled_back(): whether a callback has rolled this step
    back (the trainer's; after_step stops there)."""

    def __init__(self, callbacks: Iterable[Callback] = (), rolled_back: Callable[[], bool] = lambda: False):
        self.items: list[Callback] = list(callbacks)
        self.rolled_back = rolled_back
        for c in self.items:
            if not isinstance(c, Callback):
                raise TypeError(f"{c!r} is not a plait.Callback: subclass plait.Callback and override its hooks")

    def _each(self, hook: str, *args) -> None:
        for c in self.items:
            _returned(c, hook, getattr(c, hook)(*args))

    def on_setup(self, run: RunState) -> None:
        self._each("on_setup", run)

    def on_model(self, run: RunState, parts: list[nn.Module]) -> None:
        self._each("on_model", run, parts)

    def on_start(self, run: RunState) -> None:
        self._each("on_start", run)

    def before_step(self, run: RunState, step: int) -> None:
        self._each("before_step", run, step)

    def should_step(self, run: RunState, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        self._each("should_step", run, loss, grad_norm)  # every one sees the step, withheld or not

    def after_step(self, run: RunState, step: int, result: Any) -> None:
        for c in self.items:
            _returned(c, "after_step", getattr(c, "after_step")(run, step, result))  # noqa: B009 - a user's may return
            if self.rolled_back():  # the step no longer counts: the callbacks after it never see it
                return

    def after_eval(self, run: RunState, step: int, val_loss: float) -> None:
        self._each("after_eval", run, step, val_loss)

    def after_checkpoint(self, run: RunState, step: int, saved: dict[str, Any]) -> None:
        self._each("after_checkpoint", run, step, saved)

    def on_end(self, run: RunState, final: dict[str, Any]) -> None:
        self._each("on_end", run, final)

    def close(self, run: RunState) -> None:
        errors = []
        for c in reversed(self.items):
            try:
                c.close(run)
            except Exception as e:  # the others still close; the first error is raised after them
                errors.append(e)
        if errors:
            raise errors[0]


_INSTEAD = {
    "should_step": "call run.withhold_step(why) to withhold the update",
    "after_step": "call run.roll_back() to roll the run back",
}


def _returned(callback: Callback, hook: str, value: Any) -> None:
    if value is not None:
        instead = _INSTEAD.get(hook, "return nothing")
        raise TypeError(f"{type(callback).__name__}.{hook} returned {value!r}: plait's hooks return nothing; {instead}")
