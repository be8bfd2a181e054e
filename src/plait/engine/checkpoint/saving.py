"""The save in flight: its tensors staged to CPU memory and written by DCP (asynchronously, from a background
thread, where checkpoint.async_enabled), then published (plait.engine.checkpoint.publisher); the free space
checked before a byte is written; a failure turned into a reason in plain words.

Communication plan: an asynchronous save runs DCP's collectives (gather the save plans, scatter the final plan,
gather the write results; a handful of small messages per save) on a gloo group of its own (`save_group`) from
the background thread, so they never interleave with the training step's collectives. Before the first save of
a process every rank's tensor sizes are all-gathered once over the control group (the size estimate), and the
main rank's free-space verdict is broadcast over it before each save."""

from __future__ import annotations

import contextlib
import errno
import math
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

from plait.config import CheckpointConfig
from plait.core import storage, torch_private
from plait.core.publish import LockLost
from plait.core.storage import Location
from plait.engine.checkpoint.publisher import Publisher
from plait.engine.checkpoint.verify import flatten
from plait.engine.checkpoint.wording import mb, one_line, short, warn


@dataclass
class Outcome:
    """How a save ended."""

    step: int
    ok: bool
    error: str = ""
    blocked_s: float = 0.0
    write_s: float = 0.0
    num_bytes: int = 0
    fenced: bool = False  # refused: another run took the lock over (error says which)


class AsyncSaver:
    """Writes one save at a time (see the module docstring); `pending` is the future of the one in flight,
    whose result is its Outcome once it is published or has failed."""

    def __init__(self, cfg: CheckpointConfig, publisher: Publisher, *, control, rank: int):
        self.cfg = cfg
        self.publisher = publisher
        self.dir = publisher.dir
        self.is_writer = publisher.is_writer
        self.control = control  # the manager's gloo group for decisions (None in one process)
        self.rank = rank
        self.distributed = control is not None
        self.save_group = dist.new_group(backend="gloo") if self.distributed and cfg.async_enabled else None
        self.stager = None  # torch_private.reusable_stager, made at the first asynchronous save
        self.executor: ThreadPoolExecutor | None = None
        self.pending: Future | None = None
        self.in_flight_step = 0  # the step of the save in flight
        self.started_at = 0.0  # when the save in flight began
        self.failed_attempts_at_start = 0  # storage.FAILED_ATTEMPTS when the save in flight began
        self.last_write_s = 0.0  # how long the last good save took from staged to published
        self.last_size = 0  # bytes of the last complete save: the free space the next one needs
        self.estimate = 0  # bytes a save takes, estimated from the tensors before the first one
        self.abandoned: Future | None = None  # a save given up on past the deadline (its thread may still run)
        self.abandoned_why = ""

    def busy(self) -> bool:
        """A save is in flight on this rank."""
        return self.pending is not None and not self.pending.done()

    def begin(self) -> None:
        """The save of in_flight_step begins now: its time and the storage failures so far are its baseline."""
        self.failed_attempts_at_start, self.started_at = storage.FAILED_ATTEMPTS[0], time.monotonic()

    def refuse(self, step: int, why: str) -> None:
        """A save that is not even started (it cannot fit): it ends, failed, at once."""
        self.pending = Future()
        self.pending.set_result(Outcome(step, False, why))

    def start(self, step: int, tensors: dict, meta: dict, start: float) -> None:
        """Write `tensors` with DCP and publish them with `meta`: staged and handed to the background thread
        if checkpoint.async_enabled, else written and published before returning."""
        target = self.publisher.staging_path(step)
        clear = (lambda: self.publisher.clear_remote_step(target)) if storage.is_remote(target) else None
        writer = storage.dcp_writer(target, before_write=clear)
        common = dict(storage_writer=writer, no_dist=not self.distributed)
        if self.cfg.async_enabled:
            if self.stager is None:
                # CPU buffers kept between saves; pinned where there is a GPU to copy from.
                self.stager = torch_private.reusable_stager(torch.cuda.is_available())
                self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plait-checkpoint")
            written = dcp.async_save(tensors, process_group=self.save_group, async_stager=self.stager, **common)
            staged = time.perf_counter()
            pending = cast(Future, written)  # (DCP's thread-based async save returns a future)
            assert self.executor is not None
            self.pending = self.executor.submit(self._finish, step, pending, meta, target, start, staged, writer)
            return
        written = Future()
        try:
            written.set_result(dcp.save(tensors, **common))
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            if isinstance(e, KeyboardInterrupt | SystemExit):
                raise
            written.set_exception(e)
        self.pending = Future()
        self.pending.set_result(self._finish(step, written, meta, target, start, start, writer))

    def _finish(
        self, step: int, written: Future, meta: dict, target: Location, start: float, staged: float, writer
    ) -> Outcome:
        """Wait for every rank's shards (DCP's coordinator gathers all write results before it writes
        .metadata, and a failure anywhere fails the future on every rank), then publish on the main rank."""
        try:
            md: Metadata = written.result()
            if self.is_writer:
                storage.retry(lambda: self.publisher.publish(step, meta, target), "publish")
        except LockLost as e:  # nothing of the new holder's is touched: not even our own unfinished files
            return Outcome(step, False, str(e), blocked_s=staged - start, fenced=True)
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt | SystemExit):
                raise
            return Outcome(step, False, self._failure(e, target), blocked_s=staged - start)
        # (torch 2.11's asynchronous save returns the metadata without its storage data: the writer counted them)
        num_bytes = sum(getattr(info, "length", 0) for info in (md.storage_data or {}).values()) or writer.plait_bytes
        self.last_size = num_bytes
        # Synchronous: the loop waited for all of it. Asynchronous: only for the staging.
        end = time.perf_counter()
        blocked = end - start if staged == start else staged - start
        outcome = Outcome(step, True, blocked_s=blocked, write_s=end - staged, num_bytes=num_bytes)
        if self.is_writer:
            try:
                storage.retry(self.publisher.retain, "retention")
            except Exception as e:  # an old checkpoint that could not be deleted is not worth stopping for
                warn(f"checkpoint retention in {self.dir} failed: {one_line(e)}")
        return outcome

    def _failure(self, error: BaseException, target: Location) -> str:
        """After a failed save (every rank's writes have ended: DCP fails the save on all ranks together),
        the main rank removes what it left behind; returns the reason in plain words."""
        reason = short(error)
        # torch's writer reports a full disk as "unexpected pos A vs B": look at the disk before cleaning up
        free = _free_bytes(self.dir) if isinstance(self.dir, Path) else None
        if free is not None and (_is_no_space(error) or free < 1 << 20):
            reason = f"the checkpoint disk is full ({mb(free)} left on {self.dir}; torch said: {reason})"
        if self.is_writer:
            reason += self.publisher.discard(target)
        return reason

    def short_of_space(self, tensors: dict) -> str:
        """Why the next save cannot fit on the checkpoint disk (the main rank measures, all ranks agree), or
        "". Only on a local disk. Its size is the last save's; before the first save of this process, the
        tensors' bytes (each tensor once, at its full size, over all ranks: one all-gather of their sizes)."""
        if storage.is_remote(self.dir):
            return ""
        if not self.estimate:  # the same on every rank: the first save of this process
            self.estimate = _estimated_bytes({"model": tensors["model"], "optim": tensors["optim"]}, self.control)
        need = self.last_size or self.estimate
        why = ""
        if self.is_writer and isinstance(self.dir, Path):
            free = _free_bytes(self.dir)
            if free is not None and free < need:
                takes = "takes" if self.last_size else "will take about"
                why = (
                    f"not enough free space on the checkpoint disk ({mb(free)} free on {self.dir}, a checkpoint "
                    f"{takes} {mb(need)}); free space or lower checkpoint.keep_last"
                )
        if self.control is not None:
            box = [why]
            dist.broadcast_object_list(box, src=0, group=self.control)
            why = box[0]
        return why

    def collect(self, *, wait: bool) -> Outcome | None:
        """The outcome of the save in flight, if it has finished (or once it has, with wait); None if not."""
        if self.pending is None or not (wait or self.pending.done()):
            return None
        outcome: Outcome = self.pending.result()
        self.pending = None
        if outcome.ok:
            self.last_write_s = outcome.write_s
        return outcome

    def wait(self, timeout: float) -> bool:
        """Wait at most `timeout` s for the save in flight to end; whether it has."""
        assert self.pending is not None
        try:
            self.pending.result(timeout=timeout)
        except TimeoutError:
            return False
        return True

    def wait_while_on_time(self, limit: float) -> None:
        """Wait for the save in flight while no storage write has failed and it has run less than `limit` s."""
        while self.pending is not None and not self.pending.done():
            left = limit - (time.monotonic() - self.started_at)
            if left <= 0 or storage.FAILED_ATTEMPTS[0] > self.failed_attempts_at_start:
                break
            with contextlib.suppress(TimeoutError):
                self.pending.result(timeout=min(left, 0.05))

    def abandon(self, what: str) -> str:
        """Give up on the save in flight (the process still ends only once its retries do); why, in words."""
        waited = time.monotonic() - self.started_at
        self.abandoned_why = f"{what} was still not written after {waited:.0f} s ({self.storage_state()})"
        self.abandoned, self.pending = self.pending, None  # its thread still holds the staging buffers
        return self.abandoned_why

    def storage_state(self) -> str:
        """Why the save in flight has not ended, from this rank's view: 'storage failing' only where writes
        have failed (and are being retried), else 'slow', with its time so far against the last good save's."""
        failures = storage.FAILED_ATTEMPTS[0] - self.failed_attempts_at_start
        if failures:
            return f"storage failing: {failures} failed attempt{'s' if failures > 1 else ''} so far, retrying"
        if self.pending is None or self.pending.done():
            return "another rank's write has not ended yet"
        elapsed = time.monotonic() - self.started_at
        last = f", the last save took {self.last_write_s:.1f} s" if self.last_write_s else ""
        return f"slow: {elapsed:.1f} s so far{last}"

    def shut_down(self) -> None:
        """Release the thread, the staging buffers (unless an abandoned save still reads them) and the group."""
        if self.executor is not None:
            self.executor.shutdown(wait=self.abandoned is None)
            self.executor = None
        if self.stager is not None and self.abandoned is None:
            self.stager.close()
        self.stager = None
        if self.save_group is not None:
            dist.destroy_process_group(self.save_group)
        self.save_group = None


def _estimated_bytes(tensors: dict, group) -> int:
    """Bytes a checkpoint of these state dicts takes: every tensor once, at its global size (a DTensor's whole
    shape; replicas written once, as DCP does), summed over all ranks' tensors (pipeline stages hold different
    ones), plus 1% and 1 MiB for metadata and record checksums."""
    sizes = {}
    for name, value in flatten(tensors).items():
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
