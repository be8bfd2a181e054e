"""When a run saves: every checkpoint.every_steps, every checkpoint.every_minutes, at the last step, and when a
stop was asked; a due save deferred while the previous one is slow or failing, and how long the final save (and
a stop's) is waited for.

Communication plan: one small all-reduce (MAX) per step over the manager's gloo control group when distributed
(none in one process): whether a time-based save is due (rank 0's clock decides for all), whether any rank was
asked to stop, whether the previous save is still in flight on any rank. Deciding to defer takes one more."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from plait.config import CheckpointConfig
from plait.engine.checkpoint.saving import AsyncSaver
from plait.engine.checkpoint.wording import warn

# A due save waits for the one in flight while that one is on time: no failed write, and not yet longer than
# twice the last good save or this (whichever is longer); then it is deferred. The loop's longest wait for
# storage is this, or twice a good save's time (bench/s3_outage.py).
ON_TIME_MIN_S = 0.5

# The final save and a stop's save (and the save in flight before them) are waited for at most this long:
# a preempted worker has 110 s (plait.cli.launch.STOP_GRACE_S) for its last step and checkpoint.
FINAL_WAIT_S = 90.0


class SaveCadence:
    """The schedule of one run's saves, the same decision on every rank (see the module docstring)."""

    def __init__(self, cfg: CheckpointConfig, saver: AsyncSaver, *, total_steps: int, control, rank: int):
        self.cfg = cfg
        self.saver = saver
        self.total_steps = total_steps
        self.control = control
        self.rank = rank
        self.last_save_time = time.monotonic()
        self.deferred = 0  # a step whose save waits for the one in flight to end (0: none)
        self.deferred_saves = 0
        self.deadline = 0.0  # until when a final or stop save (and the one before it) is waited for

    def should_save(self, step: int, stop_requested: bool = False) -> tuple[bool, bool, bool]:
        """(save due, stop now, a save still in flight), the same on every rank. A save is due every
        checkpoint.every_steps, every checkpoint.every_minutes (rank 0's clock decides for all ranks), at the
        last step if checkpoint.save_final, and when any rank was asked to stop (a signal). In flight: the
        previous save has not ended on some rank."""
        every = self.cfg.every_steps
        due = (every > 0 and step % every == 0) or self.is_final(step)
        late = self.cfg.every_minutes > 0 and time.monotonic() - self.last_save_time >= 60 * self.cfg.every_minutes
        busy = self.saver.busy()
        if self.control is not None:
            flags = torch.tensor([int(late and self.rank == 0), int(stop_requested), int(busy)])
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.control)
            late, stop_requested, busy = bool(flags[0]), bool(flags[1]), bool(flags[2])
        return due or late or stop_requested, stop_requested, busy

    def is_final(self, step: int) -> bool:
        """The run's last step, whose save checkpoint.save_final asks for (waited for, never deferred)."""
        return step == self.total_steps and self.cfg.save_final

    def wait_for_final(self) -> None:
        """A final or stop save is due: the one in flight before it, and it, are waited for from now until
        the deadline: FINAL_WAIT_S, longer where a good save took long (a large model on slow storage is not
        abandoned for being large)."""
        self.deadline = time.monotonic() + FINAL_WAIT_S + 2 * self.saver.last_write_s

    def still_in_flight_after_its_usual_time(self) -> bool:
        """Wait for the save in flight while it is on time (no failed write, and no longer yet than
        max(ON_TIME_MIN_S, 2 x the last good save's time)); then whether it is still in flight on any rank."""
        self.saver.wait_while_on_time(max(ON_TIME_MIN_S, 2 * self.saver.last_write_s))
        return any_rank(self.control, self.saver.busy())

    def defer(self, step: int) -> dict[str, float]:
        """A save due while the previous one is still being written: taken at the first step after that one
        ends; said once per deferral (a further save point meanwhile is folded into it)."""
        first = not self.deferred
        self.deferred = step
        self.deferred_saves += 1
        if first and self.saver.is_writer:
            warn(
                f"checkpoint of step {step} deferred: the save of step {self.saver.in_flight_step} is still being "
                f"written to {self.saver.dir} ({self.saver.storage_state()}); training goes on, and the next step "
                f"after that save ends is saved"
            )
        return {"deferred_step": step, "deferred_saves": self.deferred_saves}


def any_rank(group, flag: bool) -> bool:
    """Whether `flag` is set on any rank of `group` (one all-reduce; the flag itself in one process)."""
    if group is None:
        return flag
    box = torch.tensor([int(flag)])
    dist.all_reduce(box, op=dist.ReduceOp.MAX, group=group)
    return bool(box.item())
