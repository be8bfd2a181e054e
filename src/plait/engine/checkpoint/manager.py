"""The checkpoint manager of a run: what the trainer and callbacks talk to. It saves on its own cadence
(plait.engine.checkpoint.cadence: every N steps, every M minutes, at the end, on a stop; deferred while the
previous save is slow or failing), asynchronously (.saving: staging, DCP's save, free space, failures), publishes
atomically and keeps what retention says (.publisher), and restores a run (.load). What is saved is the run's
list of Stateful parts (.state: model, optimizers, LR schedules, data position, counters, RNG)."""

from __future__ import annotations

import json
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plait.config import CheckpointConfig
from plait.core.publish import LockLost
from plait.core.storage import Location
from plait.engine.checkpoint.cadence import FINAL_WAIT_S, ON_TIME_MIN_S, SaveCadence, any_rank
from plait.engine.checkpoint.find import FORMAT
from plait.engine.checkpoint.load import NO_DIST_WARNING, load_state
from plait.engine.checkpoint.publisher import Publisher, kept_forever
from plait.engine.checkpoint.saving import AsyncSaver
from plait.engine.checkpoint.state import TrainState, run_state, split
from plait.engine.checkpoint.wording import warn

__all__ = [  # (the constants, TrainState and kept_forever: where plait.engine.checkpoint imports them from)
    "ABANDON_AFTER_S", "FINAL_WAIT_S", "ON_TIME_MIN_S", "CheckpointManager", "TrainState", "kept_forever",
]  # fmt: skip

# A run that fails with a save in flight waits this long for it before giving up on it (see close()).
ABANDON_AFTER_S = 30.0


class CheckpointManager:
    """Saves (asynchronously, on its own cadence) and restores model, optimizer, LR schedule, data position,
    RNG and counters of a run.

    Communication plan: besides the save's own group (.saving) and the cadence's per-step all-reduce
    (.cadence), a gloo control group carries the main thread's decisions: the main rank's free-space verdict
    before a save, whether a save given up on is still running on any rank, and whether every rank found a
    checkpoint loadable (one all-gather per load).
    """

    def __init__(
        self,
        ckpt_dir: Location,
        cfg: CheckpointConfig,
        *,
        total_steps: int = 0,
        is_writer: bool = True,
        config: dict | None = None,
        tokenizer_path: Path | None = None,
    ):
        self.dir = ckpt_dir
        self.cfg = cfg
        self.total_steps = total_steps
        self.is_writer = is_writer
        self.config = config or {}
        self.tokenizer_path = tokenizer_path
        self.failed_saves = 0
        self.final_lost = ""  # why the run's final checkpoint could not be written, if it could not
        self.stopped_at = 0  # the step at which a stop request ended the run (0: not stopped)
        # Called on every rank when a save begins, with (step, trainable): entries for that checkpoint's
        # plait.json (the lineage's weights hash, from the weights as they are saved; they may use collectives).
        self.describers: list[Callable[[int, Any], dict[str, Any]]] = []
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        self._rank = dist.get_rank() if dist.is_initialized() else 0
        self._control = dist.new_group(backend="gloo") if distributed else None
        warnings.filterwarnings("ignore", message=NO_DIST_WARNING)  # one process saves without a group: intended
        self.publisher = Publisher(ckpt_dir, cfg, is_writer=is_writer, tokenizer_path=tokenizer_path)
        self._saver = AsyncSaver(cfg, self.publisher, control=self._control, rank=self._rank)
        self._cadence = SaveCadence(cfg, self._saver, total_steps=total_steps, control=self._control, rank=self._rank)

    # ---------------------------------------------------------------------------------------- cadence

    def should_save(self, step: int, stop_requested: bool = False) -> tuple[bool, bool, bool]:
        """(save due, stop now, a save still in flight), the same on every rank (SaveCadence.should_save)."""
        return self._cadence.should_save(step, stop_requested)

    def maybe_save(self, step: int, t, *, loader, state: TrainState, stop_requested: bool = False) -> dict[str, float]:
        """Publish a save that has finished; start one if due. Returns metrics of a save that ended in this
        call (else nothing): saved_step or failed_step, blocked_s (how long the save held up the loop),
        write_s (from staged to published), size_mb, and failed_saves (saves lost so far in this run); or
        deferred_step when a due save had to wait for the previous one.

        The loop never waits for slow or failing storage: a save due while the previous one is still being
        written waits for it only while that one is on time (no failed write, not yet twice as long as the last
        good save, or ON_TIME_MIN_S); after that it is deferred, not waited for, to the first step at which the
        previous one has ended (a backlog of one: later save points meanwhile are folded into it). The final
        save and a stop's save wait, at most FINAL_WAIT_S and saying so. When a stop was requested on any rank
        (`plait.core.stop`), this step's save is waited for (published before returning) and `stopped` is set: the
        loop ends here on every rank."""
        cadence, saver = self._cadence, self._saver
        report = self._collect(wait=False)
        due, stop, busy = cadence.should_save(step, stop_requested)
        if stop or cadence.is_final(step):
            cadence.wait_for_final()
            report.update(self._wait_for_storage(f"the save of step {saver.in_flight_step}", before=step))
            if not any_rank(self._control, saver.abandoned is not None):  # its staging buffers are free
                cadence.deferred = 0
                report.update(self.save(step, t, loader=loader, state=state))
            elif not self.final_lost:
                self.final_lost = f"the checkpoint of step {step} was not attempted: {saver.abandoned_why}"
        elif due and busy and cadence.still_in_flight_after_its_usual_time():
            report.update(cadence.defer(step))
        elif due or (cadence.deferred and not busy):
            cadence.deferred = 0
            report.update(self.save(step, t, loader=loader, state=state))
        if stop:
            report.update(self.wait())
            self.stopped_at = step
        return report

    def _wait_for_storage(self, what: str, *, before: int | None = None) -> dict[str, float]:
        """Wait for the save in flight until the cadence's deadline, saying so when it is not over within a
        second. Past the deadline it is abandoned (the process still ends only once its retries do) and the
        run's final checkpoint is reported lost."""
        saver = self._saver
        if saver.pending is None:
            return {}
        if not saver.wait(1.0):
            left = max(0.0, self._cadence.deadline - time.monotonic())
            if self.is_writer:
                after = f" before the checkpoint of step {before}" if before is not None else ""
                warn(f"waiting up to {left:.0f} s for {what} to {self.dir}{after} ({saver.storage_state()})")
            if not saver.wait(left):
                self.failed_saves += 1
                self.final_lost = self.final_lost or saver.abandon(what)
                return {"failed_step": saver.in_flight_step, "failed_saves": self.failed_saves}
        return self._collect(wait=True)

    def wait(self) -> dict[str, float]:
        """Wait for the save in flight (if any) to be published or to fail, at most FINAL_WAIT_S; its report."""
        if self._saver.pending is not None and self._cadence.deadline <= time.monotonic():
            self._cadence.wait_for_final()
        return self._wait_for_storage(f"the checkpoint of step {self._saver.in_flight_step}")

    def close(self) -> dict[str, float]:
        """Wait for the save in flight and publish it; release threads, buffers and groups. Returns on
        every rank only once the last checkpoint is visible.

        Called while an exception propagates (the run failed), it waits at most ABANDON_AFTER_S for the save
        in flight (a lost peer would make it wait for the collective timeout) and not for the other ranks."""
        failing = sys.exc_info()[0] is not None
        if failing and self._saver.pending is not None and not self._saver.wait(ABANDON_AFTER_S):
            warn(f"run failed with a checkpoint save in flight; abandoned after {ABANDON_AFTER_S} s")
            self._saver.pending = None
            return {}
        try:
            report = self.wait()
        except LockLost:  # the last save was refused: another run holds the directory now
            self._shut_down()
            raise
        if self._control is not None and not failing:
            dist.barrier(group=self._control)
        self._shut_down()
        return report

    def _shut_down(self) -> None:
        self._saver.shut_down()
        if self._control is not None:
            dist.destroy_process_group(self._control)
        self._control = None

    # ------------------------------------------------------------------------------------------- save

    def save(self, step: int, t, *, loader, state: TrainState) -> dict[str, float]:
        """Start saving this step (asynchronously if checkpoint.async_enabled; see plait.engine.checkpoint).
        Returns the report of a save that ended meanwhile: the previous one, or this one if synchronous."""
        start = time.perf_counter()
        report = self._collect(wait=True)  # one save in flight at a time: its staging buffers are reused
        saver = self._saver
        saver.in_flight_step = step
        described = {k: v for describe in self.describers for k, v in describe(step, t).items()}  # every rank
        self._cadence.last_save_time = time.monotonic()
        saver.begin()
        tensors, plain = split(run_state(t, loader=loader, state=state, rank=self._rank))
        short = saver.short_of_space(tensors)
        if short:  # refused before writing a byte: a save that cannot fit would only fill the disk
            saver.refuse(step, short)
            report.update(self._collect(wait=True))
            return report
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        meta = {"format": FORMAT, **plain, "world_size": world_size, "config": self.config, **described}
        meta = json.loads(json.dumps(meta, default=_jsonable))  # a snapshot: the loop moves on meanwhile
        saver.start(step, tensors, meta, start)
        if not self.cfg.async_enabled:
            report.update(self._collect(wait=True))
        return report

    def _collect(self, *, wait: bool) -> dict[str, float]:
        """The report of the save in flight, if it has finished (or once it has, with wait)."""
        outcome = self._saver.collect(wait=wait)
        if outcome is None:
            return {}
        if outcome.fenced:
            raise LockLost(outcome.error)
        if outcome.ok:
            return {
                "saved_step": outcome.step,
                "blocked_s": outcome.blocked_s,
                "write_s": outcome.write_s,
                "size_mb": outcome.num_bytes / 2**20,
                "failed_saves": self.failed_saves,
            }
        self.failed_saves += 1
        if outcome.step == self.total_steps and self.cfg.save_final:  # the run's error says it, once
            self.final_lost = f"the final checkpoint (step {outcome.step}) could not be written: {outcome.error}"
        elif self.is_writer:
            warn(
                f"checkpoint of step {outcome.step} was not saved to {self.dir}: {outcome.error}; "
                f"training continues and the next save tries again"
            )
        return {"failed_step": outcome.step, "blocked_s": outcome.blocked_s, "failed_saves": self.failed_saves}

    # ------------------------------------------------------------------------------------------- load

    def mark_damaged(self, path: Location, why: str) -> None:
        """A checkpoint that failed to load (a CRC32 mismatch, a truncated record): from now on neither counted,
        loaded nor deleted by retention, and set aside, not replaced, by a new save of its step."""
        self.publisher.verified[path.name] = why or "it failed to load"

    def load(self, path: Location, t, *, loader, state: TrainState) -> None:
        """Restore the run from `path` on every rank (plait.engine.checkpoint.load.load_state)."""
        load_state(path, t, loader=loader, state=state, group=self._control, rank=self._rank, config=self.config)


def _jsonable(obj):
    if isinstance(obj, torch.Tensor):
        return obj.item()
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(f"cannot store {type(obj).__name__} in checkpoint metadata")
