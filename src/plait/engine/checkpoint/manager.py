"""Saving: the cadence of a run's checkpoints (every N steps, every M minutes, at the end, on a stop; deferred
while the previous one is slow or failing), asynchronous saves that publish atomically, free space checked
before a byte is written, retention, and restoring a run (plait.engine.checkpoint.load)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

from plait.config import CheckpointConfig
from plait.core import storage, torch_private
from plait.core.publish import LockLost, check_fence, displaced_holder
from plait.core.storage import DCP_METADATA, Location
from plait.data.chat import chat_files
from plait.engine.checkpoint.find import (
    ANY_STEP_DIR,
    FORMAT,
    META,
    checkpoint_problems,
    classify,
    read_meta,
    step_of,
)
from plait.engine.checkpoint.load import NO_DIST_WARNING, load_state, rng_state, state_dicts
from plait.engine.checkpoint.pins import describe_pin, pinned
from plait.engine.checkpoint.verify import flatten
from plait.engine.checkpoint.wording import mb, one_line, short, warn

# A run that fails with a save in flight waits this long for it before giving up on it (see close()).
ABANDON_AFTER_S = 30.0

# A due save waits for the one in flight while that one is on time: no failed write, and not yet longer than
# twice the last good save or this (whichever is longer); then it is deferred. The loop's longest wait for
# storage is this, or twice a good save's time (bench/s3_outage.py).
ON_TIME_MIN_S = 0.5

# The final save and a stop's save (and the save in flight before them) are waited for at most this long:
# a preempted worker has 110 s (plait.cli.launch.STOP_GRACE_S) for its last step and checkpoint.
FINAL_WAIT_S = 90.0


@dataclass
class TrainState:
    """Counters of a run: restored exactly on resume."""

    step: int = 0
    tokens: int = 0


@dataclass
class _Outcome:
    step: int
    ok: bool
    error: str = ""
    blocked_s: float = 0.0
    write_s: float = 0.0
    num_bytes: int = 0
    fenced: bool = False  # refused: another run took the lock over (error says which)


class CheckpointManager:
    """Saves (asynchronously, on its own cadence) and restores model, optimizer, LR schedule, data position,
    RNG and counters of a run.

    Communication plan: an asynchronous save runs DCP's collectives (gather the save plans, scatter the
    final plan, gather the write results; a handful of small messages per save) on a gloo group of its own
    from a background thread, so they never interleave with the training step's collectives. A second gloo
    group carries the main thread's decisions: whether a time-based save is due (rank 0's clock decides, one
    broadcast per step when checkpoint.every_minutes is set) and whether every rank found a checkpoint
    loadable (one all-gather per load).
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
        self.deferred_saves = 0
        self._deferred = 0  # a step whose save waits for the one in flight to end (0: none)
        self._in_flight_step = 0  # the step of the save in flight
        self._deadline = 0.0  # until when a final or stop save (and the one before it) is waited for
        self._abandoned: Future | None = None  # a save given up on past the deadline (its thread may still run)
        self._abandoned_why = ""
        self._failed_attempts_at_start = 0  # storage.FAILED_ATTEMPTS when the save in flight began
        self._started_at = 0.0  # when the save in flight began
        self._last_write_s = 0.0  # how long the last good save took from staged to published
        self._distributed = dist.is_initialized() and dist.get_world_size() > 1
        self._rank = dist.get_rank() if dist.is_initialized() else 0
        self._control = dist.new_group(backend="gloo") if self._distributed else None
        self._save_group = dist.new_group(backend="gloo") if self._distributed and cfg.async_enabled else None
        self._stager = None  # torch_private.reusable_stager, made at the first asynchronous save
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._last_save_time = time.monotonic()
        self._last_size = 0  # bytes of the last complete save: the free space the next one needs
        self._estimate = 0  # bytes a save takes, estimated from the tensors before the first one
        self.final_lost = ""  # why the run's final checkpoint could not be written, if it could not
        # Called on every rank when a save begins, with (step, trainable): entries for that checkpoint's
        # plait.json (the lineage's weights hash, from the weights as they are saved; they may use collectives).
        self.describers: list[Callable[[int, Any], dict[str, Any]]] = []
        self._val_losses: dict[str, float | None] = {}  # checkpoint name -> its recorded validation loss
        # Called on the main rank before a save is published, with its step (a test's fault injection).
        self.before_publish: list[Callable[[int], None]] = []
        warnings.filterwarnings("ignore", message=NO_DIST_WARNING)  # one process saves without a group: intended
        self.stopped_at = 0  # the step at which a stop request ended the run (0: not stopped)
        self._verified: dict[str, str] = {}  # checkpoint name -> its problems ("" for none), for retention
        self._replaced: dict[str, Location] = {}  # on S3: a complete checkpoint moved aside until its step is saved
        self._said_pinned: set[str] = set()  # pinned checkpoints retention has said it keeps
        self._displaced = displaced_holder(self.dir) if self.is_writer else ""
        if self.is_writer and isinstance(self.dir, Path):
            storage.makedirs(self.dir)
            self._clear_unfinished(self.dir)

    def _clear_unfinished(self, root: Path) -> None:
        """Saves an earlier process never finished: removed, unless the lock was taken from a holder that may
        still be running (run.break_lock, an expired lease): then they are its in-flight files, moved aside
        (never deleted, never mixed with a save of ours), and said."""
        unfinished = sorted(root.glob("step_*.tmp"))  # a local directory (on S3 a save writes in place)
        if not self._displaced:
            for stale in unfinished:
                storage.remove_tree(stale)
            return
        for stale in unfinished:
            aside = set_aside_name(stale, "displaced")
            storage.rename(stale, aside)
            warn(
                f"{stale} is an unfinished save of {self._displaced}, whose lock this run took over and which "
                f"may still be running: moved to {aside}, not deleted (that run publishes nothing more); delete it "
                f"once that run has ended"
            )

    # ---------------------------------------------------------------------------------------- cadence

    def should_save(self, step: int, stop_requested: bool = False) -> tuple[bool, bool, bool]:
        """(save due, stop now, a save still in flight), the same on every rank. A save is due every
        checkpoint.every_steps, every checkpoint.every_minutes (rank 0's clock decides for all ranks), at the
        last step if checkpoint.save_final, and when any rank was asked to stop (a signal). In flight: the
        previous save has not ended on some rank. One small all-reduce over the control group per step when
        distributed (none in one process)."""
        every = self.cfg.every_steps
        due = (every > 0 and step % every == 0) or (step == self.total_steps and self.cfg.save_final)
        late = self.cfg.every_minutes > 0 and time.monotonic() - self._last_save_time >= 60 * self.cfg.every_minutes
        busy = self._pending is not None and not self._pending.done()
        if self._control is not None:
            flags = torch.tensor([int(late and self._rank == 0), int(stop_requested), int(busy)])
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._control)
            late, stop_requested, busy = bool(flags[0]), bool(flags[1]), bool(flags[2])
        return due or late or stop_requested, stop_requested, busy

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
        report = self._collect(wait=False)
        due, stop, busy = self.should_save(step, stop_requested)
        must = stop or (step == self.total_steps and self.cfg.save_final)
        if must:
            self._deadline = time.monotonic() + self._final_wait_s()
            report.update(self._wait_for_storage(f"the save of step {self._in_flight_step}", before=step))
            if not self._any_rank(self._abandoned is not None):  # its staging buffers are free: save this step
                self._deferred = 0
                report.update(self.save(step, t, loader=loader, state=state))
            elif not self.final_lost:
                self.final_lost = f"the checkpoint of step {step} was not attempted: {self._abandoned_why}"
        elif due and busy and self._still_in_flight_after_its_usual_time():
            report.update(self._defer(step))
        elif due or (self._deferred and not busy):
            self._deferred = 0
            report.update(self.save(step, t, loader=loader, state=state))
        if stop:
            report.update(self.wait())
            self.stopped_at = step
        return report

    def _still_in_flight_after_its_usual_time(self) -> bool:
        """Wait for the save in flight while it is on time (no failed write, and no longer yet than
        max(ON_TIME_MIN_S, 2 x the last good save's time)); then whether it is still in flight on any rank."""
        limit = max(ON_TIME_MIN_S, 2 * self._last_write_s)
        while self._pending is not None and not self._pending.done():
            left = limit - (time.monotonic() - self._started_at)
            if left <= 0 or storage.FAILED_ATTEMPTS[0] > self._failed_attempts_at_start:
                break
            with contextlib.suppress(TimeoutError):
                self._pending.result(timeout=min(left, 0.05))
        return self._any_rank(self._pending is not None and not self._pending.done())

    def _defer(self, step: int) -> dict[str, float]:
        """A save due while the previous one is still being written: taken at the first step after that one
        ends; said once per deferral (a further save point meanwhile is folded into it)."""
        first = not self._deferred
        self._deferred = step
        self.deferred_saves += 1
        if first and self.is_writer:
            warn(
                f"checkpoint of step {step} deferred: the save of step {self._in_flight_step} is still being written "
                f"to {self.dir} ({self._storage_state()}); training goes on, and the next step after that save "
                f"ends is saved"
            )
        return {"deferred_step": step, "deferred_saves": self.deferred_saves}

    def _storage_state(self) -> str:
        """Why the save in flight has not ended, from this rank's view: 'storage failing' only where writes
        have failed (and are being retried), else 'slow', with its time so far against the last good save's."""
        failures = storage.FAILED_ATTEMPTS[0] - self._failed_attempts_at_start
        if failures:
            return f"storage failing: {failures} failed attempt{'s' if failures > 1 else ''} so far, retrying"
        if self._pending is None or self._pending.done():
            return "another rank's write has not ended yet"
        elapsed = time.monotonic() - self._started_at
        last = f", the last save took {self._last_write_s:.1f} s" if self._last_write_s else ""
        return f"slow: {elapsed:.1f} s so far{last}"

    def _wait_for_storage(self, what: str, *, before: int | None = None) -> dict[str, float]:
        """Wait for the save in flight until self._deadline, saying so when it is not over within a second.
        Past the deadline it is abandoned (the process still ends only once its retries do) and the run's
        final checkpoint is reported lost."""
        if self._pending is None:
            return {}
        try:
            self._pending.result(timeout=1.0)
        except TimeoutError:
            left = max(0.0, self._deadline - time.monotonic())
            if self.is_writer:
                after = f" before the checkpoint of step {before}" if before is not None else ""
                warn(f"waiting up to {left:.0f} s for {what} to {self.dir}{after} ({self._storage_state()})")
            try:
                self._pending.result(timeout=left)
            except TimeoutError:
                self.failed_saves += 1
                waited = time.monotonic() - self._started_at
                self._abandoned_why = f"{what} was still not written after {waited:.0f} s ({self._storage_state()})"
                self.final_lost = self.final_lost or self._abandoned_why
                self._abandoned, self._pending = self._pending, None  # its thread still holds the staging buffers
                return {"failed_step": self._in_flight_step, "failed_saves": self.failed_saves}
        return self._collect(wait=True)

    def _final_wait_s(self) -> float:
        """How long a final or stop save (and the one in flight before it) is waited for: FINAL_WAIT_S, longer
        where a good save took long (a large model on slow storage is not abandoned for being large)."""
        return FINAL_WAIT_S + 2 * self._last_write_s

    def _any_rank(self, flag: bool) -> bool:
        if self._control is None:
            return flag
        box = torch.tensor([int(flag)])
        dist.all_reduce(box, op=dist.ReduceOp.MAX, group=self._control)
        return bool(box.item())

    def wait(self) -> dict[str, float]:
        """Wait for the save in flight (if any) to be published or to fail, at most FINAL_WAIT_S; its report."""
        if self._pending is not None and self._deadline <= time.monotonic():
            self._deadline = time.monotonic() + self._final_wait_s()
        return self._wait_for_storage(f"the checkpoint of step {self._in_flight_step}")

    def close(self) -> dict[str, float]:
        """Wait for the save in flight and publish it; release threads, buffers and groups. Returns on
        every rank only once the last checkpoint is visible.

        Called while an exception propagates (the run failed), it waits at most ABANDON_AFTER_S for the save
        in flight (a lost peer would make it wait for the collective timeout) and not for the other ranks."""
        failing = sys.exc_info()[0] is not None
        if failing and self._pending is not None:
            try:
                self._pending.result(timeout=ABANDON_AFTER_S)
            except TimeoutError:
                warn(f"run failed with a checkpoint save in flight; abandoned after {ABANDON_AFTER_S} s")
                self._pending = None
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
        if self._executor is not None:
            self._executor.shutdown(wait=self._abandoned is None)
            self._executor = None
        if self._stager is not None and self._abandoned is None:  # an abandoned save still reads its buffers
            self._stager.close()
        self._stager = None
        for group in (self._save_group, self._control):
            if group is not None:
                dist.destroy_process_group(group)
        self._save_group = self._control = None

    # ------------------------------------------------------------------------------------------- save

    def save(self, step: int, t, *, loader, state: TrainState) -> dict[str, float]:
        """Start saving this step (asynchronously if checkpoint.async_enabled; see the module docstring).
        Returns the report of a save that ended meanwhile: the previous one, or this one if synchronous."""
        start = time.perf_counter()
        report = self._collect(wait=True)  # one save in flight at a time: its staging buffers are reused
        self._in_flight_step = step
        described = {k: v for describe in self.describers for k, v in describe(step, t).items()}  # every rank
        self._last_save_time = time.monotonic()
        self._failed_attempts_at_start, self._started_at = storage.FAILED_ATTEMPTS[0], time.monotonic()
        model_sd, optim_sd, groups = state_dicts(t)
        short = self._short_of_space(model_sd, optim_sd)
        if short:  # refused before writing a byte: a save that cannot fit would only fill the disk
            self._pending = Future()
            self._pending.set_result(_Outcome(step, False, short))
            report.update(self._collect(wait=True))
            return report
        tensors = {"model": model_sd, "optim": optim_sd, "rng": {f"rank_{self._rank}": rng_state()}}
        meta = {
            "format": FORMAT,
            "train_state": asdict(state),
            "loader": loader.state_dict(),
            "scheduler": t.schedulers[0].state_dict(),  # (read by plait before the per-part list below)
            "schedulers": [s.state_dict() for s in t.schedulers],
            "param_groups": groups,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "config": self.config,
            **described,
        }
        meta = json.loads(json.dumps(meta, default=_jsonable))  # a snapshot: the loop moves on meanwhile
        target = self._staging_path(step)
        clear = (lambda: self._clear_remote_step(target)) if storage.is_remote(target) else None
        writer = storage.dcp_writer(target, before_write=clear)
        common = dict(storage_writer=writer, no_dist=not self._distributed)
        if self.cfg.async_enabled:
            if self._stager is None:
                # CPU buffers kept between saves; pinned where there is a GPU to copy from.
                pinned = torch.cuda.is_available()
                self._stager = torch_private.reusable_stager(pinned)
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plait-checkpoint")
            written = dcp.async_save(tensors, process_group=self._save_group, async_stager=self._stager, **common)
            staged = time.perf_counter()
            pending = cast(Future, written)  # (DCP's thread-based async save returns a future)
            self._pending = self._executor.submit(self._finish, step, pending, meta, target, start, staged, writer)
        else:
            written = Future()
            try:
                written.set_result(dcp.save(tensors, **common))
            except BaseException as e:  # DCP's CheckpointException is a BaseException
                if isinstance(e, KeyboardInterrupt | SystemExit):
                    raise
                written.set_exception(e)
            self._pending = Future()
            self._pending.set_result(self._finish(step, written, meta, target, start, start, writer))
            report.update(self._collect(wait=True))
        return report

    def _short_of_space(self, model_sd: dict, optim_sd: dict) -> str:
        """Why the next save cannot fit on the checkpoint disk (the main rank measures, all ranks agree), or
        "". Only on a local disk. Its size is the last save's; before the first save of this process, the
        tensors' bytes (each tensor once, at its full size, over all ranks: one all-gather of their sizes)."""
        if storage.is_remote(self.dir):
            return ""
        if not self._estimate:  # the same on every rank: the first save of this process
            self._estimate = _estimated_bytes(model_sd, optim_sd, self._control)
        need = self._last_size or self._estimate
        why = ""
        if self.is_writer and isinstance(self.dir, Path):
            free = _free_bytes(self.dir)
            if free is not None and free < need:
                takes = "takes" if self._last_size else "will take about"
                why = (
                    f"not enough free space on the checkpoint disk ({mb(free)} free on {self.dir}, a checkpoint "
                    f"{takes} {mb(need)}); free space or lower checkpoint.keep_last"
                )
        if self._control is not None:
            box = [why]
            dist.broadcast_object_list(box, src=0, group=self._control)
            why = box[0]
        return why

    def _clear_remote_step(self, target: Location) -> None:
        """On S3 a save writes in place (no rename), so what an earlier run left under its step goes first
        (on DCP's coordinator, in the save, before any rank writes): an unfinished save's objects are removed
        (nothing was published), a damaged checkpoint is moved aside and kept, as on a local disk, and a
        complete one is moved aside until the new save is published (_publish then removes it; _failed_save
        puts it back), so a save that fails loses nothing."""
        try:
            files = set(storage.file_sizes(target))
        except FileNotFoundError:  # nothing there: the usual case
            return
        if META not in files:
            storage.remove_tree(target)
            return
        damage = self._verified.get(target.name) or checkpoint_problems(target)
        aside = set_aside_name(target, "damaged" if damage else "replaced")
        storage.rename(target, aside)
        self._verified.pop(target.name, None)
        if damage:
            warn(f"damaged checkpoint {target} ({damage}) moved to {aside} to make room for the new save of its step")
        else:
            self._replaced[target.name] = aside

    def _staging_path(self, step: int) -> Location:
        name = f"step_{step:08d}"
        return self.dir / name if storage.is_remote(self.dir) else self.dir / f"{name}.tmp"

    def _finish(
        self, step: int, written: Future, meta: dict, target: Location, start: float, staged: float, writer
    ) -> _Outcome:
        """Wait for every rank's shards (DCP's coordinator gathers all write results before it writes
        .metadata, and a failure anywhere fails the future on every rank), then publish on the main rank."""
        try:
            md: Metadata = written.result()
            if self.is_writer:
                storage.retry(lambda: self._publish(step, meta, target), "publish")
        except LockLost as e:  # nothing of the new holder's is touched: not even our own unfinished files
            return _Outcome(step, False, str(e), blocked_s=staged - start, fenced=True)
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt | SystemExit):
                raise
            return _Outcome(step, False, self._failed_save(e, target), blocked_s=staged - start)
        # (torch 2.11's asynchronous save returns the metadata without its storage data: the writer counted them)
        num_bytes = sum(getattr(info, "length", 0) for info in (md.storage_data or {}).values()) or writer.plait_bytes
        self._last_size = num_bytes
        # Synchronous: the loop waited for all of it. Asynchronous: only for the staging.
        end = time.perf_counter()
        blocked = end - start if staged == start else staged - start
        outcome = _Outcome(step, True, blocked_s=blocked, write_s=end - staged, num_bytes=num_bytes)
        if self.is_writer:
            try:
                storage.retry(self._retain, "retention")
            except Exception as e:  # an old checkpoint that could not be deleted is not worth stopping for
                warn(f"checkpoint retention in {self.dir} failed: {one_line(e)}")
        return outcome

    def _failed_save(self, error: BaseException, target: Location) -> str:
        """After a failed save (every rank's writes have ended: DCP fails the save on all ranks together),
        the main rank removes what it left behind; returns the reason in plain words."""
        reason = short(error)
        # torch's writer reports a full disk as "unexpected pos A vs B": look at the disk before cleaning up
        free = _free_bytes(self.dir) if isinstance(self.dir, Path) else None
        if free is not None and (_is_no_space(error) or free < 1 << 20):
            reason = f"the checkpoint disk is full ({mb(free)} left on {self.dir}; torch said: {reason})"
        if self.is_writer:
            replaced = self._replaced.pop(target.name, None)  # (on S3: _clear_remote_step)
            try:
                check_fence(self.dir, f"the cleanup of {target}")  # no other run's files under this name
                storage.remove_tree(target)
                if replaced is not None:  # put back the checkpoint this save was to replace
                    storage.rename(replaced, target)
            except Exception as e:
                reason += f"; its partial files in {target} could not be cleared ({one_line(e)})"
                if replaced is not None:
                    reason += f"; the checkpoint it was to replace is kept as {replaced}"
        return reason

    def _publish(self, step: int, meta: dict, target: Location) -> None:
        for hook in self.before_publish:  # e.g. plait.features.faults: a crash at this moment, for tests
            hook(step)
        if self.tokenizer_path is not None:
            storage.copy_in(self.tokenizer_path, target / "tokenizer.json")
            for path in chat_files(self.tokenizer_path):  # the chat template, where the data was rendered with one
                storage.copy_in(path, target / path.name)
        meta = {**meta, "dcp_metadata_sha256": hashlib.sha256(storage.read_bytes(target / DCP_METADATA)).hexdigest()}
        text = json.dumps(meta, indent=1).encode()
        final = self.dir / f"step_{step:08d}"
        check_fence(self.dir, f"checkpoint {final}")  # this run's lock still its own: re-read just before publishing
        storage.write_bytes(target / META, text)  # on S3 written last: this is the publish
        if not isinstance(final, Path) or not isinstance(target, Path):
            if (replaced := self._replaced.pop(final.name, None)) is not None:  # (_clear_remote_step)
                try:  # published already: a copy left behind is not worth failing the save for
                    storage.remove_tree(replaced)
                except Exception as e:
                    warn(f"the earlier checkpoint of step {step}, replaced, is left at {replaced} ({one_line(e)})")
            return
        if final.exists():  # an older save of the same step (a rerun): replace it only now ...
            damage = self._verified.get(final.name) or checkpoint_problems(final)
            if (final / DCP_METADATA).exists() and not damage:
                storage.remove_tree(final)
            else:  # ... unless it is damaged (also if only its tensors failed to load): the user's to inspect
                aside = set_aside_name(final, "damaged")
                storage.rename(final, aside)
                self._verified.pop(final.name, None)
                warn(
                    f"damaged checkpoint {final} ({damage or 'its metadata is missing'}) moved to {aside} to make "
                    f"room for the new save of its step"
                )
        storage.rename(target, final)

    def _collect(self, *, wait: bool) -> dict[str, float]:
        """The outcome of the save in flight, if it has finished (or once it has, with wait)."""
        if self._pending is None or not (wait or self._pending.done()):
            return {}
        outcome: _Outcome = self._pending.result()
        self._pending = None
        if outcome.fenced:
            raise LockLost(outcome.error)
        if outcome.ok:
            self._last_write_s = outcome.write_s
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

    def _retain(self) -> None:
        """Keep the newest checkpoint.keep_last complete checkpoints and every checkpoint.keep_every-th
        step; remove the other complete ones and what failed or interrupted saves left behind (no save is in
        flight now). Damaged checkpoints are neither counted nor removed: they are the user's to inspect."""
        check_fence(self.dir, "retention's deletions")
        tree = storage.list_tree(self.dir)
        complete, damaged = classify(self.dir, tree)
        for c in complete:  # published checkpoints never change: each is verified once
            if c.name not in self._verified:
                self._verified[c.name] = checkpoint_problems(c)
                if self._verified[c.name]:
                    warn(f"checkpoint {c} is damaged ({self._verified[c.name]}): kept, but not counted or loaded")
        damaged += [(c, self._verified[c.name]) for c in complete if self._verified[c.name]]
        complete = [c for c in complete if not self._verified[c.name]]
        steps = [step_of(c) for c in complete]
        keep = set(steps[-max(1, self.cfg.keep_last) :]) | kept_forever(steps, self.cfg.keep_every)
        if self.cfg.keep_best:
            keep |= self._best(complete)
        pins = pinned(tree)
        for c in complete:
            if step_of(c) in keep:
                continue
            if c.name in pins:  # the base of a fine-tune, an export, an adapter: kept, said once
                if c.name not in self._said_pinned:
                    self._said_pinned.add(c.name)
                    users = "; ".join(describe_pin(self.dir, n) for n in pins[c.name])
                    warn(f"checkpoint {c} kept past checkpoint.keep_last: {users} depends on it (pinned in "
                         f"{self.dir / 'pins'})")  # fmt: skip
                continue
            storage.remove_tree(c)
        known = {c.name for c in complete} | {d.name for d, _ in damaged}
        for name in tree:
            if name in known or not ANY_STEP_DIR.match(name):
                continue
            # a partial save: step_<N>.tmp on a local disk, an unpublished step_<N> prefix on S3; not while the
            # run whose lock we took may still be writing one
            if self._displaced:
                continue
            if name.endswith(".tmp") or (steps and step_of(self.dir / name) < steps[-1]):
                storage.remove_tree(self.dir / name)

    def _best(self, complete: list) -> set[int]:
        """checkpoint.keep_best: the step of the checkpoint with the lowest validation loss its meta records
        (each read once), or nothing when none records one."""
        for c in complete:
            if c.name not in self._val_losses:
                with contextlib.suppress(Exception):  # unreadable: not a candidate (it is reported elsewhere)
                    self._val_losses[c.name] = read_meta(c).get("val_loss")
        scored = [(v, step_of(c)) for c in complete if (v := self._val_losses.get(c.name)) is not None]
        return {min(scored)[1]} if scored else set()

    # ------------------------------------------------------------------------------------------- load

    def mark_damaged(self, path: Location, why: str) -> None:
        """A checkpoint that failed to load (a CRC32 mismatch, a truncated record): from now on neither counted,
        loaded nor deleted by retention, and set aside, not replaced, by a new save of its step."""
        self._verified[path.name] = why or "it failed to load"

    def load(self, path: Location, t, *, loader, state: TrainState) -> None:
        """Restore the run from `path` on every rank (plait.engine.checkpoint.load.load_state)."""
        load_state(path, t, loader=loader, state=state, group=self._control, rank=self._rank, config=self.config)


def set_aside_name(path: Location, why: str) -> Location:
    """Where a checkpoint is moved to make room for a new save of its step: beside it, named with why and
    when (never a step_<N> name, so no listing counts it and retention never deletes it)."""
    return path.parent / f"{path.name}.{why}-{time.strftime('%Y%m%d-%H%M%S')}"


def kept_forever(steps: list[int], every: int) -> set[int]:
    """checkpoint.keep_every: the first checkpoint at or after each multiple of `every` (the multiple itself
    unless its save was deferred), from the steps saved (ascending). Once saved, it stays the first."""
    if every <= 0:
        return set()
    first: dict[int, int] = {}
    for s in steps:
        if s >= every:
            first.setdefault(s // every, s)
    return set(first.values())


def _estimated_bytes(model_sd: dict, optim_sd: dict, group) -> int:
    """Bytes a checkpoint of these state dicts takes: every tensor once, at its global size (a DTensor's whole
    shape; replicas written once, as DCP does), summed over all ranks' tensors (pipeline stages hold different
    ones), plus 1% and 1 MiB for metadata and record checksums."""
    sizes = {}
    for name, value in flatten({"model": model_sd, "optim": optim_sd}).items():
        if isinstance(value, torch.Tensor):
            sizes[name] = math.prod(value.shape) * value.element_size()
    if group is not None:
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, sizes, group=group)
        for rank_sizes in everyone:
            sizes.update(rank_sizes)
    total = sum(sizes.values())
    return total + total // 100 + (1 << 20)


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _is_no_space(error: BaseException) -> bool:
    import errno

    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def _jsonable(obj):
    if isinstance(obj, torch.Tensor):
        return obj.item()
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(f"cannot store {type(obj).__name__} in checkpoint metadata")
